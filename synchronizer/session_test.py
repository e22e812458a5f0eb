"""Unit tests of the session's pure rules."""

from synchronizer.session import most_behind


def test_uploads_wait_only_while_most_reading_learners_are_behind_on_the_downlink() -> None:
    def behind(*queued: int, stalled: tuple[int, ...] = ()) -> bool:
        queues = [(b, 99.0) for b in queued] + [(b, 90.0) for b in stalled]
        return most_behind(queues, 100.0, mark=100, stalled_s=2.0)

    assert not behind()  # no learner here: nothing to wait for
    assert behind(101)
    assert not behind(100)
    # One slow learner alone holds no upload back; most of them behind does.
    assert not behind(0, 10**9)
    assert not behind(0, 0, 10**9, 10**9)
    assert behind(0, 200, 300)
    assert behind(150, 200, 10**9, 0, 101)
    # A learner whose queue has not moved for 2 s is not reading: it does not count...
    assert not behind(stalled=(10**9,))
    assert not behind(0, stalled=(10**9, 10**9))
    # ...though one with nothing queued, however long ago it last moved, is caught up.
    assert not behind(200, stalled=(0, 0))
    assert behind(200, 300, stalled=(0,))
