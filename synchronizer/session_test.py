"""Unit tests of the session's pure rules."""

from synchronizer.session import most_behind


def test_uploads_wait_only_while_most_learners_are_behind_on_the_downlink() -> None:
    mark = 100
    assert not most_behind([], mark)  # no learner here: nothing to wait for
    assert most_behind([101], mark)
    assert not most_behind([100], mark)
    # One slow learner alone holds no upload back; most of them behind does.
    assert not most_behind([0, 10**9], mark)
    assert not most_behind([0, 0, 10**9, 10**9], mark)
    assert most_behind([0, 200, 300], mark)
    assert most_behind([150, 200, 10**9, 0, 101], mark)
