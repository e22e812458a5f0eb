"""The learner's side of the atoll.v1 protocol: one facade over the transport's rooms.

It knows nothing of JAX: it sends encoded fragments, hands back acks and new global
fragments as numpy arrays, and keeps the session alive. Sending never blocks the caller.
The rooms (learner/transport/) mirror the synchronizer's:
- `session.py`, the control session with any replica (synchronizer/session.py): hello,
  heartbeats, the welcome, owner map, acks and job status; reconnects for as long as the
  learner lives (session thread);
- `ingest.py`, each update chunk by chunk to its fragment's owner, kept until committed and
  sent again to a new owner (synchronizer/ingest.py; ingest threads);
- `follow.py`, new global fragments from every owner of the map, as deltas onto the values
  held or whole (synchronizer/followers.py; a thread per owner);
- `fetch.py`, the current values, whole or as ranges at a version (synchronizer/ranges.py;
  the caller's thread);
beside `calls.py` (channels, credentials, byte counts, what a failure means) and
`values.py` (the values held, as the synchronizer holds them).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence

import grpc
import numpy as np

from learner.transport.calls import Channels, ClientStats, Identity, SessionError
from learner.transport.fetch import Fetch
from learner.transport.follow import Follow
from learner.transport.ingest import Ingest
from learner.transport.session import Session
from learner.transport.values import GlobalFragment, Held, RangeValues
from services import kernels
from services.gen.atoll.v1 import session_pb2
from services.layout import LeafSpec

__all__ = ["GlobalFragment", "RangeValues", "SessionError", "SynchronizerClient"]


class SynchronizerClient:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        job: str,
        learner_id: str,
        incarnation: str,
        params: Sequence[LeafSpec],
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        max_backoff_s: float = 5.0,
        give_up_s: float = 0.0,
        routes: Mapping[str, str] | None = None,
        version_notices: bool = False,
        tls_server_name: str = "",
    ) -> None:
        """`credentials`: TLS (services.tls.learner_credentials); None: plaintext. `token`
        goes with every call as `authorization: Bearer` (per-slot or the job's). `routes`:
        advertised owner address -> the address this learner reaches it at. `give_up_s`:
        raise SessionError once no synchronizer has answered for this long (0: never).
        `version_notices`: the session is told new versions (into `notices`) instead of being
        sent their values (a learner of several processes fetches its ranges itself).
        `tls_server_name`: with TLS, the name each owner's certificate is checked against
        when this learner dials it at the address it advertises (an IP, in the chart): every
        replica holds the synchronizers' certificate, which names their Service, not their
        pods. Default: the host of the first address, as its session's channel checks."""
        self.identity = Identity(job, learner_id, incarnation)
        self.channels = Channels(
            addresses,
            token=token,
            credentials=credentials,
            max_backoff_s=max_backoff_s,
            routes=routes,
            tls_server_name=tls_server_name,
        )
        self._closed = threading.Event()
        self.held = Held()
        self.fetch = Fetch(self.channels, self.held, job, self._closed, self.check)
        self.ingest = Ingest(self.channels, self.identity, self._closed, self.check)
        self.follow = Follow(self.channels, self.held, self.fetch, self.identity, self._closed)
        self.follow.enabled = not version_notices
        # Queue one update and return its seq: the ingest's own call, its signature written once.
        self.send_update = self.ingest.send
        self.session = Session(
            self.channels,
            self.identity,
            params,
            (self.held, self.fetch, self.ingest, self.follow),
            self._closed,
            give_up_s=give_up_s,
            version_notices=version_notices,
        )

    # --- what the learner reads -----------------------------------------------------------
    @property
    def learner_id(self) -> str:
        return self.identity.learner_id

    @property
    def incarnation(self) -> str:
        return self.identity.incarnation

    @property
    def addresses(self) -> list[str]:
        return self.channels.addresses

    @property
    def stats(self) -> ClientStats:
        return self.channels.stats

    @property
    def welcome(self) -> session_pb2.Welcome | None:
        return self.session.welcome

    @property
    def job_status(self) -> session_pb2.JobStatus | None:
        return self.session.job_status

    @property
    def job_finished(self) -> bool:
        """The job's step budget is spent: finish now (final sync), whatever --steps says."""
        return self.session.job_finished

    @property
    def owners(self) -> dict[int, session_pb2.FragmentOwner]:
        return self.session.owners

    @property
    def fragments(self) -> queue.Queue[GlobalFragment]:
        """New global values, in the order they arrived."""
        return self.held.fragments

    @property
    def notices(self) -> queue.Queue[tuple[int, int]]:
        """New versions (fragment, version), when the session is told them."""
        return self.held.notices

    @property
    def known_versions(self) -> dict[int, int]:
        return self.held.known_versions

    # --- lifecycle ------------------------------------------------------------------------
    def connect(self, stop: threading.Event | None = None) -> session_pb2.Welcome:
        """Open the session (in the background, reconnecting as needed); return the welcome.
        Waits for as long as no synchronizer answers (or until `give_up_s`, or `stop`)."""
        self._warm()
        self.ingest.start()
        try:
            return self.session.start(stop)
        except SessionError:
            self.close()
            raise

    def connect_data(self) -> None:
        """Send updates and fetch values without a session of its own: another process of
        this learner holds the session and hands on what it says (`set_owners`, `settle`)."""
        self.follow.enabled = False
        self.channels.session = self.channels.open(self.channels.addresses[0])
        self._warm()
        self.ingest.start()

    def _warm(self) -> None:
        """Load the compiled decoders new values are applied with (from numba's cache) now,
        on a thread of their own, rather than by the first new value, which would wait for
        them a second or more."""
        threading.Thread(target=kernels.warm_decoders, name="atoll-warm", daemon=True).start()

    def check(self) -> None:
        """Raise the session's fatal error, if the synchronizer refused it, or SessionError
        once no synchronizer has answered for `give_up_s` (when one is set)."""
        self.session.check()

    def wait_closed(self, timeout: float) -> bool:
        """Whether the client was closed, waiting at most `timeout` seconds for it."""
        return self._closed.wait(timeout)

    def close(self) -> None:
        self._closed.set()
        self.session.stop()
        self.follow.close()
        self.ingest.join()
        thread = self.session.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self.channels.close()

    # --- the session ----------------------------------------------------------------------
    def heartbeat(
        self,
        *,
        step: int,
        step_time_ema_s: float,
        tokens_per_s: float,
        loss: float,
        eval_loss: float,
        done: bool = False,
        last_sent: bool = False,
        still_to_send: list[int] | None = None,
    ) -> None:
        self.session.heartbeat(
            step,
            session_pb2.Heartbeat(
                step=step,
                step_time_ema_s=step_time_ema_s,
                tokens_per_s=tokens_per_s,
                loss=loss,
                eval_loss=eval_loss,
                done=done,
                last_sent=last_sent,
                finishing=still_to_send is not None,
                still_to_send=still_to_send or [],
            ),
        )

    def set_owners(self, owners: Sequence[session_pb2.FragmentOwner]) -> None:
        """The owner map, as the session (of this or another process) told it."""
        self.session.set_owners(owners)

    # --- ingest ---------------------------------------------------------------------------
    def send_initial(self, fragment: int, values: np.ndarray) -> int:
        """Queue a fragment of the job's initial parameters (float32, kind INITIAL)."""
        return self.ingest.send_initial(fragment, values)

    def ingest_raw(self, chunks: Sequence[session_pb2.UpdateChunk]) -> session_pb2.Ack:
        """Send hand-built chunks as they are to their fragment's owner (protocol tests)."""
        return self.ingest.raw(chunks)

    def wait_ack(self, seq: int, timeout: float, received: bool = False) -> session_pb2.Ack:
        """Wait for an update's final ack (or, with `received`, for its owner to have it)."""
        return self.ingest.wait_ack(seq, timeout, received)

    def unacked(self) -> int:
        """Updates not committed (or refused) yet."""
        return self.ingest.unacked()

    def final_acks(self) -> dict[int, session_pb2.Ack]:
        """The final acks so far, by seq (a copy)."""
        return self.ingest.final_acks()

    def settle(self, ack: session_pb2.Ack) -> None:
        """An update's final ack, as the session (of this or another process) got it."""
        self.ingest.settle(ack)

    # --- fetching -------------------------------------------------------------------------
    def fetch_state(
        self,
        fragments: Sequence[int] = (),
        held: Mapping[int, np.ndarray] | None = None,
        *,
        retry: bool = True,
    ) -> list[GlobalFragment]:
        """The current global value of `fragments` (all if empty), whole
        (learner.transport.fetch.Fetch.state)."""
        return self.fetch.state(fragments, held, retry=retry)

    def fetch_ranges(
        self,
        ranges: Mapping[int, Sequence[tuple[int, int]]],
        versions: Mapping[int, int] | None = None,
    ) -> list[RangeValues]:
        """The values of `ranges` of each fragment at `versions` (absent: the current one)."""
        return self.fetch.ranges(ranges, versions)
