"""Logging and metrics: the one place where every atoll metric is defined.

Names follow Prometheus conventions: `atoll_` prefix, base units, `_total` counters and
bounded labels (reasons and sources are fixed sets; fragments are bounded by P).

Each role has its own registry, so a process serves its own role's metrics only (a learner
exports no `atoll_redis_up`, which the synchronizers' alert reads): `serve_metrics(role,
listen)` serves one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TextIO
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.goodput import Release
from services.grpcopts import split_hostport

DROP_REASONS = ("direction", "shrink", "norm")  # why an update merged at no weight
REJECT_REASONS = (
    "unknown_fragment",
    "shape_mismatch",
    "bad_codec",
    "checksum",
    "out_of_order",
    "non_finite",
    "stale",
    "bad_request",
    "norm",
    "not_live",
)
BADPUT_SOURCES = ("startup", "compile", "waiting", "recovery", "lost")


class _Lines:
    """structlog's logger: each event one line on `file`. A line that cannot be written (a
    full disk, a closed pipe, no stderr at all) is dropped and counted (`dropped`), never
    raised into the code that logged it: a replica whose log cannot be written still answers
    its calls. A line goes to the file's descriptor whole, unbuffered: one that failed is
    not written later from a buffer, so the count is of lines lost."""

    def __init__(self, file: TextIO | None, dropped: Callable[[], None] | None) -> None:
        self.file, self.dropped = file, dropped
        # Re-entrant: a signal handler that logs may interrupt a line being written.
        self.lock = threading.RLock()

    def msg(self, message: str) -> None:
        try:
            if self.file is None:
                raise OSError("no file to log to")
            line = message + "\n"
            with self.lock:
                try:
                    fd = self.file.fileno()
                except (OSError, AttributeError, ValueError):  # in memory: no descriptor
                    self.file.write(line)
                    self.file.flush()
                    return
                self.file.flush()  # whatever others printed to it first
                view = memoryview(line.encode())
                while view:
                    view = view[os.write(fd, view) :]
        except (OSError, ValueError):  # ValueError: the file was closed
            if self.dropped is not None:
                self.dropped()

    log = debug = info = warn = warning = error = err = critical = exception = fatal = msg


def configure_logging(
    level: str = "info",
    *,
    json: bool = True,
    file: TextIO | None = None,
    dropped: Callable[[], None] | None = None,
) -> None:
    """structlog to stderr (or `file`): JSON lines in services, aligned text for people
    (json=False). A line that cannot be written is dropped, and `dropped` called."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    lines = _Lines(file or sys.stderr, dropped)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_: lines,
        cache_logger_on_first_use=False,
    )


Role = Literal["synchronizer", "learner", "tool"]
SYNCHRONIZER = CollectorRegistry()
LEARNER = CollectorRegistry()
TOOL = CollectorRegistry()  # atoll's own tools (`atoll up`, benchmarks): process metrics so far
REGISTRIES: dict[Role, CollectorRegistry] = {
    "synchronizer": SYNCHRONIZER,
    "learner": LEARNER,
    "tool": TOOL,
}
for _registry in REGISTRIES.values():
    # process_start_time_seconds and the like: the flapping alert counts restarts with it.
    ProcessCollector(registry=_registry)
    PlatformCollector(registry=_registry)
    GCCollector(registry=_registry)


def serve_metrics(role: Role, listen: str) -> tuple[WSGIServer, threading.Thread]:
    """Serve `role`'s registry at http://LISTEN/metrics (port 0: any; the server's
    `server_port` says which) on a daemon thread."""
    host, port = split_hostport(listen)
    return start_http_server(port, addr=host, registry=REGISTRIES[role])


class KnownGauge(Collector):
    """A gauge with no sample until its first `set`: a value not yet known is absent, not
    0 (a loss of 0 before the first step, Redis reported down before the first check)."""

    def __init__(self, name: str, doc: str, registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = float(value)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.doc)
        if self.value is not None:
            family.add_metric([], self.value)
        yield family


class JobFigures(Collector):
    """The job's own counts, as the replica last read them from Redis, where each fact is
    final (a merge's useful seconds and an update's first receipt are counted there once,
    by the script that commits or records them). A replica that dies loses none of them
    and one that starts exports the job's totals, not its own since it started; every
    replica of a job exports the same figures, so queries take `max` over them. Absent
    until the first reading."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.read: dict[str, float] | None = None
        registry.register(self)

    def set(self, *, useful_seconds: float, updates_accepted: float, learners_live: int) -> None:
        self.read = {
            "useful_seconds": useful_seconds,
            "updates_accepted": updates_accepted,
            "learners_live": float(learners_live),
        }

    def collect(self) -> Iterator[Metric]:
        useful = CounterMetricFamily(
            "atoll_job_useful_seconds",
            "Useful learner seconds of every merge the job committed (the run report's "
            "useful_seconds), as read from Redis; the same on every replica",
        )
        accepted = CounterMetricFamily(
            "atoll_job_updates_accepted",
            "Updates the job admitted, each counted once however often it was re-sent (the "
            "run report's updates.accepted), as read from Redis; the same on every replica",
        )
        live = GaugeMetricFamily(
            "atoll_job_learners_live",
            "Learners whose session lease is live in Redis (a replica's restart does not end "
            "it); the same on every replica",
        )
        if self.read is not None:
            useful.add_metric([], self.read["useful_seconds"])
            accepted.add_metric([], self.read["updates_accepted"])
            live.add_metric([], self.read["learners_live"])
        yield from (useful, accepted, live)


# --- synchronizer ---------------------------------------------------------------------------
_S = SYNCHRONIZER
LEARNERS_CONNECTED = Gauge(
    "atoll_learners_connected", "Learner sessions open on this synchronizer replica", registry=_S
)
FOLLOWERS = Gauge(
    "atoll_followers",
    "Follow calls open on this synchronizer replica (learners taking its fragments' values)",
    registry=_S,
)
UPDATES_ACCEPTED = Counter(
    "atoll_updates_accepted_total", "Outer-gradient updates accepted", registry=_S
)
UPDATES_DROPPED = Counter(
    "atoll_updates_dropped_total",
    "Updates recorded but merged at no weight, by reason: direction (their values point "
    "against the fragment's last merged outer gradient, --min-update-agreement), shrink (they "
    "move the fragment's own values toward zero, --max-shrink-agreement) or norm (over "
    "--max-update-norm-ratio times the other slots' recent norms)",
    ["reason"],
    registry=_S,
)
UPDATES_DUPLICATE = Counter(
    "atoll_updates_duplicate_total",
    "Retried updates acknowledged without being applied again",
    registry=_S,
)
UPDATES_REJECTED = Counter(
    "atoll_updates_rejected_total", "Updates refused, by reason", ["reason"], registry=_S
)
MERGES = Counter("atoll_merges_total", "Merges committed by this replica", registry=_S)
LOG_LINES_DROPPED = Counter(
    "atoll_log_lines_dropped_total",
    "Log lines this replica could not write (a full disk, a closed pipe)",
    registry=_S,
)
MERGE_ABORTS = Counter(
    "atoll_merge_aborts_total",
    "Merges abandoned because another replica committed first",
    registry=_S,
)
QUORUM_SIZE = Histogram(
    "atoll_merge_quorum_size",
    "Learners whose updates entered one merge",
    # A bucket per whole number up to 16: a quantile's bucket, rounded up, is the quorum.
    buckets=(*range(1, 17), 24, 32, 48, 64),
    registry=_S,
)
GRACE_SECONDS = Histogram(
    "atoll_grace_window_seconds",
    "Grace window waited after quorum",
    buckets=(0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    registry=_S,
)
MERGE_SECONDS = Histogram(
    "atoll_merge_duration_seconds",
    "Merge and commit time of one round",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=_S,
)
# Seconds one phase of a merge or of an Ingest call may take: a millisecond to ten seconds.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
MERGE_PHASE_SECONDS = Histogram(
    "atoll_merge_phase_seconds",
    "Time one merge spent, by phase: summing provisional updates (provisional), waiting for "
    "a keyframe write (keyframe_wait), the outer step (step), writing the delta "
    "(delta_write), the value's checksum (checksum), the commit in Redis (commit)",
    ["phase"],
    buckets=PHASE_BUCKETS,
    registry=_S,
)
INGEST_WAIT_SECONDS = Histogram(
    "atoll_ingest_wait_seconds",
    "Time one Ingest call of an update waited, by what it waited for: the learner's next "
    "chunk (read), chunk sums on the fragment's worker (sum), recording it (record), the "
    "replica's learners to catch up on global fragments before reading more (downlink)",
    ["phase"],
    buckets=PHASE_BUCKETS,
    registry=_S,
)
STALENESS = Histogram(
    "atoll_update_staleness_versions",
    "Versions between an update's base and the fragment's version when it was merged",
    buckets=(*range(9), 12, 16),
    registry=_S,
)
BYTES = Counter(
    "atoll_bytes_total",
    "Bytes on the wire (payload and protocol), by direction",
    ["direction"],
    registry=_S,
)
FRAGMENT_VERSION = Gauge(
    "atoll_fragment_version", "Committed version of a fragment", ["fragment"], registry=_S
)
REDIS_UP = KnownGauge(
    "atoll_redis_up",
    "1 while Redis answers this replica, else 0 (absent before its first check)",
    _S,
)
JOB = JobFigures(_S)

# --- learner --------------------------------------------------------------------------------
_L = LEARNER
LEARNER_STEPS = Counter(
    "atoll_learner_steps_total", "Inner steps done by this learner", registry=_L
)
LEARNER_TOKENS = Counter(
    "atoll_learner_tokens_total", "Tokens trained on by this learner", registry=_L
)
LEARNER_STEP_SECONDS = Histogram(
    "atoll_learner_step_duration_seconds",
    "Inner step time",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=_L,
)
LEARNER_LOSS = KnownGauge(
    "atoll_learner_loss", "Training loss of the last inner step (absent before the first)", _L
)
LEARNER_EVAL_LOSS = KnownGauge(
    "atoll_learner_eval_loss",
    "Eval loss of the last global model seen (absent before the first evaluation)",
    _L,
)
LEARNER_BYTES = Counter(
    "atoll_learner_bytes_total",
    "Bytes this learner put on the wire, by direction",
    ["direction"],
    registry=_L,
)
GOODPUT_HELP = "Inner-step compute seconds whose outer gradient was merged"
BADPUT_SECONDS = Counter(
    "atoll_badput_seconds_total",
    "Learner seconds that did not become merged progress",
    ["source"],
    registry=_L,
)
PROVISIONED_HELP = (
    "Wall seconds a learner slot was provisioned, dead and restarting time included where "
    "the exporter can see it"
)
LEARNER_PARAMETERS = Gauge(
    "atoll_learner_parameters",
    "Parameters of the model this learner trains (data-parallel training would send "
    "2(M-1)/M x 4 bytes per parameter per learner step)",
    registry=_L,
)
LEARNER_LOG_LINES_DROPPED = Counter(
    "atoll_learner_log_lines_dropped_total",
    "Log lines this learner could not write (a full disk, a closed pipe)",
    registry=_L,
)
REJOINS = Counter(
    "atoll_learner_rejoins_total", "Times this learner (re)joined a synchronizer", registry=_L
)


class _ReadAtScrape(Collector):
    """A counter whose values are read when Prometheus scrapes (time that accrues)."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.source: Callable[[], Mapping[tuple[str, ...], float]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, seconds in self.source().items():
            family.add_metric(list(values), seconds)
        yield family


class LearnerGoodput:
    """This learner's useful seconds (credited when an update is acknowledged as merged,
    released as they accrue: `Release`) and, unless a supervisor exports its slot's time,
    its provisioned seconds since the process started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._useful = Release(since=time.monotonic())
        self._ended = False
        self._started = time.monotonic() - _process_age()
        self.goodput = _ReadAtScrape("atoll_goodput_seconds", GOODPUT_HELP)
        self.goodput.source = self._useful_seconds
        self.provisioned = _ReadAtScrape("atoll_provisioned_seconds", PROVISIONED_HELP)
        self.provisioned.source = lambda: {(): time.monotonic() - self._started}
        LEARNER.register(self.goodput)
        LEARNER.register(self.provisioned)

    def credit(self, seconds: float) -> None:
        with self._lock:
            self._useful.credit(seconds)

    def _useful_seconds(self) -> dict[tuple[str, ...], float]:
        with self._lock:
            if self._ended:
                return {(): self._useful.released}
            return {(): self._useful.release(time.monotonic())}

    def end(self) -> None:
        """This learner's training is over (done, or told to stop): release no more. Its
        provisioned time may stop counting now (`atoll up` ends a slot's at training's end
        or when it is told to leave), and useful time released after it would read as
        goodput above 1; what is left unreleased is at most one update's compute. No lock:
        a signal handler calls it, maybe while this thread holds the lock."""
        self._ended = True

    def supervised(self) -> None:
        """A supervisor (`atoll up --metrics`) exports this slot's provisioned time, dead
        and restarting time included: this process exports none, so it is not counted twice."""
        self.provisioned.source = None


def _process_age() -> float:
    """Seconds since this process started (its launch, not its first import of atoll)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


GOODPUT = LearnerGoodput()
# `atoll up --metrics`: every learner slot's provisioned seconds, from its first launch to its
# own end, dead and restarting time included (the cluster sets the source).
SLOT_PROVISIONED = _ReadAtScrape("atoll_provisioned_seconds", PROVISIONED_HELP, ("slot",))
TOOL.register(SLOT_PROVISIONED)

for _reason in REJECT_REASONS:
    UPDATES_REJECTED.labels(reason=_reason)
for _reason in DROP_REASONS:
    UPDATES_DROPPED.labels(reason=_reason)
for _direction in ("up", "down"):
    BYTES.labels(direction=_direction)
    LEARNER_BYTES.labels(direction=_direction)
for _source in BADPUT_SOURCES:
    BADPUT_SECONDS.labels(source=_source)
