from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from synchronizer.core.open_round import OpenRound


@dataclass(eq=False)
class Sent:
    learner: str


SLOTS = [f"l{i}" for i in range(6)]
STEPS = st.lists(
    st.tuples(st.sampled_from(["stream", "drop", "receive", "seal"]), st.integers(0, 40)),
    max_size=150,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(STEPS)
def test_the_index_by_slot_answers_what_a_scan_of_the_round_would(
    steps: list[tuple[str, int]],
) -> None:
    # The owner's questions, asked of the index and of plain lists of the same updates.
    updates = [Sent(SLOTS[i % len(SLOTS)]) for i in range(41)]
    index: OpenRound[Sent] = OpenRound()
    members: list[Sent] = []
    in_flight: set[Sent] = set()
    for what, i in steps:
        u = updates[i]
        if what == "stream" and u not in members:
            index.stream(u)
            in_flight.add(u)
        elif what == "drop":
            assert index.drop(u) == (u in in_flight)
            in_flight.discard(u)
        elif what == "receive" and u in in_flight:
            index.receive(u)
            in_flight.discard(u)
            members.append(u)
        elif what == "seal":
            assert index.seal() == members
            members = []
        assert index.members == members
        assert index.in_flight == in_flight
        assert set(index.contributors()) == {m.learner for m in members}
        assert set(index.sending()) == {m.learner for m in in_flight}
        for slot in SLOTS:
            mine = [m for m in members if m.learner == slot]
            mine += [m for m in in_flight if m.learner == slot]
            assert sorted(map(id, index.of(slot))) == sorted(map(id, mine))
