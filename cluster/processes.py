"""Child processes of a local cluster: started with fork+exec, stopped by PID.

Children are started through `subprocess` (never a bare fork after gRPC or JAX are
initialised), each in its own process group so a SIGKILL reaches exactly that child.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.lifecycle import PARENT_ENV


def atoll_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "atoll.cli", *args]


def accelerators_present() -> int:
    """How many NVIDIA GPUs (or TPU chips) this machine shows, from their device nodes,
    without starting JAX in this process."""
    return len(glob.glob("/dev/nvidia[0-9]*")) or len(glob.glob("/dev/accel[0-9]*"))


def child_env(
    threads: int = 1, extra: dict[str, str] | None = None, accelerators: bool = False
) -> dict[str, str]:
    """Environment for a child: XLA and BLAS limited to `threads`, Python unbuffered. JAX
    runs on the CPU (no probing for devices) unless `accelerators` is asked for and the
    machine has them; a `JAX_PLATFORMS` of the caller's own always wins."""
    env = dict(os.environ)
    env.pop("ATOLL_CONFIG", None)
    on_cpu = not (accelerators and accelerators_present())
    if on_cpu:
        env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": (
                f"--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={threads}"
            ),
            "OMP_NUM_THREADS": str(threads),
            "OPENBLAS_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            PARENT_ENV: str(os.getpid()),
        }
    )
    env.update(extra or {})
    return env


def gpu_pinning(learner: int, per_learner: int) -> dict[str, str]:
    """`CUDA_VISIBLE_DEVICES` for learner i with `per_learner` GPUs each: devices
    [i*g, (i+1)*g) of those this process sees (its own `CUDA_VISIBLE_DEVICES`, else all);
    nothing with g = 0."""
    if not per_learner:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(k) for k in range(accelerators_present())]
    first = learner * per_learner
    if first + per_learner > len(ids):
        raise ValueError(
            f"--gpus-per-learner {per_learner}: learner {learner} needs GPUs {first}.."
            f"{first + per_learner - 1}, this machine shows {len(ids)}; start fewer learners"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[first : first + per_learner])}


@dataclass
class Child:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    # The cores it may run on (empty: those of its parent). It inherits them at its start,
    # so every thread it makes has them and its pools are sized by them.
    cores: tuple[int, ...] = ()

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        # A child inherits the affinity of the thread that starts it (Linux sets it per
        # thread), so this thread takes the child's cores for the moment of the start.
        mine = os.sched_getaffinity(0) if self.cores else set()
        if self.cores:
            os.sched_setaffinity(0, self.cores)
        try:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        finally:
            if self.cores:
                os.sched_setaffinity(0, mine)
            log.close()
        self.starts += 1
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
        if self.process is None:
            return None
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(timeout=5)
        return self.process.returncode

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=5)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def stop_all(children: Sequence[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM to every child at once, then SIGKILL to those still running `timeout_s`
    later: stopping N children takes one timeout at most, not N of them."""
    for child in children:
        child.signal(signal.SIGCONT)
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()


def wait_for_file(path: Path, child: Child, timeout_s: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return dict(json.loads(path.read_text()))
        if not child.alive():
            raise RuntimeError(f"{child.name} exited at start:\n{child.tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{child.name} did not start within {timeout_s} s:\n{child.tail()}")


@dataclass
class SynchronizerChild(Child):
    port: int = 0
    metrics_port: int = 0
    host: str = "127.0.0.1"  # where it listens (and advertises)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start_and_wait(self, timeout_s: float = 60.0) -> SynchronizerChild:
        port_file = self.log_path.with_suffix(".ports")
        port_file.unlink(missing_ok=True)
        self.start()
        ports = wait_for_file(port_file, self, timeout_s)
        self.port, self.metrics_port = ports["grpc"], ports["metrics"]
        # A restart comes back on the same address, where learners look for it.
        listen = self.args.index("--listen") + 1
        self.args[listen] = f"{self.host}:{self.port}"
        metrics = self.args.index("--metrics-listen") + 1  # and its /metrics, for Prometheus
        self.args[metrics] = f"127.0.0.1:{self.metrics_port}"
        return self


def synchronizer_args(
    port: int,
    redis_url: str,
    tensor_store: str,
    security: Sequence[str] = ("--insecure",),
    host: str = "127.0.0.1",
) -> list[str]:
    """`atoll synchronizer` on a port of `host` (loopback by default; port 0: any), metrics
    on any loopback port, this Redis and tensor store; plaintext unless `security` gives TLS
    flags."""
    return [
        "synchronizer",
        *security,
        "--listen",
        f"{host}:{port}",
        "--metrics-listen",
        "127.0.0.1:0",
        "--redis-url",
        redis_url,
        "--tensor-store",
        tensor_store,
    ]


def synchronizer_child(
    workdir: Path,
    redis_url: str,
    replica: str,
    job_args: Sequence[str] = (),
    port: int = 0,
    tensor_store: Path | None = None,
    security: Sequence[str] = ("--insecure",),
    host: str = "127.0.0.1",
) -> SynchronizerChild:
    """A replica; replicas of one workdir share its `tensors` folder as their tensor store."""
    log_path = workdir / f"{replica}.log"
    tensors = str(tensor_store or workdir / "tensors")
    args = atoll_command(
        *synchronizer_args(port, redis_url, tensors, security, host),
        "--replica-id",
        replica,
        "--port-file",
        str(log_path.with_suffix(".ports")),
        *job_args,
    )
    return SynchronizerChild(
        name=replica, args=args, log_path=log_path, env=child_env(1), host=host
    )
