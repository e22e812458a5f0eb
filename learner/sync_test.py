"""The sync engine's decisions, given a fragment I/O over numpy and no network: what is due
and sent, sync mode's wait for its reply, a refused update's refetch, the final sync."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from learner.fragment_io import Joined, Link, Outgoing
from learner.outer import OuterState, Send
from learner.settings import LearnerSettings
from learner.sync import SyncEngine
from learner.workload import FlatParams
from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.tape import Tape

FRAGMENTS, H = 2, 4


class FakeIO:
    """Two fragments, one leaf each (`a`, `b`, 3 values): values on the host, replies and
    acks given by the test."""

    speaks = True
    version_notices = False

    def __init__(self, mode: str = "decoupled") -> None:
        self.mode = mode
        self.tape_fields: dict[str, Any] = {}
        self.sent: list[tuple[int, Send]] = []
        self.replies: list[tuple[int, np.ndarray, int]] = []  # handed over at the next `news`
        self.acks: dict[int, session_pb2.Ack] = {}
        self.refetched: list[set[int]] = []
        self.finished = False
        self.reply_when_waiting: Any = None  # (p, value, version) given once a wait begins

    def incarnation(self, mine: str) -> str:
        return mine

    def join(self, link: Link, initial: Any, sharding: Any) -> Joined:
        config = session_pb2.JobConfig(
            mode=self.mode,
            fragments=FRAGMENTS,
            inner_steps=H,
            codec=fragment_pb2.CODEC_FP32,
            keep_overlap_progress=True,
        )
        start = [(0, np.zeros(3, np.float32)), (0, np.zeros(3, np.float32))]
        self.outer = OuterState.start(start, codecs.by_name("fp32"), 0)
        return Joined(config, self.outer, {"a": np.zeros(3, np.float32), "b": np.zeros(3)})

    def news(self, flat: FlatParams, *, wait: float, halt: bool) -> tuple[bool, bool]:
        if wait and self.reply_when_waiting is not None:
            self.replies.append(self.reply_when_waiting)
            self.reply_when_waiting = None
        adopted = False
        while self.replies:
            p, value, version = self.replies.pop(0)
            if self.outer.fragments[p].receive(value, version):
                self.adopt(flat, p, value, version)
                adopted = True
        return adopted, halt and not adopted

    def final_ack(self, seq: int) -> session_pb2.Ack | None:
        return self.acks.get(seq)

    def job_finished(self) -> bool:
        return self.finished

    def take(self, p: int, send: Send, flat: FlatParams) -> Outgoing:
        self.sent.append((p, send))
        f, theta = self.outer.fragments[p], np.asarray(flat["ab"[p]], np.float32).copy()
        return Outgoing(lambda: f.encode(send, theta), 3)

    def adopt(self, flat: FlatParams, p: int, value: np.ndarray, version: int) -> None:
        f = self.outer.fragments[p]
        flat["ab"[p]] = f.local_value(np.asarray(flat["ab"[p]]), value, 0.0)  # type: ignore[assignment]
        f.adopt(value, version)

    def refetch(self, flat: FlatParams, fragments: set[int]) -> set[int]:
        self.refetched.append(set(fragments))
        return set()

    def global_params(self, sharding: Any) -> Any:
        return {"a": self.outer.fragments[0].base, "b": self.outer.fragments[1].base}

    def checksums(self, flat: FlatParams) -> list[int]:
        return [codecs.checksum(np.asarray(flat[n], np.float32).tobytes()) for n in "ab"]

    def report(self) -> dict[str, Any]:
        return {"fake": True}

    def close(self) -> None:
        pass


def engine(io: FakeIO, tmp_path: Any) -> SyncEngine:
    settings = LearnerSettings(
        synchronizer=["127.0.0.1:1"], id="unit-0", insecure=True, heartbeat_s=1000.0, linger_s=0
    )
    shapes = {"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}
    return SyncEngine(
        settings,
        shapes,
        tokens_per_step=8,
        fragment_io=io,
        tape=Tape(tmp_path / "unit.tape", "unit-0"),
        stop_requested=threading.Event(),
    )


def params(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full(3, value, np.float32), "b": np.full(3, value, np.float32)}


def test_each_fragment_is_sent_when_due_with_its_counters(tmp_path: Any) -> None:
    io = FakeIO()
    e = engine(io, tmp_path)
    try:
        e.join(params(0.0))
        for step in range(1, H + 1):
            e.after_step(step, params(-step), seconds=0.5)
        # Fragment 0 is due at H/P, fragment 1 at H; each takes every step since its anchor.
        assert [(p, s.steps, s.tokens) for p, s in io.sent] == [(0, 2, 16), (1, 4, 32)]
        assert [f.in_flight for f in io.outer.fragments] == [True, True]
        e._encoder.submit(lambda: None).result()  # the encoder queued both
        assert e.client.unacked() == 2
    finally:
        e.close()


def test_an_adopted_reply_is_written_into_the_parameters_handed_back(tmp_path: Any) -> None:
    io = FakeIO()
    e = engine(io, tmp_path)
    try:
        e.join(params(0.0))
        e.after_step(1, params(-1.0))
        e.after_step(2, params(-2.0))  # fragment 0 sent, taken at -2
        io.replies.append((0, np.full(3, 5.0, np.float32), 1))
        out = e.after_step(3, params(-3.0))
        # theta <- Theta + (theta - theta_sent): the step taken since the send is kept.
        np.testing.assert_allclose(out["a"], np.full(3, 4.0))
        np.testing.assert_allclose(out["b"], np.full(3, -3.0))
        assert io.outer.fragments[0].version == 1
    finally:
        e.close()


def test_a_version_sealed_without_the_update_is_held_until_the_ack_names_the_reply(
    tmp_path: Any,
) -> None:
    io = FakeIO()
    e = engine(io, tmp_path)
    try:
        e.join(params(0.0))
        f = io.outer.fragments[0]
        f.confirm_by_ack = True  # as a decoupled learner of one process (whole_fragments)
        e.after_step(1, params(-1.0))
        e.after_step(2, params(-2.0))  # fragment 0 sent, taken at -2
        e._encoder.submit(lambda: None).result()
        # Version 1 holds only another learner's update: this one was still on the link.
        io.replies.append((0, np.full(3, 5.0, np.float32), 1))
        out = e.after_step(3, params(-3.0))
        np.testing.assert_allclose(out["a"], np.full(3, -3.0))  # held, not adopted
        assert f.in_flight
        assert f.sent_seq == 1
        io.acks[1] = session_pb2.Ack(seq=1, status=session_pb2.ACK_STATUS_COMMITTED, version=2)
        out = e.after_step(4, params(-4.0))
        assert f.in_flight  # merged by version 2, which has not arrived
        io.replies.append((0, np.full(3, 6.0, np.float32), 2))
        out = e.after_step(5, params(-5.0))
        np.testing.assert_allclose(out["a"], np.full(3, 3.0))  # 6 + (-5 - -2)
        assert not f.in_flight
        assert f.version == 2
    finally:
        e.close()


def test_sync_mode_waits_at_a_due_fragment_for_its_merge(tmp_path: Any) -> None:
    io = FakeIO(mode="sync")
    e = engine(io, tmp_path)
    try:
        e.join(params(0.0))
        e.after_step(1, params(-1.0))
        io.reply_when_waiting = (0, np.full(3, 7.0, np.float32), 1)
        out = e.after_step(2, params(-2.0))
        assert not io.outer.fragments[0].in_flight
        np.testing.assert_allclose(out["a"], np.full(3, 7.0))
        assert e.badput["waiting"] > 0
    finally:
        e.close()


def test_a_refused_update_is_lost_badput_and_its_fragment_refetched(tmp_path: Any) -> None:
    io = FakeIO()
    e = engine(io, tmp_path)
    try:
        e.join(params(0.0))
        e.after_step(1, params(-1.0), seconds=1.0)
        e.after_step(2, params(-2.0), seconds=1.0)
        e._encoder.submit(lambda: None).result()
        io.acks[1] = session_pb2.Ack(seq=1, status=session_pb2.ACK_STATUS_REJECTED, reason="stale")
        e.after_step(3, params(-3.0), seconds=1.0)
        assert io.refetched == [{0}]
        assert e.badput["lost"] == pytest.approx(2.0 / FRAGMENTS)
        assert e.pending_acks == {}
    finally:
        e.close()


def test_finish_sends_what_is_left_and_done_reports_the_summary(tmp_path: Any) -> None:
    io = FakeIO()
    e = engine(io, tmp_path)
    try:
        e.join(params(0.0))
        e.after_step(1, params(-1.0))
        e._encoder.submit(lambda: None).result()
        for seq in (1, 2):  # both final updates merged at once
            io.acks[seq] = session_pb2.Ack(seq=seq, status=session_pb2.ACK_STATUS_COMMITTED)
        io.replies += [(0, np.full(3, 2.0, np.float32), 1), (1, np.full(3, 3.0, np.float32), 1)]
        out = e.finish(params(-1.0), compute_seconds=0.25)
        assert [p for p, _ in io.sent] == [0, 1]
        np.testing.assert_allclose(out["a"], np.full(3, 2.0))
        np.testing.assert_allclose(out["b"], np.full(3, 3.0))
        summary = e.done(out, eval_loss=1.5)
        assert summary["versions"] == [1, 1]
        assert summary["fake"] is True
        assert set(summary["badput"]) >= {"lost", "waiting"}
        assert e.standing.eval_loss == 1.5
    finally:
        e.close()
