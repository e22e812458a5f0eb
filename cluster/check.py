"""`atoll check TAPE`: the run's invariants and goodput, from its tape alone.

- no acknowledged update lost: every update a synchronizer accepted (or a learner saw
  acknowledged as accepted) entered exactly one commit, unless the run ended with it pending,
  or its round died with its owner (the fragment was owned anew after it was received) and
  its learner incarnation died before sending it again (`dropped_with_sender`: a learner keeps
  an update until it is committed, no longer than it lives);
- none applied twice: no update id in two commits;
- each fragment's versions consecutive from 1, each round committed once (two commits of
  one version with different updates is a split brain);
- after the final sync every live learner holds the global model: each learner's last
  `finished` checksums equal the checksums of its fragments' last commits (a slot that left
  the job, `atoll up --scale`, is not held to it).

Beside them, how fast owners came back (`recommits`): after each synchronizer killed, how
long each fragment it owned went without an owner, and how long the updates of it that the
kill caught (in flight, or sent while it had no owner) and that were committed waited for
it; after each Redis restart, how long the updates in flight waited. Each within an owner
lease and RECOMMIT_SLACK_S, and each fragment committing again.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import CliPositionalArg

from cluster.report import Invariants, dropped_with_sender
from services import goodput as gp
from services import tape
from services.config import AtollSettings
from synchronizer.ownership import OWNER_TTL_S

# A killed owner's fragments (every fragment, after a Redis restart) commit again within an
# owner lease and this much: the round's updates are sent again and merged.
RECOMMIT_SLACK_S = 5.0
RECOMMIT_BOUND_S = OWNER_TTL_S + RECOMMIT_SLACK_S


def check_tape(events: Sequence[dict[str, Any]]) -> Invariants:
    problems: list[str] = []
    merged = [e for e in events if e["kind"] == "merged"]
    rounds: dict[tuple[int, int], list[str]] = {}
    for e in merged:
        key = (int(e["fragment"]), int(e["version"]))
        uids = sorted(e["uids"])
        if key in rounds and rounds[key] != uids:
            problems.append(
                f"fragment {key[0]} version {key[1]} was committed twice, with different updates"
            )
        rounds.setdefault(key, uids)
    versions: dict[int, list[int]] = defaultdict(list)
    for fragment, version in sorted(rounds):
        versions[fragment].append(version)
    for fragment, seen in sorted(versions.items()):
        if seen != list(range(1, len(seen) + 1)):
            problems.append(f"fragment {fragment}: versions {seen} are not consecutive from 1")
    counts = Counter(uid for uids in rounds.values() for uid in uids)
    double = sum(n - 1 for n in counts.values() if n > 1)
    if double:
        problems.append(f"{double} updates were applied more than once")
    acknowledged = {str(e["uid"]) for e in events if e["kind"] == "accepted"}
    acknowledged |= {
        str(e["uid"]) for e in events if e["kind"] == "acked" and e.get("status") == "accepted"
    }
    pending = {str(u) for e in events if e["kind"] == "run_ended" for u in e.get("pending", [])}
    unmerged = acknowledged - set(counts) - pending
    finished = {str(e.get("incarnation")) for e in events if e["kind"] == "finished"}
    dropped = set(dropped_with_sender(_dropped(events, unmerged), finished))
    lost = sorted(unmerged - dropped)
    if lost:
        problems.append(f"{len(lost)} acknowledged updates were never merged (first: {lost[0]})")
    problems += _final_models(events, gp.commits(events))
    return Invariants(not problems, len(lost), double, problems, len(dropped))


def _dropped(events: Sequence[dict[str, Any]], uids: set[str]) -> list[str]:
    """Of `uids`, those whose fragment was owned anew after they were last received: their
    round died with its owner's epoch. By the owners' epochs, as Redis orders them, where
    the tape has them; else by the times the lines were written (tapes of older replicas),
    which processes write apart and may order otherwise."""
    received: dict[str, tuple[float, int, int]] = {}  # uid -> when, fragment, epoch
    owned: dict[int, tuple[float, int]] = {}  # fragment -> when last owned anew, epoch
    for e in events:
        if e["kind"] == "accepted" and str(e["uid"]) in uids and "fragment" in e:
            uid, epoch = str(e["uid"]), int(e.get("epoch", 0))
            if uid not in received or epoch >= received[uid][2]:
                received[uid] = (float(e["t"]), int(e["fragment"]), epoch)
        elif e["kind"] == "owned":
            p, epoch = int(e["fragment"]), int(e.get("epoch", 0))
            if p not in owned or epoch >= owned[p][1]:
                owned[p] = (float(e["t"]), epoch)

    def died(t: float, p: int, epoch: int) -> bool:
        if p not in owned:
            return False
        if epoch and owned[p][1]:
            return owned[p][1] > epoch
        return owned[p][0] > t

    return sorted(uid for uid, (t, p, epoch) in received.items() if died(t, p, epoch))


def _final_models(
    events: Sequence[dict[str, Any]], commits: dict[tuple[int, int], dict[str, Any]]
) -> list[str]:
    last: dict[int, dict[str, Any]] = {}
    for (fragment, version), commit in commits.items():
        if fragment not in last or version > int(last[fragment]["version"]):
            last[fragment] = commit
    if not last or any("checksum" not in c for c in last.values()):
        return []
    final = [int(last[p]["checksum"]) for p in sorted(last)]
    finished: dict[str, dict[str, Any]] = {}
    left = gp.slot_ends(events)  # a slot that left the job ends on the model of its leaving
    for e in events:
        if e["kind"] == "finished" and str(e["who"]) not in left:
            finished[str(e["who"])] = e  # each learner's last word
    return [
        f"learner {who} does not hold the final global model"
        for who, e in sorted(finished.items())
        if [int(c) for c in e["checksums"]] != final
    ]


def recommits(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fragment a fault took from its owner (a synchronizer killed: those it owned last;
    Redis restarted: every fragment), how long the fault kept it from committing what it
    was sent (`seconds`): until a replica owned it again (`owned_s`; a killed owner's
    only), and for each of its updates the fault caught (in flight at it, or sent before
    the fragment was owned again: `updates`) that was committed, from the fault or the
    update's sending, whichever came later, to its commit. A caught update never committed
    was refused (stale by the time it could be merged) or dropped with its sender: it is
    counted (`uncommitted`), not waited for. None: the fragment was never owned, or never
    committed, again while the learners trained. What training's end came too soon after
    to be held to the bound is left out.

    A fragment commits only what its learners send, each in its turn: measured from the
    fault to the fragment's next commit, a fault would count the learners' cadence too."""
    ordered = sorted(events, key=lambda e: float(e["t"]))
    ended = next((float(e["t"]) for e in ordered if e["kind"] == "training_ended"), math.inf)
    committed: dict[str, float] = {}
    sent: dict[str, tuple[float, int]] = {}  # uid -> (first sent, fragment)
    merged: list[tuple[float, int]] = []  # (when, fragment)
    for e in ordered:
        if e["kind"] == "merged":
            merged.append((float(e.get("at", e["t"])), int(e["fragment"])))
            for uid in e["uids"]:
                committed.setdefault(str(uid), float(e.get("at", e["t"])))
        elif e["kind"] == "sent":
            sent.setdefault(str(e["uid"]), (float(e["t"]), int(e["fragment"])))
    fragments = sorted({p for _, p in merged})
    owned = [(float(e["t"]), int(e["fragment"])) for e in ordered if e["kind"] == "owned"]

    def held_to_bound(t: float) -> bool:
        return ended >= t + RECOMMIT_BOUND_S  # else training ended first: nothing was left

    owner: dict[int, str] = {}
    out: list[dict[str, Any]] = []
    for e in ordered:
        t = float(e["t"])
        if e["kind"] == "owned":
            owner[int(e["fragment"])] = str(e["who"])
            continue
        if e["kind"] == "killed" and "synchronizer" in e:
            fault = "synchronizer-kill"
            hit = {
                p: next((o for o, q in owned if q == p and o > t), None)
                for p, who in owner.items()
                if who == e["synchronizer"]
            }
        elif e["kind"] == "fault" and e.get("fault") == "redis-restart":
            fault, hit = "redis-restart", dict.fromkeys(fragments, t)
        else:
            continue
        for p, back in sorted(hit.items()):
            recommitted = any(q == p and m > t for m, q in merged)
            if back is None or not recommitted:
                if held_to_bound(t):
                    never = {"owned_s": None, "updates": 0, "uncommitted": 0, "seconds": None}
                    out.append({"fault": fault, "t": t, "fragment": p, **never})
                continue
            caught = [
                (when, committed.get(uid))
                for uid, (when, q) in sent.items()
                if q == p and when < max(back, t) and committed.get(uid, math.inf) > t
            ]
            waits = [back - t] + [done - max(when, t) for when, done in caught if done is not None]
            out.append(
                {
                    "fault": fault,
                    "t": t,
                    "fragment": p,
                    "owned_s": round(back - t, 3) if fault == "synchronizer-kill" else None,
                    "updates": len(caught),
                    "uncommitted": sum(1 for _, done in caught if done is None),
                    "seconds": round(max(waits), 3),
                }
            )
    return out


def recommit_summary(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`recommits`, summed up: how many, the slowest, and how many missed the bound."""
    found = recommits(events)
    seconds = [r["seconds"] for r in found if r["seconds"] is not None]
    late = [r for r in found if r["seconds"] is None or r["seconds"] > RECOMMIT_BOUND_S]
    return {
        "fragments": len(found),
        "slowest_s": max(seconds) if seconds else None,
        "bound_s": RECOMMIT_BOUND_S,
        "late": len(late),
        "late_detail": late[:10],
    }


def summarize(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    inv = check_tape(events)
    g = gp.from_tape(events)
    kinds = Counter(str(e["kind"]) for e in events)
    return {
        "events": len(events),
        "learners": g.learners,
        "commits": len(gp.commits(events)),
        "faults": kinds.get("fault", 0),
        "rejoins": kinds.get("restarted", 0),
        "reconnects": kinds.get("reconnected", 0),
        "training_seconds": round(g.end - g.start, 3),
        "useful_seconds": round(g.useful_s, 3),
        "provisioned_seconds": round(g.provisioned_s, 3),
        "goodput": round(g.goodput, 4),
        "recommits": recommit_summary(events),
        "invariants": {
            "ok": inv.ok,
            "lost_updates": inv.lost_updates,
            "double_applied": inv.double_applied,
            "dropped_with_sender": inv.dropped_with_sender,
            "problems": inv.problems,
        },
    }


class CheckSettings(AtollSettings):
    """`atoll check TAPE`: a run's invariants and goodput from its tape (exit 3 if broken)."""

    tape: CliPositionalArg[Path] = Field(description="tape file written by `atoll up --tape PATH`")
    json_path: Path | None = Field(None, alias="json", description="also write the result here")


def run(settings: CheckSettings) -> int:
    result = summarize(tape.read(settings.tape))
    text = json.dumps(result, indent=2)
    print(text)
    if settings.json_path is not None:
        settings.json_path.write_text(text + "\n")
    return 0 if result["invariants"]["ok"] else 3
