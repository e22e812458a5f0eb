"""`atoll export`: a job's global model as one safetensors file, running or finished.

Redis names each fragment's keyframe in the tensor store and the deltas committed since, which
rebuild its committed value (synchronizer/values.py); the fragment layout (a pure function of
the job's parameter spec and P) scatters each value back into its named leaves.
Leaves are written as float32, the precision the synchronizer keeps them in.

The file's metadata (all strings, as safetensors wants):
- `format`: `atoll/1`; `job`; `parameters`;
- `versions`: JSON list, the committed version of each fragment that was read;
- `model_config`: JSON, what rebuilds the built-in transformer (`atoll eval` reads it).
  `layers`, `width` and `context` come from the spec's shapes, facts the job already holds;
  `heads` and the compute `dtype` shape no parameter, so the caller gives them (`--heads`,
  `--dtype`; `atoll up --export` passes the flags it started its learners with). A model of
  your own (`--model module:function`) is exported with `{"model": "module:function"}`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
import redis
from pydantic import Field
from safetensors.numpy import save_file

from services.config import AtollSettings
from services.layout import LeafSpec, fragment_layout
from synchronizer import inspect

FORMAT = "atoll/1"
VOCAB = 256  # the built-in model's byte vocabulary


class ExportError(ValueError):
    """The job cannot be exported as asked; the message says why and what to give."""


class ExportSettings(AtollSettings):
    """`atoll export`: the global model of a job, read from Redis and the tensor store."""

    redis_url: str = Field(description="the job's Redis (redis://HOST:PORT/DB)")
    tensor_store: str = Field(
        description="the job's tensor store: a directory, file:///dir, s3://, gs:// or az://"
    )
    job: str = Field("default", description="the job to export")
    out: Path = Field(description="write the safetensors file here")
    model: str = Field(
        "builtin", description="the learners' --model: 'builtin' or their 'module:function'"
    )
    heads: int | None = Field(
        None,
        ge=1,
        description="the built-in model's attention heads (the learners' --heads); needed for "
        "the built-in model, which cannot read it from the job",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the learners' compute --dtype, recorded for `atoll eval`"
    )


def builtin_config(
    specs: list[LeafSpec], heads: int | None, dtype: str, model: str = "builtin"
) -> dict[str, Any]:
    """The model config of the metadata: the built-in transformer's sizes read from the
    spec's shapes, with `heads` and `dtype` as given."""
    if model != "builtin":
        return {"model": model}
    shapes = {s.name: s.shape for s in specs}
    if len(shapes.get("embed", ())) != 2 or len(shapes.get("pos", ())) != 2:
        raise ExportError(
            "the job's parameters are not the built-in transformer's (no embed and pos "
            "leaves); give the learners' --model"
        )
    width, context = shapes["embed"][1], shapes["pos"][0]
    layers = len({s.name.split("/")[1] for s in specs if s.name.startswith("blocks/")})
    if heads is None:
        raise ExportError(
            "--heads is needed: the number of attention heads shapes no parameter, so the "
            "job does not know it; give the learners' --heads"
        )
    if width % heads:
        raise ExportError(f"--heads {heads} does not divide the model's width {width}")
    expected = VOCAB * width + context * width + width + layers * (12 * width**2 + 2 * width)
    if sum(s.size for s in specs) != expected:
        raise ExportError("the job's parameters do not add up to a built-in transformer")
    return {
        "model": "builtin",
        "layers": layers,
        "width": width,
        "heads": heads,
        "context": context,
        "dtype": dtype,
    }


def export_model(
    r: Any,
    job: str,
    tensor_store: str,
    out: Path,
    *,
    model: str = "builtin",
    heads: int | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Write the job's committed global model to `out`; return the file's metadata."""
    specs = inspect.job_spec(r, job)
    config = inspect.job_config(r, job)
    if specs is None or config is None:
        raise ExportError(f"job {job!r} has no parameter spec in this Redis: no learner joined it")
    model_config = builtin_config(specs, heads, dtype, model)
    fragments = int(config["fragments"])
    layout = fragment_layout(specs, fragments)
    leaves: dict[str, np.ndarray] = {}
    versions: list[int] = []
    for p in range(fragments):
        found = inspect.committed_value(r, job, p, tensor_store)
        if found is None:
            raise ExportError(f"fragment {p} of job {job!r} has no committed value yet")
        version, flat = found
        leaves.update(layout.scatter(p, flat))
        versions.append(version)
    metadata = {
        "format": FORMAT,
        "job": job,
        "parameters": str(sum(v.size for v in leaves.values())),
        "versions": json.dumps(versions),
        "model_config": json.dumps(model_config),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in leaves.items()}, str(tmp), metadata)
    os.replace(tmp, out)
    return metadata


def run(settings: ExportSettings) -> int:
    r = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    try:
        r.ping()
    except redis.RedisError as err:
        print(f"atoll export: cannot reach Redis at --redis-url: {err}", file=sys.stderr)
        return 1
    metadata = export_model(
        r,
        settings.job,
        settings.tensor_store,
        settings.out,
        model=settings.model,
        heads=settings.heads,
        dtype=settings.dtype,
    )
    print(json.dumps({"out": str(settings.out), **metadata}))
    return 0
