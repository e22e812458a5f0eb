"""The network between learners and synchronizers, made faulty on purpose.

`atoll up` puts one TCP proxy on loopback in front of every synchronizer for every learner,
and the learner is given the proxies' addresses instead of the synchronizers'. So each
learner has links of its own, and a fault hits one learner's links:

- latency: every byte is delivered `delay` seconds after it was read;
- bandwidth: each direction is paced to `rate` bytes per second;
- reset: every open connection is aborted (RST), as a middlebox timing out would;
- partition: connections are aborted and new ones refused until the partition heals.

All proxies run on one asyncio loop in a background thread; the methods below are called
from the cluster's thread and are safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

CHUNK = 64 * 1024


@dataclass
class LinkState:
    """What the network is doing to one learner's links now."""

    delay_s: float = 0.0
    rate_bytes_s: float = 0.0  # 0: unlimited
    partitioned: bool = False
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class FaultProxy:
    """`host`: the address its proxies listen on (loopback; the hub's with --regions).
    `delay_s`: each learner's delay when no fault is on (a region's link, --link delay=)."""

    def __init__(
        self,
        learners: int,
        upstreams: Sequence[tuple[str, int]],
        host: str = "127.0.0.1",
        delay_s: float = 0.0,
    ) -> None:
        self.upstreams = list(upstreams)
        self.host = host
        self.base_delay_s = delay_s
        self.links = [LinkState(delay_s=delay_s) for _ in range(learners)]
        self.addresses: list[list[str]] = [[] for _ in range(learners)]
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="atoll-proxy")
        self._thread.daemon = True

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    async def _listen(self) -> None:
        for learner in range(len(self.links)):
            for host, port in self.upstreams:
                server = await asyncio.start_server(
                    self._handler(learner, host, port), self.host, 0
                )
                self._servers.append(server)
                bound = server.sockets[0].getsockname()[1]
                self.addresses[learner].append(f"{self.host}:{bound}")

    def _handler(
        self, learner: int, host: str, port: int
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(learner, host, port, reader, writer)

        return handle

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            for server in self._servers:
                server.close()
            for link in self.links:
                for writer in list(link.writers):
                    _abort(writer)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # --- faults (any thread) --------------------------------------------------------------
    def latency(self, learner: int, delay_s: float) -> None:
        self._loop.call_soon_threadsafe(setattr, self.links[learner], "delay_s", delay_s)

    def bandwidth(self, learner: int, rate_bytes_s: float) -> None:
        self._loop.call_soon_threadsafe(setattr, self.links[learner], "rate_bytes_s", rate_bytes_s)

    def reset(self, learner: int) -> None:
        self._loop.call_soon_threadsafe(self._reset, learner)

    def partition(self, learner: int, on: bool) -> None:
        def apply() -> None:
            self.links[learner].partitioned = on
            if on:
                self._reset(learner)

        self._loop.call_soon_threadsafe(apply)

    def heal(self, learner: int) -> None:
        """Undo every fault on this learner's links (its link's own delay stays)."""

        def apply() -> None:
            link = self.links[learner]
            link.delay_s, link.rate_bytes_s, link.partitioned = self.base_delay_s, 0.0, False

        self._loop.call_soon_threadsafe(apply)

    def _reset(self, learner: int) -> None:
        for writer in list(self.links[learner].writers):
            _abort(writer)

    # --- the pump -------------------------------------------------------------------------
    async def _serve(
        self,
        learner: int,
        host: str,
        port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        link = self.links[learner]
        if link.partitioned:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            _abort(writer)
            return
        link.writers |= {writer, up_writer}
        try:
            await asyncio.gather(
                self._pump(link, reader, up_writer), self._pump(link, up_reader, writer)
            )
        finally:
            link.writers -= {writer, up_writer}
            for w in (writer, up_writer):
                _abort(w)

    async def _pump(
        self, link: LinkState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copy one direction, delaying and pacing as the link's state says at the time."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                if link.rate_bytes_s > 0:
                    await asyncio.sleep(len(data) / link.rate_bytes_s)

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((time.monotonic() + link.delay_s, data))
                if not data or sender.done():
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a RST, as a broken network does, not a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()
