"""When a slot's checkpoint is due, and that nothing is taken without its engine's state."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner import checkpoint as ckpt
from learner.checkpointer import CHECKPOINT_SHARE, Checkpointer
from learner.settings import LearnerSettings


class Source:
    """An engine's state with no fragments."""

    def checkpoint_key(self) -> dict[str, Any]:
        return {"job": "j", "learner": "l-0", "fragments": 0, "inner_steps": 1}

    def checkpoint_state(
        self, arrays: dict[str, np.ndarray]
    ) -> tuple[list[dict[str, Any]], Future[list[ckpt.EncoderHeld]]]:
        held: Future[list[ckpt.EncoderHeld]] = Future()
        held.set_result([])
        return [], held


def settings(tmp_path: Path | None, **kw: Any) -> LearnerSettings:
    return LearnerSettings(synchronizer=["x:1"], id="l-0", job="j", state_dir=tmp_path, **kw)


def test_nothing_is_due_without_a_state_dir_or_an_attached_engine(tmp_path: Path) -> None:
    alone = Checkpointer(settings(None))
    alone.attach(Source())
    assert not alone.due(1)
    unattached = Checkpointer(settings(tmp_path))
    assert not unattached.due(1)
    assert unattached.read({}, []) is None
    alone.close()
    unattached.close()


def test_due_every_n_steps_spaced_by_what_the_last_write_took(tmp_path: Path) -> None:
    c = Checkpointer(settings(tmp_path, checkpoint_every=2, checkpoint_seconds=0.0))
    c.attach(Source())
    try:
        assert not c.due(1)
        assert c.due(2)
        c.write({"w": np.ones(3, np.float32)}, (), {"step": 2, "tokens": 8, "position": 2})
        while not c.ready():
            pass
        c.write_s = 1e6 * CHECKPOINT_SHARE  # a slow disk: the next one waits
        assert not c.due(4)
        c.write_s = 0.0
        assert c.due(4)
        loaded = c.read(Source().checkpoint_key(), ["w"])
        assert loaded is not None
        np.testing.assert_array_equal(loaded.params["w"], np.ones(3))
        assert loaded.meta["step"] == 2
        assert c.read({**Source().checkpoint_key(), "job": "other"}, ["w"]) is None
    finally:
        c.close()


class FailingSource(Source):
    """An engine whose encoder thread failed (as a full disk fails the write)."""

    def checkpoint_state(
        self, arrays: dict[str, np.ndarray]
    ) -> tuple[list[dict[str, Any]], Future[list[ckpt.EncoderHeld]]]:
        held: Future[list[ckpt.EncoderHeld]] = Future()
        held.set_exception(OSError("no space left on device"))
        return [], held


def test_a_failed_write_stops_the_learner_at_the_next_checkpoint(tmp_path: Path) -> None:
    c = Checkpointer(settings(tmp_path, checkpoint_every=1))
    c.attach(FailingSource())
    try:
        c.write({"w": np.ones(1, np.float32)}, (), {"step": 1, "tokens": 1, "position": 1})
        c._writer.submit(lambda: None).result()  # the write is over
        with pytest.raises(OSError, match="no space"):
            c.ready()
    finally:
        c.close()
