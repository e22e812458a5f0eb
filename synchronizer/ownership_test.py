from collections import Counter

from synchronizer.ownership import rightful_owners


def test_fragments_spread_evenly_and_few_move_when_a_replica_leaves() -> None:
    replicas = ["a", "b", "c"]
    owners = rightful_owners(8, replicas)
    assert max(Counter(owners).values()) <= 3  # ceil(8 / 3)
    assert set(owners) == set(replicas)
    assert rightful_owners(8, replicas) == owners  # a pure function of the live set
    two = rightful_owners(8, ["a", "b"])
    # Fragments of the replicas that stayed mostly stay with them.
    stayed = sum(1 for before, after in zip(owners, two, strict=True) if before == after)
    assert stayed >= sum(1 for o in owners if o != "c") - 2
    assert rightful_owners(3, ["x", "y"]).count("x") in (1, 2)
    assert rightful_owners(4, []) == [None] * 4
