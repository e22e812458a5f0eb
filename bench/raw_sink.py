"""The bare gRPC sink `atoll bench synchronizer` measures a replica against (`atoll bench
raw-sink`, a process of its own): a grpc.aio bidi stream that counts payloads and acks
them, with nothing of atoll's behind it; or, `--summing`, the floor: each chunk parsed as
an owner parses it, hashed and summed into a float32 fragment on one worker thread
(`_Summer`), and nothing else."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import xxhash
from pydantic import BaseModel, Field

from services import codec as codecs
from services import kernels
from services.grpcopts import server_options
from synchronizer.core.admission import Arrived, parse_chunk
from synchronizer.worker import TOGETHER


class RawSink(BaseModel):
    """Internal: the bare gRPC sink that `bench synchronizer` measures against."""

    port_file: Path = Field(description="write the bound port here (JSON)")
    summing: bool = Field(
        False,
        description="also hash each chunk and sum it into a float32 fragment on one worker "
        "thread, as a fragment's owner must (the floor of `bench synchronizer`)",
    )

    def cli_cmd(self) -> None:
        serve_raw_sink(self.port_file, summing=self.summing)


RAW_METHOD = "/atoll.bench.RawSink/Stream"


class _Summer:
    """The least a fragment's owner does with an update's bytes, on one worker thread as the
    owner's is: each chunk hashed in arrival order and summed into a float32 fragment, the
    chunks of one range queued together summed in one pass (as the owner's worker sums them).
    Nothing else: no checks, no admission, no Redis, no outer step."""

    def __init__(self) -> None:
        self.codec = codecs.by_name("int8")
        self.acc: np.ndarray | None = None
        self.failure = ""  # why a batch could not be summed: the calls then fail with it
        self.queue: queue.SimpleQueue[
            tuple[int, int, memoryview, xxhash.xxh3_64 | None, Callable[[], object] | None] | None
        ] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="summer", daemon=True)
        self.thread.start()

    def add(
        self, n: int, offset: int, count: int, data: memoryview, hasher: xxhash.xxh3_64
    ) -> None:
        """Queue one chunk."""
        if self.acc is None:
            self.acc = np.zeros(n, np.float32)
        self.queue.put((offset, count, data, hasher, None))

    def done(self) -> asyncio.Future[int]:
        """A future done once every chunk queued so far is hashed and summed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def resolve() -> None:
            if not future.done():  # its call may have been cancelled meanwhile
                future.set_result(1)

        self.queue.put((0, 0, memoryview(b""), None, lambda: loop.call_soon_threadsafe(resolve)))
        return future

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            batch = [item]
            while len(batch) < TOGETHER:  # as many as the owner's worker takes at once
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.queue.put(None)
                    break
                batch.append(more)
            try:
                self._sum(batch)
            except Exception as err:  # every call waiting fails with it (`serve_raw_sink`)
                self.failure = self.failure or repr(err)
            for *_, finished in batch:
                if finished is not None:
                    finished()

    def _sum(
        self,
        batch: list[tuple[int, int, memoryview, Any, Callable[[], object] | None]],
    ) -> None:
        for _, _, data, hasher, _ in batch:
            if hasher is not None:
                hasher.update(data)
        ranges: dict[tuple[int, int], list[codecs.Ready]] = {}
        assert self.acc is not None
        for offset, count, data, hasher, _ in batch:
            if hasher is None:  # a marker (`done`)
                continue
            segment = codecs.Segment(offset, count, data)
            ready = self.codec.ready(self.acc, 1.0, segment, codecs.DEFAULT_BLOCK_SIZE)
            if ready is None:
                raise ValueError("int8 at the default block size has no compiled sum")
            ranges.setdefault((offset, count), []).append(ready)
        for (offset, count), chunks in ranges.items():
            for i in range(0, len(chunks), kernels.MANY):
                self.codec.decode_many(
                    self.acc, offset, count, codecs.DEFAULT_BLOCK_SIZE, chunks[i : i + kernels.MANY]
                )


def serve_raw_sink(port_file: Path, summing: bool = False) -> None:
    """A bare grpc.aio bidi stream (the synchronizer's own server flavour) that counts chunks
    into payloads and acks each payload: gRPC with nothing of atoll's behind it. `summing`:
    each message is an Ingest chunk, parsed as the owner parses it, and its payload hashed
    and summed (`_Summer`) before its update is acked, "ok" if its checksum holds."""

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

    if summing:
        kernels.warm()  # as a replica does before it serves: no compiling in the measurement
    summer = _Summer() if summing else None

    async def handle_summing(
        request_iterator: AsyncIterator[Arrived], context: grpc.aio.ServicerContext[Any, bytes]
    ) -> AsyncIterator[bytes]:
        assert summer is not None
        size = int(dict(context.invocation_metadata() or ())["payload-bytes"])
        received, hasher = 0, xxhash.xxh3_64()
        async for chunk, data in request_iterator:
            header = chunk.header
            summer.add(header.num_elements, chunk.value_offset, chunk.value_count, data, hasher)
            received += len(data)
            if received >= size:  # one whole payload in: ack it once it is summed
                received -= size
                await summer.done()
                if summer.failure:
                    await context.abort(
                        grpc.StatusCode.INTERNAL, f"the summing sink failed: {summer.failure}"
                    )
                yield b"ok" if hasher.intdigest() == header.checksum else b"bad"
                hasher = xxhash.xxh3_64()

    async def serve() -> None:
        method = (
            grpc.stream_stream_rpc_method_handler(handle_summing, request_deserializer=parse_chunk)
            if summing
            else grpc.stream_stream_rpc_method_handler(handle)  # bytes in, bytes out
        )
        handler = grpc.method_handlers_generic_handler("atoll.bench.RawSink", {"Stream": method})
        server = grpc.aio.server(options=server_options())
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await asyncio.to_thread(port_file.write_text, json.dumps({"grpc": port, "metrics": 0}))
        await server.wait_for_termination()

    asyncio.run(serve())
