"""`atoll learner`: thread limits first (before JAX starts), then join, train, report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog

from learner import group
from learner.group import Group
from learner.settings import LearnerSettings
from services import telemetry as tm
from services import tls
from services.grpcopts import cannot_listen

log = structlog.get_logger("atoll.learner")


def limit_threads(threads: int) -> None:
    """Cap XLA's and BLAS's CPU threads, so several learners share a machine's cores.

    Must run before JAX initialises its backend (its first use, not its import).
    """
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={threads}"
    ).strip()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def use_compile_cache(folder: Path) -> None:
    """Keep every compiled function in `folder`, so the next process with the same model
    (a restarted learner) loads it instead of compiling. Must run before JAX is imported."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(folder)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def start_processes(settings: LearnerSettings) -> tuple[LearnerSettings, Group, list[Any]]:
    """This learner's processes: with --local-processes, process 0 starts the others;
    then every process joins the group (before JAX's first computation). A learner of
    several processes keeps no local checkpoint yet (its read position only), and each
    process but the first reports beside --report."""
    children: list[Any] = []
    if settings.processes > 1 and settings.local_processes and settings.process_id is None:
        coordinator = settings.coordinator or group.free_address()
        children = group.spawn_followers(settings.processes, coordinator)
        settings = settings.model_copy(update={"coordinator": coordinator, "process_id": 0})
    joined = group.start(
        settings.coordinator, settings.processes, settings.process_id, settings.collectives_host
    )
    if joined.many:
        report = settings.report
        if report is not None and not joined.leader:
            report = report.with_name(f"{report.stem}.process-{joined.process}{report.suffix}")
        settings = settings.model_copy(update={"checkpoint_every": 0, "report": report})
    return settings, joined, children


def run(settings: LearnerSettings) -> None:
    tm.configure_logging(settings.log_level, dropped=tm.LEARNER_LOG_LINES_DROPPED.inc)
    if not settings.standalone:
        try:
            tls.learner_credentials(
                settings.insecure, settings.tls_ca, settings.tls_cert, settings.tls_key
            )
        except tls.TlsError as err:
            raise SystemExit(f"atoll learner: {err}") from None
    limit_threads(settings.threads)
    if settings.compile_cache is not None:
        use_compile_cache(settings.compile_cache)
    settings, joined, children = start_processes(settings)
    try:
        train(settings, joined)
        joined.leave()  # every process at once: before waiting for the ones started here
    finally:
        for child in children:  # they stop with this process: wait for them a while
            try:
                child.wait(timeout=60)
            except Exception:
                child.kill()


def train(settings: LearnerSettings, joined: Group) -> None:
    from learner import workload
    from learner.trainer import Learner, install_stop_handler, write_report

    if not settings.export_provisioned:
        tm.GOODPUT.supervised()
    if settings.metrics_listen:
        try:
            tm.serve_metrics("learner", settings.metrics_listen)
        except OSError as err:
            message = cannot_listen("--metrics-listen", settings.metrics_listen, err)
            raise SystemExit(f"atoll learner: {message}") from None
    from learner.client import SessionError

    learner = Learner(settings, workload.load(settings), joined)
    install_stop_handler(learner, joined)
    try:
        summary = learner.run()
    except SessionError as err:  # its message says what to do; a traceback would bury it
        if learner.stop_requested.is_set():  # told to stop before it could join: not a failure
            log.info("stopped_before_joining", reason=str(err))
            return
        log.error("session_failed", error=str(err))  # for the logs; the line below for people
        raise SystemExit(f"atoll learner: {err}") from None
    finally:
        learner.close()
    log.info(
        "finished",
        steps=summary["steps"],
        loss=summary["loss"]["final"],
        eval_loss=summary["eval_loss"],
    )
    if settings.report is not None:
        write_report(settings.report, summary)
