"""Logging a loop that retries through an outage (Redis or the tensor store away).

A retry loop that logs each failure writes tens of lines a second for as long as Redis is
down (a round is evaluated every 0.1 s per owned fragment). `OutageLog` writes one line when
the outage starts, one every `every_s` while it lasts, with how many failures each covers,
and one when the loop succeeds again, with how long the outage lasted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class OutageLog:
    def __init__(
        self,
        log: Any,
        failing: str,
        recovered: str,
        *,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        **fields: Any,
    ) -> None:
        self.log, self.failing, self.recovered = log, failing, recovered
        self.every_s, self.clock, self.fields = every_s, clock, fields
        self.since: float | None = None  # when the outage started; None: no outage
        self._logged_at = 0.0
        self._unlogged = 0  # failures since the last line
        self._failures = 0  # failures in this outage

    def failed(self, err: BaseException) -> None:
        now = self.clock()
        self._unlogged += 1
        self._failures += 1
        if self.since is None:
            self.since = now
        elif now - self._logged_at < self.every_s:
            return
        self.log.warning(
            self.failing,
            error=str(err) or repr(err),
            failures=self._unlogged,
            outage_s=round(now - self.since, 1),
            **self.fields,
        )
        self._logged_at, self._unlogged = now, 0

    def succeeded(self) -> None:
        if self.since is None:
            return
        self.log.info(
            self.recovered,
            failures=self._failures,
            outage_s=round(self.clock() - self.since, 1),
            **self.fields,
        )
        self.since, self._unlogged, self._failures = None, 0, 0


async def every(
    interval_s: float,
    step: Callable[[], Awaitable[None]],
    outage: OutageLog,
    *,
    pause_s: float = 0.5,
) -> None:
    """Run `step` every `interval_s` for as long as the task lives: a failure (Redis or the
    tensor store away) is logged through `outage`, and tried again `pause_s` later."""
    while True:
        try:
            await step()
            outage.succeeded()
        except Exception as err:
            outage.failed(err)
            await asyncio.sleep(pause_s)
        await asyncio.sleep(interval_s)
