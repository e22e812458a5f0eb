"""`atoll bench codecs`: how much each codec loses, on outer-gradient-like vectors.

For each distribution (Gaussian, Laplace, Student-t with 3 degrees of freedom: outer
gradients have heavy tails) and each codec: payload bytes per value, the relative L2 error
of one encoding, and the relative error of the sum of 50 encodings with error feedback
(what a fragment accumulates over 50 syncs). The 4-bit default (`--codec int4`) is the 4-bit
codec with the lower error here.

Then each codec's speed on one core (numpy's element-wise loops are single-threaded):
encode and decode of a `--speed-values` Gaussian vector, best of `--speed-repeats`, in GB/s
of float32 values (what the synchronizer's merge reads) and of payload bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.runs import write
from services import codec as codecs

if TYPE_CHECKING:
    from bench.settings import CodecsBench

DISTRIBUTIONS = ("normal", "laplace", "student3")


def _sample(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind == "normal":
        return rng.normal(size=n).astype(np.float32)
    if kind == "laplace":
        return rng.laplace(size=n).astype(np.float32)
    return rng.standard_t(3, size=n).astype(np.float32)


def run(settings: CodecsBench) -> None:
    rng = np.random.default_rng(settings.seed)
    rows = []
    for kind in DISTRIBUTIONS:
        for name in settings.codecs:
            codec = codecs.by_name(name)
            x = _sample(rng, kind, settings.values)
            payload = codec.encode(x, settings.block_size)
            once = codec.decode(payload, x.size, settings.block_size)
            feedback = codecs.ErrorFeedback(codec, settings.block_size)
            true_sum = np.zeros(x.size, np.float64)
            sent_sum = np.zeros(x.size, np.float64)
            for _ in range(settings.rounds):
                delta = _sample(rng, kind, settings.values)
                true_sum += delta
                segments = feedback.encode(delta)
                sent_sum += codecs.decode_segments(codec, segments, x.size, settings.block_size)
            rows.append(
                {
                    "distribution": kind,
                    "codec": name,
                    "bytes_per_value": round(len(payload) / x.size, 4),
                    "relative_error": round(float(np.linalg.norm(once - x) / np.linalg.norm(x)), 4),
                    "feedback_sum_error": round(
                        float(np.linalg.norm(sent_sum - true_sum) / np.linalg.norm(true_sum)), 5
                    ),
                }
            )
    result = {"values": settings.values, "rounds": settings.rounds, "runs": rows}
    if settings.speed_values:
        result["speed"] = speed(settings, rng)
    write(result, settings.json_path)


def _best_seconds(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best


def speed(settings: CodecsBench, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Encode and decode throughput of each codec on one core."""
    n, block = settings.speed_values, settings.block_size
    x = _sample(rng, "normal", n)
    rows = []
    for name in settings.codecs:
        codec = codecs.by_name(name)
        payload = codec.encode(x, block)
        codec.decode(payload, n, block)  # warm: first-touch page faults are not decoding
        encode_s = _best_seconds(partial(codec.encode, x, block), settings.speed_repeats)
        decode_s = _best_seconds(partial(codec.decode, payload, n, block), settings.speed_repeats)
        rows.append(
            {
                "codec": name,
                "values": n,
                "payload_bytes": len(payload),
                "encode_gb_per_s": round(4 * n / encode_s / 1e9, 3),
                "decode_gb_per_s": round(4 * n / decode_s / 1e9, 3),
                "decode_payload_gb_per_s": round(len(payload) / decode_s / 1e9, 3),
                "decode_ms": round(decode_s * 1e3, 2),
            }
        )
    return rows
