"""`atoll bench codecs`: how much each codec loses, on outer-gradient-like vectors.

For each distribution (Gaussian, Laplace, Student-t with 3 degrees of freedom: outer
gradients have heavy tails) and each codec: payload bytes per value, the relative L2 error
of one encoding, and the relative error of the sum of 50 encodings with error feedback
(what a fragment accumulates over 50 syncs). The 4-bit default (`--codec int4`) is the 4-bit
codec with the lower error here. How fast each codec is: `atoll bench codec-speed`.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from bench.options import Output
from bench.runs import write
from services import codec as codecs


class CodecsBench(Output):
    """Bytes per value and error of each codec, with and without error feedback."""

    codecs: list[str] = Field(
        ["bf16", "int8", "int4-uniform", "e3m0", "int2", "sign", "topk"],
        description="codecs compared",
    )
    values: int = Field(1 << 18, ge=256, description="values per vector")
    rounds: int = Field(50, ge=1, description="encodings summed with error feedback")
    block_size: int = Field(256, ge=1, description="values per block scale")
    seed: int = Field(0, description="random seed")

    def cli_cmd(self) -> None:
        run(self)


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
    write({"values": settings.values, "rounds": settings.rounds, "runs": rows}, settings.json_path)
