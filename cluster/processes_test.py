import pytest

from cluster import processes
from cluster.processes import child_env, gpu_pinning


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
