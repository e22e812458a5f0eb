"""Loss curves of a run: every learner's training loss and the global model's eval loss on
held-out text, over wall time and over tokens, against chance (a uniform guess over the 256
byte values: ln 256 nats per byte); over wall time, the learners' restarts and the merges
committed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CHANCE = math.log(256)  # nats per byte of a uniform guess over byte values
EVAL_LABEL = "global model, held-out text (eval)"


def plot_losses(
    summaries: Sequence[dict[str, Any]],
    path: Path,
    *,
    restarts: Sequence[float] = (),
    merges: Sequence[float] = (),
) -> list[str]:
    """Write the PNG; return its legend's labels. `restarts` and `merges`: when learner
    slots were restarted and merges committed (Unix times)."""
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    # One clock for the run: each slot's points (every incarnation, `combine_incarnations`)
    # are seconds from its own first start, which may come after the run's.
    t0 = min((float(s["started_at"]) for s in summaries), default=0.0)
    for s in summaries:
        losses = s["losses"]
        if not losses:
            continue
        t, _, tokens, loss = zip(*losses, strict=True)
        t = tuple(x + float(s["started_at"]) - t0 for x in t)
        by_time.plot(t, loss, lw=1, alpha=0.8, label=s["learner"])
        by_tokens.plot(tokens, loss, lw=1, alpha=0.8, label=s["learner"])
    evals = sorted(
        (e[0] + float(s["started_at"]) - t0, *e[1:]) for s in summaries for e in s["evals"]
    )
    if evals:
        t, _, tokens, loss = zip(*evals, strict=True)
        by_time.plot(t, loss, "k.", ms=5, label=EVAL_LABEL)
        by_tokens.plot(tokens, loss, "k.", ms=5, label=EVAL_LABEL)
    for ax in (by_time, by_tokens):
        ax.axhline(CHANCE, ls=":", color="0.4", lw=1, label="chance (uniform over 256 bytes)")
    for i, at in enumerate(sorted(restarts)):
        label = "learner restarted" if i == 0 else None
        by_time.axvline(at - t0, color="tab:red", ls="--", lw=0.8, alpha=0.7, label=label)
    if merges:
        # A tick along the bottom per merge (x: the run's clock; y: the axes' own).
        by_time.plot(
            [m - t0 for m in merges],
            [0.02] * len(merges),
            "|",
            color="0.3",
            ms=8,
            transform=by_time.get_xaxis_transform(),
            label="merge committed",
        )
    by_time.set_xlabel("wall time (s)")
    by_tokens.set_xlabel("tokens per learner")
    by_time.set_ylabel("loss (nats per byte)")
    for ax in (by_time, by_tokens):
        ax.grid(alpha=0.3)
    by_tokens.legend(fontsize=8)
    by_time.legend(fontsize=8)
    labels = sorted(
        {h.get_label() for ax in (by_time, by_tokens) for h in ax.get_legend_handles_labels()[0]}
    )
    fig.suptitle("atoll: learners' training loss and the global model's eval loss on held-out text")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels
