from dataclasses import dataclass

from learner.shards import normalize, plan, runs
from services.layout import LeafSpec, fragment_layout


@dataclass(frozen=True)
class Dev:
    id: int
    process_index: int


D0, D1 = Dev(0, 0), Dev(1, 1)


def test_runs_of_a_shard_in_row_major_order() -> None:
    assert runs((4, 3), normalize((slice(2, 4),), (4, 3))) == [(6, 6)]  # rows: one run
    assert runs((2, 4), normalize((slice(None), slice(0, 2)), (2, 4))) == [(0, 2), (4, 2)]
    assert runs((2, 2, 4), ((0, 2), (1, 2), (2, 4))) == [(6, 2), (14, 2)]
    assert runs((5,), ((0, 5),)) == [(0, 5)]
    assert runs((), ()) == [(0, 1)]


def test_each_process_sends_its_own_rows_and_the_first_sends_replicated_leaves() -> None:
    layout = fragment_layout([LeafSpec("a", (4, 3)), LeafSpec("b", (3,))], 1)
    indices: dict[str, dict[Dev, tuple[slice, ...]]] = {
        "a": {D0: (slice(0, 2), slice(None)), D1: (slice(2, 4), slice(None))},
        "b": {D0: (slice(None),), D1: (slice(None),)},  # replicated
    }
    first, second = plan(layout, indices, 0)[0], plan(layout, indices, 1)[0]
    assert first.held == ((0, 6), (12, 3))
    assert first.sent == ((0, 6), (12, 3))
    assert first.sent_local == ((0, 6), (6, 3))
    assert (first.part, first.parts) == (0, 2)
    assert second.held == ((6, 9),)  # its rows of a, then all of b, joined
    assert second.sent == ((6, 6),)
    assert (second.part, second.parts) == (1, 2)
    assert sorted(first.sent + second.sent) == [(0, 6), (6, 6), (12, 3)]  # exactly the whole
    assert [(p.leaf, p.spans) for p in second.pieces] == [("a", ((0, 6),)), ("b", ((6, 3),))]


def test_a_fragment_only_one_process_sends_is_sent_whole() -> None:
    layout = fragment_layout([LeafSpec("b", (3,))], 1)
    indices = {"b": {D0: (slice(None),), D1: (slice(None),)}}
    second = plan(layout, indices, 1)[0]
    assert (second.sent, second.parts) == ((), 1)
    assert plan(layout, indices, 0)[0].sent == ((0, 3),)


def test_with_every_leaf_replicated_the_first_process_sends_each_fragment_whole() -> None:
    layout = fragment_layout([LeafSpec("a", (4, 3)), LeafSpec("b", (3,)), LeafSpec("c", ())], 2)
    whole = {"a": (slice(None), slice(None)), "b": (slice(None),), "c": ()}
    indices = {name: {D0: index, D1: index} for name, index in whole.items()}
    for first, second in zip(plan(layout, indices, 0), plan(layout, indices, 1), strict=True):
        assert first.held == second.held == first.sent == ((0, first.size),)
        assert second.sent == ()
        assert (first.part, first.parts, second.parts) == (0, 1, 1)
        assert first.sent_local == ((0, first.size),)
