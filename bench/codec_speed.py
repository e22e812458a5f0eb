"""`atoll bench codec-speed`: how fast each codec encodes and decodes, on one host core and
on the learner's device, side by side in one run.

Host, one core (numpy's element-wise loops are single-threaded; run it with
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 so that BLAS is too): each codec encodes a
`--values` Gaussian vector segment by segment as a learner sends it (`--chunk-bytes` a
segment), decodes every segment, and decodes every segment into an accumulator with a weight
(`Codec.decode_into`, what the synchronizer's owner runs per arriving chunk), moves every
segment from one accumulator to another (`Codec.move_into`, a chunk of an update still
arriving when its round is sealed; where a codec has no compiled move, the two decode_into
calls the owner makes instead), and takes the outer step with the codec as the downlink
(`services.downlink.fused_step`, segment by segment; none where the codec has no compiled
step: the owner's numpy path), and hashes the payload (XXH3, as the owner checks each
chunk). Beside them, `accumulate`: one compiled pass that adds a constant to every value of
the accumulator, the memory traffic any decode_into has at least. Best of
`--repeats`, in GB/s of float32 values and of payload bytes, from wall time and from the
thread's CPU time (on a shared machine the latter is what one core gives).

Device, for the codecs encoded there (int8, int4): one update of a fragment of `--values`
values in `--tensors` tensors, from the anchor and the parameters as the learner holds them
on its device, through error feedback and encoding to segments on the host
(`DeviceFeedback.encode_update`), against what the host path does for the same update
(copying the parameters to the host, then `ErrorFeedback.encode`); in ms, with the bytes
each copies from the device, on whatever platform JAX has.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit
from pydantic import Field

from bench.options import Output
from bench.runs import write
from services import codec as codecs
from services.downlink import fused_step


class CodecSpeedBench(Output):
    """Encode and decode speed of each codec on one host core (beside the least memory
    traffic decoding into a sum has), and int8 and int4 encoding on the learner's device
    against the host path, side by side in one run."""

    codecs: list[str] = Field(
        ["fp32", "bf16", "int8", "int4", "e3m0", "int2", "sign", "topk"],
        description="codecs measured (int4: the codec `--codec int4` names)",
    )
    values: int = Field(
        25_000_000,
        ge=256,
        description="values encoded (default: a fragment of a 100M-parameter model at P=4)",
    )
    block_size: int = Field(256, ge=1, description="values per block scale")
    chunk_bytes: int = Field(1 << 20, ge=1024, description="encoded bytes a segment, at most")
    repeats: int = Field(3, ge=1, description="runs of each measurement (the best is kept)")
    device: bool = Field(True, description="also measure encoding on JAX's device")
    tensors: int = Field(8, ge=1, description="tensors in the device run's fragment")
    seed: int = Field(0, description="random seed")

    def cli_cmd(self) -> None:
        run(self)


def _best(work: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best wall seconds and best CPU seconds of this thread over `repeats` runs."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        work()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.thread_time() - c0)
    return wall, cpu


def _rates(prefix: str, seconds: tuple[float, float], values: int, payload: int) -> dict[str, Any]:
    wall, cpu = seconds
    return {
        f"{prefix}_ms": round(wall * 1e3, 2),
        f"{prefix}_gb_per_s": round(4 * values / wall / 1e9, 3),
        f"{prefix}_payload_gb_per_s": round(payload / wall / 1e9, 3),
        f"{prefix}_cpu_gb_per_s": round(4 * values / cpu / 1e9, 3),
        f"{prefix}_cpu_payload_gb_per_s": round(payload / cpu / 1e9, 3),
    }


@njit(nogil=True, cache=True, boundscheck=False)
def _accumulate(acc: np.ndarray, w: np.float32) -> None:
    """acc += w: reads and writes every float32 value once, as decoding into it must."""
    for i in range(acc.size):
        acc[i] += w


def _floor(settings: CodecSpeedBench) -> dict[str, Any]:
    """The accumulator's read and write of every value, on this thread."""
    acc = np.zeros(settings.values, np.float32)
    _accumulate(acc, np.float32(0.37))  # compiles, and touches the pages
    wall, cpu = _best(lambda: _accumulate(acc, np.float32(0.37)), settings.repeats)
    return {
        "accumulate_ms": round(wall * 1e3, 2),
        "accumulate_gb_per_s": round(4 * acc.size / wall / 1e9, 3),
        "accumulate_cpu_gb_per_s": round(4 * acc.size / cpu / 1e9, 3),
    }


def _label(name: str, codec: codecs.Codec) -> str:
    return name if codec.name == name else f"{name} ({codec.name})"


def _host_row(name: str, x: np.ndarray, settings: CodecSpeedBench) -> dict[str, Any]:
    """Encode, decode and decode_into of one codec on this thread."""
    codec = codecs.by_name(name)
    n, block, repeats = x.size, settings.block_size, settings.repeats
    step = codecs.segment_values(codec, block, settings.chunk_bytes)
    parts = [(s, x[s : s + step]) for s in range(0, n, step)]
    segments = [codecs.Segment(s, part.size, codec.encode(part, block)) for s, part in parts]
    payload = sum(len(s.data) for s in segments)
    acc = np.zeros(n, np.float32)

    def encode() -> None:
        for _, part in parts:
            codec.encode(part, block)

    def decode() -> None:
        for s in segments:
            codec.decode(s.data, s.count, block)

    def decode_into() -> None:
        for s in segments:
            codec.decode_into(acc, 0.37, s, block)

    dst = np.zeros(n, np.float32)

    def move_into() -> None:
        for s in segments:
            if not codec.move_into(acc, dst, 0.37, s, block):
                codec.decode_into(acc, -0.37, s, block)
                codec.decode_into(dst, 0.37, s, block)

    # The outer step over a round's sum: momentum trace, residual and value updated in place.
    trace, residual, theta = (np.zeros(n, np.float32) for _ in range(3))

    def outer_step() -> bool:
        for start, part in parts:
            at = slice(start, start + part.size)
            args = (x[at], 0.5, trace[at], 0.9, 0.7, residual[at], theta[at], codec, block)
            if fused_step(*args) is None:
                return False
        return True

    def checksum() -> None:
        for s in segments:
            codecs.checksum(s.data)

    decode_into()  # the first touch of the accumulator's pages is not decoding
    move_into()
    compiled_step = outer_step()
    return {
        "codec": _label(name, codec),
        "payload_bytes": payload,
        **_rates("encode", _best(encode, repeats), n, payload),
        **_rates("decode", _best(decode, repeats), n, payload),
        **_rates("decode_into", _best(decode_into, repeats), n, payload),
        **_rates("move_into", _best(move_into, repeats), n, payload),
        **_rates("checksum", _best(checksum, repeats), n, payload),
        **(_rates("step", _best(outer_step, repeats), n, payload) if compiled_step else {}),
    }


def _device_row(
    name: str,
    anchor: list[Any],
    theta: list[Any],
    sizes: tuple[int, ...],
    settings: CodecSpeedBench,
) -> dict[str, Any]:
    """One update of one codec encoded on the device, against the host path."""
    import jax

    from learner.device_codec import DeviceFeedback

    codec = codecs.by_name(name)
    block, chunk = settings.block_size, settings.chunk_bytes
    on_device = DeviceFeedback(codec, block, chunk, tensor_sizes=sizes)
    on_host = codecs.ErrorFeedback(codec, block, chunk_bytes=chunk, tensor_sizes=sizes)
    anchor_host = np.concatenate(jax.device_get(anchor))

    def device_path() -> list[codecs.Segment]:
        return on_device.encode_update(anchor, theta)

    def host_path() -> list[codecs.Segment]:
        return on_host.encode(anchor_host - np.concatenate(jax.device_get(theta)))

    first = time.perf_counter()
    encoded = device_path()  # compiles (no residual yet)
    payload = sum(len(s.data) for s in encoded)
    # The same update, with no residual yet on either side: the same bytes from both.
    identical = [s.data for s in encoded] == [s.data for s in host_path()]
    on_host = codecs.ErrorFeedback(codec, block, chunk_bytes=chunk, tensor_sizes=sizes)
    device_path()  # compiles (with a residual)
    compile_s = time.perf_counter() - first
    device_s, _ = _best(device_path, settings.repeats)
    host_s, _ = _best(host_path, settings.repeats)
    return {
        "codec": _label(name, codec),
        "device_encode_ms": round(device_s * 1e3, 2),
        "host_encode_ms": round(host_s * 1e3, 2),
        "host_over_device": round(host_s / device_s, 2),
        "bytes_identical_to_host": identical,
        "device_to_host_bytes": {"device": payload, "host": 4 * anchor_host.size},
        "first_two_calls_s": round(compile_s, 2),
    }


def device(settings: CodecSpeedBench, x: np.ndarray) -> dict[str, Any]:
    """int8 and int4 updates encoded on JAX's device against the host path."""
    import jax
    import jax.numpy as jnp

    from learner.device_codec import supports

    bounds = [int(b) for b in np.linspace(0, x.size, settings.tensors + 1)]
    anchor_host = np.random.default_rng(settings.seed + 1).normal(size=x.size).astype(np.float32)
    theta_host = anchor_host - x * np.float32(1e-3)
    anchor = [jnp.asarray(anchor_host[a:b]) for a, b in itertools.pairwise(bounds)]
    theta = [jnp.asarray(theta_host[a:b]) for a, b in itertools.pairwise(bounds)]
    for array in (*anchor, *theta):
        array.block_until_ready()
    sizes = tuple(b - a for a, b in itertools.pairwise(bounds))
    rows = [
        _device_row(name, anchor, theta, sizes, settings)
        for name in settings.codecs
        if supports(codecs.by_name(name))
    ]
    first = jax.devices()[0]
    return {"platform": first.platform, "device": first.device_kind, "runs": rows}


def run(settings: CodecSpeedBench) -> None:
    x = np.random.default_rng(settings.seed).normal(size=settings.values).astype(np.float32)
    result: dict[str, Any] = {
        "values": settings.values,
        "block_size": settings.block_size,
        "chunk_bytes": settings.chunk_bytes,
        "repeats": settings.repeats,
        "host": [_host_row(name, x, settings) for name in settings.codecs],
        "host_floor": _floor(settings),
    }
    if settings.device:
        result["device"] = device(settings, x)
    write(result, settings.json_path)
