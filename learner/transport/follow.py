"""Following: new global fragments from their owners, on a Follow call to every replica of
the owner map (as synchronizer/followers.py serves them), as deltas onto the values held or
whole.

Owns the Follow calls, one a replica of the owner map (a thread each, named atoll-follow),
and the fragments each replica owned when its call began: a replica that took fragments
over since is followed again, from the values held now. The session thread hands on each
new owner map (`set_owners`); each call's thread assembles values and hands them on
(`Held.deliver`). A learner of several processes does not follow (its leader is told
versions; every process fetches its own ranges).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import grpc
import structlog

from learner.transport.calls import Channels, Identity, status
from learner.transport.fetch import Fetch
from learner.transport.values import Assembly, Held
from services.gen.atoll.v1 import session_pb2, synchronizer_pb2
from services.grpcopts import backoff_delays

log = structlog.get_logger("atoll.learner.client")

# A Follow refused for a reason a retry will not cure (an older replica, a credential), or
# ended because newer calls of this slot took its place (another process speaks for it):
# said as a warning, and tried again (the owner map or the replica may change).
_FOLLOW_REFUSED = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


class Follow:
    """The Follow calls of one learner."""

    def __init__(
        self,
        channels: Channels,
        held: Held,
        fetch: Fetch,
        identity: Identity,
        closed: threading.Event,
    ) -> None:
        self.channels, self.held, self.fetch = channels, held, fetch
        self.identity, self.closed = identity, closed
        self.enabled = True  # off: another process holds the session, or versions are told
        self.joined_versions: list[int] = []  # the versions the learner joined at
        self._owners: dict[int, session_pb2.FragmentOwner] = {}
        self._lock = threading.Lock()
        # Follow calls, one a replica of the owner map (by the address it is reached at), and
        # the fragments each replica owned when its call began.
        self._following: dict[str, Any] = {}
        self._followed: dict[str, frozenset[int]] = {}

    def set_owners(self, owners: dict[int, session_pb2.FragmentOwner]) -> None:
        """Follow every replica of the owner map; stop following those that left it, and
        follow again a replica that took fragments over since its call began: it knows
        only what the learner held then, and would send a fragment it took from there."""
        with self._lock:
            self._owners = owners
            self._follow_owners()

    def close(self) -> None:
        """End every Follow call (the client is closed)."""
        with self._lock:
            following = list(self._following.values())
        for call in following:
            if call is not None:
                call.cancel()

    def _owner_addresses(self) -> set[str]:
        """The replicas of the owner map, by the address each is reached at (under lock)."""
        return {self.channels.reached_at(o.address) for o in self._owners.values()}

    def _owned_by(self, address: str) -> frozenset[int]:
        """The fragments the replica at `address` owns, as the owner map says (under lock)."""
        return frozenset(
            p for p, o in self._owners.items() if self.channels.reached_at(o.address) == address
        )

    def _follow_owners(self) -> None:
        """(under lock)"""
        if not self.enabled or self.closed.is_set():
            return
        wanted = self._owner_addresses()
        for address, call in self._following.items():
            if call is None:
                continue
            owned = self._owned_by(address)
            if address not in wanted:
                call.cancel()  # its thread sees the map moved and ends
            elif not owned <= self._followed.get(address, frozenset()):
                call.cancel()  # its thread follows again, from the values held now
            else:
                self._followed[address] = owned  # one it loses, then takes back, counts
        for address in wanted - set(self._following):
            self._following[address] = None
            threading.Thread(
                target=self._follow, args=(address,), name="atoll-follow", daemon=True
            ).start()

    def _request(self) -> synchronizer_pb2.FollowRequest:
        """What this learner holds: its values, or, for a fragment it has none of yet, the
        version it joined at (it fetches at least that one: no newer one is missed)."""
        held = dict(enumerate(self.joined_versions))
        held.update(self.held.versions())
        return synchronizer_pb2.FollowRequest(
            job=self.identity.job, held=held, learner_id=self.identity.learner_id
        )

    def _follow(self, address: str) -> None:
        """New global values of the fragments `address` owns, for as long as it owns some:
        followed again when the call breaks (at once when this learner ended it, to follow
        from what it holds now; else with backoff, reset once a call brought values)."""
        self.identity.bind_log_context()
        delays = backoff_delays(max_s=self.channels.max_backoff_s, initial_s=0.1)
        try:
            while not self.closed.is_set():
                with self._lock:
                    if address not in self._owner_addresses():
                        return
                    followed = self._owned_by(address)
                channel = self.channels.owner(address)
                follow = self.channels.method(
                    "unary_stream", "Follow", session_pb2.SynchronizerMessage, channel
                )
                responses: Any = None
                taken = [0]  # chunks the call brought
                try:
                    responses = follow(self._request(), metadata=self.channels.metadata)
                    with self._lock:
                        self._following[address] = responses
                        self._followed[address] = followed
                        moved = address not in self._owner_addresses()
                    if moved or self.closed.is_set():
                        continue
                    self._take(responses, taken, channel)
                    continue  # the replica ended it (it drains): follow again at once
                except grpc.RpcError as err:
                    code = status(err)
                    if code == grpc.StatusCode.CANCELLED:
                        continue  # this learner ended it: the map moved
                    level = log.warning if code in _FOLLOW_REFUSED else log.info
                    level(
                        "follow_broken",
                        address=address,
                        code=str(code),
                        details=err.details() if hasattr(err, "details") else str(err),
                    )
                except Exception as err:  # a garbled value, a channel closed meanwhile
                    log.warning("follow_broken", address=address, error=str(err))
                finally:
                    if responses is not None:
                        responses.cancel()
                    if taken[0]:
                        delays = backoff_delays(max_s=self.channels.max_backoff_s, initial_s=0.1)
                self.closed.wait(next(delays))
        finally:
            with self._lock:
                self._following.pop(address, None)
                self._followed.pop(address, None)
                if not self.closed.is_set():
                    self._follow_owners()  # the map may have moved back meanwhile

    def _take(
        self,
        responses: Iterable[session_pb2.SynchronizerMessage],
        taken: list[int],
        channel: grpc.Channel,
    ) -> None:
        """Assemble and hand on the global values one Follow call brings, counting its
        chunks into `taken`; a fragment whose delta does not follow the values held is
        fetched over `channel` (the owner's: the session's may be reconnecting)."""
        assembling: dict[int, Assembly] = {}
        for message in responses:
            taken[0] += 1
            if message.WhichOneof("kind") != "fragment":
                continue
            try:
                got = self.fetch.assemble(assembling, message.fragment, channel)
            except ValueError as err:
                log.warning("fragment_dropped", error=str(err))
                assembling.pop(message.fragment.header.fragment, None)
                continue
            if got is not None:
                self.held.hold(got)
                self.held.deliver(got)
