"""Flags several benchmarks share: where the result goes, and the model they train."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class Output(BaseModel):
    json_path: Path | None = Field(None, alias="json", description="write the result JSON here")


class Model(BaseModel):
    layers: int = Field(4, ge=1, description="transformer layers")
    width: int = Field(128, ge=8, description="model width")
    heads: int = Field(4, ge=1, description="attention heads")
    context: int = Field(128, ge=8, description="context length in bytes")
    batch_size: int = Field(8, ge=1, description="sequences per step per learner")
