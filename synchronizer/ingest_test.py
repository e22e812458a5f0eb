"""The Ingest call against the in-memory control store: an update checked chunk by chunk,
summed into its owner's round and recorded, or refused with a reason and taken out again
(a real Redis and real learners: tests/)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services import codec as codecs
from services.config import JobConfig
from services.gen.atoll.v1 import session_pb2
from services.layout import LeafSpec, fragment_layout
from services.tape import Tape
from services.wire import segments_header
from synchronizer.core.admission import Arrived
from synchronizer.ingest import Ingest
from synchronizer.owner import FragmentOwner
from synchronizer.ownership import Ownership
from synchronizer.store.memory_store import MemoryControlStore
from synchronizer.store.tensors import TensorStore

SIZE = 1000
LAYOUT = fragment_layout([LeafSpec("w", (SIZE,), "float32")], 1)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Context:
    """What Ingest reads of its call: its peer; abort raises."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def _job(
    tmp_path: Path, owned: bool = True
) -> tuple[Ingest, FragmentOwner, MemoryControlStore]:
    """A job of one fragment whose first values are in, owned by this replica ("r", epoch
    1) unless not `owned`, with learner slot "a" live as incarnation "i"."""
    config = JobConfig(job="job", fragments=1)
    store = MemoryControlStore("job")
    tensors, tape = TensorStore(str(tmp_path)), Tape(None, "r")
    ownership = Ownership(
        replica="r",
        address="127.0.0.1:1",
        config=config,
        store=store,
        tensors=tensors,
        tape=tape,
        layout=lambda: LAYOUT,
    )
    assert await store.own("acquire", 0, "r", ttl_s=60) == ("owned", 1)
    owner = FragmentOwner(
        fragment=0,
        size=SIZE,
        segments=(SIZE,),
        epoch=1,
        replica="r",
        config=config,
        store=store,
        tensors=tensors,
        tape=tape,
        fragments=1,
    )
    value, state = await owner.initial_state(np.zeros(SIZE, np.float32))
    assert await store.init_fragment(0, value, state)
    await owner.load(await store.pointer(0))
    if owned:
        ownership.owned[0] = owner
    assert (await store.hello("[]", "a", "i", 60, 0, True)).status == "ok"
    return Ingest(config, store, ownership, lambda: LAYOUT), owner, store


def _update(x: np.ndarray, seq: int = 1, learner: str = "a") -> list[Arrived]:
    """An outer gradient's chunks as a learner sends them (fp32, 400 bytes a chunk)."""
    codec = codecs.by_name("fp32")
    segments = codecs.encode_segments(codec, x, 0, 400)[0]
    header = segments_header(0, codec.wire, 0, SIZE, segments)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    return [
        Arrived(
            session_pb2.UpdateChunk(
                header=header,
                kind=session_pb2.UPDATE_KIND_OUTER_GRADIENT,
                seq=seq,
                base_version=0,
                c_steps=10,
                c_tokens=100,
                compute_seconds=1.0,
                chunk_index=i,
                value_offset=s.offset,
                value_count=s.count,
                tensor_norms=[norm],
                learner_id=learner,
                incarnation="i",
            ),
            memoryview(bytes(s.data)),
        )
        for i, s in enumerate(segments)
    ]


async def _call(ingest: Ingest, chunks: list[Arrived]) -> session_pb2.Ack:
    async def stream() -> AsyncIterator[Arrived]:
        for chunk in chunks:
            yield chunk

    return await ingest.Ingest(stream(), Context())  # type: ignore[arg-type]


X = np.random.default_rng(0).normal(scale=0.01, size=SIZE).astype(np.float32)


def test_an_update_is_summed_into_its_owners_round_and_recorded(tmp_path: Path) -> None:
    async def run() -> None:
        ingest, owner, store = await _job(tmp_path)
        ack = await _call(ingest, _update(X))
        assert (ack.status, ack.seq, ack.version, ack.epoch) == (
            session_pb2.ACK_STATUS_RECEIVED,
            1,
            0,
            1,
        )
        assert [u.uid for u in owner.open.members] == ["a/i/1"]
        assert await store.pending(1) == ["a/i/1"]
        again = await _call(ingest, _update(X))  # a retry of the same bytes
        assert again.status == session_pb2.ACK_STATUS_RECEIVED
        owner.close()

    asyncio.run(run())


def test_a_corrupted_update_is_refused_and_taken_out_of_the_round(tmp_path: Path) -> None:
    async def run() -> None:
        ingest, owner, store = await _job(tmp_path)
        chunks = _update(X)
        chunk, data = chunks[1]
        flipped = bytearray(data)
        flipped[0] ^= 1
        chunks[1] = Arrived(chunk, memoryview(bytes(flipped)))
        ack = await _call(ingest, chunks)
        assert ack.status == session_pb2.ACK_STATUS_REJECTED
        assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "checksum" in ack.reason
        assert not owner.open.members
        assert await store.pending(1) == []
        held = owner.sums.current.provisional  # summed apart: no weight was known
        assert held is not None
        np.testing.assert_array_equal(held.total, np.zeros(SIZE, np.float32))
        assert (await store.stats(1))["updates_rejected"] == 1
        owner.close()

    asyncio.run(run())


def test_an_update_from_a_slot_without_a_live_session_is_refused_as_retryable(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        ingest, owner, _ = await _job(tmp_path)
        ack = await _call(ingest, _update(X, learner="nobody"))
        assert ack.status == session_pb2.ACK_STATUS_REJECTED
        assert ack.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "no live session" in ack.reason
        owner.close()

    asyncio.run(run())


def test_an_update_for_a_fragment_this_replica_does_not_own_is_sent_elsewhere(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        ingest, owner, _ = await _job(tmp_path, owned=False)
        with pytest.raises(Aborted) as aborted:
            await _call(ingest, _update(X))
        assert aborted.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not the owner of fragment 0" in str(aborted.value)
        owner.close()

    asyncio.run(run())


def test_calls_over_the_slots_limit_are_ended_and_counted_out_again(tmp_path: Path) -> None:
    async def run() -> None:
        ingest, owner, _ = await _job(tmp_path)
        ingest.in_flight[("a", 0)] = ingest.max_per_slot  # the slot's calls, all in flight
        with pytest.raises(Aborted) as aborted:
            await _call(ingest, _update(X))
        assert aborted.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-ingest-per-slot" in str(aborted.value)
        assert ingest.in_flight == {("a", 0): ingest.max_per_slot}  # the opening counted out
        del ingest.in_flight[("a", 0)]
        ack = await _call(ingest, _update(X))
        assert ack.status == session_pb2.ACK_STATUS_RECEIVED
        assert not ingest.in_flight
        owner.close()

    asyncio.run(run())
