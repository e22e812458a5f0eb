import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cluster import processes
from cluster.processes import Child, child_env, gpu_pinning, stop_all


def test_each_learner_gets_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(processes, "accelerators_present", lambda: 4)
    assert gpu_pinning(0, 1) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert gpu_pinning(3, 1) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert gpu_pinning(1, 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert gpu_pinning(5, 0) == {}  # no pinning
    with pytest.raises(ValueError, match="shows 4"):
        gpu_pinning(2, 2)
    # Within the devices this process was given, in their order.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert gpu_pinning(1, 1) == {"CUDA_VISIBLE_DEVICES": "7"}


def test_jax_stays_on_the_cpu_unless_a_learner_may_use_accelerators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(processes, "accelerators_present", lambda: 2)
    assert child_env()["JAX_PLATFORMS"] == "cpu"  # a synchronizer
    assert "JAX_PLATFORMS" not in child_env(accelerators=True)  # a learner on a GPU machine
    monkeypatch.setattr(processes, "accelerators_present", lambda: 0)
    assert child_env(accelerators=True)["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert child_env()["JAX_PLATFORMS"] == "cuda"  # the caller's own wins


def test_stop_all_waits_one_timeout_for_every_child(tmp_path: Path) -> None:
    """Three children that ignore SIGTERM: killed together after one timeout, not three."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    children = [
        Child(f"c{i}", [sys.executable, "-c", ignore], tmp_path / f"c{i}.log", dict(os.environ))
        for i in range(3)
    ]
    for child in children:
        child.start()
    time.sleep(0.5)  # each has set its handler
    started = time.monotonic()
    stop_all(children, timeout_s=1.0)
    assert time.monotonic() - started < 2.5
    assert not any(child.alive() for child in children)
    assert {child.process.returncode for child in children if child.process} == {-signal.SIGKILL}


def test_a_child_started_on_cores_runs_only_on_them_and_its_parent_keeps_its_own(
    tmp_path: Path,
) -> None:
    mine = os.sched_getaffinity(0)
    core = min(mine)
    log = tmp_path / "child.log"
    script = "import os; print(sorted(os.sched_getaffinity(0)))"
    child = Child("pinned", [sys.executable, "-c", script], log, dict(os.environ), cores=(core,))
    child.start()
    assert child.process is not None
    assert child.process.wait(timeout=30) == 0
    assert log.read_text().strip() == f"[{core}]"
    assert os.sched_getaffinity(0) == mine
