"""`atoll bench synchronizer`: how fast one replica ingests updates, against raw gRPC.

Every part runs in this one invocation on the same machine. N clients, each a process of its
own as learners are (with a learner's control session), stream 4 MiB int8 updates of one
fragment to a real synchronizer (its own process, a real Redis), each waiting for RECEIVED
acks with a few updates outstanding:
first with rounds held open (`ratio`), then with rounds merging at the default cadence
(`merging_ratio`). Then the same clients stream the same bytes, in the same chunks, to a bare
gRPC sink process that only counts them and acks (raw): on one long stream per client, and
again with one call per payload as Ingest makes (`raw_per_call_mb_s`: what the calls alone
cost, beside what the replica does with their bytes). Then the floor (`floor_mb_s`,
`floor_ratio`): the same clients stream the updates on one stream each to a sink that does
only the least an owner must with them, parse each chunk, hash it and sum it into a float32
fragment on one worker thread, chunks of one range together (bench/raw_sink.py); what is left
between it and the replica is admission, checks and per-call costs. Last, the same payloads
written straight into a fresh Redis, one SET each, as the first design stored every update:
that ceiling (`store_ratio`) is what data plane v2 left behind.

Where the CPU goes (`cpu_ms_per_mb`): each part's CPU time (user + system, every thread)
over the MB it moved, side by side in the run: the replica (and its Redis) with rounds held
open and merging, the raw sink, and the clients of each. On a machine the parts share, a
ratio is what these leave each other: at 0.8, the replica may spend what the raw sink does
plus a quarter of the raw run's total.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import redis
from pydantic import Field

from bench.options import Output
from bench.raw_sink import RAW_METHOD
from bench.scale import cpu_seconds
from bench.synthetic import static_chunks
from cluster.processes import Child, atoll_command, child_env, synchronizer_child, wait_for_file
from cluster.redis_server import RedisServer
from learner.client import SynchronizerClient
from services import codec as codecs
from services import kernels
from services import telemetry as tm
from services.gen.atoll.v1 import session_pb2
from services.grpcopts import channel_options
from services.layout import LeafSpec
from services.lifecycle import reuse_large_buffers, watch_parent
from services.wire import DEFAULT_MAX_CHUNK_BYTES
from synchronizer.store.keys import JobKeys


class SynchronizerBench(Output):
    """Ingest of 3 learners streaming int8 updates, against raw gRPC streaming of the same
    bytes (on one stream, and one call per update), against a sink that only hashes and sums
    them as an owner must (the floor), and against Redis alone storing them; and the CPU each
    MB cost every part."""

    clients: int = Field(3, ge=1, le=16, description="concurrent learner clients")
    seconds: float = Field(10.0, gt=0.0, description="seconds each measurement streams")
    fragment_mib: float = Field(4.0, gt=0.0, description="encoded int8 update size in MiB")
    pin: bool = Field(
        False,
        description="pin the processes measured (the replica and its Redis, the sinks) to the "
        "first half of this machine's cores and the clients to the rest, so that clients "
        "do not take the replica's cores (on two cores: one each)",
    )

    def cli_cmd(self) -> None:
        run(self)


SERVICE = "atoll.v1.Synchronizer"
IN_FLIGHT = 8  # updates each client keeps in flight (a learner never waits for acks)


def split_cores(pin: bool) -> tuple[frozenset[int], frozenset[int]] | None:
    """With `pin`, (the servers' cores, the clients' cores): the first half of the cores this
    process may run on (at least one) and the rest; None without `pin` or with one core."""
    if not pin:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = max(1, len(cores) // 2)
    return frozenset(cores[:half]), frozenset(cores[half:])


def _pin(pids: Iterable[int], cores: frozenset[int] | None) -> None:
    """Every thread of each process onto `cores` (a process's threads keep their own masks)."""
    if cores is None:
        return
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task), cores)


def _values_for(mib: float) -> int:
    # int8 payload: n bytes of values + 4 bytes of scale per 256 values.
    return int(mib * (1 << 20) / (1 + 4 / codecs.DEFAULT_BLOCK_SIZE))


@dataclass
class Measured:
    """A part's payload MB/s, and the CPU ms each MB cost its server processes and clients."""

    mb_s: float
    cpu_ms_per_mb: dict[str, float]


@dataclass(frozen=True)
class Client:
    """One client process's part (it crosses to the process: plain data only). `kind`:
    "ingest" (updates to the fragment's owner at `address`, each a learner of its own,
    beside a learner's control session with the synchronizer at `session`, which follows
    the new versions), "raw" (payloads on one stream to the raw sink), "raw_calls" (one
    call a payload) or "store" (one SET a payload into the Redis at `address`)."""

    kind: str
    index: int
    address: str
    chunks: tuple[bytes, ...]  # one payload's chunks, as sent
    payload_bytes: int
    session: str = ""
    values: int = 0  # the fragment's values (the control session's parameter spec)
    redis_url: str = ""  # "ingest": the job's Redis, where its learners' leases are taken
    cores: frozenset[int] | None = None  # where the client runs (None: anywhere)


def _run_clients(
    clients: list[Client],
    seconds: float,
    servers: dict[str, int],
    cores: frozenset[int] | None = None,
) -> Measured:
    """Run each client in a process of its own, as learners are, all streaming for the same
    `seconds` once every one is ready: total payload MB/s, and the CPU ms a MB of each
    server process (by name: its pid) and of the client processes together (`clients`)."""
    context = multiprocessing.get_context("spawn")  # no gRPC state crosses a fork
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    processes = [
        context.Process(target=_client_process, args=(c, seconds, ready, go, results))
        for c in clients
    ]
    finished = False
    try:
        for process in processes:
            process.start()
        for _ in clients:
            _answer(ready.get(timeout=120))
        _pin(servers.values(), cores)  # every thread they have started by now
        cpu0 = {name: cpu_seconds(pid) for name, pid in servers.items()}
        start = time.monotonic()
        go.set()
        done = [_answer(results.get(timeout=seconds + 120)) for _ in clients]
        elapsed = time.monotonic() - start
        cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in servers.items()}
        finished = True
    finally:
        for process in processes:
            if process.pid is None:  # never started
                continue
            if not finished:
                process.kill()
            process.join(30)
            if process.is_alive():
                process.kill()
    mb = sum(sent for sent, _ in done) / 1e6
    cpu["clients"] = sum(seconds for _, seconds in done)
    return Measured(
        mb / elapsed,
        {name: round(1e3 * seconds / mb, 3) if mb else 0.0 for name, seconds in cpu.items()},
    )


def _answer(message: tuple[str, object]) -> Any:
    """A client process's message, or its failure raised here."""
    kind, value = message
    if kind == "error":
        raise RuntimeError(f"a benchmark client failed: {value}")
    return value


def _client_process(
    client: Client,
    seconds: float,
    ready: multiprocessing.Queue[tuple[str, object]],
    go: Any,
    results: multiprocessing.Queue[tuple[str, object]],
) -> None:
    """A client process: ready (its control session said hello), then stream until
    `seconds` after the go; puts (payload bytes acknowledged, CPU seconds it spent)."""
    if client.cores is not None:  # before any thread starts: they inherit it
        os.sched_setaffinity(0, client.cores)
    # What `atoll` sets up in each of its processes (atoll/cli.py): a learner's are too.
    watch_parent(parent=os.getppid())  # the benchmark was killed: stop too
    reuse_large_buffers()
    tm.configure_logging("warning", json=False)
    session, stop = None, threading.Event()
    try:
        if client.session:
            kernels.warm_decoders()  # as a learner's session does when it connects
            session = SynchronizerClient(
                [client.session],
                job="default",
                learner_id=f"bench-{client.index}",
                incarnation=uuid.uuid4().hex,
                params=[LeafSpec("fragment", (client.values,))],
            )
            session.connect()
            # As a learner's stager takes them: no client holds every version it was sent.
            threading.Thread(target=_drain, args=(session, stop), daemon=True).start()
        ready.put(("ready", client.index))
        if not go.wait(180):
            raise TimeoutError("the other clients were not ready within 180 s")
        cpu0 = time.process_time()
        sent = BODIES[client.kind](client, time.monotonic() + seconds)
        results.put(("done", (sent, time.process_time() - cpu0)))
    except BaseException as err:  # the parent says so and stops
        results.put(("error", f"client {client.index} ({client.kind}): {err!r}"))
        ready.put(("error", f"client {client.index} ({client.kind}): {err!r}"))
    finally:
        stop.set()
        if session is not None:
            session.close()


def _drain(session: SynchronizerClient, stop: threading.Event) -> None:
    """Take each new global value the session brings, as a learner's stager does."""
    while not stop.is_set():
        with contextlib.suppress(queue.Empty):
            session.fragments.get(timeout=0.2)


def _ingest(client: Client, deadline: float) -> int:
    """Updates to the owner, IN_FLIGHT calls outstanding: bytes of those acknowledged."""
    channel = grpc.insecure_channel(client.address, options=channel_options())
    call = channel.stream_unary(
        f"/{SERVICE}/Ingest",
        request_serializer=None,
        response_deserializer=session_pb2.Ack.FromString,
    )
    sent, window, k = 0, [], 0
    ok = (session_pb2.ACK_STATUS_RECEIVED, session_pb2.ACK_STATUS_COMMITTED)
    leases = redis.Redis.from_url(client.redis_url)
    done: list[int] = []  # learners whose update was answered: they leave
    while time.monotonic() < deadline:
        k += 1
        if k % LEASES_AT_ONCE == 1:
            _lease(leases, client.index, k)
        tail = session_pb2.UpdateChunk(
            seq=k, learner_id=f"bench-{client.index}-{k}", incarnation="i"
        ).SerializeToString()
        window.append((k, call.future(iter([c + tail for c in client.chunks]), timeout=60)))
        if len(window) >= IN_FLIGHT:
            answered, future = window.pop(0)
            sent += client.payload_bytes if future.result().status in ok else 0
            done.append(answered)
            if len(done) >= LEASES_AT_ONCE:
                _leave(leases, client.index, done)
    for _, future in window:
        sent += client.payload_bytes if future.result().status in ok else 0
    channel.close()
    leases.close()
    return sent


# Each update is a learner of its own (one update per learner in a round), leased a few at
# a time ahead of its update and leaving once answered, so that the job's live set holds
# about as many learners as are sending (clients x (IN_FLIGHT + 2 x LEASES_AT_ONCE)), as a
# job's does. Leasing 4096 ahead and never leaving once held 12,000 live learners, and the
# replica spent a third of its event loop reading that live set: a cost of the bench's
# make-believe learners, not of a job's.
LEASES_AT_ONCE = 16


def _lease(leases: redis.Redis, index: int, first: int) -> None:
    """Live leases for the next LEASES_AT_ONCE of the client's learners from `first`: only
    live learners' updates merge, and each update here is a learner of its own, standing in
    for a learner that said hello (an hour: the benchmark ends long before)."""
    seconds, micros = leases.time()
    until = seconds * 1000 + micros // 1000 + 3_600_000
    names = (f"bench-{index}-{k}" for k in range(first, first + LEASES_AT_ONCE))
    leases.zadd(JobKeys("default").learners, dict.fromkeys(names, until))


def _leave(leases: redis.Redis, index: int, answered: list[int]) -> None:
    """The `answered` learners leave the live set (as a learner's session ending does)."""
    leases.zrem(JobKeys("default").learners, *(f"bench-{index}-{k}" for k in answered))
    answered.clear()


def _raw(client: Client, deadline: float) -> int:
    """Payloads on one stream to the raw sink, IN_FLIGHT acks outstanding."""
    channel = grpc.insecure_channel(client.address, options=channel_options())
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
            yield from client.chunks
            count += 1

    metadata = (("payload-bytes", str(client.payload_bytes)),)
    for reply in call(requests(), metadata=metadata):
        with lock:
            acks.append(1)
            lock.notify_all()
        sent += client.payload_bytes if reply == b"ok" else 0  # a summing sink's checksum
    channel.close()
    return sent


def _raw_calls(client: Client, deadline: float) -> int:
    """IN_FLIGHT calls of one payload each at a time to the raw sink."""
    channel = grpc.insecure_channel(client.address, options=channel_options())
    call = channel.stream_stream(RAW_METHOD, None, None)
    sent = [0] * IN_FLIGHT

    def one(k: int) -> None:
        metadata = (("payload-bytes", str(client.payload_bytes)),)
        while time.monotonic() < deadline:
            for _ in call(iter(client.chunks), metadata=metadata):
                sent[k] += client.payload_bytes

    threads = [threading.Thread(target=one, args=(k,)) for k in range(IN_FLIGHT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    return sum(sent)


def _store(client: Client, deadline: float) -> int:
    """One SET a payload (its chunks joined) into Redis."""
    store = redis.Redis.from_url(client.address)
    payload = b"".join(client.chunks)
    sent = 0
    while time.monotonic() < deadline:
        store.set(f"payload:{client.index}:{sent}", payload)
        sent += 1
    store.close()
    return sent * client.payload_bytes


BODIES: dict[str, Callable[[Client, float], int]] = {
    "ingest": _ingest,
    "raw": _raw,
    "raw_calls": _raw_calls,
    "store": _store,
}


Cores = tuple[frozenset[int], frozenset[int]] | None  # (servers', clients'): `split_cores`


def measure_ingest(
    workdir: Path, clients: int, seconds: float, n: int, merging: bool = False, cores: Cores = None
) -> Measured:
    """Payload MB/s the synchronizer acknowledges as received. Rounds are held open (sync
    mode waiting for one learner more than there are) unless `merging`: then they merge at
    the default cadence (decoupled, quorum 1, adaptive grace)."""
    specs = [LeafSpec("fragment", (n,))]
    static, payload_bytes = _update_chunks(n)
    rounds = (
        ["--quorum", "1", "--max-staleness", "1000000"]
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
            first = SynchronizerClient(
                [sync.address],
                job="default",
                learner_id="bench-initial",
                incarnation=uuid.uuid4().hex,
                params=specs,
            )
            first.connect()
            first.wait_ack(first.send_initial(0, np.zeros(n, np.float32)), 60)
            owner = first.owners[0].address
            first.close()
            # Each update is a learner's own (one update per learner in a round).
            assert redis_server.process is not None
            servers = {"replica": sync.pid, "redis": redis_server.process.pid}
            mine, theirs = cores or (None, None)
            parts = [
                Client(
                    "ingest", i, owner, static, payload_bytes, sync.address, n, redis_server.url,
                    theirs,
                )
                for i in range(clients)
            ]  # fmt: skip
            return _run_clients(parts, seconds, servers, mine)
        finally:
            sync.stop()


def _update_chunks(n: int) -> tuple[tuple[bytes, ...], int]:
    """An int8 update of a fragment of n values in Ingest's chunks (its fields of each send
    left out), and its payload's bytes."""
    codec = codecs.by_name("int8")
    # An outer gradient's size against a fragment at zero: well inside the norm bound an
    # update meets before any other learner's has set the scale (owner.REFERENCE_RMS).
    values = (0.01 * np.random.default_rng(0).normal(size=n)).astype(np.float32)
    segments, _ = codecs.encode_segments(codec, values, 256, DEFAULT_MAX_CHUNK_BYTES)
    return tuple(static_chunks(0, segments, codec)), sum(len(s.data) for s in segments)


def _chunks(payload_bytes: int) -> tuple[bytes, ...]:
    """A payload of random bytes in the synchronizer's chunks."""
    payload = np.random.default_rng(0).bytes(payload_bytes)
    step = DEFAULT_MAX_CHUNK_BYTES
    return tuple(payload[i : i + step] for i in range(0, len(payload), step))


def measure_raw(
    workdir: Path,
    clients: int,
    seconds: float,
    payload_bytes: int,
    per_call: bool = False,
    summing: int = 0,
    cores: Cores = None,
) -> Measured:
    """Payload MB/s into the raw sink: each client streaming payloads on one call, IN_FLIGHT
    acks outstanding; or, `per_call`, IN_FLIGHT calls of one payload each at a time. With
    `summing` (a fragment's values), the sink sums what it is sent (`_Summer`), and the
    clients stream int8 updates of that many values, in Ingest's chunks, on one call each."""
    if per_call and summing:
        raise ValueError("the floor streams updates on one call each: per_call or summing")
    name = "raw-per-call" if per_call else "floor" if summing else "raw"
    workdir = workdir / name
    workdir.mkdir()
    port_file = workdir / "sink.ports"
    flags = ["--summing"] if summing else []
    sink = Child(
        "raw-sink",
        atoll_command("bench", "raw-sink", "--port-file", str(port_file), *flags),
        workdir / "raw-sink.log",
        child_env(1),
    ).start()
    try:
        address = f"127.0.0.1:{wait_for_file(port_file, sink)['grpc']}"
        kind = "raw_calls" if per_call else "raw"
        if summing:
            chunks, payload_bytes = _update_chunks(summing)
        else:
            chunks = _chunks(payload_bytes)
        mine, theirs = cores or (None, None)
        parts = [
            Client(kind, i, address, chunks, payload_bytes, cores=theirs) for i in range(clients)
        ]
        return _run_clients(parts, seconds, {"raw_sink": sink.pid}, mine)
    finally:
        sink.stop()


def measure_store(
    workdir: Path, clients: int, seconds: float, payload_bytes: int, cores: Cores = None
) -> float:
    with RedisServer(workdir / "redis-alone") as redis_server:
        chunks = _chunks(payload_bytes)
        mine, theirs = cores or (None, None)
        parts = [
            Client("store", i, redis_server.url, chunks, payload_bytes, cores=theirs)
            for i in range(clients)
        ]
        assert redis_server.process is not None
        return _run_clients(parts, seconds, {"redis": redis_server.process.pid}, mine).mb_s


def run(settings: SynchronizerBench) -> None:
    n = _values_for(settings.fragment_mib)
    payload_bytes = len(codecs.by_name("int8").encode(np.zeros(n, np.float32), 256))
    cores = split_cores(settings.pin)
    clients, seconds = settings.clients, settings.seconds
    with tempfile.TemporaryDirectory(prefix="atoll-bench-") as tmp:
        workdir = Path(tmp)
        ingest = measure_ingest(workdir, clients, seconds, n, cores=cores)
        merging = measure_ingest(workdir, clients, seconds, n, merging=True, cores=cores)
        raw = measure_raw(workdir, clients, seconds, payload_bytes, cores=cores)
        floor = measure_raw(workdir, clients, seconds, 0, summing=n, cores=cores)
        raw_calls = measure_raw(
            workdir, clients, seconds, payload_bytes, per_call=True, cores=cores
        )
        store = measure_store(workdir, clients, seconds, payload_bytes, cores=cores)
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
        "floor_mb_s": round(floor.mb_s, 2),
        "floor_ratio": round(floor.mb_s / raw.mb_s, 3) if raw.mb_s else 0.0,
        # The replica against the floor: what its admission path costs over hashing and
        # summing alone (rounds held open).
        "ingest_of_floor": round(ingest.mb_s / floor.mb_s, 3) if floor.mb_s else 0.0,
        "pinned": None
        if cores is None
        else {"servers": sorted(cores[0]), "clients": sorted(cores[1])},
        "store_mb_s": round(store, 2),
        "store_ratio": round(ingest.mb_s / store, 3) if store else 0.0,
        "cpu_ms_per_mb": {
            "held_open": ingest.cpu_ms_per_mb,
            "merging": merging.cpu_ms_per_mb,
            "raw": raw.cpu_ms_per_mb,
            "raw_per_call": raw_calls.cpu_ms_per_mb,
            "floor": floor.cpu_ms_per_mb,
        },
    }
    print(json.dumps(result, indent=2))
    if settings.json_path is not None:
        settings.json_path.write_text(json.dumps(result, indent=2) + "\n")
