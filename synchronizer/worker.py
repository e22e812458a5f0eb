"""A fragment's worker: one thread that runs the fragment's jobs one at a time, a merge's
ahead of the chunk sums queued before it.

Chunk sums arrive three at a time per update while a round is open; a merge that waited
behind them would add their time to its latency. Jobs of each kind still run in the order
they were submitted, which is what the sums need: an update's chunks, then its take-out.

Jobs queued `together` with one function run in one call of it when several wait in a row
(up to TOGETHER; an urgent job queued meanwhile waits for them all): the owner sums chunks
of one range at once, reading and writing the sum once for all of them. They are taken
from the queue in the order they would have run.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

_URGENT, _QUEUED, _STOP = 0, 1, 2
# Jobs one call of a `together` function takes at most: an urgent job queued meanwhile
# waits for all of them (the owner's sums of 8 chunks at once, twice).
TOGETHER = 16


@dataclass(frozen=True)
class _Together:
    """A job run with the jobs of the same function queued right behind it: `run` takes
    each job's arguments and returns, per job, its result or the exception it raised."""

    run: Callable[[list[tuple[Any, ...]]], list[Any]]


class WorkerShutDown(RuntimeError):
    """A job was queued to the worker of an owner that gave its fragment up."""


class FragmentWorker(Executor):
    def __init__(self, name: str) -> None:
        self._jobs: queue.PriorityQueue[
            tuple[
                int, int, Future[Any] | None, Callable[..., Any] | _Together | None, tuple[Any, ...]
            ]
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

    def together(
        self, run: Callable[[list[tuple[Any, ...]]], list[Any]], /, *args: Any
    ) -> Future[Any]:
        """Queue a job as `submit` does, run in one call of `run` with the jobs of `run` queued
        right behind it (a result or an exception per job, in order)."""
        return self._put(_QUEUED, _Together(run), args, {})

    def urgent(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        """Queue a job ahead of every queued one, behind urgent ones queued before it."""
        return self._put(_URGENT, fn, args, {})

    def _put(
        self,
        rank: int,
        fn: Callable[..., Any] | _Together,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise WorkerShutDown("the fragment's worker is shut down: it gave the fragment up")
            call = (lambda: fn(*args, **kwargs)) if kwargs and callable(fn) else fn
            self._jobs.put((rank, next(self._order), future, call, () if kwargs else args))
        return future

    def _run(self) -> None:
        while True:
            _, _, future, fn, args = self._jobs.get()
            if future is None or fn is None:
                return
            if isinstance(fn, _Together):
                self._run_together(fn, future, args)
            elif future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as err:
                    future.set_exception(err)
                else:
                    future.set_result(result)

    def _run_together(
        self, together: _Together, future: Future[Any], args: tuple[Any, ...]
    ) -> None:
        """Run a `together` job with the like ones queued right behind it. The first other
        job taken goes back to its place in the queue (its priority and order kept)."""
        jobs = [(future, args)]
        while len(jobs) < TOGETHER:
            with self._lock:  # a shutdown cancels what is queued: this job too if it goes back
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job[3] != together or job[2] is None:
                    self._jobs.put(job)
                    break
            jobs.append((job[2], job[4]))
        running = [(f, a) for f, a in jobs if f.set_running_or_notify_cancel()]
        if not running:
            return
        try:
            results = together.run([a for _, a in running])
        except BaseException as err:
            results = [err] * len(running)
        for (f, _), result in zip(running, results, strict=True):
            if isinstance(result, BaseException):
                f.set_exception(result)
            else:
                f.set_result(result)

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
