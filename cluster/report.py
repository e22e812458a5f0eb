"""The run report and the invariants behind it: pure functions over what a run left behind.

Keys are stable (see ARCHITECTURE.md); tools and checks read them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bandwidth import dp_equivalent_bytes
from services.goodput import goodput


@dataclass
class Invariants:
    ok: bool
    lost_updates: int
    double_applied: int
    problems: list[str] = field(default_factory=list)
    # Received (never committed) updates whose round died with its owner and whose learner
    # incarnation died too before sending them again: the protocol's two copies both gone.
    # Not a broken promise (a learner keeps an update until it is committed, no longer than
    # it lives); counted so a soak shows how often it happens.
    dropped_with_sender: int = 0


def dropped_with_sender(dropped: Sequence[str], finished: set[str]) -> list[str]:
    """Of the uids `dropped` with their round (received under an owner epoch that has since
    ended, never received again), those whose incarnation never finished: it died before it
    could send them again. One whose incarnation finished was lost by the protocol."""
    return [uid for uid in dropped if uid.rsplit("/", 2)[1] not in finished]


def check_invariants(
    commit_logs: Sequence[Sequence[dict[str, Any]]],
    versions: Sequence[int],
    accepted: int,
    pending: int,
    learner_checksums: dict[str, Sequence[int]] | None = None,
    global_checksums: Sequence[int] | None = None,
    dropped: int = 0,
) -> Invariants:
    """No acknowledged update lost, none applied twice, versions consecutive, one commit per
    round, and every live learner equal to the global model at the end. `dropped`: updates
    that died with both their round and their sender (`dropped_with_sender`)."""
    problems: list[str] = []
    merged = [uid for log in commit_logs for entry in log for uid in entry["uids"]]
    counts = Counter(merged)
    double = sum(n - 1 for n in counts.values() if n > 1)
    if double:
        problems.append(f"{double} updates were applied more than once")
    lost = max(0, accepted - len(counts) - pending - dropped)
    if lost:
        problems.append(f"{lost} acknowledged updates were never merged")
    for p, log in enumerate(commit_logs):
        seen = [int(e["version"]) for e in log]
        if seen != list(range(1, len(seen) + 1)) or (versions and versions[p] != len(seen)):
            problems.append(f"fragment {p}: versions {seen} are not consecutive from 1")
    if learner_checksums and global_checksums is not None:
        for learner, sums in learner_checksums.items():
            if list(sums) != list(global_checksums):
                problems.append(f"learner {learner} does not hold the final global model")
    return Invariants(not problems, lost, double, problems, dropped)


def merged_by_incarnation(
    commit_logs: Sequence[Sequence[dict[str, Any]]],
) -> dict[str, dict[str, int]]:
    """learner -> incarnation -> updates of that incarnation merged (uids are l/i/seq)."""
    out: dict[str, dict[str, int]] = {}
    for log in commit_logs:
        for entry in log:
            for uid in entry["uids"]:
                learner, incarnation, _ = uid.rsplit("/", 2)
                per = out.setdefault(learner, {})
                per[incarnation] = per.get(incarnation, 0) + 1
    return out


def combine_incarnations(incarnations: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One slot's summary over its incarnations, oldest first: the last one's counts and
    state (steps and tokens carry over restarts), the first measured initial loss, and every
    incarnation's loss and eval points on the first one's clock."""
    first, last = incarnations[0], incarnations[-1]
    t0 = float(first["started_at"])

    def on_first_clock(key: str) -> list[list[Any]]:
        return [
            [float(point[0]) + float(s["started_at"]) - t0, *point[1:]]
            for s in incarnations
            for point in s.get(key, [])
        ]

    initial = [s["loss"]["initial"] for s in incarnations if s["loss"]["initial"] is not None]
    return {
        **last,
        "started_at": t0,
        "incarnations": len(incarnations),
        "loss": {**last["loss"], "initial": initial[0] if initial else None},
        "losses": on_first_clock("losses"),
        "evals": on_first_clock("evals"),
    }


def read_summaries(folder: Path) -> list[dict[str, Any]]:
    """Every slot's summary from `SLOT.N.summary.json` (N: the slot's Nth launch), its
    incarnations combined; a slot whose last incarnation was killed has `partial` set."""
    by_slot: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for path in folder.glob("*.*.summary.json"):
        slot, _, n = path.name.removesuffix(".summary.json").rpartition(".")
        if n.isdigit():
            by_slot.setdefault(slot, []).append((int(n), json.loads(path.read_text())))
    return [
        combine_incarnations([summary for _, summary in sorted(by_slot[slot])])
        for slot in sorted(by_slot)
    ]


def build_report(
    *,
    settings: dict[str, Any],
    summaries: Sequence[dict[str, Any]],
    stats: dict[str, float],
    wall_seconds: float,
    provisioned_seconds: float,
    invariants: Invariants,
    eval_loss: float,
    faults: Sequence[dict[str, Any]] = (),
    started_at: float = 0.0,
    merged: dict[str, dict[str, int]] | None = None,
    commit_logs: Sequence[Sequence[dict[str, Any]]] = (),
    unreported: dict[str, tuple[int, int]] | None = None,
    recommits: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`unreported`: learner slots that wrote no summary (they ended dead), with the steps the
    synchronizer last heard of from them and the tokens each step took."""
    learners = int(settings["learners"])
    parameters = int(summaries[0]["parameters"]) if summaries else 0
    unreported = unreported or {}
    steps_total = sum(int(s["steps"]) for s in summaries)
    steps_total += sum(steps for steps, _ in unreported.values())
    tokens_total = sum(int(s["tokens"]) for s in summaries)
    tokens_total += sum(steps * tokens for steps, tokens in unreported.values())
    up, down = stats.get("bytes_up", 0.0), stats.get("bytes_down", 0.0)
    dp = dp_equivalent_bytes(parameters, learners, steps_total)
    initial = [s["loss"]["initial"] for s in summaries if s["loss"]["initial"] is not None]
    final = [  # a slot that left before its first step has no loss (NaN)
        s["loss"]["final"]
        for s in summaries
        if s["loss"]["final"] is not None and math.isfinite(s["loss"]["final"])
    ]
    useful = stats.get("useful_seconds", 0.0)
    return {
        "learners": learners,
        "fragments": settings["fragments"],
        "inner_steps": settings["inner_steps"],
        "mode": settings["mode"],
        "codec": settings["codec"],
        "parameters": parameters,
        "wall_seconds": round(wall_seconds, 3),
        "started_at": started_at,
        "tokens_total": tokens_total,
        "slots_without_summary": {name: steps for name, (steps, _) in unreported.items()},
        "tokens_merged": round(stats.get("tokens_merged", 0.0)),
        "goodput": round(goodput(useful, provisioned_seconds), 4),
        "useful_seconds": round(useful, 3),
        "provisioned_seconds": round(provisioned_seconds, 3),
        "loss": {
            "initial": sum(initial) / len(initial) if initial else None,
            "final": sum(final) / len(final) if final else None,
        },
        "eval_loss": eval_loss,
        "bytes": {"up": int(up), "down": int(down)},
        "dp_equivalent_bytes": int(dp),
        "bandwidth_reduction": round(dp / (up + down), 2) if up + down else 0.0,
        "versions_committed": int(stats.get("versions_committed", 0)),
        "updates": {
            "accepted": int(stats.get("updates_accepted", 0)),
            "rejected": int(stats.get("updates_rejected", 0)),
            "stale_folded": int(stats.get("stale_folded", 0)),
        },
        "faults": {
            "injected": len(faults),
            "schedule": list(faults),
            # From the tape, when the run keeps one (cluster/check.py).
            **({"recommits": recommits} if recommits is not None else {}),
        },
        "invariants": {
            "ok": invariants.ok,
            "lost_updates": invariants.lost_updates,
            "double_applied": invariants.double_applied,
            "dropped_with_sender": invariants.dropped_with_sender,
            "problems": invariants.problems,
        },
        "data": data_report(summaries),
        "commits": [
            {
                k: e.get(k)
                for k in (
                    "fragment",
                    "version",
                    "learners",
                    "clips",
                    "agreements",
                    "shrinks",
                    "scale",
                    "committed_at",
                )
            }
            for log in commit_logs
            for e in log
        ],
        "per_learner": [
            {
                **{k: s[k] for k in PER_LEARNER_KEYS},
                "merged_by_incarnation": (merged or {}).get(s["learner"], {}),
            }
            for s in summaries
        ],
    }


def data_report(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the run trained and was scored on, from its learners' summaries: the windows of
    every learner's batches together (`fingerprint`: equal for runs that trained on the same
    windows, however many learners split them), the evaluation windows' fingerprint, and how
    the text was read (`capped`: some learner's cap cut its text short)."""
    from learner.data import combine_digests

    facts = [s["data"] for s in summaries if s.get("data")]
    if not facts:
        return {}
    evaluated = {combine_digests([f["evaluated"]])["fingerprint"] for f in facts if f["evaluated"]}
    return {
        "split": facts[0].get("split"),
        "trained": combine_digests([f["trained"] for f in facts]),
        "evaluated": evaluated.pop() if len(evaluated) == 1 else sorted(evaluated),
        "train_bytes": [f.get("train_bytes") for f in facts],
        "cap_bytes": facts[0].get("cap_bytes"),
        "capped": any(f.get("capped") for f in facts),
    }


PER_LEARNER_KEYS = (
    "learner",
    "incarnation",
    "incarnations",
    "loss",
    "steps",
    "tokens",
    "eval_loss",
    "reconnects",
    "badput_seconds",
    "step_time_ema_s",
)
REQUIRED_KEYS = (
    "learners",
    "fragments",
    "inner_steps",
    "mode",
    "codec",
    "wall_seconds",
    "tokens_total",
    "tokens_merged",
    "goodput",
    "loss.initial",
    "loss.final",
    "eval_loss",
    "bytes.up",
    "bytes.down",
    "dp_equivalent_bytes",
    "bandwidth_reduction",
    "versions_committed",
    "updates.accepted",
    "updates.rejected",
    "updates.stale_folded",
    "faults.injected",
    "invariants.ok",
    "invariants.lost_updates",
    "invariants.double_applied",
)


def missing_keys(report: dict[str, Any]) -> list[str]:
    missing = []
    for dotted in REQUIRED_KEYS:
        node: Any = report
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(dotted)
                break
            node = node[part]
    return missing
