"""The processes of one learner: started together through `jax.distributed`, one of them the
leader (process 0), the others following it.

The leader keeps the learner's control session and decides, between two steps, what every
process does (which new global values to adopt, which acknowledgements and owners hold, when
to stop); it publishes each decision in the coordination service's key-value store, where
the followers read it. Every process then runs the same deterministic bookkeeping on its own
shard of each fragment, so no decision ever depends on which process made it.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

log = structlog.get_logger("atoll.learner.group")
READ_TIMEOUT_S = 600.0  # a follower gives up on a leader this long silent


class KeyValues(Protocol):
    """The part of the coordination service's client a group uses."""

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        """Store `value` under `key`."""

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        """Wait for `key` and return its value."""

    def key_value_delete(self, key: str) -> None:
        """Delete `key`."""


@dataclass
class Group:
    """This process's place among the learner's processes, and the store they share."""

    process: int
    count: int
    store: KeyValues | None = None

    @property
    def leader(self) -> bool:
        return self.process == 0

    @property
    def many(self) -> bool:
        return self.count > 1

    def publish(self, key: str, value: Any) -> None:
        assert self.store is not None
        self.store.key_value_set_bytes(f"atoll/{key}", json.dumps(value).encode())

    def read(self, key: str, timeout_s: float = READ_TIMEOUT_S) -> Any:
        assert self.store is not None
        return json.loads(
            self.store.blocking_key_value_get_bytes(f"atoll/{key}", int(timeout_s * 1000))
        )

    def leave(self) -> None:
        """Leave the group (every process of it does so together)."""
        if self.many:
            import jax

            jax.distributed.shutdown()  # type: ignore[no-untyped-call]

    def forget(self, key: str) -> None:
        """Drop `key` and every key under `key/`."""
        assert self.store is not None
        self.store.key_value_delete(f"atoll/{key}")


def start(
    coordinator: str, processes: int, process_id: int | None, collectives_host: str = ""
) -> Group:
    """Join the learner's processes (`jax.distributed`); a learner of one process joins
    nothing. `coordinator` HOST:PORT is process 0's; empty: JAX finds the cluster itself
    (SLURM, Open MPI, a TPU slice, Kubernetes). `collectives_host`: the address gloo binds
    and advertises (default: this host's name, which inside a network namespace may name
    an address the namespace does not have). Must run before JAX's first computation."""
    if processes <= 1:
        return Group(0, 1)
    import jax
    from jax._src import distributed  # the coordination service's key-value store

    # Processes on CPUs (tests, a laptop) reach each other's devices through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    if collectives_host:
        bind_collectives(collectives_host)
    jax.distributed.initialize(
        coordinator_address=coordinator or None,
        num_processes=processes,
        process_id=process_id,
    )
    client = distributed.global_state.client
    assert client is not None
    group = Group(jax.process_index(), jax.process_count(), client)
    log.info("processes_joined", process=group.process, processes=group.count)
    return group


def bind_collectives(host: str) -> None:
    """Make JAX's CPU client build its gloo collectives on `host`: JAX offers no setting for
    it, so the factory its backend calls is given the address."""
    import functools

    from jax._src.lib import _jax  # type: ignore[attr-defined]  # xla_bridge calls this

    factory = _jax.make_gloo_tcp_collectives
    _jax.make_gloo_tcp_collectives = functools.partial(factory, hostname=host)


def gpu_ids() -> list[str]:
    """The GPUs this process may use: its CUDA_VISIBLE_DEVICES, else every one the machine
    shows (from the device nodes, without starting JAX)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g for g in visible.split(",") if g]
    return [str(k) for k in range(len(glob.glob("/dev/nvidia[0-9]*")))]


def spawn_followers(processes: int, coordinator: str) -> list[subprocess.Popen[bytes]]:
    """Start processes 1..processes-1 of this learner on this machine, with this process's
    own command line; on a machine with GPUs, process k gets the k-th of those it sees (and
    this process the first). They end when this process does (ATOLL_PARENT_PID)."""
    gpus = gpu_ids()
    if gpus and len(gpus) < processes:
        raise ValueError(
            f"--processes {processes} --local-processes: one GPU each, and this machine "
            f"shows {len(gpus)} ({','.join(gpus)})"
        )
    children = []
    for k in range(1, processes):
        env = dict(os.environ)
        env.update(
            ATOLL_PROCESS_ID=str(k),
            ATOLL_COORDINATOR=coordinator,
            ATOLL_PARENT_PID=str(os.getpid()),
        )
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[k]
        command = [sys.executable, "-m", "atoll.cli", *sys.argv[1:]]
        children.append(subprocess.Popen(command, env=env, start_new_session=True))
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    return children


def free_address() -> str:
    """A free port on the loopback, for a coordinator all of whose processes are local."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
