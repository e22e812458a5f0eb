"""`atoll bench scale`: synchronizer ingest at model size, over 1, 2, 4... replicas.

For each replica count R, in this one invocation: a fresh Redis and tensor store, R replicas
(each its own process), a model of N parameters in P fragments initialized through the real
protocol, then L synthetic learners (processes) that stream pre-encoded int4 updates to each
fragment's owner over Ingest calls (`--calls` at once), round robin over the fragments, each
fragment again once its last update merged, while rounds merge at the default cadence
(decoupled, quorum 1, adaptive grace). Each learner holds its control session with one
replica, spread over them as a Service spreads them, and heartbeats like a real one; it
follows every replica, reading each new global fragment its owner pushes (counted, not
decoded). Reported per R:
payload MB/s received, updates sent and received, MB/s pushed to the learners, one call's
time and what the replicas say it waited for, how fresh the learners' view was (from an
update's receipt to a newer version of its fragment at its learner, and from a version's
commit to its first chunk at a learner: `freshness`), merges (the slowest four, with their
phases, and the mean of each phase), each replica's peak RSS (the kernel's high-water
mark) against the bound 6 x the fp32 bytes of the fragments it owns + 500 MB, Redis's peak
memory and largest value, merge latency (a round ready, by its last update or its grace
window's end, to its version committed), and the cores busy meanwhile (the machine's, the
replicas', the synthetic learners').
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import redis
from pydantic import Field

from bench.options import Output
from bench.synthetic import model_spec
from cluster.processes import Child, atoll_command, child_env, synchronizer_child
from cluster.redis_server import RedisServer
from learner.client import SynchronizerClient
from services import codec as codecs
from services.layout import LeafSpec, fragment_layout
from services.wire import DEFAULT_MAX_CHUNK_BYTES
from synchronizer import inspect
from synchronizer.store.keys import JobKeys


class ScaleBench(Output):
    """Synchronizer ingest at model size over 1, 2, 4... replicas, rounds merging: MB/s,
    scaling efficiency, peak RSS per replica, Redis memory, merge latency, and how soon
    the learners saw the versions their updates made."""

    params: float = Field(1e9, ge=1e4, description="model parameters N (e.g. 3e8, 1e9)")
    fragments: int = Field(8, ge=1, le=256, description="P")
    replicas: str = Field("1,2,4", description="replica counts to measure, comma separated")
    learners: int = Field(8, ge=1, le=64, description="synthetic learner processes")
    seconds: float = Field(20.0, gt=0.0, description="seconds each replica count streams")
    codec: str = Field("int4", description="codec of the pre-encoded updates")
    calls: int = Field(
        4,
        ge=1,
        le=16,
        description="Ingest calls each synthetic learner keeps in flight, each to a fragment "
        "none of its others is sending, and each fragment sent again once its last update "
        "merged (4: as a learner's client does; a replica holds each arriving update's "
        "payload bytes until it is received)",
    )

    client_cores: int = Field(
        0,
        ge=0,
        description="pin the synthetic learners to this many of the machine's last cores and "
        "each replica to an equal share of the rest, none shared (0: nothing pinned, every "
        "process on every core)",
    )

    def cli_cmd(self) -> None:
        run(self)


def pinning(
    cores: Collection[int], clients: int, replicas: int
) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Each replica's cores and the learners' with `clients` cores for the learners: the
    last `clients` of `cores` for them, the rest split into equal runs, one per replica (a
    remainder left idle). Nothing pinned with `clients` 0."""
    if not clients:
        return [()] * replicas, ()
    ordered = sorted(cores)
    share = (len(ordered) - clients) // replicas
    if share < 1:
        raise ValueError(
            f"--client-cores {clients} leaves {len(ordered) - clients} of this process's "
            f"{len(ordered)} cores for {replicas} replicas, fewer than one each: pin fewer "
            "client cores or measure fewer replicas"
        )
    return (
        [tuple(ordered[i * share : (i + 1) * share]) for i in range(replicas)],
        tuple(ordered[-clients:]),
    )


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _p50_p99(values: list[float]) -> dict[str, float]:
    return {"p50": round(_percentile(values, 50), 4), "p99": round(_percentile(values, 99), 4)}


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far. ProcessLookupError for
    one that is gone: a part that died during a measurement fails it, rather than reading
    as a process that spent nothing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        raise ProcessLookupError(
            f"process {pid} is gone, so its CPU time cannot be read: it exited during the "
            "measurement (its log says why)"
        ) from None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    """The machine's busy CPU seconds since boot, over all its cores."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _redis_figures(url: str) -> tuple[float, int]:
    """Redis's peak memory (MB) and its largest value (bytes, by MEMORY USAGE)."""
    r = redis.Redis.from_url(url)
    peak = float(r.info("memory")["used_memory_peak"]) / 1e6
    largest = 0
    for key in r.scan_iter(count=1000):
        largest = max(largest, int(r.memory_usage(key, samples=0) or 0))
    r.close()
    return peak, largest


def _phase_means(metrics_ports: list[int], histogram: str) -> dict[str, float]:
    """Mean seconds per phase of a histogram with a `phase` label, over the replicas, from
    their /metrics: what an Ingest call waited for, where a merge's time went."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != histogram:
                continue
            for sample in family.samples:
                phase = sample.labels.get("phase", "")
                if sample.name.endswith("_sum"):
                    sums[phase] = sums.get(phase, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[phase] = counts.get(phase, 0.0) + sample.value
    return {phase: round(sums[phase] / counts[phase], 4) for phase in sums if counts.get(phase)}


def freshness(
    results: list[dict[str, Any]], entries: list[dict[str, Any]]
) -> tuple[list[float], list[float]]:
    """From the synthetic learners' results and the fragments' commit logs: for each update
    received, the seconds until its learner saw the first chunk of a newer version of that
    fragment (the earliest it sends the fragment again: its round merged, and the new
    version pushed); for each version a learner saw, the seconds from its commit to its
    first chunk there (the push alone). Times are wall-clock, all on one machine."""
    committed = {
        (int(e["fragment"]), int(e["version"])): float(e["committed_at"])
        for e in entries
        if "committed_at" in e
    }
    newer: list[float] = []
    lags: list[float] = []
    for result in results:
        seen = [(int(p), int(v), float(t)) for p, v, t in result["seen_at"]]
        for p, version, at in result["received_at"]:
            later = [t for q, v, t in seen if q == p and v > version and t >= at]
            if later:
                newer.append(min(later) - at)
        lags += [t - committed[(p, v)] for p, v, t in seen if (p, v) in committed]
    return newer, lags


def _initialize(address: str, spec: list[LeafSpec], fragments: int) -> None:
    """Send the job's initial parameters through the protocol, one fragment at a time."""
    client = SynchronizerClient(
        [address],
        job="default",
        learner_id="bench-init",
        incarnation=uuid.uuid4().hex,
        params=spec,
        max_backoff_s=0.5,
    )
    client.connect()
    layout = fragment_layout(spec, fragments)
    rng = np.random.default_rng(0)
    try:
        for p in range(fragments):
            n = layout.fragments[p].num_elements
            values = rng.normal(scale=0.02, size=n).astype(np.float32)
            client.wait_ack(client.send_initial(p, values), 600)
    finally:
        client.close()


def run_replicas(settings: ScaleBench, workdir: Path, replicas: int) -> dict[str, Any]:
    spec = model_spec(int(settings.params), settings.fragments)
    layout = fragment_layout(spec, settings.fragments)
    n = layout.fragments[0].num_elements
    update = workdir / f"update-{settings.codec}.bin"
    if not update.exists():
        codec = codecs.by_name(settings.codec)
        values = np.random.default_rng(1).normal(scale=1e-3, size=n).astype(np.float32)
        segments, _ = codecs.encode_segments(codec, values, 256, DEFAULT_MAX_CHUNK_BYTES)
        update.write_bytes(codecs.pack_segments(segments))
        del values
    run_dir = workdir / f"r{replicas}"
    run_dir.mkdir()
    with RedisServer(run_dir / "redis") as redis_server:
        job_args = [
            "--fragments",
            str(settings.fragments),
            "--codec",
            settings.codec,
            "--max-staleness",
            "1000000",
            # Each update its own round, as these benches were measured (the synthetic
            # learners send no step times: every-learner rounds would wait out the cap).
            "--quorum",
            "1",
            "--log-level",
            "warning",
        ]
        replica_cores, client_cores = pinning(
            os.sched_getaffinity(0), settings.client_cores, replicas
        )
        children = [
            synchronizer_child(run_dir, redis_server.url, f"replica-{i}", job_args)
            for i in range(replicas)
        ]
        for child, cores in zip(children, replica_cores, strict=True):
            child.cores = cores
        for child in children:
            child.start_and_wait()
        learners: list[Child] = []
        try:
            time.sleep(1.0)  # every replica registered before the spec exists
            _initialize(children[0].address, spec, settings.fragments)
            addresses = ",".join(c.address for c in children)
            began = time.monotonic()
            machine0 = _machine_busy_seconds()
            replicas0 = sum(cpu_seconds(c.pid) for c in children)
            for i in range(settings.learners):
                result = run_dir / f"learner-{i}.json"
                learners.append(
                    Child(
                        f"learner-{i}",
                        atoll_command(
                            "bench",
                            "scale-learner",
                            "--addresses",
                            addresses,
                            "--index",
                            str(i),
                            "--params",
                            str(int(settings.params)),
                            "--fragments",
                            str(settings.fragments),
                            "--update",
                            str(update),
                            "--seconds",
                            str(settings.seconds),
                            "--result",
                            str(result),
                            "--codec",
                            settings.codec,
                            "--calls",
                            str(settings.calls),
                        ),
                        run_dir / f"learner-{i}.log",
                        child_env(1),
                        cores=client_cores,
                    ).start()
                )
            deadline = time.monotonic() + settings.seconds + 120
            while any(c.alive() for c in learners) and time.monotonic() < deadline:
                time.sleep(0.5)
            wall = time.monotonic() - began
            machine1 = _machine_busy_seconds()
            replica_cpu = sum(cpu_seconds(c.pid) for c in children) - replicas0
            results = []
            for i, learner in enumerate(learners):
                path = run_dir / f"learner-{i}.json"
                if not path.exists():
                    raise RuntimeError(f"synthetic learner {i} wrote no result:\n{learner.tail()}")
                results.append(json.loads(path.read_text()))
            r = redis.Redis.from_url(redis_server.url)
            logs = [inspect.commit_log(r, "default", p) for p in range(settings.fragments)]
            owners = [r.get(JobKeys("default").owner(p)) for p in range(settings.fragments)]
            r.close()
            owned = {c.name: 0 for c in children}
            for owner in owners:
                if isinstance(owner, bytes):
                    owned[owner.decode().rsplit(" ", 1)[0]] += 1
            rss = [_peak_rss_mb(c.process.pid) for c in children if c.process is not None]
            ports = [c.metrics_port for c in children]
            waits = _phase_means(ports, "atoll_ingest_wait_seconds")
            merge_phases = _phase_means(ports, "atoll_merge_phase_seconds")
            peak, largest = _redis_figures(redis_server.url)
        finally:
            for learner in learners:
                learner.stop()
            for child in children:
                child.stop()
    logged = [e for log in logs for e in log]
    entries = [e for e in logged if "latency_s" in e]
    calls = [float(c) for r in results for c in r["calls_s"]]
    newer, lags = freshness(results, logged)
    refused: dict[str, int] = {}
    for r in results:
        for code, count in r["refused"].items():
            refused[code] = refused.get(code, 0) + int(count)
    latencies = [float(e["latency_s"]) for e in entries]
    seconds = max(r["seconds"] for r in results)
    fragment_mb = n * 4 / 1e6
    bounds = [6 * fragment_mb * owned[c.name] + 500 for c in children]
    return {
        "replicas": replicas,
        "ingest_mb_s": round(sum(r["bytes"] for r in results) / seconds / 1e6, 2),
        "updates_sent": sum(r["sent"] for r in results),
        "updates_received": sum(r["received"] for r in results),
        "pushed_mb_s": round(sum(r["bytes_down"] for r in results) / seconds / 1e6, 2),
        # One Ingest call as its learner saw it, and what the replicas say it waited for.
        "ingest_call_s": _p50_p99(calls),
        "ingest_wait_mean_s": waits,
        # From an update's receipt to its learner's first chunk of a newer version of that
        # fragment (the earliest it sends the fragment again); from a version's commit to
        # a learner's first chunk of it; calls that failed.
        "newer_version_s": _p50_p99(newer),
        "push_lag_s": _p50_p99(lags),
        "calls_refused": refused,
        "merge_phase_mean_s": merge_phases,
        "merges": len(logged),
        "fragments_owned": [owned[c.name] for c in children],
        "peak_rss_mb": [round(x, 1) for x in rss],
        "rss_bound_mb": [round(b, 1) for b in bounds],
        "redis_used_memory_peak_mb": round(peak, 2),
        "max_redis_value_bytes": largest,
        "merge_latency_s": _p50_p99(latencies),
        # Cores busy while the learners ran: the whole machine's (of `cores`), the replicas'
        # and the synthetic learners' (each process's CPU seconds over that time).
        "cpu_cores_busy": {
            "machine": round((machine1 - machine0) / wall, 2),
            "replicas": round(replica_cpu / wall, 2),
            "learners": round(sum(float(r.get("cpu_s", 0.0)) for r in results) / wall, 2),
            "cores": os.cpu_count() or 0,
        },
        # Where each ran (empty: anywhere): `--client-cores`.
        "pinned_cores": {
            "replicas": [list(c) for c in replica_cores],
            "learners": list(client_cores),
        },
        # Where the tail is: [fragment, version, seconds, {phase: seconds}] of the slowest
        # merges (the time from ready to the merge's start is the rest).
        "slowest_merges": [
            [int(e["fragment"]), int(e["version"]), float(e["latency_s"]), e.get("phases_s")]
            for e in sorted(entries, key=lambda e: -float(e["latency_s"]))[:4]
        ],
    }


def run(settings: ScaleBench) -> None:
    import tempfile

    counts = [int(x) for x in settings.replicas.split(",") if x.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="atoll-bench-scale-") as tmp:
        for replicas in counts:
            rows.append(run_replicas(settings, Path(tmp), replicas))
            # A large model's tensor store is tens of GB: gone before the next count.
            shutil.rmtree(Path(tmp) / f"r{replicas}", ignore_errors=True)
            print(json.dumps(rows[-1]), flush=True)
    first, last = rows[0], rows[-1]
    efficiency = (
        last["ingest_mb_s"] / (last["replicas"] / first["replicas"] * first["ingest_mb_s"])
        if first["ingest_mb_s"]
        else 0.0
    )
    latencies = [row["merge_latency_s"]["p99"] for row in rows]
    result = {
        "params": int(settings.params),
        "fragments": settings.fragments,
        "codec": settings.codec,
        "learners": settings.learners,
        "calls": settings.calls,
        "seconds": settings.seconds,
        "replicas": counts,
        "ingest_mb_s": [row["ingest_mb_s"] for row in rows],
        "scaling_efficiency": round(efficiency, 3),
        "merges": sum(row["merges"] for row in rows),
        "peak_rss_mb_per_replica": max(max(row["peak_rss_mb"]) for row in rows),
        "rss_within_bound": all(
            rss <= bound
            for row in rows
            for rss, bound in zip(row["peak_rss_mb"], row["rss_bound_mb"], strict=True)
        ),
        "redis_used_memory_peak_mb": max(row["redis_used_memory_peak_mb"] for row in rows),
        "max_redis_value_bytes": max(row["max_redis_value_bytes"] for row in rows),
        "merge_latency_s": {
            "p50": max(row["merge_latency_s"]["p50"] for row in rows),
            "p99": max(latencies),
        },
        "runs": rows,
    }
    print(json.dumps(result, indent=2))
    if settings.json_path is not None:
        settings.json_path.write_text(json.dumps(result, indent=2) + "\n")
