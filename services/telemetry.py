"""Logging and metrics: the one place where every atoll metric is defined.

Names follow Prometheus conventions: `atoll_` prefix, base units, `_total` counters and
bounded labels (reasons and sources are fixed sets; fragments are bounded by P).

Each role has its own registry, so a process serves its own role's metrics only (a learner
exports no `atoll_redis_up`, which the synchronizers' alert reads): `serve_metrics(role,
listen)` serves one.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Literal
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

from services.grpcopts import split_hostport

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
)
BADPUT_SOURCES = ("startup", "compile", "waiting", "recovery", "lost")


def configure_logging(level: str = "info", *, json: bool = True) -> None:
    """structlog to stderr: JSON lines in services, aligned text for people (json=False)."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
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


# --- synchronizer ---------------------------------------------------------------------------
_S = SYNCHRONIZER
LEARNERS_CONNECTED = Gauge(
    "atoll_learners_connected", "Learner sessions open on this synchronizer replica", registry=_S
)
UPDATES_ACCEPTED = Counter(
    "atoll_updates_accepted_total", "Outer-gradient updates accepted", registry=_S
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
MERGE_ABORTS = Counter(
    "atoll_merge_aborts_total",
    "Merges abandoned because another replica committed first",
    registry=_S,
)
QUORUM_SIZE = Histogram(
    "atoll_merge_quorum_size",
    "Learners whose updates entered one merge",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
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
STALENESS = Histogram(
    "atoll_update_staleness_versions",
    "Versions between an update's base and the fragment's version when it was merged",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
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
REDIS_UP = Gauge("atoll_redis_up", "1 while Redis answers this replica, else 0", registry=_S)

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
LEARNER_LOSS = Gauge("atoll_learner_loss", "Training loss of the last inner step", registry=_L)
LEARNER_EVAL_LOSS = Gauge(
    "atoll_learner_eval_loss", "Eval loss of the last global model seen", registry=_L
)
LEARNER_BYTES = Counter(
    "atoll_learner_bytes_total",
    "Bytes this learner put on the wire, by direction",
    ["direction"],
    registry=_L,
)
GOODPUT_SECONDS = Counter(
    "atoll_goodput_seconds_total",
    "Inner-step compute seconds whose outer gradient was merged",
    registry=_L,
)
BADPUT_SECONDS = Counter(
    "atoll_badput_seconds_total",
    "Learner seconds that did not become merged progress",
    ["source"],
    registry=_L,
)
PROVISIONED_SECONDS = Counter(
    "atoll_provisioned_seconds_total",
    "Wall seconds this learner slot was provisioned",
    registry=_L,
)
LEARNER_PARAMETERS = Gauge(
    "atoll_learner_parameters",
    "Parameters of the model this learner trains (the data-parallel equivalent of its bytes "
    "is 8 x parameters per step)",
    registry=_L,
)
REJOINS = Counter(
    "atoll_learner_rejoins_total", "Times this learner (re)joined a synchronizer", registry=_L
)

for _reason in REJECT_REASONS:
    UPDATES_REJECTED.labels(reason=_reason)
for _direction in ("up", "down"):
    BYTES.labels(direction=_direction)
    LEARNER_BYTES.labels(direction=_direction)
for _source in BADPUT_SOURCES:
    BADPUT_SECONDS.labels(source=_source)
