"""`atoll plan`: the WAN bandwidth a training run needs, data-parallel against atoll.

The formulas (docs/bandwidth.md):

- data-parallel: every step each learner all-reduces its gradients, 2(M-1)/M x bytes per
  gradient value x N values (a ring), and waits for it. For a compute utilization u the
  all-reduce may take T (1/u - 1), so the link needs
  `bw_dp = 2(M-1)/M x g x N / (T (1/u - 1))`.
- atoll: every H/P steps a learner sends one fragment of N/P values at b bits each (the
  codec's payload per value, block scales included) and receives the new global fragment
  as a delta at b' bits per value. The transfer overlaps tau inner steps, so at full
  utilization it must finish within tau T: `bw_atoll = (N/P)(b + b')/8 / (tau T)` on a link
  shared by both directions. A lower target utilization lets it also stall: it may take
  `tau T + H/P T (1/u - 1)`. The mean rate over a run is `N (b + b') / 8 / (H T)`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import Field

from services import codec as codecs
from services.config import AtollSettings, CodecName


def bits_per_value(codec: str, block_size: int = codecs.DEFAULT_BLOCK_SIZE) -> float:
    """Payload bits per value of a codec, block scales included (measured on its encoder)."""
    n = 1 << 16
    payload = codecs.by_name(codec).encode(np.zeros(n, np.float32), block_size)
    return 8.0 * len(payload) / n


@dataclass(frozen=True)
class Plan:
    parameters: float
    step_seconds: float
    learners: int
    inner_steps: int
    fragments: int
    overlap_steps: int
    codec: str
    downlink_codec: str
    utilization: float
    dp_gbps: float
    atoll_gbps: float
    atoll_mean_gbps: float
    reduction: float


def plan(
    parameters: float,
    step_seconds: float,
    learners: int,
    inner_steps: int,
    fragments: int,
    overlap_steps: int,
    codec: str = "int4",
    downlink_codec: str = "int4",
    utilization: float = 0.9,
    gradient_bytes: float = 4.0,
) -> Plan:
    if not 0.0 < utilization < 1.0:
        raise ValueError(f"utilization {utilization} must be between 0 and 1 (e.g. 0.9)")
    slack = 1.0 / utilization - 1.0
    ring = 2.0 * (learners - 1) / learners if learners > 1 else 0.0
    dp_bytes_per_s = ring * gradient_bytes * parameters / (step_seconds * slack)
    per_value = (bits_per_value(codec) + bits_per_value(downlink_codec)) / 8.0
    fragment_bytes = parameters / fragments * per_value
    window = overlap_steps * step_seconds + inner_steps / fragments * step_seconds * slack
    atoll_bytes_per_s = fragment_bytes / window
    mean_bytes_per_s = parameters * per_value / (inner_steps * step_seconds)
    return Plan(
        parameters=parameters,
        step_seconds=step_seconds,
        learners=learners,
        inner_steps=inner_steps,
        fragments=fragments,
        overlap_steps=overlap_steps,
        codec=codec,
        downlink_codec=downlink_codec,
        utilization=utilization,
        dp_gbps=dp_bytes_per_s * 8 / 1e9,
        atoll_gbps=atoll_bytes_per_s * 8 / 1e9,
        atoll_mean_gbps=mean_bytes_per_s * 8 / 1e9,
        reduction=dp_bytes_per_s / atoll_bytes_per_s if atoll_bytes_per_s else 0.0,
    )


class PlanSettings(AtollSettings):
    """`atoll plan`: WAN bandwidth for a target compute utilization, data-parallel and atoll."""

    parameters: float = Field(gt=0, description="model parameters, e.g. 1e9")
    step_seconds: float = Field(gt=0, description="one inner step's compute time")
    learners: int = Field(8, ge=1, description="M: learners (data-parallel: replicas)")
    inner_steps: int = Field(100, ge=1, description="H")
    fragments: int = Field(4, ge=1, description="P")
    overlap_steps: int = Field(5, ge=1, description="tau: steps a fragment's sync may take")
    codec: CodecName = Field("int4", description="uplink codec")
    downlink_codec: CodecName = Field("int4", description="downlink codec")
    utilization: float = Field(0.9, gt=0, lt=1, description="target compute utilization")
    gradient_bytes: float = Field(4.0, gt=0, description="data-parallel bytes per gradient")
    json_path: Path | None = Field(None, alias="json", description="write the plan JSON here")


def run(settings: PlanSettings) -> int:
    result = plan(
        settings.parameters,
        settings.step_seconds,
        settings.learners,
        settings.inner_steps,
        settings.fragments,
        settings.overlap_steps,
        settings.codec,
        settings.downlink_codec,
        settings.utilization,
        settings.gradient_bytes,
    )
    text = json.dumps(
        {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(result).items()}, indent=2
    )
    print(text)
    if settings.json_path is not None:
        settings.json_path.write_text(text + "\n")
    return 0
