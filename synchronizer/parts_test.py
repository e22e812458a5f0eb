import pytest

from services.gen.atoll.v1 import session_pb2
from synchronizer.core.admission import (
    Rejection,
    Status,
    check_part_chunk,
    check_parts,
    check_same_update,
)
from synchronizer.parts import Coverage, combined_checksum


def test_coverage_refuses_any_overlap_and_joins_neighbours() -> None:
    c = Coverage()
    assert c.claim(10, 5)  # 10..14
    assert c.claim(0, 5)  # 0..4
    assert not c.claim(4, 2)  # touches 4
    assert not c.claim(14, 1)
    assert not c.claim(0, 100)  # spans both
    assert c.claim(5, 5)  # fills the gap: one range 0..14
    assert (c.starts, c.ends, c.total) == ([0], [15], 15)
    assert c.claim(20, 1)
    assert c.claim(15, 5)
    assert (c.starts, c.ends, c.total) == ([0], [21], 21)


def test_the_combined_checksum_follows_part_order_not_arrival() -> None:
    assert combined_checksum({1: 7, 0: 9}) == combined_checksum({0: 9, 1: 7})
    assert combined_checksum({0: 7, 1: 9}) != combined_checksum({0: 9, 1: 7})


def chunk(**kw: int) -> session_pb2.UpdateChunk:
    fields = {"seq": 1, "kind": 1, "part": 0, "parts": 2, "value_offset": 0, "value_count": 4}
    fields.update(kw)
    return session_pb2.UpdateChunk(**fields)  # type: ignore[arg-type]


def test_part_numbers_and_the_merge_rule_are_checked() -> None:
    check_parts(chunk(), size=100, whole_only=None)
    for bad in (chunk(part=2), chunk(parts=1000), chunk(parts=3, part=3)):
        with pytest.raises(Rejection):
            check_parts(bad, size=100, whole_only=None)
    with pytest.raises(Rejection, match="--merge mean"):
        check_parts(chunk(), size=100, whole_only="radial")


def test_a_parts_chunks_come_in_order_inside_the_fragment() -> None:
    first = chunk(value_offset=8)
    check_part_chunk(first, first, 0, 0, 100)
    check_part_chunk(chunk(chunk_index=1, value_offset=40), first, 1, 12, 100)  # a gap: ok
    with pytest.raises(Rejection, match="out of order"):
        check_part_chunk(chunk(chunk_index=1, value_offset=10), first, 1, 12, 100)
    with pytest.raises(Rejection, match="fragment has"):
        check_part_chunk(chunk(chunk_index=1, value_offset=98), first, 1, 12, 100)
    with pytest.raises(Rejection, match="header changed"):
        check_part_chunk(chunk(chunk_index=1, value_offset=40, part=1), first, 1, 12, 100)


def test_parts_must_agree_on_the_updates_counters() -> None:
    first = chunk(c_steps=5, c_tokens=100)
    check_same_update(chunk(part=1, c_steps=5, c_tokens=100), first)
    with pytest.raises(Rejection) as refused:
        check_same_update(chunk(part=1, c_steps=6, c_tokens=100), first)
    assert refused.value.code == Status.INVALID_ARGUMENT
