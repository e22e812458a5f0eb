"""`atoll eval`: the eval loss of an exported model on any text files or folders.

Deterministic: the text is read as a learner reads its evaluation files (sorted, joined by
newlines), and the windows are the same evenly spread selection a learner's eval makes
(`learner.data.eval_windows`), so on a run's evaluation text with the run's window count it
gives the run's eval loss. The loss is mean next-byte cross-entropy in nats per byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from services.config import AtollSettings


class EvalSettings(AtollSettings):
    """`atoll eval`: score an exported model (`atoll export`, `atoll up --export`)."""

    model_file: Path = Field(description="a safetensors file written by atoll export")
    data: list[Path] = Field(
        default_factory=list,
        description="text files or folders to score; empty: this Python's standard library",
    )
    held_out: bool = Field(
        False,
        description="score only the files a learner holds out of --data (every 50th): a "
        "run's evaluation text when it was given no --eval-data",
    )
    ood_data: list[Path] = Field(
        default_factory=list,
        description="a second text to score too, all of its files (prose, another project's "
        "sources: text the model was not trained near), with the same window count; its loss "
        "is `ood_loss` in the result",
    )
    json_path: Path | None = Field(None, alias="json", description="write the result JSON here")
    context: int = Field(0, ge=0, description="window length in bytes; 0: the model's context")
    batch_size: int = Field(16, ge=1, description="windows per forward pass (no effect on loss)")
    windows: int = Field(
        0,
        ge=0,
        description="windows scored, evenly spread over the text (a run's --eval-windows, or "
        "--eval-batches x --batch-size); 0: every window",
    )
    dtype: Literal["model", "auto", "float32", "bfloat16"] = Field(
        "model",
        description="compute dtype; model: the one recorded in the file (auto: bfloat16 on "
        "GPU and TPU, float32 on CPU, as the learners chose)",
    )


def load(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The model's leaves (as numpy arrays) and the file's metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        metadata = dict(f.metadata() or {})
        leaves = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if "model_config" not in metadata:
        raise ValueError(f"{path} has no model_config in its metadata: not an atoll export")
    return leaves, metadata


def evaluate(settings: EvalSettings) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from learner.data import (
        default_paths,
        eval_batches,
        held_out,
        list_files,
        mean_loss,
        no_text,
        read_text,
    )
    from learner.model import TransformerConfig, make_loss, resolve_dtype

    leaves, metadata = load(settings.model_file)
    config = json.loads(metadata["model_config"])
    if config.get("model") != "builtin":
        raise ValueError(
            f"{settings.model_file} holds {config.get('model')!r}; atoll eval scores the "
            "built-in transformer"
        )
    context = settings.context or int(config["context"])
    if context > int(config["context"]):
        raise ValueError(f"--context {context} is past the model's context {config['context']}")
    dtype = resolve_dtype(config["dtype"] if settings.dtype == "model" else settings.dtype)
    cfg = TransformerConfig(
        int(config["layers"]),
        int(config["width"]),
        int(config["heads"]),
        int(config["context"]),
        compute_dtype=dtype,
    )
    # Held out: the training listing's every 50th file, as the learners chose them; else
    # every text file, with or without a suffix.
    files = list_files(settings.data or default_paths(), any_text=not settings.held_out)
    if settings.held_out:
        files = held_out(files)
    if not files:
        raise no_text(settings.data, "--data")
    batches = eval_batches(read_text(files), settings.batch_size, context, settings.windows)
    params = {k: jnp.asarray(v) for k, v in leaves.items()}
    loss = jax.jit(make_loss(cfg))
    windows = sum(len(b) for b in batches)
    ood: dict[str, Any] = {}
    if settings.ood_data:
        ood_files = list_files(settings.ood_data, any_text=True)
        if not ood_files:
            raise no_text(settings.ood_data, "--ood-data")
        text = read_text(ood_files)
        ood_batches = eval_batches(text, settings.batch_size, context, settings.windows)
        ood = {
            "ood_loss": mean_loss(lambda b: float(loss(params, jnp.asarray(b))), ood_batches),
            "ood_files": len(ood_files),
            "ood_windows": sum(len(b) for b in ood_batches),
            "ood_data": [str(p) for p in settings.ood_data],
        }
    return {
        **ood,
        "eval_loss": mean_loss(lambda b: float(loss(params, jnp.asarray(b))), batches),
        "tokens": windows * context,
        "windows": windows,
        "context": context,
        "dtype": dtype,
        "files": len(files),
        "model_file": str(settings.model_file),
        "data": [str(p) for p in settings.data] or [str(p) for p in default_paths()],
        "held_out": settings.held_out,
        "job": metadata.get("job"),
        "versions": json.loads(metadata.get("versions", "[]")),
    }


def run(settings: EvalSettings) -> int:
    result = evaluate(settings)
    text = json.dumps(result, indent=2)
    print(text)
    if settings.json_path is not None:
        settings.json_path.parent.mkdir(parents=True, exist_ok=True)
        settings.json_path.write_text(text + "\n")
    return 0
