"""What `atoll up` shows while it runs: state read from Redis, drawn live or as log lines."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from cluster.settings import UpSettings
from learner.model import TransformerConfig
from services.bandwidth import dp_equivalent_bytes
from services.goodput import goodput
from synchronizer import inspect

PLAIN_EVERY_S = 10.0


@dataclass
class ClusterState:
    elapsed: float
    learners: dict[str, dict[str, str]] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    pending: int = 0
    now_ms: float = 0.0

    @property
    def learners_done(self) -> int:
        return sum(1 for f in self.learners.values() if f.get("done") == "1")

    def alive(self, fields: dict[str, str]) -> bool:
        return float(fields.get("lease_expiry_ms", 0)) > self.now_ms


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_state(r: Any, settings: UpSettings, started: float) -> ClusterState:
    """One snapshot of the job from Redis (`r` is a redis.Redis; replies are untyped)."""
    job = settings.job
    state = ClusterState(elapsed=time.time() - started)
    try:
        seconds, micros = r.time()
        state.now_ms = seconds * 1000 + micros / 1000
        state.learners = inspect.learners(r, job)
        state.versions = inspect.versions(r, job, settings.fragments)
        state.stats = inspect.stats(r, job, settings.fragments)
        state.pending = len(inspect.pending(r, job, settings.fragments))
    except redis.RedisError:
        pass  # Redis may be restarting; show what we have
    return state


def _fmt(value: str | None, digits: int = 3) -> str:
    if value is None or value in ("", "-1.0", "nan"):
        return "-"
    try:
        return f"{float(value):.{digits}f}"
    except ValueError:
        return value


def slot_status(fields: dict[str, str] | None, lease_live: bool, running: bool) -> str:
    """A learner slot as the table shows it: `done`; `down` (no process: killed, or not
    restarted yet); `running` (a live session that has trained); `starting` (a process
    that has not joined, or not trained, yet: importing, compiling, restoring)."""
    if fields is not None and fields.get("done") == "1":
        return "done"
    if not running:
        return "down"
    if fields is not None and lease_live and float(fields.get("step", 0) or 0) > 0:
        return "running"
    return "starting"


def measured(value: str | None) -> float | None:
    """A loss as a heartbeat carries it; None where there is none yet (-1, nan, absent)."""
    try:
        x = float(value) if value else math.nan
    except ValueError:
        return None
    return x if math.isfinite(x) and x >= 0 else None


class LiveView:
    def __init__(self, live: bool, workdir: Path) -> None:
        self.live = live
        self.workdir = workdir
        self.console = Console()
        self._live: Live | None = None
        self._last_plain = 0.0
        # Each slot's last heard fields, kept after it leaves: the last frame shows them.
        self._fields: dict[str, dict[str, str]] = {}
        # Learners take turns evaluating the one global model: the newest result is the
        # model's eval loss (each learner's own last one is older, of an older model).
        self._evals: dict[str, str] = {}
        self.global_eval: float | None = None

    def hear(self, state: ClusterState) -> None:
        """Take in one snapshot: each slot's fields, and any eval that is new."""
        for name, fields in state.learners.items():
            self._fields[name] = fields
            value = fields.get("eval_loss", "")
            if value != self._evals.get(name):
                self._evals[name] = value
                if measured(value) is not None:
                    self.global_eval = measured(value)

    def __enter__(self) -> LiveView:
        self.console.print(f"[bold]atoll up[/bold]: logs in {self.workdir}")
        if self.live:
            self._live = Live(console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def update(self, state: ClusterState, cluster: Any) -> None:
        settings: UpSettings = cluster.settings
        up, down = state.stats.get("bytes_up", 0.0), state.stats.get("bytes_down", 0.0)
        params = TransformerConfig(
            settings.layers, settings.width, settings.heads, settings.context
        ).parameters
        steps = sum(int(float(f.get("step", 0))) for f in state.learners.values())
        dp = dp_equivalent_bytes(params, settings.learners, steps)
        provisioned = sum(cluster.provisioned().values())
        good = goodput(state.stats.get("useful_seconds", 0.0), provisioned)
        reduction = f"{dp / (up + down):.0f}x" if up + down and dp else "-"
        self.hear(state)
        shown = "-" if self.global_eval is None else f"{self.global_eval:.3f}"
        summary = (
            f"t={state.elapsed:6.1f}s  versions={state.versions}  "
            f"global model eval {shown}  goodput={good:.2f}  "
            f"up={up / 1e6:.1f}MB down={down / 1e6:.1f}MB  vs data-parallel: {reduction} less"
        )
        if self._live is not None:
            table = Table(title="learners", expand=False)
            for col in ("learner", "state", "step", "loss", "tokens/s"):
                table.add_column(col, justify="right" if col != "learner" else "left")
            running = {c.name for c in cluster.learners if c.alive()}
            for name in sorted({c.name for c in cluster.learners} | set(self._fields)):
                f = self._fields.get(name)
                heard = name in state.learners and state.alive(state.learners[name])
                table.add_row(
                    name,
                    slot_status(f, heard, name in running),
                    (f or {}).get("step", "0").split(".")[0],
                    _fmt((f or {}).get("loss")),
                    _fmt((f or {}).get("tokens_per_s"), 0),
                )
            self._live.update(Group(table, summary))
        elif time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = time.monotonic()
            steps_text = " ".join(
                f"{n}:{state.learners[n].get('step', '0').split('.')[0]}"
                for n in sorted(state.learners)
            )
            print(f"{summary}  steps {steps_text}", flush=True)

    def final(self, report: dict[str, Any]) -> None:
        inv = report["invariants"]
        self.console.print(
            f"[bold]done[/bold] in {report['wall_seconds']:.0f}s: loss "
            f"{_fmt(str(report['loss']['initial']))} -> {_fmt(str(report['loss']['final']))}, "
            f"eval loss {_fmt(str(report['eval_loss']))}, goodput {report['goodput']:.2f}, bytes "
            f"{report['bytes']['up'] / 1e6:.1f}MB up / {report['bytes']['down'] / 1e6:.1f}MB down "
            f"({report['bandwidth_reduction']:.0f}x less than data-parallel), "
            f"{report['versions_committed']} versions; invariants "
            + ("[green]ok[/green]" if inv["ok"] else f"[red]violated[/red]: {inv['problems']}")
        )
