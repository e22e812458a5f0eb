"""`atoll bench mfu`: the learner's own training rate against a bare JAX step, same call.

Per model size, four runs, each its own process, one after the other on the same devices:
- anchor: a byte-level transformer train step written here with nothing of atoll's (its
  own parameters, bf16 compute on accelerators with the fused attention named on NVIDIA
  GPUs, optax AdamW, random tokens made on the device);
- the learner alone (`atoll learner --standalone`): the inner loop, data included;
- the learner syncing to a local synchronizer (Redis, one replica);
- the same with local checkpoints on (the learner's defaults: every step, at most one a
  second, written off the loop).
Each learner reports its steady rate (steps and wall time once every fragment has synced
twice, 2 x H + 5 steps: its first encodings compile, as the anchor's first steps do; every
hook, sync and checkpoint after that included). `ratio` = synced-and-checkpointing learner / anchor;
`sync_overhead` = 1 - synced / alone; `checkpoint_overhead` = 1 - checkpointing / synced.
MFU counts 6 x parameters + 12 x layers x context x width FLOPs per token against the
device's peak (bf16 dense for H100/H200; on a CPU, a float32 matmul measured in the anchor).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from bench.options import Output
from cluster.processes import Child, atoll_command, synchronizer_child
from cluster.redis_server import RedisServer


class MfuBench(Output):
    """The learner's training rate (syncing, checkpoints on) against a bare JAX step of the
    same model, per size: MFU, ratio, sync and checkpoint overheads."""

    sizes: str = Field(
        "",
        description="model sizes, comma separated, of 86m, 303m, 1b, cpu-small, cpu-medium "
        "(default: 86m,303m with an NVIDIA GPU, else cpu-small,cpu-medium)",
    )
    steps: int = Field(
        60,
        ge=5,
        description="measured steps per run (after 2 x H + 5 steps: every fragment synced twice)",
    )
    fragments: int = Field(4, ge=1, description="P of the synced runs")
    inner_steps: int = Field(40, ge=1, description="H of the synced runs")
    threads: int = Field(1, ge=1, description="CPU threads of each run (on a CPU)")
    timeout_s: float = Field(900.0, gt=0.0, description="limit for each run")

    def cli_cmd(self) -> None:
        run(self)


class MfuAnchor(BaseModel):
    """internal: the bare JAX step `atoll bench mfu` compares against"""

    layers: int = Field(description="layers")
    width: int = Field(description="width")
    heads: int = Field(description="heads")
    context: int = Field(description="context")
    batch_size: int = Field(description="sequences per step")
    steps: int = Field(description="measured steps")
    json_path: Path = Field(alias="json", description="where to write the result")

    def cli_cmd(self) -> None:
        run_anchor(self)


# name -> (layers, width, heads, context, batch)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "86m": (12, 768, 12, 1024, 32),
    "303m": (24, 1024, 16, 1024, 16),
    "1b": (24, 2048, 16, 1024, 8),
    "cpu-small": (2, 128, 4, 128, 8),
    "cpu-medium": (4, 256, 4, 256, 8),
}
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def parameters(layers: int, width: int, context: int) -> int:
    return 256 * width + context * width + width + layers * (12 * width * width + 2 * width)


def flops_per_token(layers: int, width: int, context: int) -> float:
    return 6.0 * parameters(layers, width, context) + 12.0 * layers * context * width


# --- the anchor: a bare JAX step, nothing of atoll's ----------------------------------------
def run_anchor(settings: MfuAnchor) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax
    import jax.numpy as jnp
    import optax

    layers, width, heads, context, batch = (
        settings.layers,
        settings.width,
        settings.heads,
        settings.context,
        settings.batch_size,
    )
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    dtype = jnp.bfloat16 if device.platform in ("gpu", "tpu") else jnp.float32
    implementation: Literal["xla", "cudnn"] = "cudnn" if gpu else "xla"
    keys = iter(jax.random.split(jax.random.key(0), 3 + 4 * layers))

    def normal(shape: tuple[int, ...], std: float) -> jax.Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    params: dict[str, Any] = {
        "embed": normal((256, width), 0.02),
        "pos": normal((context, width), 0.01),
        "final": jnp.ones((width,), jnp.float32),
        "layers": [
            {
                "n1": jnp.ones((width,), jnp.float32),
                "qkv": normal((width, 3 * width), 0.02),
                "o": normal((width, width), 0.02),
                "n2": jnp.ones((width,), jnp.float32),
                "up": normal((width, 4 * width), 0.02),
                "down": normal((4 * width, width), 0.02),
            }
            for _ in range(layers)
        ],
    }

    def norm(x: jax.Array, g: jax.Array) -> jax.Array:
        v = jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
        return (x * jax.lax.rsqrt(v + 1e-6)).astype(x.dtype) * g.astype(x.dtype)

    def loss_fn(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        b, t = inputs.shape
        x = (p["embed"][inputs] + p["pos"][:t]).astype(dtype)
        for layer in p["layers"]:
            y = norm(x, layer["n1"])
            qkv = (y @ layer["qkv"].astype(dtype)).reshape(b, t, 3, heads, width // heads)
            a = jax.nn.dot_product_attention(
                qkv[:, :, 0],
                qkv[:, :, 1],
                qkv[:, :, 2],
                is_causal=True,
                implementation=implementation,
            )
            x = x + a.reshape(b, t, width) @ layer["o"].astype(dtype)
            y = jax.nn.gelu(norm(x, layer["n2"]) @ layer["up"].astype(dtype))
            x = x + y @ layer["down"].astype(dtype)
        logits = (norm(x, p["final"]) @ p["embed"].astype(dtype).T).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.01)
    opt = tx.init(params)

    def train_step(p: Any, o: Any, key: jax.Array) -> Any:
        tokens = jax.random.randint(key, (batch, context + 1), 0, 256, jnp.int32)
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    key = jax.random.key(1)
    for i in range(3):  # compile and warm up
        params, opt, loss = step(params, opt, jax.random.fold_in(key, i))
    float(loss)
    t0 = time.monotonic()
    for i in range(settings.steps):
        params, opt, loss = step(params, opt, jax.random.fold_in(key, 100 + i))
    float(loss)
    seconds = time.monotonic() - t0
    kind = device.device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), 0.0)
    if not peak:  # a CPU: the float32 matmul rate it reaches here
        a = jnp.ones((2048, 2048), jnp.float32)
        mm = jax.jit(lambda x: x @ x)
        mm(a).block_until_ready()
        t = time.monotonic()
        for _ in range(10):
            r = mm(a)
        r.block_until_ready()
        peak = 10 * 2 * 2048**3 / (time.monotonic() - t)
    settings.json_path.write_text(
        json.dumps(
            {
                "device": f"{kind} x{len(jax.devices())}",
                "steps": settings.steps,
                "seconds": seconds,
                "tokens_per_s": settings.steps * batch * context / seconds,
                "peak_flops": peak,
                "attention": implementation,
                "dtype": str(jnp.dtype(dtype)),
            }
        )
    )


# --- the bench ------------------------------------------------------------------------------
def _shape_args(layers: int, width: int, heads: int, context: int, batch: int) -> list[str]:
    """The model's shape and batch, as both the anchor and the learner take them."""
    shape = {"layers": layers, "width": width, "heads": heads, "context": context}
    return [a for k, v in {**shape, "batch-size": batch}.items() for a in (f"--{k}", str(v))]


def _learner_args(layers: int, width: int, heads: int, context: int, batch: int) -> list[str]:
    return [
        "learner",
        "--insecure",
        *_shape_args(layers, width, heads, context, batch),
        "--eval-every",
        "0",
        "--log-level",
        "warning",
    ]


def _run_child(name: str, args: list[str], workdir: Path, timeout_s: float, threads: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    # The anchor gets the learner's CPU threads (the learner sets these itself).
    env["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={threads}"
    # Every run on the same one device: the first GPU this bench may use (the anchor steps
    # on one device, and a learner would otherwise spread over all it sees).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    env["CUDA_VISIBLE_DEVICES"] = visible or "0"
    child = Child(name, atoll_command(*args), workdir / f"{name}.log", env).start()
    deadline = time.monotonic() + timeout_s
    while child.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if child.alive():
        child.stop()
        raise TimeoutError(f"{name} did not finish within {timeout_s:.0f} s:\n{child.tail()}")
    if child.process is not None and child.process.returncode:
        raise RuntimeError(f"{name} failed:\n{child.tail()}")


def _rate(report: Path, tokens_per_step: int) -> float:
    steady = json.loads(report.read_text())["steady"]
    return float(steady["steps"]) * tokens_per_step / max(1e-9, float(steady["seconds"]))


def measure(settings: MfuBench, size: str, workdir: Path) -> dict[str, Any]:
    layers, width, heads, context, batch = SIZES[size]
    tokens_per_step = batch * context
    anchor_json = workdir / f"{size}-anchor.json"
    _run_child(
        f"{size}-anchor",
        [
            "bench",
            "mfu-anchor",
            *_shape_args(layers, width, heads, context, batch),
            "--steps",
            str(settings.steps),
            "--json",
            str(anchor_json),
        ],
        workdir,
        settings.timeout_s,
        settings.threads,
    )
    anchor = json.loads(anchor_json.read_text())
    # The learner's rate is measured once each fragment has synced twice: its first two
    # encodings compile (as the anchor's first steps do, which it does not time either).
    warm = 2 * settings.inner_steps + 5
    base = [
        *_learner_args(layers, width, heads, context, batch),
        "--steps",
        str(settings.steps + warm),
        "--rate-after-steps",
        str(warm),
        "--threads",
        str(settings.threads),
    ]
    alone = workdir / f"{size}-alone.json"
    _run_child(
        f"{size}-alone",
        [*base, "--standalone", "--report", str(alone)],
        workdir,
        settings.timeout_s,
        settings.threads,
    )
    synced = workdir / f"{size}-synced.json"
    checkpointed = workdir / f"{size}-checkpointed.json"
    with RedisServer(workdir / f"{size}-redis") as redis_server:
        for name, extra in (
            ("synced", ["--checkpoint-every", "0"]),
            ("checkpointed", ["--state-dir", str(workdir / f"{size}-state")]),
        ):
            sync = synchronizer_child(
                workdir,
                redis_server.url,
                f"{size}-{name}-sync",
                [
                    "--job",
                    name,
                    "--fragments",
                    str(settings.fragments),
                    "--inner-steps",
                    str(settings.inner_steps),
                    "--codec",
                    "int4",
                    "--log-level",
                    "warning",
                ],
                tensor_store=workdir / f"{size}-{name}-tensors",
            ).start_and_wait()
            try:
                _run_child(
                    f"{size}-{name}",
                    [
                        *base,
                        "--synchronizer",
                        sync.address,
                        "--job",
                        name,
                        "--id",
                        f"{size}-{name}",
                        "--report",
                        str(workdir / f"{size}-{name}.json"),
                        *extra,
                    ],
                    workdir,
                    settings.timeout_s,
                    settings.threads,
                )
            finally:
                sync.stop()
    per_token = flops_per_token(layers, width, context)
    peak = float(anchor["peak_flops"])
    rates = {
        "anchor": float(anchor["tokens_per_s"]),
        "alone": _rate(alone, tokens_per_step),
        "synced": _rate(synced, tokens_per_step),
        "checkpointed": _rate(checkpointed, tokens_per_step),
    }
    return {
        "size": size,
        "device": anchor["device"],
        "params": parameters(layers, width, context),
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "anchor_mfu": round(rates["anchor"] * per_token / peak, 4),
        "learner_mfu": round(rates["checkpointed"] * per_token / peak, 4),
        "ratio": round(rates["checkpointed"] / rates["anchor"], 4),
        "alone_ratio": round(rates["alone"] / rates["anchor"], 4),
        "sync_overhead": round(1.0 - rates["synced"] / rates["alone"], 4),
        "checkpoint_overhead": round(1.0 - rates["checkpointed"] / rates["synced"], 4),
    }


def default_sizes() -> str:
    """About 85M and 300M parameters where an NVIDIA GPU is present; small ones on a CPU."""
    return "86m,303m" if Path("/dev/nvidia0").exists() else "cpu-small,cpu-medium"


def run(settings: MfuBench) -> None:
    chosen = settings.sizes or default_sizes()
    sizes = [s.strip() for s in chosen.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown --sizes {unknown}; choose from {sorted(SIZES)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="atoll-bench-mfu-") as tmp:
        for size in sizes:
            runs.append(measure(settings, size, Path(tmp)))
            print(json.dumps(runs[-1]), flush=True)
    result = {"steps": settings.steps, "runs": runs}
    print(json.dumps(result, indent=2))
    if settings.json_path is not None:
        settings.json_path.write_text(json.dumps(result, indent=2) + "\n")
