"""Helpers that play learners in synchronizer tests: the real protocol client, numpy data."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import redis

from learner.client import SynchronizerClient
from services import codec as codecs
from services.gen.atoll.v1 import session_pb2
from services.layout import FragmentLayout, LeafSpec, fragment_layout
from synchronizer.store import job_key

SPECS = [LeafSpec(f"blocks/{i}/w", (32, 32)) for i in range(4)] + [LeafSpec("embed", (16, 32))]


def layout(fragments: int) -> FragmentLayout:
    return fragment_layout(SPECS, fragments)


def client(addresses: Sequence[str], learner_id: str, **kw: object) -> SynchronizerClient:
    c = SynchronizerClient(
        list(addresses),
        job="default",
        learner_id=learner_id,
        incarnation=uuid.uuid4().hex,
        params=SPECS,
        max_backoff_s=0.5,
        **kw,  # type: ignore[arg-type]
    )
    c.connect()
    return c


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
    return c.send_update(
        fragment=fragment,
        payload=enc.encode(delta, 256),
        codec=enc.wire,
        block_size=256,
        num_elements=n,
        base_version=base_version,
        c_steps=c_steps,
        c_tokens=c_tokens,
        compute_seconds=1.0,
    )


def key(*parts: object) -> str:
    return job_key("default", *parts)


def commit_log(r: redis.Redis, fragment: int) -> list[dict[str, object]]:
    import json

    return [json.loads(e) for e in r.lrange(key("log", fragment), 0, -1)]  # type: ignore[union-attr]


def version(r: redis.Redis, fragment: int) -> int:
    return int(r.hget(key("frag", fragment), "version") or -1)  # type: ignore[arg-type]


def chunks_for(
    fragment: int,
    payload: bytes,
    *,
    codec: int,
    block_size: int,
    num_elements: int,
    seq: int,
    base_version: int = 0,
    c_steps: int = 10,
    c_tokens: int = 1000,
    max_chunk: int = 1024,
) -> list[session_pb2.UpdateChunk]:
    """Hand-built update chunks, for tests that send what a correct learner never would."""
    from services.wire import make_header, split

    header = make_header(fragment, codec, block_size, num_elements, payload, max_chunk)
    return [
        session_pb2.UpdateChunk(
            header=header,
            kind=session_pb2.UPDATE_KIND_OUTER_GRADIENT,
            seq=seq,
            base_version=base_version,
            c_steps=c_steps,
            c_tokens=c_tokens,
            compute_seconds=1.0,
            chunk_index=i,
            data=d,
        )
        for i, d in enumerate(split(payload, max_chunk))
    ]


def commit_versions(c: SynchronizerClient, r: redis.Redis, fragment: int, count: int) -> None:
    """Send `count` updates of one fragment, each on the last, and wait for each commit."""
    import time

    for v in range(count):
        c.wait_ack(send_delta(c, fragment, 2, v, seed=v), 10)
        deadline = time.monotonic() + 15
        while version(r, fragment) != v + 1:
            assert time.monotonic() < deadline, f"version {v + 1} was not committed"
            time.sleep(0.05)
