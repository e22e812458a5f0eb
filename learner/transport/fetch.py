"""Fetching global values: whole fragments, or value ranges of them (FetchState, as
synchronizer/ranges.py serves it).

Runs on the thread that asks: the engine's (joining, a refused update's fragment), the
session thread (fragments that moved while it was away), a Follow call's thread (a delta
that does not follow the value held). Owns nothing but the assembly of what one call
brings; the values fetched are held (`Held`) as the synchronizer holds them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np
import structlog
import xxhash

from learner.transport.calls import Channels, SessionError, describe, retryable
from learner.transport.values import Assembly, GlobalFragment, Held, RangeValues
from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, synchronizer_pb2
from services.grpcopts import backoff_delays

log = structlog.get_logger("atoll.learner.client")
FETCH_TIMEOUT_S = 120.0


class Fetch:
    """FetchState calls of one learner of job `job`."""

    def __init__(
        self,
        channels: Channels,
        held: Held,
        job: str,
        closed: threading.Event,
        check: Callable[[], None],
    ) -> None:
        """`closed`: the client closed; `check`: raises once the session failed for good."""
        self.channels, self.held, self.job = channels, held, job
        self.closed, self.check = closed, check

    def state(
        self,
        fragments: Sequence[int] = (),
        held: Mapping[int, np.ndarray] | None = None,
        *,
        retry: bool = True,
    ) -> list[GlobalFragment]:
        """The current global value of `fragments` (all if empty), over the unary stream;
        the caller adopts them (they count as known). A fragment in `held` whose current value
        is that array (same checksum) is not sent again: the held array comes back instead.
        A failure a retry may cure (no replica answers, the session moved to another one) is
        retried with backoff, as the session is (until `give_up_s`, if set); `retry=False`
        tries once and raises grpc.RpcError or ValueError. A refusal always raises."""
        delays = backoff_delays(max_s=self.channels.max_backoff_s, initial_s=0.1)
        while True:
            try:
                out = self.whole(fragments, held or {})
                break
            except (grpc.RpcError, ValueError) as err:
                if not retry or not retryable(err):
                    raise
                log.info("fetch_retry", error=describe(err))
            if self.closed.wait(next(delays)):
                raise SessionError("the session was closed while fetching the global model")
            self.check()
        self.held.know(out)
        return out

    def whole(
        self,
        fragments: Sequence[int],
        held: Mapping[int, np.ndarray] | None = None,
        channel: grpc.Channel | None = None,
    ) -> list[GlobalFragment]:
        """The current values of `fragments` over `channel` (default: the session's), once;
        they are held."""
        assert (channel or self.channels.session) is not None, "connect() first"
        mine = {p: np.ascontiguousarray(v, "<f4") for p, v in (held or {}).items()}
        fetch = self.channels.method(
            "unary_stream", "FetchState", fragment_pb2.GlobalFragmentChunk, channel
        )
        request = synchronizer_pb2.FetchStateRequest(
            job=self.job,
            fragments=list(fragments),
            held={p: codecs.checksum(v.tobytes()) for p, v in mine.items()},
        )
        out: list[GlobalFragment] = []
        assembling: dict[int, Assembly] = {}
        for chunk in fetch(request, timeout=FETCH_TIMEOUT_S, metadata=self.channels.metadata):
            p = chunk.header.fragment
            if chunk.unchanged and p in mine:
                out.append(GlobalFragment(p, chunk.version, mine[p].copy()))
                continue
            got = self.assemble(assembling, chunk)
            if got is not None:
                out.append(got)
        for g in out:
            self.held.hold(g)
        return out

    def assemble(
        self,
        assembling: dict[int, Assembly],
        chunk: fragment_pb2.GlobalFragmentChunk,
        channel: grpc.Channel | None = None,
    ) -> GlobalFragment | None:
        """A whole global value from its chunks: sent whole, or rebuilt from a delta onto the
        value held (a delta that does not follow it brings a whole copy instead, fetched
        over `channel`, default: the session's)."""
        p = chunk.header.fragment
        if chunk.chunk_index == 0:
            base = None
            if chunk.delta:
                held = self.held.get(p)
                if held is not None and held[0] >= chunk.version:
                    return None  # already held (a whole copy overtook this delta)
                if held is None or held[0] != chunk.base_version:
                    log.info(
                        "delta_gap", fragment=p, held=held and held[0], base=chunk.base_version
                    )
                    # Delivered by the caller, like a pushed value.
                    fetched = self.whole([p], channel=channel)
                    return fetched[0] if fetched else None
                base = held[1]
            assembling[p] = Assembly(chunk, base)
        assembly = assembling.get(p)
        if assembly is None or assembly.version != chunk.version:
            return None  # the rest of a value whose start was skipped
        if not assembly.feed(chunk):
            return None
        del assembling[p]
        return GlobalFragment(p, assembly.version, assembly.values)

    def ranges(
        self,
        ranges: Mapping[int, Sequence[tuple[int, int]]],
        versions: Mapping[int, int] | None = None,
    ) -> list[RangeValues]:
        """The values of `ranges` ((offset, count) pairs, increasing) of each fragment, at
        `versions` (absent: the current one), each fragment's checked against its checksum."""
        assert self.channels.session is not None, "connect() first"
        fetch = self.channels.method("unary_stream", "FetchState", fragment_pb2.GlobalFragmentChunk)
        request = synchronizer_pb2.FetchStateRequest(
            job=self.job, fragments=list(ranges), versions=dict(versions or {})
        )
        for p, wanted in ranges.items():
            request.ranges[p].offsets.extend(o for o, _ in wanted)
            request.ranges[p].counts.extend(c for _, c in wanted)
        parts: dict[int, list[fragment_pb2.GlobalFragmentChunk]] = {}
        for chunk in fetch(request, timeout=FETCH_TIMEOUT_S, metadata=self.channels.metadata):
            parts.setdefault(chunk.header.fragment, []).append(chunk)
        out = []
        for p, wanted in ranges.items():
            chunks = parts.get(p, [])
            hasher = xxhash.xxh3_64()
            for chunk in chunks:
                hasher.update(chunk.data)
            header = chunks[0].header if chunks else None
            expected = [(int(c.value_offset), int(c.value_count)) for c in chunks]
            if (
                header is None
                or len(chunks) != header.chunk_count
                or hasher.intdigest() != header.checksum
                or joined(expected) != joined(list(wanted))
            ):
                raise ValueError(f"fragment {p}: the ranges fetched are not those asked for")
            values = np.frombuffer(b"".join(c.data for c in chunks), "<f4").astype(np.float32)
            out.append(RangeValues(p, chunks[0].version, values, chunks[0].value_checksum))
        return out


def joined(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges with neighbours joined: the same values however they are cut in chunks."""
    out: list[tuple[int, int]] = []
    for offset, count in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((offset, count))
    return out
