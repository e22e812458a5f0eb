"""Control sessions against the in-memory control store: hello, the welcome, heartbeats,
the step budget and commit notices (a real Redis and real learners: tests/)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.config import SynchronizerSettings
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.layout import FragmentLayout, fragment_layout
from services.tape import Tape
from synchronizer.ownership import Ownership
from synchronizer.session import Connection, SessionClosed, Sessions, spec_from_json
from synchronizer.store.control import Commit
from synchronizer.store.memory_store import MemoryControlStore
from synchronizer.store.tensors import TensorStore


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000.0

    def __call__(self) -> float:
        return self.ms


def _sessions(
    tmp_path: Path, store: MemoryControlStore, **settings: object
) -> tuple[Sessions, SynchronizerSettings]:
    config = SynchronizerSettings(
        job="job",
        fragments=1,
        replica_id="r",
        lease_ttl_s=5.0,
        **settings,  # type: ignore[arg-type]
    )
    tensors, tape = TensorStore(str(tmp_path)), Tape(None, "r")
    layout: list[FragmentLayout] = []

    def adopt(spec: str) -> None:
        if not layout:
            layout.append(fragment_layout(spec_from_json(spec), config.fragments))

    def current() -> FragmentLayout | None:
        return layout[0] if layout else None

    ownership = Ownership(
        replica="r",
        address="127.0.0.1:1",
        config=config,
        store=store,
        tensors=tensors,
        tape=tape,
        layout=current,
    )
    sessions = Sessions(config, store, ownership, tape, current, adopt)
    return sessions, config


def _hello(
    learner: str, incarnation: str, shape: tuple[int, ...] = (4, 4), step: int = 0
) -> session_pb2.LearnerMessage:
    spec = fragment_pb2.TensorSpec(name="w", shape=shape, dtype="float32")
    return session_pb2.LearnerMessage(
        hello=session_pb2.Hello(
            job="job", learner_id=learner, incarnation=incarnation, params=[spec], step=step
        )
    )


def _sent(conn: Connection) -> list[session_pb2.SynchronizerMessage | SessionClosed | None]:
    out = []
    while not conn.outbox.empty():
        out.append(conn.outbox.get_nowait())
    return out


def test_the_first_hello_is_welcomed_with_the_jobs_config_and_asked_for_first_values(
    tmp_path: Path,
) -> None:
    store = MemoryControlStore("job")
    sessions, _ = _sessions(tmp_path, store)

    async def run() -> None:
        conn, message = await sessions._hello(_hello("a", "i"))
        welcome = message.welcome
        assert (conn.learner, conn.incarnation) == ("a", "i")
        assert welcome.config.job == "job"
        assert welcome.config.fragments == 1
        assert list(welcome.versions) == [0]
        assert not welcome.initialized
        assert welcome.initializer  # the job has no values yet: this learner sends them
        assert [p.name for p in welcome.params] == ["w"]
        other, _ = await sessions._hello(_hello("b", "j"))
        assert other.learner == "b"

    asyncio.run(run())


@pytest.mark.parametrize(
    ("second", "code"),
    [
        (_hello("a", "i2"), grpc.StatusCode.ALREADY_EXISTS),  # the slot's lease still runs
        (_hello("b", "j", shape=(4, 5)), grpc.StatusCode.FAILED_PRECONDITION),  # another model
        (_hello("", "j"), grpc.StatusCode.INVALID_ARGUMENT),  # no slot named
    ],
)
def test_a_hello_is_refused_with_a_status_the_learner_can_act_on(
    tmp_path: Path, second: session_pb2.LearnerMessage, code: grpc.StatusCode
) -> None:
    store = MemoryControlStore("job")
    sessions, _ = _sessions(tmp_path, store)

    async def run() -> None:
        await sessions._hello(_hello("a", "i"))
        with pytest.raises(SessionClosed) as closed:
            await sessions._hello(second)
        assert closed.value.code == code

    asyncio.run(run())


def test_heartbeats_count_steps_at_the_bound_tell_the_budget_and_end_a_superseded_session(
    tmp_path: Path,
) -> None:
    """A claim that runs ahead counts at --max-steps-per-s; each heartbeat's reply says
    where the job's budget stands; once a newer incarnation of the slot said hello (its
    lease lapsed meanwhile), the old session's next heartbeat closes it."""
    clock = Clock()
    store = MemoryControlStore("job", clock)
    sessions, _ = _sessions(tmp_path, store, job_steps=1_000, max_steps_per_s=10.0)

    async def run() -> None:
        conn, _ = await sessions._hello(_hello("a", "i"))
        assert await sessions._heartbeat(conn, session_pb2.Heartbeat(step=900))
        assert conn.counted_steps < 900  # bounded: well under a second at 10 steps/s
        (status,) = _sent(conn)
        assert isinstance(status, session_pb2.SynchronizerMessage)
        assert status.status.job_steps == 1_000
        assert status.status.steps_done == int(conn.counted_steps)
        assert not status.status.finish
        clock.ms += 10_000  # the lease lapses; the slot says hello again
        await sessions._hello(_hello("a", "i2"))
        assert not await sessions._heartbeat(conn, session_pb2.Heartbeat(step=901))
        (closed,) = _sent(conn)
        assert isinstance(closed, SessionClosed)
        assert closed.code == grpc.StatusCode.ABORTED

    asyncio.run(run())


def test_a_commit_is_told_to_the_learners_whose_updates_it_merged(tmp_path: Path) -> None:
    store = MemoryControlStore("job")
    sessions, _ = _sessions(tmp_path, store)

    async def run() -> None:
        a, _ = await sessions._hello(_hello("a", "i"))
        b, _ = await sessions._hello(_hello("b", "j"))
        assert await store.own("acquire", 0, "r", ttl_s=60) == ("owned", 1)
        assert await store.init_fragment(0, "v0", ())
        entry = {"version": 1, "uids": ["a/i/3", "a/old/4"]}
        commit = Commit(0, "r", 1, 0, "v0", (), "d1", [], 1.0, 1.0, 0, entry)
        assert await store.commit(commit) == ("committed", 1)
        for conn in (a, b):  # sessions open since version 0
            sessions.connections[conn.prefix] = conn
            conn.notified[0] = 0
        await sessions._notify_commits(0, 1)
        (ack,) = _sent(a)
        assert isinstance(ack, session_pb2.SynchronizerMessage)
        assert (ack.ack.seq, ack.ack.status, ack.ack.version) == (
            3,
            session_pb2.ACK_STATUS_COMMITTED,
            1,
        )
        assert _sent(b) == []  # none of b's updates merged
        assert a.notified[0] == b.notified[0] == 1

    asyncio.run(run())
