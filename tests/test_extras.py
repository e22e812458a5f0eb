"""`pip install 'atoll[cuda]'` and `'atoll[tpu]'`: each extra is the jax atoll pins, with that
accelerator's backend, so a learner on GPUs or TPUs runs the jax the tests ran."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_accelerator_extras_pin_the_base_jax() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (jax,) = [d for d in project["dependencies"] if re.match(r"jax==", d)]
    pinned = jax.removeprefix("jax==")
    extras = project["optional-dependencies"]
    assert extras["cuda"] == [f"jax[cuda12]=={pinned}"]
    assert extras["tpu"] == [f"jax[tpu]=={pinned}"]
    assert f"jaxlib=={pinned}" in project["dependencies"]


def test_the_image_and_the_docs_offer_them() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ARG EXTRA=""' in dockerfile
    assert "atoll${EXTRA:+[$EXTRA]}" in dockerfile
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    for extra in ("cuda", "tpu"):
        assert f"pip install 'atoll[{extra}]'" in deploy
