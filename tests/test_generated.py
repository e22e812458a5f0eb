"""The committed files made from the registries are exactly what `make generated` makes."""

from __future__ import annotations

import json

import pytest

from atoll import generated
from services.codec_example_test import register_example


def test_generated_files_match_the_registries() -> None:
    drifted = [
        str(path)
        for path, text in generated.generate().items()
        if (generated.ROOT / path).read_text() != text
    ]
    assert not drifted, f"{drifted} drifted from the registries; run `make generated`"


def test_a_new_codec_is_offered_by_the_chart_and_the_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    register_example(monkeypatch)
    files = generated.generate()
    schema = json.loads(files[generated.HELM_SCHEMA])
    assert "fp8" in schema["properties"]["job"]["properties"]["codec"]["enum"]
    assert "| `fp8` |" in files[generated.ALGORITHM_DOC]
