"""The control session's handling of what a replica says, without a network."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from learner.transport import session as module
from learner.transport.calls import Channels, Identity, SessionError
from learner.transport.fetch import Fetch
from learner.transport.follow import Follow
from learner.transport.ingest import Ingest
from learner.transport.session import Session
from learner.transport.values import Held
from services.gen.atoll.v1 import session_pb2


def session(give_up_s: float = 0.0) -> Session:
    channels, identity, closed = (
        Channels(["127.0.0.1:1"]),
        Identity("j", "l-0", "i"),
        threading.Event(),
    )
    held = Held()
    fetch = Fetch(channels, held, "j", closed, lambda: None)
    ingest = Ingest(channels, identity, closed, lambda: None)
    follow = Follow(channels, held, fetch, identity, closed)
    follow.enabled = False  # no Follow calls without a network
    return Session(
        channels,
        identity,
        [],
        (held, fetch, ingest, follow),
        closed,
        give_up_s=give_up_s,
        version_notices=True,
    )


def test_a_welcome_after_a_reconnect_resends_and_tells_the_versions_that_moved() -> None:
    s = session()
    s.ingest.send_initial(0, np.ones(2, np.float32))
    s.ingest.kept()[0].received_epoch = 4
    s.held.notice(0, 3)
    owners = [session_pb2.FragmentOwner(fragment=0, replica="r", address="a:1", epoch=5)]
    welcome = session_pb2.Welcome(versions=[3, 2], initialized=True, owners=owners)
    s._on_welcome(welcome, first=False)
    assert s.ingest.kept()[0].received_epoch is None  # asked again
    assert s.owners[0].epoch == 5
    assert s.ingest.owners[0].epoch == 5
    assert [s.held.notices.get_nowait() for _ in range(2)] == [(0, 3), (1, 2)]
    assert s.held.notices.empty()
    s.check()  # up


def test_no_answer_for_longer_than_give_up_s_is_a_session_error() -> None:
    s = session(give_up_s=0.05)
    time.sleep(0.1)
    with pytest.raises(SessionError, match="no synchronizer answered"):
        s.check()


def test_a_quiet_session_says_its_last_heartbeat_again_so_its_lease_outlives_a_slow_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(module, "KEEPALIVE_S", 0.05)
    s = session()
    outbox: queue.Queue[module.Outbound | None] = queue.Queue()
    sent = module._requests(outbox, s._keepalive)
    first = next(sent)  # nothing said yet: the hello's step, losses unknown
    assert isinstance(first, session_pb2.LearnerMessage)
    assert first.heartbeat.step == 0
    assert np.isnan(first.heartbeat.loss)
    beat = session_pb2.Heartbeat(step=7, step_time_ema_s=0.1, loss=2.5, eval_loss=3.0)
    s.heartbeat(7, beat)  # not connected: kept, not queued
    again = next(sent)
    assert isinstance(again, session_pb2.LearnerMessage)
    assert again.heartbeat == beat
    outbox.put(None)
    assert list(sent) == []
