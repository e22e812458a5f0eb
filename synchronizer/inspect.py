"""Reading a job's state from outside a replica (tools, the live view, tests), through the one
key schema. Synchronous: these callers hold a plain `redis.Redis`."""

from __future__ import annotations

import json
from typing import Any

import obstore

from services.codec import checksum
from synchronizer.keys import JobKeys
from synchronizer.tensors import TensorStore


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def versions(r: Any, job: str, fragments: int) -> list[int]:
    keys = JobKeys(job)
    return [int(r.hget(keys.frag(p), "version") or 0) for p in range(fragments)]


def stats(r: Any, job: str, fragments: int) -> dict[str, float]:
    """The job's counters: job-wide plus every fragment's, summed."""
    keys = JobKeys(job)
    out: dict[str, float] = {}
    for name in [keys.stats, *(keys.fragment_stats(p) for p in range(fragments))]:
        for k, v in r.hgetall(name).items():
            out[_s(k)] = out.get(_s(k), 0.0) + float(v)
    return out


def pending(r: Any, job: str, fragments: int) -> list[str]:
    """Uids received into open rounds, not merged yet."""
    keys = JobKeys(job)
    return sorted(_s(u) for p in range(fragments) for u in r.hkeys(keys.round(p)))


def commit_log(r: Any, job: str, fragment: int) -> list[dict[str, Any]]:
    return [json.loads(e) for e in r.lrange(JobKeys(job).log(fragment), 0, -1)]


def value_name(r: Any, job: str, fragment: int) -> str | None:
    name = r.hget(JobKeys(job).frag(fragment), "value")
    return None if name is None else _s(name)


def global_value(r: Any, job: str, fragment: int, tensor_store: str) -> bytes | None:
    """The committed float32 value of a fragment, from the tensor store."""
    name = value_name(r, job, fragment)
    if name is None:
        return None
    store = TensorStore(tensor_store)
    return bytes(obstore.get(store._store, name).bytes())


def global_checksums(r: Any, job: str, fragments: int, tensor_store: str) -> list[int]:
    out = []
    for p in range(fragments):
        value = global_value(r, job, p, tensor_store)
        out.append(checksum(value) if value is not None else -1)
    return out


def learners(r: Any, job: str) -> dict[str, dict[str, str]]:
    keys = JobKeys(job)
    out = {}
    for name, expiry in r.zrange(keys.learners, 0, -1, withscores=True):
        fields = {_s(k): _s(v) for k, v in r.hgetall(keys.learner(_s(name))).items()}
        fields["lease_expiry_ms"] = str(expiry)
        out[_s(name)] = fields
    return out


def slot_steps(r: Any, job: str) -> dict[str, int]:
    return {_s(k): int(float(v)) for k, v in r.hgetall(JobKeys(job).slot_steps).items()}
