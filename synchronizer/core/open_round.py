"""The updates of a fragment's open round, by learner slot: those received into it
(`members`, in the order they were received) and those still streaming in (`in_flight`).

An owner asks two things of them per update and per look at the round: whether a slot has
an update in the round already (one each), and which slots contributed or are still
sending (the round rule's counts). Asked of the lists, each question was a scan of every
update in the round, on the event loop that receives every chunk: O(L) per update for L
learners, O(L^2) per round. Here each slot's updates are kept apart, so the first question
costs what one slot's updates do, and the second reads a dict's keys.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView
from typing import Generic, Protocol, TypeVar


class FromSlot(Protocol):
    @property
    def learner(self) -> str: ...


U = TypeVar("U", bound=FromSlot)


def _drop(by: dict[str, list[U]], update: U) -> None:
    mine = by[update.learner]
    mine.remove(update)
    if not mine:
        del by[update.learner]


class OpenRound(Generic[U]):
    def __init__(self) -> None:
        self.members: list[U] = []  # received into the open round, in order
        self._members: dict[str, list[U]] = {}
        self._in_flight: dict[str, list[U]] = {}  # summing, not received yet

    @property
    def in_flight(self) -> set[U]:
        """The updates streaming in (summing, not received yet)."""
        return {u for mine in self._in_flight.values() for u in mine}

    def _streaming(self, update: U) -> bool:
        return update in self._in_flight.get(update.learner, ())

    def stream(self, update: U) -> None:
        """An update began: its chunks are summed as they come."""
        if not self._streaming(update):
            self._in_flight.setdefault(update.learner, []).append(update)

    def drop(self, update: U) -> bool:
        """An update streaming in will not be received (or was, elsewhere): whether it was
        streaming in."""
        if not self._streaming(update):
            return False
        _drop(self._in_flight, update)
        return True

    def receive(self, update: U) -> None:
        """An update streaming in was received: a member of the open round."""
        self.drop(update)
        self.members.append(update)
        self._members.setdefault(update.learner, []).append(update)

    def seal(self) -> list[U]:
        """Close the round: its members, in order. Those streaming in stay, for the next."""
        members = self.members
        self.members, self._members = [], {}
        return members

    def of(self, learner: str) -> Iterator[U]:
        """A slot's updates in the round, received or streaming in."""
        yield from self._members.get(learner, ())
        yield from self._in_flight.get(learner, ())

    def contributors(self) -> KeysView[str]:
        """The slots with an update received into the round."""
        return self._members.keys()

    def sending(self) -> KeysView[str]:
        """The slots with an update streaming in."""
        return self._in_flight.keys()
