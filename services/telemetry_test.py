import io
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from prometheus_client import CollectorRegistry

from services import telemetry as tm


def _names(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


def test_each_role_exports_its_own_metrics() -> None:
    synchronizer, learner = _names(tm.SYNCHRONIZER), _names(tm.LEARNER)
    assert "atoll_redis_up" in synchronizer
    assert "atoll_redis_up" not in learner
    assert "atoll_learner_rejoins" in learner  # a counter family is named without _total
    assert not {n for n in synchronizer & learner if n.startswith("atoll_")}
    assert not {n for n in _names(tm.TOOL) if n.startswith("atoll_")}


def test_every_role_has_the_process_start_time() -> None:
    """The flapping alert counts a learner's restarts with it."""
    for registry in tm.REGISTRIES.values():
        assert "process_start_time_seconds" in _names(registry)


def test_serve_metrics_serves_one_role() -> None:
    server, _ = tm.serve_metrics("learner", "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "atoll_learner_steps_total" in text
    assert "atoll_redis_up" not in text
    assert "atoll_merges_total" not in text


def _log_to_full_device(dropped: Callable[[], None], *events: str) -> None:
    """Log `events` where every write fails: /dev/full refuses them (ENOSPC), as a full
    disk under a service's log does."""
    saved = structlog.get_config()
    with open("/dev/full", "w") as full:
        tm.configure_logging("info", file=full, dropped=dropped)
        try:
            for event in events:
                structlog.get_logger("test").error(event, fragment=0)
        finally:
            structlog.configure(**saved)  # the other tests' logging, as it was


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_log_line_that_cannot_be_written_is_dropped_and_counted() -> None:
    # The code that logged goes on, and each line is counted.
    dropped: list[int] = []
    _log_to_full_device(lambda: dropped.append(1), "tensor_store_write_failed", "again")
    assert dropped == [1, 1]
    # Written whole where it can be, each line once, and in memory too.
    saved, lines = structlog.get_config(), io.StringIO()
    tm.configure_logging("info", file=lines, dropped=lambda: dropped.append(1))
    try:
        structlog.get_logger("test").info("kept", fragment=1)
    finally:
        structlog.configure(**saved)
    assert [json.loads(line)["event"] for line in lines.getvalue().splitlines()] == ["kept"]
    assert dropped == [1, 1]
    # The services count into Prometheus.
    before = tm.LOG_LINES_DROPPED._value.get()
    _log_to_full_device(tm.LOG_LINES_DROPPED.inc, "lost")
    assert tm.LOG_LINES_DROPPED._value.get() == before + 1


def test_a_value_not_known_yet_is_absent_not_zero() -> None:
    registry = CollectorRegistry()
    gauge = tm.KnownGauge("atoll_test_loss", "a loss", registry)
    job = tm.JobFigures(registry)
    samples = {s.name for f in registry.collect() for s in f.samples}
    assert samples == set()  # no 0 before the first step or the first reading of Redis
    assert {f.name for f in registry.collect()} >= {"atoll_test_loss", "atoll_job_useful_seconds"}
    gauge.set(2.5)
    job.set(useful_seconds=12.0, updates_accepted=7, learners_live=3)
    values = {s.name: s.value for f in registry.collect() for s in f.samples}
    assert values == {
        "atoll_test_loss": 2.5,
        "atoll_job_useful_seconds_total": 12.0,
        "atoll_job_updates_accepted_total": 7.0,
        "atoll_job_learners_live": 3.0,
    }
