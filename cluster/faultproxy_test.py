"""The fault proxy's standing delay (a region's `--link delay=`): every byte arrives that much
later each way, and healing a fault goes back to it, not to no delay."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from cluster.faultproxy import FaultProxy


def echo_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):  # the proxy closes with a reset
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, int(server.getsockname()[1])


def round_trip(address: str) -> float:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        started = time.monotonic()
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
        return time.monotonic() - started


def test_a_standing_delay_holds_each_way_and_survives_healing() -> None:
    server, port = echo_server()
    proxy = FaultProxy(1, [("127.0.0.1", port)], host="127.0.0.1", delay_s=0.15).start()
    try:
        assert proxy.addresses[0][0].startswith("127.0.0.1:")
        assert 0.3 <= round_trip(proxy.addresses[0][0]) < 1.5  # 0.15 s up, 0.15 s down
        proxy.latency(0, 0.0)
        proxy.heal(0)  # the fault is over: back to the link's own delay
        time.sleep(0.1)
        assert proxy.links[0].delay_s == 0.15
    finally:
        proxy.stop()
        server.close()
