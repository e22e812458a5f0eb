"""The synchronizer service over real gRPC and a real Redis."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from cluster.processes import synchronizer_child
from cluster.redis_server import RedisServer
from learner.client import SessionError, SynchronizerClient
from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2, synchronizer_pb2
from synchronizer import inspect
from synchronizer.store.control import Commit
from synchronizer.store.redis_store import open_store
from synchronizer.store.tensors import version_of
from tests import support
from tests.conftest import SpawnSynchronizer


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or (
            line.startswith(name + "{") and line.split(" ")[0] == name
        ):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def health(address: str, service: str = "atoll.v1.Synchronizer") -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def wait_until(predicate: object, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_health_serving_and_metrics(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer()
    wait_until(lambda: health(sync.address) == health_pb2.HealthCheckResponse.SERVING)
    text = urllib.request.urlopen(f"http://127.0.0.1:{sync.metrics_port}/metrics").read().decode()
    for name in (
        "atoll_learners_connected",
        "atoll_updates_rejected_total",
        "atoll_bytes_total",
        "atoll_redis_up",
    ):
        assert name in text
    # Redis's health is known from the first scrape (never 0 before a first check), and the
    # job's own counts, read from Redis, are there once the replica is ready.
    assert "atoll_redis_up 1.0" in text
    assert "atoll_job_useful_seconds_total 0.0" in text
    assert "atoll_job_updates_accepted_total 0.0" in text
    assert "atoll_job_learners_live 0.0" in text
    assert health(sync.address, "") == health_pb2.HealthCheckResponse.SERVING
    redis_server.stop()
    wait_until(
        lambda: health(sync.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
        what="NOT_SERVING after Redis stopped",
    )
    # Liveness does not follow Redis: a Redis outage must not get every replica restarted.
    assert health(sync.address, "") == health_pb2.HealthCheckResponse.SERVING
    # Its loops retry several times a second; the log says so once, not at each retry.
    time.sleep(3.0)

    def events() -> list[str]:
        return [json.loads(line)["event"] for line in sync.log_path.read_text().splitlines()]

    for retrying in ("watch_interrupted", "ownership_tick_failed"):
        assert events().count(retrying) == 1, (retrying, events().count(retrying))
    redis_server.start()
    wait_until(
        lambda: health(sync.address) == health_pb2.HealthCheckResponse.SERVING,
        what="SERVING after Redis came back",
    )
    wait_until(
        lambda: {"watch_resumed", "ownership_tick_resumed"} <= set(events()),
        what="the end of the outage logged",
    )


def test_log_lines_name_who_wrote_them(spawn_synchronizer: SpawnSynchronizer) -> None:
    """Bound once per session (structlog's contextvars), not passed at each call: a
    replica's lines name it and its job; a learner's session thread names its slot,
    incarnation and job."""
    sync = spawn_synchronizer()
    with capture_logs([structlog.contextvars.merge_contextvars]) as lines:
        client = support.client([sync.address], "l-named")
        sync.stop(timeout_s=10)

        # Only this client's line: clients of earlier tests may still be logging theirs.
        def mine(line: dict[str, Any]) -> bool:
            return line["event"] == "session_broken" and line.get("learner") == "l-named"

        wait_until(lambda: any(map(mine, lines)), what="the learner logging its broken session")
        client.close()
    broken = next(line for line in lines if mine(line))
    assert broken["learner"] == "l-named"
    assert broken["incarnation"] == client.incarnation
    assert broken["job"] == "default"
    for line in sync.log_path.read_text().splitlines():
        fields = json.loads(line)
        assert (fields["replica"], fields["job"]) == (sync.name, "default"), fields


def test_quorum_two_of_three_and_a_late_update_is_folded_into_the_next_round(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--quorum", "2", "--grace-seconds", "0")
    c0, c1, c2 = (support.client([sync.address], f"l{i}") for i in range(3))
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c0, 2)
        c0.wait_ack(support.send_delta(c0, 0, 2, 0, seed=1), 10, received=True)
        time.sleep(0.5)
        assert support.version(r, 0) == 0, "one update of K=2 must not merge"
        c2.wait_ack(support.send_delta(c2, 0, 2, 0, seed=3), 10, received=True)
        wait_until(lambda: support.version(r, 0) == 1, what="the round to merge at quorum")
        assert support.version(r, 0) == 1
        first = support.commit_log(r, 0)[0]
        assert sorted(first["learners"]) == ["l0", "l2"]  # type: ignore[arg-type]
        # c1 is late: its update (base version 0) arrives after the round merged.
        c1.wait_ack(support.send_delta(c1, 0, 2, 0, seed=2), 10, received=True)
        time.sleep(0.3)
        assert support.version(r, 0) == 1, "the late update alone is below quorum"
        c0.wait_ack(support.send_delta(c0, 0, 2, 1, seed=4), 10, received=True)
        wait_until(lambda: support.version(r, 0) == 2, what="second round")
        second = support.commit_log(r, 0)[1]
        assert sorted(second["learners"]) == ["l0", "l1"]  # type: ignore[arg-type]
        assert sorted(second["base_versions"]) == [0, 1]  # type: ignore[arg-type]
        assert support.stats(r, 2)["stale_folded"] == 1
    finally:
        for c in (c0, c1, c2):
            c.close()


def test_rounds_stop_waiting_for_a_finishing_learner_with_nothing_more_for_them(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    """A learner past its last step says which fragments it will still send; a round that
    no live learner can add to any more merges at once, not after its grace window."""
    sync = spawn_synchronizer("--fragments", "2", "--quorum", "1", "--grace-seconds", "30")
    c0, c1, c2 = (support.client([sync.address], f"l{i}") for i in range(3))
    r = redis.Redis(port=redis_server.port)

    def finishing(c: SynchronizerClient, still: list[int]) -> None:
        c.heartbeat(
            step=5,
            step_time_ema_s=0.1,
            tokens_per_s=1.0,
            loss=1.0,
            eval_loss=1.0,
            still_to_send=still,
        )

    try:
        support.initialize(c0, 2)
        c0.wait_ack(support.send_delta(c0, 0, 2, 0, seed=1), 10, received=True)
        time.sleep(1.0)
        assert support.version(r, 0) == 0, "quorum reached: the 30 s grace window waits"
        finishing(c1, [1])  # nothing more for fragment 0
        time.sleep(1.0)
        assert support.version(r, 0) == 0, "l2 is still training: it may still send"
        finishing(c2, [0])  # l2 will still send fragment 0
        time.sleep(1.0)
        assert support.version(r, 0) == 0, "l2 said it will still send fragment 0"
        finishing(c2, [])  # all sent
        wait_until(lambda: support.version(r, 0) == 1, timeout=5, what="merge without grace")
        assert support.commit_log(r, 0)[0]["learners"] == ["l0"]
        assert support.version(r, 1) == 0, "fragment 1 has no update: nothing to merge"
    finally:
        for c in (c0, c1, c2):
            c.close()


def _ones_for_fragment_1(seq: int, incarnation: str) -> tuple[bytes, list[session_pb2.UpdateChunk]]:
    """An int8 update of all ones for fragment 1 of 2 from l0's `incarnation`, and its
    chunks with this seq."""
    n = support.layout(2).fragments[1].num_elements
    segments, _ = codecs.encode_segments(codecs.by_name("int8"), np.ones(n, np.float32), 256, 1024)
    chunks = support.chunks_for(
        1,
        segments,
        codec=fragment_pb2.CODEC_INT8,
        block_size=256,
        num_elements=n,
        seq=seq,
        incarnation=incarnation,
    )
    return b"".join(s.data for s in segments), chunks


def test_a_retried_update_is_acknowledged_and_not_applied_twice(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--grace-seconds", "0")
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c, 2)
        _, chunks = _ones_for_fragment_1(seq=500, incarnation=c.incarnation)
        assert c.ingest_raw(chunks).status == session_pb2.ACK_STATUS_RECEIVED
        wait_until(lambda: support.version(r, 1) == 1)
        theta = support.value_name(r, 1)
        assert c.ingest_raw(chunks).status == session_pb2.ACK_STATUS_DUPLICATE
        time.sleep(0.5)
        assert support.version(r, 1) == 1
        assert support.value_name(r, 1) == theta
        assert [e["uids"] for e in support.commit_log(r, 1)] == [[f"l0/{c.incarnation}/500"]]
        assert support.stats(r, 2)["updates_accepted"] == 1
        assert metric(sync.metrics_port, "atoll_updates_duplicate_total") == 1
    finally:
        c.close()


def test_a_retry_of_a_still_pending_update_keeps_it_and_it_merges_once(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    # Sync mode with two learners: l0's update waits for l1's, and l0 retries it meanwhile
    # (as after a reconnect to another replica). The retry once deleted the pending update's
    # payload, so the acknowledged update was never merged.
    sync = spawn_synchronizer("--fragments", "2", "--mode", "sync", "--quorum", "2")
    c0, c1 = (support.client([sync.address], f"l{i}") for i in range(2))
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c0, 2)
        _, chunks = _ones_for_fragment_1(seq=700, incarnation=c0.incarnation)
        assert c0.ingest_raw(chunks).status == session_pb2.ACK_STATUS_RECEIVED
        assert c0.ingest_raw(chunks).status == session_pb2.ACK_STATUS_RECEIVED
        uid = f"l0/{c0.incarnation}/700"
        assert support.pending(r, 2) == [uid], "received once, pending once"
        # A retry with other bytes under the same seq is refused, and changes nothing.
        _, other = _ones_for_fragment_1(seq=700, incarnation=c0.incarnation)
        other[-1].data = other[-1].data[:-1] + bytes([other[-1].data[-1] ^ 1])
        other = support.chunks_for(
            1,
            [codecs.Segment(c.value_offset, c.value_count, c.data) for c in other],
            codec=fragment_pb2.CODEC_INT8,
            block_size=256,
            num_elements=other[0].header.num_elements,
            seq=700,
            incarnation=c0.incarnation,
        )
        refused = c0.ingest_raw(other)
        assert refused.status == session_pb2.ACK_STATUS_REJECTED
        assert "other bytes" in refused.reason
        seq1 = support.send_delta(c1, 1, 2, 0, seed=5)
        c1.wait_ack(seq1, 10, received=True)
        wait_until(lambda: support.version(r, 1) == 1, what="the round of both learners")
        assert sorted(support.commit_log(r, 1)[0]["uids"]) == sorted(  # type: ignore[arg-type]
            [uid, f"l1/{c1.incarnation}/{seq1}"]
        )
        assert support.pending(r, 2) == []
        assert c1.wait_ack(seq1, 10).status == session_pb2.ACK_STATUS_COMMITTED
    finally:
        c0.close()
        c1.close()


N0 = support.layout(2).fragments[0].num_elements


def _int8(n: int = N0, value: float = 1.0) -> bytes:
    return codecs.by_name("int8").encode(np.full(n, value, np.float32), 256)


def _flip(chunks: list[session_pb2.UpdateChunk]) -> list[session_pb2.UpdateChunk]:
    chunks[-1].data = chunks[-1].data[:-1] + bytes([chunks[-1].data[-1] ^ 0x01])
    return chunks


def _segments_int8(seq: int) -> list[session_pb2.UpdateChunk]:
    segments, _ = codecs.encode_segments(codecs.by_name("int8"), np.ones(N0, np.float32), 256, 512)
    return support.chunks_for(0, segments, num_elements=N0, seq=seq, **INT8)


def _nan_fp32() -> bytes:
    v = np.zeros(N0, np.float32)
    v[5] = np.nan
    return v.tobytes()


INT8 = {"codec": fragment_pb2.CODEC_INT8, "block_size": 256}
BAD_INPUTS = {
    "unknown_fragment": (
        lambda s: support.chunks_for(7, _int8(), num_elements=N0, seq=s, **INT8),
        "does not exist",
    ),
    "shape_mismatch": (
        lambda s: support.chunks_for(0, _int8(N0 - 1), num_elements=N0 - 1, seq=s, **INT8),
        "holds",
    ),
    "bad_codec": (
        lambda s: support.chunks_for(
            0, _int8(), codec=fragment_pb2.CODEC_UNSPECIFIED, block_size=256, num_elements=N0, seq=s
        ),
        "not supported",
    ),
    "bad_codec_params": (
        lambda s: support.chunks_for(
            0, _int8(), codec=fragment_pb2.CODEC_INT8, block_size=0, num_elements=N0, seq=s
        ),
        "block_size 0",
    ),
    "checksum": (
        lambda s: _flip(support.chunks_for(0, _int8(), num_elements=N0, seq=s, **INT8)),
        "checksum",
    ),
    "out_of_order": (
        lambda s: _segments_int8(s)[::-1],
        "out of order",
    ),
    "non_finite": (
        lambda s: support.chunks_for(
            0, _nan_fp32(), codec=fragment_pb2.CODEC_FP32, block_size=0, num_elements=N0, seq=s
        ),
        "NaN",
    ),
    "stale": (
        lambda s: support.chunks_for(0, _int8(), num_elements=N0, seq=s, base_version=99, **INT8),
        "newer than",
    ),
}
REASON = {"bad_codec_params": "bad_codec", "stale": "bad_request"}


@pytest.fixture
def bad_input_setup(spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer) -> object:
    sync = spawn_synchronizer("--fragments", "2", "--grace-seconds", "0")
    c = support.client([sync.address], "l0")
    support.initialize(c, 2)
    yield sync, c, redis.Redis(port=redis_server.port)
    c.close()


def test_each_bad_input_is_refused_with_a_reason_and_changes_nothing(
    bad_input_setup: object,
) -> None:
    sync, c, r = bad_input_setup  # type: ignore[misc]

    def state() -> object:
        return [
            (r.hgetall(support.KEYS.frag(p)), r.hgetall(support.KEYS.round(p))) for p in range(2)
        ]

    before = state()
    for seq, (case, (build, words)) in enumerate(BAD_INPUTS.items(), start=100):
        reason = REASON.get(case, case)
        counted = metric(sync.metrics_port, f'atoll_updates_rejected_total{{reason="{reason}"}}')
        chunks = build(seq)
        for chunk in chunks:  # from l0's session, as a learner sends
            chunk.incarnation = c.incarnation
        ack = c.ingest_raw(chunks)
        assert ack.status == session_pb2.ACK_STATUS_REJECTED, case
        assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], case
        assert words in ack.reason, (case, ack.reason)
        after = metric(sync.metrics_port, f'atoll_updates_rejected_total{{reason="{reason}"}}')
        assert after == counted + 1, case
    time.sleep(0.5)
    assert state() == before
    assert support.pending(r, 2) == []
    # The session survived every refusal: a good update still goes through.
    ack = c.wait_ack(support.send_delta(c, 0, 2, 0), 10, received=True)
    assert ack.status == session_pb2.ACK_STATUS_RECEIVED


def test_stale_updates_are_refused(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--grace-seconds", "0", "--max-staleness", "1")
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c, 2)
        support.commit_versions(c, r, 0, 3)
        ack = c.wait_ack(support.send_delta(c, 0, 2, 0), 10, received=True)
        assert ack.status == session_pb2.ACK_STATUS_REJECTED
        assert ack.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "fetch the fragment" in ack.reason
        assert support.version(r, 0) == 3
    finally:
        c.close()


def test_a_follower_gets_the_deltas_since_the_version_it_holds_and_bad_follows_are_refused(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--grace-seconds", "0")
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    channel = grpc.insecure_channel(sync.address)
    follow = channel.unary_stream(
        "/atoll.v1.Synchronizer/Follow",
        request_serializer=synchronizer_pb2.FollowRequest.SerializeToString,
        response_deserializer=session_pb2.SynchronizerMessage.FromString,
    )

    def following(held: dict[int, int]) -> synchronizer_pb2.FollowRequest:
        return synchronizer_pb2.FollowRequest(job="default", held=held, learner_id="w")

    try:
        support.initialize(c, 2)
        support.commit_versions(c, r, 0, 3)

        def first_chunks(
            held: dict[int, int], newest: int
        ) -> list[fragment_pb2.GlobalFragmentChunk]:
            """The first chunk of each value pushed, until fragment 0's `newest` one."""
            call = follow(following(held), timeout=10)
            out = []
            for message in call:
                chunk = message.fragment
                if chunk.chunk_index == 0:
                    out.append(chunk)
                if chunk.header.fragment == 0 and chunk.version == newest:
                    break
            call.cancel()
            return out

        # One holding version 1 gets the deltas onto it, in order; nothing of fragment 1,
        # which did not move since.
        got = first_chunks({0: 1, 1: 0}, 3)
        assert [(g.header.fragment, g.version, g.delta, g.base_version) for g in got] == [
            (0, 2, True, 1),
            (0, 3, True, 2),
        ]
        # One holding a version the job never made, or nothing of fragment 0, is followed
        # from the current version on: nothing comes until the next commit, a delta onto it.
        for held in ({0: 99}, {}):
            call = follow(following(held), timeout=10)
            # The call is followed before the commit (the replica counts it; the learner
            # follows it too).
            wait_until(lambda: metric(sync.metrics_port, "atoll_followers") == 2)
            now = support.version(r, 0)
            c.wait_ack(support.send_delta(c, 0, 2, now, seed=now), 10, received=True)
            first = next(iter(call)).fragment
            assert (first.header.fragment, first.version, first.delta, first.base_version) == (
                0,
                now + 1,
                True,
                now,
            )
            call.cancel()
        # Bad follows are refused with what to do, and the replica serves on.
        refusals = [
            (
                synchronizer_pb2.FollowRequest(job="other", learner_id="w"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "serves job 'default', not 'other'",
            ),
            (
                synchronizer_pb2.FollowRequest(job="default"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "names the learner slot following",
            ),
            (
                following({7: 1}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "fragments [7] do not exist",
            ),
            (
                following({0: 1, 1: 1, 2: 1}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "at most the job's 2 fragments",
            ),
        ]
        for request, code, words in refusals:
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(follow(request, timeout=10)))
            assert refused.value.code() == code
            assert words in (refused.value.details() or "")
        assert [g.version for g in first_chunks({0: 3, 1: 0}, 5)] == [4, 5]
        # A slot's third Follow call, on a connection of its own (each connection may
        # have two), ends its oldest (ABORTED, saying why); the two newest are served on,
        # and other slots' calls are untouched.
        channels = [
            grpc.insecure_channel(sync.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(3)
        ]
        follows = [
            ch.unary_stream(
                "/atoll.v1.Synchronizer/Follow",
                request_serializer=synchronizer_pb2.FollowRequest.SerializeToString,
                response_deserializer=session_pb2.SynchronizerMessage.FromString,
            )
            for ch in channels
        ]
        # Only l0's own call is left once the calls cancelled above have ended here.
        wait_until(lambda: metric(sync.metrics_port, "atoll_followers") == 1)
        calls = []
        for n, f in enumerate(follows[:2]):  # one after the other: the oldest is calls[0]
            calls.append(f(following({}), timeout=30))
            wait_until(lambda n=n: metric(sync.metrics_port, "atoll_followers") == n + 2)
        calls.append(follows[2](following({}), timeout=30))
        with pytest.raises(grpc.RpcError) as superseded:
            next(iter(calls[0]))
        assert superseded.value.code() == grpc.StatusCode.ABORTED
        assert "newer Follow calls of learner slot 'w'" in (superseded.value.details() or "")
        wait_until(lambda: metric(sync.metrics_port, "atoll_followers") == 3)
        now = support.version(r, 0)
        c.wait_ack(support.send_delta(c, 0, 2, now, seed=now), 10, received=True)
        for call in calls[1:]:
            assert next(iter(call)).fragment.version == now + 1
            call.cancel()
        for ch in channels:
            ch.close()
        c.check()  # l0's own session and Follow call went on
    finally:
        channel.close()
        c.close()


def test_a_different_model_or_job_is_refused_at_hello(
    spawn_synchronizer: SpawnSynchronizer,
) -> None:
    sync = spawn_synchronizer("--fragments", "2")
    c = support.client([sync.address], "l0")
    try:
        from learner.client import SynchronizerClient
        from services.layout import LeafSpec

        other = SynchronizerClient(
            [sync.address],
            job="default",
            learner_id="x",
            incarnation="i",
            params=[LeafSpec("w", (3, 3)), LeafSpec("v", (3,))],
        )
        with pytest.raises(SessionError, match="model differs"):
            other.connect()
        wrong_job = SynchronizerClient(
            [sync.address], job="other", learner_id="y", incarnation="j", params=support.SPECS
        )
        with pytest.raises(SessionError, match="serves job"):
            wrong_job.connect()
    finally:
        c.close()


def test_redis_restarted_with_aof_loses_no_committed_version(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        sync = synchronizer_child(
            tmp_path, server.url, "sync-0", ["--fragments", "2", "--grace-seconds", "0"]
        ).start_and_wait()
        c = support.client([sync.address], "l0")
        r = redis.Redis(port=server.port)
        try:
            support.initialize(c, 2)
            support.commit_versions(c, r, 0, 3)
            theta = support.value_name(r, 0)
            server.restart(signal.SIGKILL)
            r = redis.Redis(port=server.port)
            assert support.version(r, 0) == 3
            assert support.value_name(r, 0) == theta
            assert [e["version"] for e in support.commit_log(r, 0)] == [1, 2, 3]
            # The replica carries on against the restarted Redis.
            c.wait_ack(support.send_delta(c, 0, 2, 3, seed=9), 30, received=True)
            wait_until(lambda: support.version(r, 0) == 4, timeout=30, what="commit after restart")
        finally:
            c.close()
            sync.stop()


@pytest.mark.parametrize("downlink", ["int8", "int4"])
def test_learners_rebuild_every_global_version_bit_for_bit_from_compressed_deltas(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer, downlink: str
) -> None:
    sync = spawn_synchronizer(
        "--fragments", "2", "--grace-seconds", "0", "--downlink-codec", downlink
    )
    c0, c1 = (support.client([sync.address], f"l{i}") for i in range(2))
    r = redis.Redis(port=redis_server.port)
    rounds = 25
    try:
        support.initialize(c0, 2)
        for v in range(rounds):  # each update is its own round (quorum 1)
            for i, c in enumerate((c0, c1)):
                c.wait_ack(
                    support.send_delta(c, v % 2, 2, support.version(r, v % 2), seed=v * 2 + i),
                    10,
                    received=True,
                )
            wait_until(lambda v=v: support.version(r, v % 2) >= v // 2 + 1, what=f"round {v}")
        # Every update merged: the job's versions no longer move.
        wait_until(
            lambda: support.pending(r, 2) == [],
            what="every update to be merged",
        )
        final = {p: support.version(r, p) for p in range(2)}
        for c in (c0, c1):
            wait_until(
                lambda c=c: all(c.held.versions().get(p, -1) == final[p] for p in range(2)),
                what="every version to reach the learner",
            )
            for p in range(2):
                held = c.held.values[p][1]
                value = inspect.global_value(r, "default", p, str(sync.log_path.parent / "tensors"))
                theta = np.frombuffer(value, "<f4")  # type: ignore[arg-type]
                assert held.tobytes() == theta.tobytes(), (p, downlink, np.abs(held - theta).max())
        # What came down were deltas: far fewer bytes than a float32 copy per version.
        full = sum(support.layout(2).fragments[p].num_elements * 4 for p in range(2))
        versions = sum(final.values())
        assert versions >= rounds
        assert c1.stats.bytes_down < 0.5 * full * versions
    finally:
        for c in (c0, c1):
            c.close()


def test_merges_write_deltas_and_a_keyframe_every_eighth_version_that_rebuilds_the_value(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    """A merge writes its delta; the value, optimizer state and residual only with every
    VALUE_EVERY-th version (values.py), which the next commit names. Whatever the pointer
    names is in the store, the committed value is that keyframe plus the deltas since (what
    the commit log's checksum says), and old objects are collected."""
    sync = spawn_synchronizer("--fragments", "1", "--grace-seconds", "0")
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    rounds = 21
    root = sync.log_path.parent / "tensors"
    folder = root / "default" / "fragment-00000"
    try:
        support.initialize(c, 1)
        for v in range(rounds):  # each update is its own round (quorum 1)
            c.wait_ack(support.send_delta(c, 0, 1, support.version(r, 0), seed=v), 10)
            wait_until(lambda v=v: support.version(r, 0) >= v + 1, what=f"version {v + 1}")
        frag = {
            str(k, "utf-8"): str(v, "utf-8") for k, v in r.hgetall(support.KEYS.frag(0)).items()
        }
        log = support.commit_log(r, 0)
        assert [int(str(e["version"])) for e in log][-1] == rounds
        named = [frag["value"], *frag["state"].split(",")]
        assert all((root / name).exists() for name in named), named
        # Version 16 was a keyframe, written after its commit and named from version 17 on.
        assert {version_of(n) for n in named} == {16}, named
        assert [version_of(str(e["value"])) for e in log][15:] == [8, 16, 16, 16, 16, 16]
        value = inspect.global_value(r, "default", 0, str(root))
        assert value is not None
        assert codecs.checksum(value) == int(str(log[-1]["checksum"]))

        def kept(kind: str) -> list[int]:
            return sorted(version_of(p.name) for p in folder.glob(f"*.{kind}"))

        # Collected: keyframes but the two last named, and deltas before the older one.
        wait_until(lambda: kept("value") == [8, 16], what="old keyframes collected")
        wait_until(lambda: kept("delta") == list(range(9, rounds + 1)), what="old deltas collected")
    finally:
        c.close()


def test_a_joiner_holding_the_initial_values_gets_them_confirmed_not_sent(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--quorum", "2", "--grace-seconds", "0")
    c0, c1 = (support.client([sync.address], f"l{i}") for i in range(2))
    lay = support.layout(2)
    mine = {p: lay.gather(p, support.initial_params(0)) for p in range(2)}
    try:
        support.initialize(c0, 2)
        before = c1.stats.bytes_down
        same = c1.fetch_state(held=mine)
        unchanged_bytes = c1.stats.bytes_down - before
        for g in same:
            np.testing.assert_array_equal(g.values, mine[g.fragment])
        # A different initialization (another seed) is not the job's: sent whole.
        other = {p: lay.gather(p, support.initial_params(1)) for p in range(2)}
        before = c1.stats.bytes_down
        sent = c1.fetch_state(held=other)
        whole_bytes = c1.stats.bytes_down - before
        for g in sent:
            np.testing.assert_array_equal(g.values, mine[g.fragment])
        assert unchanged_bytes < 200 < 4 * sum(v.size for v in mine.values()) <= whole_bytes
        # Once a fragment has moved, the initial values no longer match it.
        c0.wait_ack(support.send_delta(c0, 0, 2, 0, seed=1), 10, received=True)
        c1.wait_ack(support.send_delta(c1, 0, 2, 0, seed=2), 10, received=True)
        r = redis.Redis(port=redis_server.port)
        wait_until(lambda: support.version(r, 0) == 1, what="fragment 0 to merge")
        moved = {g.fragment: g for g in c1.fetch_state(held=mine)}
        assert moved[0].version == 1
        assert not np.array_equal(moved[0].values, mine[0])
        np.testing.assert_array_equal(moved[1].values, mine[1])
    finally:
        for c in (c0, c1):
            c.close()


def test_one_joining_learner_at_a_time_is_asked_for_the_initial_parameters(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2")
    first = support.client([sync.address], "l0")
    second = support.client([sync.address], "l1")
    try:
        assert first.welcome is not None
        assert second.welcome is not None
        assert not first.welcome.initialized
        assert first.welcome.initializer
        assert not second.welcome.initialized
        assert not second.welcome.initializer  # l0 holds the claim: l1 waits for its values
        support.initialize(first, 2)
        later = support.client([sync.address], "l2")
        assert later.welcome is not None
        assert later.welcome.initialized
        assert not later.welcome.initializer
        later.close()
    finally:
        first.close()
        second.close()


# One update as `ControlStore.receive` records it: learner l0's first, of its first hello.
RECEIVED: dict[str, object] = {
    "learner": "l0",
    "incarnation": "i0",
    "seq": 1,
    "checksum": 7,
    "base_version": 0,
    "max_staleness": 2,
    "record": {"weight": 1.0},
    "generation": 1,
}


def test_a_resend_whose_round_died_with_its_owner_is_taken_however_far_the_fragment_moved(
    redis_server: RedisServer,
) -> None:
    """An update received by an owner that then died is sent again to the next owner; the
    fragment may have moved past the staleness bound meanwhile (the other learners' rounds
    went on). It was admitted once, so it is taken (received, to merge), where a new update
    as stale is refused: otherwise an acknowledged update would never be merged."""

    async def go() -> tuple[str, str, str]:
        store = open_store(redis_server.url, "default")
        try:
            await store.init_fragment(0, "value", ("state0",))
            update = RECEIVED
            await store.redis.set(support.KEYS.owner(0), "replica-a 1")
            first, _ = await store.receive(0, "replica-a", 1, **update)  # type: ignore[arg-type]
            # replica-a dies; replica-b owns the fragment, which moves on 5 versions
            await store.redis.set(support.KEYS.owner(0), "replica-b 2")
            await store.redis.hset(support.KEYS.frag(0), "version", 5)
            again, _ = await store.receive(0, "replica-b", 2, **update)  # type: ignore[arg-type]
            fresh, _ = await store.receive(0, "replica-b", 2, **{**update, "seq": 2})  # type: ignore[arg-type]
            return first, again, fresh
        finally:
            await store.redis.aclose()

    assert asyncio.run(go()) == ("received", "received", "stale")


def test_a_new_incarnation_counts_the_updates_its_predecessor_can_no_longer_send(
    redis_server: RedisServer,
) -> None:
    """A learner killed with updates received but not committed leaves them to nobody once
    its next incarnation's first update replaces its records: one whose round died with an
    earlier owner is counted as dropped with its sender at once; one of the current round
    is kept apart until its round commits (then let go) or dies with its owner (then
    counted). What `atoll up`'s report reads, as `atoll check` reads the tape."""
    keys, update = support.KEYS, RECEIVED

    def commit(epoch: int, version: int, merged: list[tuple[str, str, int]]) -> Commit:
        return Commit(0, "replica-b", epoch, version, "v", ("s",), "d", merged, 1.0, 1.0, 0, {})

    async def go() -> list[tuple[list[str], float, set[bytes]]]:
        store = open_store(redis_server.url, "default")
        sync = redis.Redis.from_url(redis_server.url)

        def seen() -> tuple[list[str], float, set[bytes]]:
            dropped = inspect.stats(sync, "default", 1).get("updates_dropped", 0.0)
            return inspect.dropped(sync, "default", 1), dropped, sync.smembers(keys.orphans(0))

        try:
            await store.init_fragment(0, "value", ("state0",))
            await store.redis.set(keys.owner(0), "replica-a 1")
            await store.redis.set(keys.epoch(0), 1)
            await store.receive(0, "replica-a", 1, **update)  # type: ignore[arg-type]
            # replica-a dies; replica-b owns the fragment; i0 sends seq 2 and 3 there, dies
            await store.redis.set(keys.owner(0), "replica-b 2")
            await store.redis.set(keys.epoch(0), 2)
            for seq in (2, 3):
                await store.receive(0, "replica-b", 2, **{**update, "seq": seq})  # type: ignore[arg-type]
            states = [seen()]
            again = {**update, "incarnation": "i1", "generation": 2}
            status, _ = await store.receive(0, "replica-b", 2, **again)  # type: ignore[arg-type]
            assert status == "received"
            states.append(seen())
            # seq 2's round commits; then replica-b dies with seq 3 (and i1's) in its round
            assert (await store.commit(commit(2, 0, [("l0", "i0", 2)])))[0] == "committed"
            states.append(seen())
            await store.redis.delete(keys.owner(0))
            assert (await store.own("acquire", 0, "replica-c", ttl_s=5.0))[0] == "owned"
            states.append(seen())
            return states
        finally:
            sync.close()
            await store.redis.aclose()

    assert asyncio.run(go()) == [
        (["l0/i0/1"], 0.0, set()),  # still on record: the report finds it there
        ([], 1.0, {b"l0/i0/2", b"l0/i0/3"}),  # replaced: counted, or kept apart
        ([], 1.0, {b"l0/i0/3"}),  # committed: no longer an orphan
        # Its round died with its owner: counted. i1's own is on record for the report, which
        # counts it only if i1 did not live to finish (it sends it again).
        (["l0/i1/1"], 2.0, set()),
    ]


def test_a_learner_joining_once_the_budget_is_spent_learns_it_from_its_welcome(
    spawn_synchronizer: SpawnSynchronizer,
) -> None:
    # A slot brought back after the end (a restarted pod) must not train a step and send
    # it: the job's status comes with the welcome, before any heartbeat of its own.
    sync = spawn_synchronizer(
        "--fragments", "2", "--grace-seconds", "0", "--job-steps", "6", "--max-steps-per-s", "1000"
    )  # fmt: skip
    c = support.client([sync.address], "l0")
    try:
        support.initialize(c, 2)
        assert c.welcome is not None
        assert c.welcome.status.job_steps == 6
        assert not c.welcome.status.finish
        c.heartbeat(step=6, step_time_ema_s=0.1, tokens_per_s=10.0, loss=1.0, eval_loss=0.0)
        wait_until(lambda: c.job_finished, what="the budget spent")
        late = support.client([sync.address], "l1")
        try:
            assert late.job_finished
            assert late.welcome is not None
            assert late.welcome.status.steps_done >= 6
        finally:
            late.close()
    finally:
        c.close()
