"""`atoll synchronizer`: wires the service, health, reflection, metrics and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import sys
import threading

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from redis.exceptions import RedisClusterException, RedisError

from services import kernels, tls
from services import telemetry as tm
from services.config import JobConfig, SynchronizerSettings
from services.grpcopts import bind_error, cannot_listen, server_options, split_hostport
from synchronizer.auth import Authenticator, load_tokens
from synchronizer.service import SERVICE_NAME, SynchronizerService
from synchronizer.store.control import ControlStore, StoreError
from synchronizer.store.redis_store import open_store, redact
from synchronizer.store.tensors import TensorStore, TensorStoreError

log = structlog.get_logger("atoll.synchronizer")
DRAIN_SECONDS = 5.0


async def _watch_store(
    store: ControlStore, health_servicer: HealthServicer, fragments: int
) -> None:
    """Readiness follows Redis (the service's name is SERVING while Redis answers); liveness
    (the empty name) stays SERVING while the process runs, so a Redis blip never gets every
    replica restarted. Each answer also refreshes the job's figures (`tm.JOB`)."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while True:
        try:
            up = await asyncio.wait_for(store.ping(), timeout=2.0)
            if up:
                await asyncio.wait_for(_read_job_figures(store, fragments), timeout=2.0)
        except Exception:
            up = False
        tm.REDIS_UP.set(1 if up else 0)
        await health_servicer.set(SERVICE_NAME, serving if up else not_serving)
        await asyncio.sleep(1.0)


async def _read_job_figures(store: ControlStore, fragments: int) -> None:
    stats = await store.stats(fragments)
    live = await store.live()
    tm.JOB.set(
        useful_seconds=stats.get("useful_seconds", 0.0),
        updates_accepted=stats.get("updates_accepted", 0.0),
        learners_live=len(live.learners),
    )


def advertised(settings: SynchronizerSettings, port: int) -> str:
    if settings.advertise:
        return settings.advertise
    host, _ = split_hostport(settings.listen)
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


def authenticator(settings: SynchronizerSettings) -> Authenticator:
    tokens = None
    if settings.learner_tokens_file is not None:
        try:
            tokens = load_tokens(settings.learner_tokens_file)
        except (OSError, ValueError) as err:
            raise SystemExit(f"atoll synchronizer: --learner-tokens-file: {err}") from None
    mtls = settings.tls_ca is not None
    return Authenticator(
        SERVICE_NAME,
        mtls=mtls,
        tokens=tokens,
        shared_token=settings.token,
        anonymous=settings.insecure and not (mtls or tokens or settings.token),
        pool_size=settings.pool_size,
    )


def bind(server: grpc.aio.Server, settings: SynchronizerSettings) -> int:
    """Listen with TLS (mTLS with --tls-ca), or in plaintext with --insecure."""
    try:
        if settings.tls_cert is None or settings.tls_key is None:
            return server.add_insecure_port(settings.listen)
        credentials = tls.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)
        return server.add_secure_port(settings.listen, credentials)
    except tls.TlsError as err:
        raise SystemExit(f"atoll synchronizer: {err}") from None
    except RuntimeError as err:  # gRPC's "Failed to bind": taken since `bind_error` looked
        raise SystemExit(
            f"atoll synchronizer: {cannot_listen('--listen', settings.listen, err)}"
        ) from None


def transport(settings: SynchronizerSettings) -> str:
    if settings.tls_cert is None:
        return "plaintext"
    return "mtls" if settings.tls_ca is not None else "tls"


async def serve(settings: SynchronizerSettings) -> None:
    # Every line this replica logs names it and its job (tasks inherit the context).
    structlog.contextvars.bind_contextvars(replica=settings.replica_id, job=settings.job)
    problem = settings.transport_problem()
    if problem is not None:
        raise SystemExit(f"atoll synchronizer: {problem}")
    for flag, listen in (
        ("--listen", settings.listen),
        ("--metrics-listen", settings.metrics_listen),
        ("--health-listen", settings.health_listen),
    ):
        in_use = bind_error(listen) if listen else None
        if in_use is not None:
            raise SystemExit(f"atoll synchronizer: {cannot_listen(flag, listen, in_use)}")
    interceptor = authenticator(settings)
    store = open_store(settings.redis_url, settings.job)
    tensors = TensorStore(settings.tensor_store)
    job = await store.job_config(settings.model_dump(include=set(JobConfig.model_fields)))
    tm.REDIS_UP.set(1)  # it answered: known before the metrics are served
    mine = settings.model_dump(include=set(job))
    if job != mine:
        differing = sorted(k for k in job if job[k] != mine.get(k))
        raise SystemExit(
            f"job {settings.job!r} in Redis runs with "
            + ", ".join(f"{k}={job[k]!r}" for k in differing)
            + "; this replica was started with "
            + ", ".join(f"{k}={mine.get(k)!r}" for k in differing)
            + ". Start every replica with the same algorithm flags, or use a new --job."
        )
    server = grpc.aio.server(options=server_options(), interceptors=[interceptor])
    port = bind(server, settings)
    if port == 0:
        raise SystemExit(
            f"atoll synchronizer: cannot listen on --listen {settings.listen}: the address is "
            "taken or not this machine's; choose a free port"
        )
    service = SynchronizerService(settings, store, tensors, advertised(settings, port))
    # The decoders compile (a machine's first run) or load from numba's cache meanwhile.
    warming = asyncio.create_task(asyncio.to_thread(kernels.warm))
    await service.load_known_spec()
    if settings.init_from is not None:
        with np.load(settings.init_from) as npz:
            arrays = {name: np.asarray(npz[name], np.float32) for name in npz.files}
        taken = await service.initialize_from(arrays)
        log.info("initial_parameters", source=str(settings.init_from), fragments_set=taken)

    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = HealthServicer()
    # Live from the start; ready once `_watch_store` has seen Redis answer (never NOT_FOUND,
    # which a probe asking between the start and the first ping would get).
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    try:
        metrics_server, _ = tm.serve_metrics("synchronizer", settings.metrics_listen)
    except OSError as err:
        raise SystemExit(
            f"atoll synchronizer: {cannot_listen('--metrics-listen', settings.metrics_listen, err)}"
        ) from None
    probes = None
    if settings.health_listen:
        # Health only, in plaintext: probes that cannot speak TLS; nothing else is served.
        probes = grpc.aio.server(options=server_options())
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probes)
        if probes.add_insecure_port(settings.health_listen) == 0:
            raise SystemExit(f"cannot listen on --health-listen {settings.health_listen}")
        await probes.start()
    await warming
    # What exists now (modules, compiled kernels, the service) lives as long as the replica:
    # out of the collector's sight, each of the collections that chunk handling triggers
    # walks only what was made since.
    gc.collect()
    gc.freeze()
    await server.start()
    bound_metrics = metrics_server.server_port
    log.info(
        "serving",
        listen=settings.listen,
        port=port,
        advertise=service.ownership.address,
        metrics_port=bound_metrics,
        replica=settings.replica_id,
        job=settings.job,
        tensor_store=redact(settings.tensor_store),
        transport=transport(settings),
    )
    service.tape.write("started", port=port)
    if settings.port_file is not None:
        settings.port_file.write_text(json.dumps({"grpc": port, "metrics": bound_metrics}))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(_watch_store(store, health_servicer, settings.fragments)),
        asyncio.create_task(service.ownership.run_forever()),
        asyncio.create_task(service.sessions.watch_forever()),
        asyncio.create_task(service.followers.watch_forever()),
        asyncio.create_task(service.flush_stats_forever()),
    ]
    await stop.wait()
    log.info("draining", seconds=DRAIN_SECONDS)
    _force_exit_after(DRAIN_SECONDS + FORCED_EXIT_S, loop)
    await health_servicer.enter_graceful_shutdown()
    await service.ownership.stop()
    for conn in list(service.sessions.connections.values()):
        conn.outbox.put_nowait(None)
    service.followers.close()
    await server.stop(DRAIN_SECONDS)
    if probes is not None:
        await probes.stop(0)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await service.flush_stats()
    metrics_server.shutdown()
    await store.close()
    log.info("stopped")


FORCED_EXIT_S = 5.0


def _force_exit_after(seconds: float, loop: asyncio.AbstractEventLoop) -> None:
    """A replica told to stop is gone within `seconds`, whatever its shutdown waits on: it
    owns nothing durable that a forced exit could lose (the leases lapse)."""

    def force() -> None:
        pending = [
            f"{t.get_name()}: {t.get_stack(limit=3)}"
            for t in asyncio.all_tasks(loop)
            if not t.done()
        ]
        log.error("shutdown_forced", seconds=seconds, pending=pending[:10])
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


# How long a thread holds the GIL while another waits for it (Python's default: 5 ms). A
# replica's fragment workers and step pool run compiled loops that release the GIL and need
# it back between chunks; with the event loop busy receiving and pushing, each return waited
# up to the whole interval. At 1e9 parameters over four replicas (the device's CPUs), 0.5 ms
# halved the time uploads waited for their chunks' sums (docs/BENCHMARKS.md, session 9).
GIL_SWITCH_INTERVAL_S = 0.0005


def run(settings: SynchronizerSettings) -> None:
    tm.configure_logging(settings.log_level, dropped=tm.LOG_LINES_DROPPED.inc)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        asyncio.run(serve(settings))
    except (StoreError, TensorStoreError) as err:
        raise SystemExit(f"atoll synchronizer: {err}") from None
    except (RedisError, RedisClusterException) as err:
        raise SystemExit(
            f"atoll synchronizer: cannot reach Redis at {redact(settings.redis_url)} "
            f"({type(err).__name__}); start it or fix --redis-url"
        ) from None
    except OSError as err:  # not Redis's (its client wraps its own): a file, a socket
        raise SystemExit(f"atoll synchronizer: {err}") from None
