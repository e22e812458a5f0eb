"""`atoll learner`: thread limits first (before JAX starts), then join, train, report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import structlog

from learner.settings import LearnerSettings
from services import telemetry as tm
from services import tls

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


def run(settings: LearnerSettings) -> None:
    tm.configure_logging(settings.log_level)
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
    from learner import workload
    from learner.trainer import Learner, install_stop_handler, write_report

    if not settings.export_provisioned:
        tm.GOODPUT.supervised()
    if settings.metrics_listen:
        tm.serve_metrics("learner", settings.metrics_listen)
    from learner.client import SessionError

    learner = Learner(settings, workload.load(settings))
    install_stop_handler(learner)
    try:
        summary = learner.run()
    except SessionError as err:  # its message says what to do; a traceback would bury it
        if learner.stop_requested.is_set():  # told to stop before it could join: not a failure
            log.info("stopped_before_joining", reason=str(err))
            return
        print(f"atoll learner: {err}", file=sys.stderr)
        raise SystemExit(1) from None
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
