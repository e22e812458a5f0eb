"""`atoll synchronizer`: wires the servicer, health, reflection, metrics and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from services import telemetry as tm
from services.config import JobConfig, SynchronizerSettings
from services.grpcopts import server_options, split_hostport
from synchronizer.service import SERVICE_NAME, SynchronizerService
from synchronizer.store import StoreError, open_store

log = structlog.get_logger("atoll.synchronizer")
DRAIN_SECONDS = 5.0


async def _watch_store(service: SynchronizerService, health_servicer: HealthServicer) -> None:
    """SERVING while the store answers, NOT_SERVING otherwise."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while True:
        try:
            up = await asyncio.wait_for(service.store.ping(), timeout=2.0)
        except Exception:
            up = False
        tm.REDIS_UP.set(1 if up else 0)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, serving if up else not_serving)
        await asyncio.sleep(1.0)


async def serve(settings: SynchronizerSettings) -> None:
    store = open_store(settings.redis_url, settings.job)
    job = await store.job_config(settings.model_dump(include=set(JobConfig.model_fields)))
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
    service = SynchronizerService(settings, store)
    await service.load_known_spec()
    if settings.init_from is not None:
        with np.load(settings.init_from) as npz:
            arrays = {name: np.asarray(npz[name], np.float32) for name in npz.files}
        won = await service.initialize_from(arrays)
        log.info("initial_parameters", source=str(settings.init_from), applied=won)

    server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(settings.listen)
    if port == 0:
        raise SystemExit(f"cannot listen on {settings.listen}: the address is taken or invalid")
    metrics_host, metrics_port = split_hostport(settings.metrics_listen)
    metrics_server, _ = start_http_server(metrics_port, addr=metrics_host)
    await server.start()
    bound_metrics = metrics_server.server_port
    log.info(
        "serving",
        listen=settings.listen,
        port=port,
        metrics_port=bound_metrics,
        replica=settings.replica_id,
        job=settings.job,
    )
    service.tape.write("started", port=port)
    if settings.port_file is not None:
        settings.port_file.write_text(json.dumps({"grpc": port, "metrics": bound_metrics}))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(_watch_store(service, health_servicer)),
        asyncio.create_task(service.merger.sweep_forever()),
        asyncio.create_task(service.broadcast_forever()),
        asyncio.create_task(service.flush_stats_forever()),
    ]
    await stop.wait()
    log.info("draining", seconds=DRAIN_SECONDS)
    await health_servicer.enter_graceful_shutdown()
    for conn in list(service.connections.values()):
        conn.outbox.put_nowait(None)
    await server.stop(DRAIN_SECONDS)
    service.merger.close()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await service.flush_stats()
    metrics_server.shutdown()
    await store.close()
    log.info("stopped")


def run(settings: SynchronizerSettings) -> None:
    tm.configure_logging(settings.log_level)
    try:
        asyncio.run(serve(settings))
    except StoreError as err:
        raise SystemExit(f"atoll synchronizer: {err}") from None
    except (RedisError, OSError) as err:
        raise SystemExit(
            f"atoll synchronizer: cannot reach Redis at {settings.redis_url} ({err}); start it "
            "or fix --redis-url"
        ) from None
