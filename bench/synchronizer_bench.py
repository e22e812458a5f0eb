"""`atoll bench synchronizer`: how fast one replica ingests updates, against raw gRPC.

Every part runs in this one invocation on the same machine. N clients (the learner's own
protocol client) stream 4 MiB int8 updates of one fragment to a real synchronizer (its own
process, a real Redis), each waiting for RECEIVED acks with a few updates outstanding:
first with rounds held open (`ratio`), then with rounds merging at the default cadence
(`merging_ratio`). Then the same clients stream the same bytes, in the same chunks, to a bare
gRPC sink process that only counts them and acks (raw): on one long stream per client, and
again with one call per payload as Ingest makes (`raw_per_call_mb_s`: what the calls alone
cost, beside what the replica does with their bytes). Last, the same payloads written
straight into a fresh Redis, one SET each, as the first design stored every update: that
ceiling (`store_ratio`) is what data plane v2 left behind.

Where the CPU goes (`cpu_ms_per_mb`): each part's CPU time (user + system, every thread)
over the MB it moved, side by side in the run: the replica (and its Redis) with rounds held
open and merging, the raw sink, and the clients of each. On a machine the parts share, a
ratio is what these leave each other: at 0.8, the replica may spend what the raw sink does
plus a quarter of the raw run's total.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import redis

from bench.scale import cpu_seconds, static_chunks
from cluster.processes import Child, atoll_command, child_env, synchronizer_child, wait_for_file
from cluster.redis_server import RedisServer
from learner.client import SynchronizerClient
from services import codec as codecs
from services.gen.atoll.v1 import session_pb2
from services.grpcopts import channel_options, server_options
from services.layout import LeafSpec
from services.wire import DEFAULT_MAX_CHUNK_BYTES

if TYPE_CHECKING:
    from bench.settings import SynchronizerBench

SERVICE = "atoll.v1.Synchronizer"
IN_FLIGHT = 8  # updates each client keeps in flight (a learner never waits for acks)


def _values_for(mib: float) -> int:
    # int8 payload: n bytes of values + 4 bytes of scale per 256 values.
    return int(mib * (1 << 20) / (1 + 4 / codecs.DEFAULT_BLOCK_SIZE))


@dataclass
class Measured:
    """A part's payload MB/s, and the CPU ms each MB cost its server processes and clients."""

    mb_s: float
    cpu_ms_per_mb: dict[str, float]


def _run_clients(
    n: int, seconds: float, body: Callable[[int, float], int], servers: dict[str, int]
) -> Measured:
    """Run `body(index, deadline)` in n threads: total payload MB/s, and the CPU ms a MB of
    each server process (by name: its pid) and of this process's threads (`clients`)."""
    totals = [0] * n
    cpu0 = {name: cpu_seconds(pid) for name, pid in servers.items()}
    clients0 = time.process_time()
    start = time.monotonic()
    deadline = start + seconds

    def work(i: int) -> None:
        totals[i] = body(i, deadline)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mb = sum(totals) / 1e6
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in servers.items()}
    cpu["clients"] = time.process_time() - clients0
    return Measured(
        mb / (time.monotonic() - start),
        {name: round(1e3 * seconds / mb, 3) if mb else 0.0 for name, seconds in cpu.items()},
    )


def measure_ingest(
    workdir: Path, clients: int, seconds: float, n: int, merging: bool = False
) -> Measured:
    """Payload MB/s the synchronizer acknowledges as received. Rounds are held open (sync
    mode waiting for one learner more than there are) unless `merging`: then they merge at
    the default cadence (decoupled, quorum 1, adaptive grace)."""
    specs = [LeafSpec("fragment", (n,))]
    codec = codecs.by_name("int8")
    values = np.random.default_rng(0).normal(size=n).astype(np.float32)
    segments, _ = codecs.encode_segments(codec, values, 256, DEFAULT_MAX_CHUNK_BYTES)
    payload_bytes = sum(len(s.data) for s in segments)
    rounds = (
        ["--max-staleness", "1000000"]
        if merging
        else ["--mode", "sync", "--quorum", "1000000", "--max-staleness", "1000000"]
    )
    run_dir = workdir / ("merging" if merging else "open")
    run_dir.mkdir()
    with RedisServer(run_dir / "redis") as redis_server:
        sync = synchronizer_child(
            run_dir,
            redis_server.url,
            "bench-sync",
            ["--fragments", "1", "--log-level", "warning", *rounds],
        ).start_and_wait()
        try:
            conns = [
                SynchronizerClient(
                    [sync.address],
                    job="default",
                    learner_id=f"bench-{i}",
                    incarnation=uuid.uuid4().hex,
                    params=specs,
                )
                for i in range(clients)
            ]
            for c in conns:
                c.connect()
            seq = conns[0].send_initial(0, np.zeros(n, np.float32))
            conns[0].wait_ack(seq, 60)

            owner = conns[0].owners[0].address
            # Each update is a learner's own (one update per learner in a round).
            static = static_chunks(0, segments, codec)

            def stream(i: int, deadline: float) -> int:
                channel = grpc.insecure_channel(owner, options=channel_options())
                call = channel.stream_unary(
                    f"/{SERVICE}/Ingest",
                    request_serializer=None,
                    response_deserializer=session_pb2.Ack.FromString,
                )
                sent, window, k = 0, [], 0
                ok = (session_pb2.ACK_STATUS_RECEIVED, session_pb2.ACK_STATUS_COMMITTED)
                while time.monotonic() < deadline:
                    k += 1
                    tail = session_pb2.UpdateChunk(
                        seq=k, learner_id=f"bench-{i}-{k}", incarnation="i"
                    ).SerializeToString()
                    window.append(call.future(iter([c + tail for c in static]), timeout=60))
                    if len(window) >= IN_FLIGHT:
                        sent += payload_bytes if window.pop(0).result().status in ok else 0
                for f in window:
                    sent += payload_bytes if f.result().status in ok else 0
                channel.close()
                return sent

            assert redis_server.process is not None
            servers = {"replica": sync.pid, "redis": redis_server.process.pid}
            measured = _run_clients(clients, seconds, stream, servers)
            for c in conns:
                c.close()
            return measured
        finally:
            sync.stop()


def measure_raw(
    workdir: Path, clients: int, seconds: float, payload_bytes: int, per_call: bool = False
) -> Measured:
    """Payload MB/s into the raw sink: each client streaming payloads on one call, IN_FLIGHT
    acks outstanding; or, `per_call`, IN_FLIGHT calls of one payload each at a time."""
    workdir = workdir / ("raw-per-call" if per_call else "raw")
    workdir.mkdir()
    port_file = workdir / "sink.ports"
    sink = Child(
        "raw-sink",
        atoll_command("bench", "raw-sink", "--port-file", str(port_file)),
        workdir / "raw-sink.log",
        child_env(1),
    ).start()
    try:
        port = wait_for_file(port_file, sink)["grpc"]
        payload = np.random.default_rng(0).bytes(payload_bytes)
        step = DEFAULT_MAX_CHUNK_BYTES  # the same chunks as the synchronizer's
        chunks = [payload[i : i + step] for i in range(0, len(payload), step)]

        def stream(_: int, deadline: float) -> int:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
            call = channel.stream_stream(RAW_METHOD, None, None)  # bytes in, bytes out
            sent = 0
            acks: list[int] = []
            lock = threading.Condition()

            def requests() -> Iterator[bytes]:
                count = 0
                while time.monotonic() < deadline:
                    with lock:
                        while count - len(acks) >= IN_FLIGHT:
                            lock.wait(0.1)
                    yield from chunks
                    count += 1

            for _ in call(requests(), metadata=(("payload-bytes", str(payload_bytes)),)):
                with lock:
                    acks.append(1)
                    lock.notify_all()
                sent += payload_bytes
            channel.close()
            return sent

        def calls(_: int, deadline: float) -> int:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
            call = channel.stream_stream(RAW_METHOD, None, None)
            sent = [0] * IN_FLIGHT

            def one(k: int) -> None:
                metadata = (("payload-bytes", str(payload_bytes)),)
                while time.monotonic() < deadline:
                    for _ in call(iter(chunks), metadata=metadata):
                        sent[k] += payload_bytes

            threads = [threading.Thread(target=one, args=(k,)) for k in range(IN_FLIGHT)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            channel.close()
            return sum(sent)

        body = calls if per_call else stream
        return _run_clients(clients, seconds, body, {"raw_sink": sink.pid})
    finally:
        sink.stop()


def measure_store(workdir: Path, clients: int, seconds: float, payload_bytes: int) -> float:
    payload = np.random.default_rng(0).bytes(payload_bytes)
    with RedisServer(workdir / "redis-alone") as redis_server:

        def write(i: int, deadline: float) -> int:
            client = redis.Redis.from_url(redis_server.url)
            sent = 0
            while time.monotonic() < deadline:
                client.set(f"payload:{i}:{sent}", payload)
                sent += 1
            client.close()
            return sent * payload_bytes

        return _run_clients(clients, seconds, write, {}).mb_s


RAW_METHOD = "/atoll.bench.RawSink/Stream"


def serve_raw_sink(port_file: Path) -> None:
    """A bare grpc.aio bidi stream (the synchronizer's own server flavour) that counts chunks
    into payloads and acks each payload: gRPC with nothing of atoll's behind it."""

    async def handle(
        request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        size = int(dict(context.invocation_metadata() or ())["payload-bytes"])
        received = 0
        async for chunk in request_iterator:
            received += len(chunk)
            if received >= size:  # one whole payload in: ack it
                received -= size
                yield b"ok"

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler(
            "atoll.bench.RawSink",
            {"Stream": grpc.stream_stream_rpc_method_handler(handle)},  # bytes in, bytes out
        )
        server = grpc.aio.server(options=server_options())
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await asyncio.to_thread(port_file.write_text, json.dumps({"grpc": port, "metrics": 0}))
        await server.wait_for_termination()

    asyncio.run(serve())


def run(settings: SynchronizerBench) -> None:
    n = _values_for(settings.fragment_mib)
    payload_bytes = len(codecs.by_name("int8").encode(np.zeros(n, np.float32), 256))
    with tempfile.TemporaryDirectory(prefix="atoll-bench-") as tmp:
        workdir = Path(tmp)
        ingest = measure_ingest(workdir, settings.clients, settings.seconds, n)
        merging = measure_ingest(workdir, settings.clients, settings.seconds, n, merging=True)
        raw = measure_raw(workdir, settings.clients, settings.seconds, payload_bytes)
        raw_calls = measure_raw(
            workdir, settings.clients, settings.seconds, payload_bytes, per_call=True
        )
        store = measure_store(workdir, settings.clients, settings.seconds, payload_bytes)
    result = {
        "clients": settings.clients,
        "seconds": settings.seconds,
        "payload_bytes": payload_bytes,
        "ingest_mb_s": round(ingest.mb_s, 2),
        "raw_grpc_mb_s": round(raw.mb_s, 2),
        "ratio": round(ingest.mb_s / raw.mb_s, 3) if raw.mb_s else 0.0,
        "merging_mb_s": round(merging.mb_s, 2),
        "merging_ratio": round(merging.mb_s / raw.mb_s, 3) if raw.mb_s else 0.0,
        "raw_per_call_mb_s": round(raw_calls.mb_s, 2),
        "store_mb_s": round(store, 2),
        "store_ratio": round(ingest.mb_s / store, 3) if store else 0.0,
        "cpu_ms_per_mb": {
            "held_open": ingest.cpu_ms_per_mb,
            "merging": merging.cpu_ms_per_mb,
            "raw": raw.cpu_ms_per_mb,
            "raw_per_call": raw_calls.cpu_ms_per_mb,
        },
    }
    print(json.dumps(result, indent=2))
    if settings.json_path is not None:
        settings.json_path.write_text(json.dumps(result, indent=2) + "\n")
