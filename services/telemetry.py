"""Logging and metrics: the one place where every atoll metric is defined.

Names follow Prometheus conventions: `atoll_` prefix, base units, `_total` counters and
bounded labels (reasons and sources are fixed sets; fragments are bounded by P).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from prometheus_client import Counter, Gauge, Histogram

REJECT_REASONS = (
    "unknown_fragment",
    "shape_mismatch",
    "bad_codec",
    "checksum",
    "out_of_order",
    "non_finite",
    "stale",
    "bad_request",
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


# --- synchronizer ---------------------------------------------------------------------------
LEARNERS_CONNECTED = Gauge(
    "atoll_learners_connected", "Learner sessions open on this synchronizer replica"
)
UPDATES_ACCEPTED = Counter("atoll_updates_accepted_total", "Outer-gradient updates accepted")
UPDATES_DUPLICATE = Counter(
    "atoll_updates_duplicate_total", "Retried updates acknowledged without being applied again"
)
UPDATES_REJECTED = Counter("atoll_updates_rejected_total", "Updates refused, by reason", ["reason"])
MERGES = Counter("atoll_merges_total", "Merges committed by this replica")
MERGE_ABORTS = Counter(
    "atoll_merge_aborts_total", "Merges abandoned because another replica committed first"
)
QUORUM_SIZE = Histogram(
    "atoll_merge_quorum_size",
    "Learners whose updates entered one merge",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
GRACE_SECONDS = Histogram(
    "atoll_grace_window_seconds",
    "Grace window waited after quorum",
    buckets=(0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
MERGE_SECONDS = Histogram(
    "atoll_merge_duration_seconds",
    "Merge and commit time of one round",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
STALENESS = Histogram(
    "atoll_update_staleness_versions",
    "Versions between an update's base and the fragment's version when it was merged",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)
BYTES = Counter(
    "atoll_bytes_total", "Bytes on the wire (payload and protocol), by direction", ["direction"]
)
FRAGMENT_VERSION = Gauge("atoll_fragment_version", "Committed version of a fragment", ["fragment"])
REDIS_UP = Gauge("atoll_redis_up", "1 while Redis answers this replica, else 0")

# --- learner --------------------------------------------------------------------------------
LEARNER_STEPS = Counter("atoll_learner_steps_total", "Inner steps done by this learner")
LEARNER_TOKENS = Counter("atoll_learner_tokens_total", "Tokens trained on by this learner")
LEARNER_STEP_SECONDS = Histogram(
    "atoll_learner_step_duration_seconds",
    "Inner step time",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
LEARNER_LOSS = Gauge("atoll_learner_loss", "Training loss of the last inner step")
LEARNER_EVAL_LOSS = Gauge("atoll_learner_eval_loss", "Eval loss of the last global model seen")
LEARNER_BYTES = Counter(
    "atoll_learner_bytes_total", "Bytes this learner put on the wire, by direction", ["direction"]
)
GOODPUT_SECONDS = Counter(
    "atoll_goodput_seconds_total", "Inner-step compute seconds whose outer gradient was merged"
)
BADPUT_SECONDS = Counter(
    "atoll_badput_seconds_total", "Learner seconds that did not become merged progress", ["source"]
)
PROVISIONED_SECONDS = Counter(
    "atoll_provisioned_seconds_total", "Wall seconds this learner slot was provisioned"
)
LEARNER_PARAMETERS = Gauge(
    "atoll_learner_parameters",
    "Parameters of the model this learner trains (the data-parallel equivalent of its bytes "
    "is 8 x parameters per step)",
)
REJOINS = Counter("atoll_learner_rejoins_total", "Times this learner (re)joined a synchronizer")

for _reason in REJECT_REASONS:
    UPDATES_REJECTED.labels(reason=_reason)
for _direction in ("up", "down"):
    BYTES.labels(direction=_direction)
    LEARNER_BYTES.labels(direction=_direction)
for _source in BADPUT_SOURCES:
    BADPUT_SECONDS.labels(source=_source)
