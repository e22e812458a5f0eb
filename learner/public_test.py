"""The learner's public face: every name it offers resolves, and importing a module of the
package stays light (the `atoll` command imports the settings)."""

from __future__ import annotations

import subprocess
import sys

import learner


def test_every_public_name_resolves_to_what_its_module_defines() -> None:
    assert sorted(learner.__all__) == sorted(dir(learner))
    for name in learner.__all__:
        value = getattr(learner, name)
        assert value.__name__ == name, name


def test_importing_the_settings_loads_neither_jax_nor_grpc() -> None:
    code = (
        "import sys, learner.settings, learner; learner.__all__; "
        "print(sorted(m for m in ('jax', 'grpc') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
