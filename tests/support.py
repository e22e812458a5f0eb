"""Helpers that play learners in synchronizer tests: the real protocol client, numpy data."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from learner.client import SynchronizerClient
from services import codec as codecs
from services.gen.atoll.v1 import session_pb2
from services.layout import FragmentLayout, LeafSpec, fragment_layout
from services.wire import segments_header
from synchronizer import inspect
from synchronizer.store.keys import JobKeys

SPECS = [LeafSpec(f"blocks/{i}/w", (32, 32)) for i in range(4)] + [LeafSpec("embed", (16, 32))]


def layout(fragments: int) -> FragmentLayout:
    return fragment_layout(SPECS, fragments)


def client(
    addresses: Sequence[str], learner_id: str, *, heartbeat_s: float | None = 1.0, **kw: object
) -> SynchronizerClient:
    """A connected session for `learner_id`, which heartbeats every `heartbeat_s` as a
    training learner does (None: never, its lease lapses): only live learners' updates
    merge."""
    c = SynchronizerClient(
        list(addresses),
        job="default",
        learner_id=learner_id,
        incarnation=uuid.uuid4().hex,
        params=SPECS,
        max_backoff_s=0.5,
        **{"give_up_s": 60.0, **kw},  # type: ignore[arg-type]  # a test fails, not hangs
    )
    c.connect()
    if heartbeat_s is not None:
        _heartbeats(c, heartbeat_s)
    return c


def _heartbeats(c: SynchronizerClient, every_s: float) -> None:
    """Send `c`'s last heartbeat again every `every_s` until it closes, as a training
    learner's steps do: a test's own heartbeats (a step, finishing) stand until its next."""
    last: dict[str, Any] = {
        "step": 0, "step_time_ema_s": 0.0, "tokens_per_s": 0.0, "loss": 0.0, "eval_loss": 0.0
    }  # fmt: skip
    send = c.heartbeat

    def heartbeat(**fields: Any) -> None:
        last.clear()
        last.update(fields)
        send(**fields)

    def again() -> None:
        while not c.wait_closed(every_s):
            send(**last)

    c.heartbeat = heartbeat  # type: ignore[method-assign]
    threading.Thread(target=again, daemon=True).start()


def initial_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.normal(size=s.shape).astype(np.float32) for s in SPECS}


def initialize(c: SynchronizerClient, fragments: int, seed: int = 0) -> None:
    params = initial_params(seed)
    lay = layout(fragments)
    for p in range(fragments):
        c.wait_ack(c.send_initial(p, lay.gather(p, params)), 30)


def send_delta(
    c: SynchronizerClient,
    fragment: int,
    fragments: int,
    base_version: int,
    *,
    seed: int = 0,
    codec: str = "int8",
    c_steps: int = 10,
    c_tokens: int = 1000,
) -> int:
    n = layout(fragments).fragments[fragment].num_elements
    delta = np.random.default_rng(seed).normal(scale=0.01, size=n).astype(np.float32)
    enc = codecs.by_name(codec)
    segments, _ = codecs.encode_segments(enc, delta, 256, 2048)
    return c.send_update(
        fragment=fragment,
        payload=segments,
        codec=enc.wire,
        block_size=256,
        num_elements=n,
        base_version=base_version,
        c_steps=c_steps,
        c_tokens=c_tokens,
        compute_seconds=1.0,
    )


KEYS = JobKeys("default")


def commit_log(r: redis.Redis, fragment: int) -> list[dict[str, object]]:
    return inspect.commit_log(r, "default", fragment)


def version(r: redis.Redis, fragment: int) -> int:
    return int(r.hget(KEYS.frag(fragment), "version") or -1)  # type: ignore[arg-type]


def stats(r: redis.Redis, fragments: int) -> dict[str, float]:
    return inspect.stats(r, "default", fragments)


def pending(r: redis.Redis, fragments: int) -> list[str]:
    return inspect.pending(r, "default", fragments)


def value_name(r: redis.Redis, fragment: int) -> str | None:
    """The tensor-store name of a fragment's committed value (changes with every commit)."""
    return inspect.value_name(r, "default", fragment)


def chunks_for(
    fragment: int,
    payload: bytes | list[codecs.Segment],
    *,
    codec: int,
    block_size: int,
    num_elements: int,
    seq: int,
    base_version: int = 0,
    c_steps: int = 10,
    c_tokens: int = 1000,
    learner: str = "l0",
    incarnation: str = "",
) -> list[session_pb2.UpdateChunk]:
    """Hand-built update chunks, for tests that send what a correct learner never would: a
    whole payload goes as one segment of every value."""
    segments = [codecs.Segment(0, num_elements, payload)] if isinstance(payload, bytes) else payload
    header = segments_header(fragment, codec, block_size, num_elements, segments)
    out = []
    for i, seg in enumerate(segments):
        chunk = session_pb2.UpdateChunk(
            kind=session_pb2.UPDATE_KIND_OUTER_GRADIENT,
            seq=seq,
            base_version=base_version,
            c_steps=c_steps,
            c_tokens=c_tokens,
            compute_seconds=1.0,
            chunk_index=i,
            data=seg.data,
            value_offset=seg.offset,
            value_count=seg.count,
            learner_id=learner,
            incarnation=incarnation,
        )
        chunk.header.CopyFrom(header)
        out.append(chunk)
    return out


def commit_versions(c: SynchronizerClient, r: redis.Redis, fragment: int, count: int) -> None:
    """Send `count` updates of one fragment, each on the last, and wait for each commit."""
    import time

    for v in range(count):
        c.wait_ack(send_delta(c, fragment, 2, v, seed=v), 10, received=True)
        deadline = time.monotonic() + 15
        while version(r, fragment) != v + 1:
            assert time.monotonic() < deadline, f"version {v + 1} was not committed"
            time.sleep(0.05)
