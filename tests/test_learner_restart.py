"""The built-in learner (inner loop + sync engine) against a real synchronizer: a new
incarnation of a slot goes on from the slot's local checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import learner as learner_package
from learner import workload
from learner.settings import LearnerSettings
from learner.trainer import Learner
from tests.conftest import SpawnSynchronizer


def test_a_restarted_learner_goes_on_from_its_checkpoint(
    spawn_synchronizer: SpawnSynchronizer, tmp_path: Path
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--inner-steps", "10")
    tape = tmp_path / "tape.jsonl"

    def run(steps: int) -> dict[str, object]:
        settings = LearnerSettings(
            synchronizer=[sync.address],
            insecure=True,
            id="learner-0",
            state_dir=tmp_path / "state",
            tape=tape,
            steps=steps,
            layers=1,
            width=16,
            heads=2,
            context=16,
            batch_size=4,
            eval_every=0,
            eval_batches=1,
            checkpoint_seconds=0.0,
            heartbeat_s=0.2,
            data=[Path(learner_package.__file__).parent],
        )
        learner = Learner(settings, workload.load(settings))
        try:
            return learner.run()
        finally:
            learner.close()

    first = run(20)
    assert first["steps"] == 20
    assert (tmp_path / "state" / "learner-0.checkpoint.1").exists()
    second = run(30)
    assert second["steps"] == 30  # it went on from its step count, not from zero
    joins = [e for e in map(json.loads, tape.read_text().splitlines()) if e["kind"] == "joined"]
    assert [j["restored"] for j in joins] == [False, True]
    assert 0 < joins[1]["step"] <= 20
    assert second["incarnation"] != first["incarnation"]
    assert min(second["versions"]) >= 2  # type: ignore[call-overload]
