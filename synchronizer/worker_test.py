from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from synchronizer.worker import FragmentWorker


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
