from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from services.outage import OutageLog, every


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))


def test_an_outage_is_three_lines_not_one_per_retry() -> None:
    now = [0.0]
    log = Lines()
    outage = OutageLog(
        log, "watch_failing", "watch_recovered", every_s=30.0, clock=lambda: now[0], fragment=2
    )
    for _ in range(450):  # 45 s of retries every 0.1 s
        outage.failed(ConnectionError("Connection refused"))
        now[0] += 0.1
    outage.succeeded()
    outage.succeeded()  # no outage: nothing to say
    assert [(level, event) for level, event, _ in log.lines] == [
        ("warning", "watch_failing"),
        ("warning", "watch_failing"),
        ("info", "watch_recovered"),
    ]
    first, again, over = (fields for _, _, fields in log.lines)
    assert first == {"error": "Connection refused", "failures": 1, "outage_s": 0.0, "fragment": 2}
    assert again["failures"] == 300
    assert again["outage_s"] == 30.0
    assert over == {"failures": 450, "outage_s": 45.0, "fragment": 2}


def test_a_new_outage_is_logged_at_once() -> None:
    now = [0.0]
    log = Lines()
    outage = OutageLog(log, "down", "up", clock=lambda: now[0])
    outage.failed(TimeoutError())
    now[0] = 1.0
    outage.succeeded()
    now[0] = 2.0
    outage.failed(TimeoutError())
    assert [event for _, event, _ in log.lines] == ["down", "up", "down"]
    assert log.lines[0][2]["error"] == "TimeoutError()"  # an error without a message


def test_a_loop_runs_its_step_again_after_failures_and_logs_the_outage_once() -> None:
    log = Lines()
    calls = [0]
    sixth = asyncio.Event()

    async def step() -> None:
        calls[0] += 1
        if calls[0] == 6:
            sixth.set()
        if calls[0] in (2, 3):
            raise ConnectionError("Connection refused")

    async def run() -> None:
        loop = asyncio.create_task(every(0.01, step, OutageLog(log, "down", "up"), pause_s=0.01))
        await asyncio.wait_for(sixth.wait(), 5)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop

    asyncio.run(run())
    assert [event for _, event, _ in log.lines] == ["down", "up"]
    assert log.lines[1][2]["failures"] == 2
