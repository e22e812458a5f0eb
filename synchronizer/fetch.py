"""The state fetch: a fragment's whole current value for a learner that (re)joins, or some
ranges of it at a chosen version for one process of a learner that spans several hosts
(`ranges`). Any replica serves it, from the tensor store, rebuilding each value from its
keyframe and the deltas since (`values.RebuiltValues`, shared with the followers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from services import codec as codecs
from services.config import SynchronizerSettings
from services.gen.atoll.v1 import fragment_pb2, synchronizer_pb2
from services.layout import FragmentLayout
from synchronizer import ranges
from synchronizer.core import admission
from synchronizer.core.admission import Rejection
from synchronizer.refusals import grpc_status
from synchronizer.store.control import ControlStore
from synchronizer.store.tensors import TensorStore
from synchronizer.values import RebuiltValues, float32_bytes


def value_layout(
    fragment: int, values: bytes | memoryview, chunk_bytes: int
) -> tuple[fragment_pb2.PayloadHeader, list[tuple[int, int]]]:
    """A whole float32 value's header as fp32 segments, and each segment's [start, stop)."""
    n = len(values) // 4
    step = max(1, chunk_bytes // 4)
    spans = [(start, min(n, start + step)) for start in range(0, max(1, n), step)]
    header = fragment_pb2.PayloadHeader(
        fragment=fragment,
        codec=fragment_pb2.CODEC_FP32,
        num_elements=n,
        checksum=codecs.checksum(values),
        chunk_count=len(spans),
        total_bytes=len(values),
    )
    return header, spans


def value_chunks(
    fragment: int, version: int, values: bytes | memoryview, chunk_bytes: int
) -> list[fragment_pb2.GlobalFragmentChunk]:
    """A whole float32 value as fp32 segments (a fetch's answer)."""
    header, spans = value_layout(fragment, values, chunk_bytes)
    return [
        fragment_pb2.GlobalFragmentChunk(
            header=header,
            version=version,
            chunk_index=i,
            data=bytes(values[4 * start : 4 * stop]),
            value_offset=start,
            value_count=stop - start,
        )
        for i, (start, stop) in enumerate(spans)
    ]


class StateFetch:
    """The FetchState call."""

    def __init__(
        self,
        settings: SynchronizerSettings,
        store: ControlStore,
        tensors: TensorStore,
        rebuilt: RebuiltValues,
        layout: Callable[[], FragmentLayout | None],
    ) -> None:
        self.settings, self.store, self.tensors = settings, store, tensors
        self.rebuilt, self._layout = rebuilt, layout

    async def fragment_chunks(
        self, fragment: int, held: int | None = None
    ) -> list[fragment_pb2.GlobalFragmentChunk]:
        """The fragment's whole current value, chunked; or, when its checksum is `held` (the
        learner already has it), one chunk without data that says so."""
        version, value = await self.rebuilt.get(self.store, self.tensors, fragment)
        chunks = await asyncio.to_thread(  # copies the whole value: off the event loop
            value_chunks, fragment, version, float32_bytes(value), self.settings.max_chunk_bytes
        )
        if held is not None and chunks[0].header.checksum == held:
            header = fragment_pb2.PayloadHeader()
            header.CopyFrom(chunks[0].header)
            header.chunk_count, header.total_bytes = 1, 0
            return [
                fragment_pb2.GlobalFragmentChunk(header=header, version=version, unchanged=True)
            ]
        return chunks

    async def FetchState(
        self,
        request: synchronizer_pb2.FetchStateRequest,
        context: grpc.aio.ServicerContext[
            synchronizer_pb2.FetchStateRequest, fragment_pb2.GlobalFragmentChunk
        ],
    ) -> AsyncIterator[fragment_pb2.GlobalFragmentChunk]:
        try:
            admission.check_job(request.job, self.settings.job)
        except Rejection as rejection:
            await context.abort(*grpc_status(rejection))
        layout = self._layout()
        if layout is None or not await self.store.is_initialized(layout.num_fragments):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the job has no global parameters yet; a learner must join first",
            )
        assert layout is not None
        named = (request.fragments, request.held, request.ranges, request.versions)
        try:
            admission.check_fragments_named(
                "state fetch", layout.num_fragments, named, request.fragments
            )
        except Rejection as rejection:
            await context.abort(*grpc_status(rejection))
        wanted = list(dict.fromkeys(request.fragments)) or list(range(layout.num_fragments))
        for p in wanted:
            if p in request.ranges or p in request.versions:
                try:
                    chunks = await self._ranges(p, request, layout)
                except Rejection as rejection:
                    await context.abort(*grpc_status(rejection))
            else:
                chunks = await self.fragment_chunks(p, request.held.get(p))
            for chunk in chunks:
                yield chunk

    async def _ranges(
        self, p: int, request: synchronizer_pb2.FetchStateRequest, layout: FragmentLayout
    ) -> list[fragment_pb2.GlobalFragmentChunk]:
        """Some ranges of fragment p (default: all of it), at a chosen version (default: the
        current one): a process of a learner over several hosts fetches its own."""
        n = layout.fragments[p].num_elements
        wanted = ranges.check_ranges(request.ranges[p], n) if p in request.ranges else [(0, n)]
        version = request.versions.get(p)
        version, values = await ranges.value_at(self.store, self.tensors, p, version, self.rebuilt)
        return await asyncio.to_thread(  # copies the values asked for: off the event loop
            ranges.range_chunks, p, version, values, wanted, self.settings.max_chunk_bytes
        )
