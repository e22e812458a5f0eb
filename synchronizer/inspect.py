"""Reading a job's state from outside a replica (tools, the live view, tests), through the one
key schema. Synchronous: these callers hold a plain `redis.Redis`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import obstore

from services.codec import by_name, checksum
from services.layout import LeafSpec
from synchronizer import values
from synchronizer.store.keys import JobKeys
from synchronizer.store.tensors import TensorStore, version_of


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def job_config(r: Any, job: str) -> dict[str, Any] | None:
    """The job's algorithm settings as the synchronizer stored them (None: no such job)."""
    stored = r.get(JobKeys(job).config)
    return None if stored is None else dict(json.loads(_s(stored)))


def job_spec(r: Any, job: str) -> list[LeafSpec] | None:
    """The job's parameter spec (None: no learner has joined it yet)."""
    stored = r.get(JobKeys(job).spec)
    if stored is None:
        return None
    return [LeafSpec(name, tuple(shape), dtype) for name, shape, dtype in json.loads(_s(stored))]


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


def dropped(r: Any, job: str, fragments: int) -> list[str]:
    """Uids received into a round that died with its owner's epoch (the fragment was owned
    anew since) and never received again: only their learner can still send them."""
    keys = JobKeys(job)
    out: list[str] = []
    for p in range(fragments):
        epoch = int(r.get(keys.epoch(p)) or 0)
        prefix = keys.seen(p, "")  # ...:seen: then the learner slot's id
        for key in r.scan_iter(match=_glob_escape(prefix) + "*"):
            learner = _s(key)[len(prefix) :]
            records = {_s(k): _s(v) for k, v in r.hgetall(key).items()}
            incarnation = records.pop("incarnation", "")
            records.pop("generation", None)
            for seq, record in records.items():
                received, _, state = record.split(" ")
                if state == "r" and int(received) < epoch:
                    out.append(f"{learner}/{incarnation}/{seq}")
    return sorted(out)


def _glob_escape(text: str) -> str:
    """`text` matched literally by a Redis SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def commit_log(r: Any, job: str, fragment: int) -> list[dict[str, Any]]:
    return [json.loads(e) for e in r.lrange(JobKeys(job).log(fragment), 0, -1)]


def value_name(r: Any, job: str, fragment: int) -> str | None:
    name = r.hget(JobKeys(job).frag(fragment), "value")
    return None if name is None else _s(name)


def read_object(tensor_store: str, name: str) -> bytes:
    """One object of the tensor store (a value a pointer names), read synchronously."""
    store = TensorStore(tensor_store)
    return bytes(obstore.get(store._store, name).bytes())


def committed_value(
    r: Any, job: str, fragment: int, tensor_store: str
) -> tuple[int, np.ndarray] | None:
    """A fragment's committed version and float32 value: the keyframe its pointer names plus
    the deltas committed since (values.py). None: no value yet."""
    keys = JobKeys(job)
    fields = {_s(k): _s(v) for k, v in r.hgetall(keys.frag(fragment)).items()}
    config = job_config(r, job)
    if "version" not in fields or config is None:
        return None
    version, name = int(fields["version"]), fields["value"]
    after = version_of(name)
    names: list[str] = []
    if version > after:  # the log's last entries are the versions since the keyframe
        entries = [json.loads(e) for e in r.lrange(keys.log(fragment), after - version, -1)]
        names = values.delta_names(entries, after, version)
    base = np.frombuffer(read_object(tensor_store, name), "<f4")
    deltas = [read_object(tensor_store, n) for n in names]
    codec = by_name(str(config["downlink_codec"]))
    return version, values.rebuild(base, deltas, codec, int(config["block_size"]))


def global_value(r: Any, job: str, fragment: int, tensor_store: str) -> bytes | None:
    """The committed float32 value of a fragment, as bytes."""
    found = committed_value(r, job, fragment, tensor_store)
    return None if found is None else found[1].tobytes()


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
