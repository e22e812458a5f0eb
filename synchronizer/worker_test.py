from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from synchronizer.worker import FragmentWorker, WorkerShutDown


def test_urgent_jobs_run_ahead_of_queued_ones_each_kind_in_order() -> None:
    worker = FragmentWorker("test")
    gate = threading.Event()
    ran: list[str] = []
    blocker = worker.submit(gate.wait, 10)  # holds the thread while the rest queue up
    queued = [worker.submit(ran.append, f"sum{i}") for i in range(3)]
    urgent = [worker.urgent(ran.append, f"merge{i}") for i in range(2)]
    gate.set()
    for f in [blocker, *queued, *urgent]:
        f.result(10)
    assert ran == ["merge0", "merge1", "sum0", "sum1", "sum2"]
    boom = worker.urgent(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(10)
    assert worker.submit(lambda x, y=0: x + y, 2, y=3).result(10) == 5
    worker.shutdown()


def test_a_shut_down_worker_cancels_what_is_queued_and_takes_no_more() -> None:
    worker = FragmentWorker("test")
    gate, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(10)

    running = worker.submit(hold)
    assert started.wait(10)
    waiting = worker.submit(lambda: "never")
    worker.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(CancelledError):
        waiting.result(10)
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
    gate.set()
    assert running.result(10) is True
    worker.shutdown()  # again: nothing to do


def test_jobs_queued_together_run_in_one_call_in_their_order_others_keep_their_place() -> None:
    """Like `together` jobs queued in a row run in one call (each gets its own result or
    exception); an urgent job queued meanwhile still runs ahead of the queued ones, and a
    job of another kind ends a run of them."""
    worker = FragmentWorker("test")
    gate = threading.Event()
    calls: list[list[int]] = []
    ran: list[str] = []

    def many(jobs: list[tuple[int]]) -> list[int | BaseException]:
        calls.append([j for (j,) in jobs])
        return [ValueError(j) if j == 2 else 10 * j for (j,) in jobs]

    blocker = worker.submit(gate.wait, 10)
    first = [worker.together(many, j) for j in range(4)]
    between = worker.submit(ran.append, "between")
    second = [worker.together(many, j) for j in range(4, 6)]
    urgent = worker.urgent(ran.append, "urgent")
    gate.set()
    assert [f.result(10) for f in first[:2]] == [0, 10]
    with pytest.raises(ValueError, match="2"):
        first[2].result(10)
    assert first[3].result(10) == 30
    assert [f.result(10) for f in second] == [40, 50]
    for f in (blocker, between, urgent):
        f.result(10)
    assert ran == ["urgent", "between"]
    assert calls == [[0, 1, 2, 3], [4, 5]]

    def broken(jobs: list[tuple[int]]) -> list[int]:
        raise RuntimeError("the whole call")

    failed = [worker.together(broken, j) for j in range(2)]
    for f in failed:
        with pytest.raises(RuntimeError, match="whole call"):
            f.result(10)
    worker.shutdown()


def test_a_job_queued_after_shutdown_is_refused_with_a_typed_error() -> None:
    # Ingest maps it to FAILED_PRECONDITION (not the owner) without its text.
    worker = FragmentWorker("t")
    worker.shutdown(wait=True)
    with pytest.raises(WorkerShutDown):
        worker.submit(lambda: None)
