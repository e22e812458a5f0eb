"""A fragment's worker: one thread that runs the fragment's jobs one at a time, a merge's
ahead of the chunk sums queued before it.

Chunk sums arrive three at a time per update while a round is open; a merge that waited
behind them would add their time to its latency. Jobs of each kind still run in the order
they were submitted, which is what the sums need: an update's chunks, then its take-out.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_URGENT, _QUEUED, _STOP = 0, 1, 2


class FragmentWorker(Executor):
    def __init__(self, name: str) -> None:
        self._jobs: queue.PriorityQueue[
            tuple[int, int, Future[Any] | None, Callable[..., Any] | None, tuple[Any, ...]]
        ] = queue.PriorityQueue()
        self._order = itertools.count()
        self._closed = False
        self._lock = threading.Lock()
        # A daemon: a replica that stops shuts its owners' workers down first; one killed
        # has nothing left to wait for.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Queue a job behind those queued before it (and behind urgent ones)."""
        return self._put(_QUEUED, fn, args, kwargs)

    def urgent(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        """Queue a job ahead of every queued one, behind urgent ones queued before it."""
        return self._put(_URGENT, fn, args, {})

    def _put(
        self, rank: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the fragment's worker is shut down: it gave the fragment up")
            call = (lambda: fn(*args, **kwargs)) if kwargs else fn
            self._jobs.put((rank, next(self._order), future, call, () if kwargs else args))
        return future

    def _run(self) -> None:
        while True:
            _, _, future, fn, args = self._jobs.get()
            if future is None or fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as err:
                future.set_exception(err)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        _, _, future, _, _ = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if future is not None:
                        future.cancel()
            self._jobs.put((_STOP, next(self._order), None, None, ()))
        if wait:
            self._thread.join()
