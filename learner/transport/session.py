"""The control session, with any synchronizer replica (as synchronizer/session.py serves
it): hello, heartbeats; the welcome, the owner map, final acks, the job's status, and, for
a learner of several processes, notices of new versions.

Runs on the session thread (atoll-session). When the session breaks it reconnects
(exponential backoff with jitter, over every address it was given) for as long as the
learner lives, asks every owner again about the updates kept, and fetches the fragments
whose version moved while it was away. It never gives up on the synchronizer tier unless
told to (`give_up_s`): the learner keeps training from what it holds meanwhile. Owns the
welcome, the owner map, the job's status, whether the session is up and why it failed for
good; hands on owner maps (to ingest and follow), acks (to ingest) and values (to `Held`).
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import structlog

from learner.transport.calls import FATAL, Channels, Identity, SessionError
from learner.transport.fetch import Fetch
from learner.transport.follow import Follow
from learner.transport.ingest import Ingest
from learner.transport.values import Held
from services import telemetry as tm
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.grpcopts import backoff_delays
from services.layout import LeafSpec

log = structlog.get_logger("atoll.learner.client")
# How soon a slot told its session is live elsewhere asks again (`_run`).
BUSY_RETRY_S = 1.0
WAITING_LOG_S = 30.0  # how often a learner waiting for its first session says so
# A session the learner has said nothing on for this long says its last heartbeat again, so
# its lease (10 s by default) outlives a slow join: making and sending the first values, or
# reading a large corpus, took longer than a lease on busy cores, and the first values were
# then refused for want of a live session, again and again.
KEEPALIVE_S = 2.0

# What the session's stream sends: a message, or one already serialized.
Outbound = session_pb2.LearnerMessage | bytes


class Session:
    """One learner's control session."""

    def __init__(
        self,
        channels: Channels,
        identity: Identity,
        params: Sequence[LeafSpec],
        parts: tuple[Held, Fetch, Ingest, Follow],
        closed: threading.Event,
        *,
        give_up_s: float = 0.0,
        version_notices: bool = False,
    ) -> None:
        """`parts`: what the session hands news on to; `give_up_s`, `version_notices`: as
        `SynchronizerClient` takes them."""
        self.channels, self.identity, self.params = channels, identity, list(params)
        self.held, self.fetch, self.ingest, self.follow = parts
        self.closed = closed
        self.give_up_s = give_up_s
        self.version_notices = version_notices
        self.welcome: session_pb2.Welcome | None = None
        self.job_status: session_pb2.JobStatus | None = None  # newest, when the job has a budget
        self.owners: dict[int, session_pb2.FragmentOwner] = {}
        self.step = 0
        self._last_heartbeat: session_pb2.Heartbeat | None = None
        self._away_since: float | None = time.monotonic()  # no session since then
        self._outbox: queue.Queue[Outbound | None] | None = None
        self._connected = threading.Event()
        self._fatal: SessionError | None = None
        self._addresses = itertools.cycle(channels.addresses)
        self.thread: threading.Thread | None = None

    def start(self, stop: threading.Event | None = None) -> session_pb2.Welcome:
        """Open the session (in the background, reconnecting as needed); return the welcome.
        Waits for as long as no synchronizer answers (or until `give_up_s`, or `stop`)."""
        self.thread = threading.Thread(target=self._run, name="atoll-session", daemon=True)
        self.thread.start()
        said = time.monotonic()
        while not self._connected.wait(0.5):
            self.check()
            if stop is not None and stop.is_set():
                raise SessionError("stopped before any synchronizer answered")
            if time.monotonic() - said >= WAITING_LOG_S:
                said = time.monotonic()
                log.warning("no_synchronizer_yet", addresses=self.channels.addresses)
        self.check()
        assert self.welcome is not None
        return self.welcome

    def stop(self) -> None:
        """End the stream (the client is closed)."""
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)

    def check(self) -> None:
        """Raise the session's fatal error, if the synchronizer refused it, or SessionError
        once no synchronizer has answered for `give_up_s` (when one is set)."""
        if self._fatal is not None:
            raise self._fatal
        away = self._away_since
        if self.give_up_s > 0 and away is not None and time.monotonic() - away > self.give_up_s:
            raise SessionError(
                f"no synchronizer answered for {self.give_up_s:.0f} s at "
                f"{', '.join(self.channels.addresses)}; check the addresses and that one is "
                "running (--give-up-s 0 retries for as long as the learner lives)"
            )

    def heartbeat(self, step: int, heartbeat: session_pb2.Heartbeat) -> None:
        """Say where the learner stands, if the session is up (else the next one will)."""
        self.step = step
        self._last_heartbeat = heartbeat
        outbox = self._outbox
        if outbox is not None and self._connected.is_set():
            outbox.put(session_pb2.LearnerMessage(heartbeat=heartbeat))

    def set_owners(self, owners: Sequence[session_pb2.FragmentOwner]) -> None:
        """The owner map, as the session (of this or another process) told it."""
        self.owners = {o.fragment: o for o in owners}
        self.ingest.set_owners(self.owners)
        self.follow.set_owners(self.owners)

    @property
    def job_finished(self) -> bool:
        """The job's step budget is spent: finish now (final sync), whatever --steps says."""
        return self.job_status is not None and self.job_status.finish

    # --- the session thread ---------------------------------------------------------------
    def _keepalive(self) -> session_pb2.LearnerMessage:
        """The last heartbeat again (before the first: the step said hello with, losses not
        known yet), which renews the lease and changes nothing else."""
        last = self._last_heartbeat
        if last is None:
            last = session_pb2.Heartbeat(step=self.step, loss=math.nan, eval_loss=math.nan)
        return session_pb2.LearnerMessage(heartbeat=last)

    def _hello(self) -> session_pb2.LearnerMessage:
        return session_pb2.LearnerMessage(
            hello=session_pb2.Hello(
                job=self.identity.job,
                learner_id=self.identity.learner_id,
                incarnation=self.identity.incarnation,
                params=[
                    fragment_pb2.TensorSpec(name=p.name, shape=p.shape, dtype=p.dtype)
                    for p in self.params
                ],
                step=self.step,
                version_notices=self.version_notices,
            )
        )

    def _run(self) -> None:
        self.identity.bind_log_context()
        max_backoff_s = self.channels.max_backoff_s
        delays = backoff_delays(max_s=max_backoff_s, initial_s=min(1.0, max_backoff_s))
        # A replica that said this slot's session is still live elsewhere (its replica died
        # less than a lease ago) answers: ask it again each second until that lease lapses,
        # not in turn with addresses that may be dead, nor after a growing backoff, so the
        # slot is back in the job within a second of the lapse.
        busy_at: str | None = None
        while not self.closed.is_set():
            address = busy_at or next(self._addresses)
            busy_at = None
            # Until a first welcome, a broken attempt is still the learner's first session
            # (a replica waiting for the job's initializer refuses it for now), not a reconnect.
            first = self.welcome is None
            try:
                self._session(address, first)
                delays = backoff_delays(max_s=max_backoff_s, initial_s=min(1.0, max_backoff_s))
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                details = err.details() if hasattr(err, "details") else str(err)
                if code in FATAL:
                    self._fatal = SessionError(f"synchronizer refused the session: {details}")
                    self._connected.set()
                    log.error("session_refused", code=str(code), details=details)
                    return
                log.info("session_broken", address=address, code=str(code), details=details)
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    busy_at = address
            except ValueError as err:  # a garbled value while catching up: start over
                log.warning("session_broken", address=address, error=str(err))
            finally:
                self._connected.clear()
                if self._away_since is None:
                    self._away_since = time.monotonic()
            if self.closed.is_set():
                return
            if self.welcome is not None:  # a session was open: this is a reconnect
                self.channels.stats.reconnects += 1
            self.closed.wait(min(BUSY_RETRY_S, max_backoff_s) if busy_at else next(delays))

    def _session(self, address: str, first: bool) -> None:
        if self.channels.session is not None:
            self.channels.session.close()
        self.channels.session = self.channels.open(address)
        session = self.channels.method("stream_stream", "Session", session_pb2.SynchronizerMessage)
        outbox: queue.Queue[Outbound | None] = queue.Queue()
        outbox.put(self._hello())
        self._outbox = outbox
        responses = session(_requests(outbox, self._keepalive), metadata=self.channels.metadata)
        try:
            for message in responses:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    self._on_welcome(message.welcome, first)
                elif kind == "ack":
                    self.ingest.settle(message.ack)
                elif kind == "owners":
                    self.set_owners(message.owners.owners)
                elif kind == "status":
                    self.job_status = message.status
                elif kind == "version":
                    self.held.notice(message.version.fragment, message.version.version)
                if self.closed.is_set():
                    break
        finally:
            outbox.put(None)
            responses.cancel()

    def _on_welcome(self, welcome: session_pb2.Welcome, first: bool) -> None:
        self.welcome = welcome
        self.follow.joined_versions = list(welcome.versions)
        if welcome.HasField("status"):
            self.job_status = welcome.status
        self.set_owners(welcome.owners)
        if not first:
            pending = self.ingest.resend()
            tm.REJOINS.inc()
            moved = self.held.moved(list(welcome.versions))
            log.info(
                "reconnected",
                synchronizer=welcome.synchronizer_id,
                resent=pending,
                moved=len(moved),
            )
            if moved and welcome.initialized and self.version_notices:
                for p in moved:
                    self.held.notice(p, welcome.versions[p])
            elif moved and welcome.initialized:
                for g in self.fetch.state(moved, retry=False):
                    self.held.fragments.put(g)
        self._away_since = None
        self._connected.set()


def _requests(
    outbox: queue.Queue[Outbound | None], keepalive: Callable[[], Outbound]
) -> Iterator[Outbound]:
    """What the session sends: the outbox's messages, and a keepalive whenever it has been
    quiet for KEEPALIVE_S."""
    while True:
        try:
            message = outbox.get(timeout=KEEPALIVE_S)
        except queue.Empty:
            yield keepalive()
            continue
        if message is None:
            return
        yield message
