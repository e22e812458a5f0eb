"""Loss curves of a run: every learner's training loss and the global model's eval loss,
over wall time and over tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_losses(summaries: Sequence[dict[str, Any]], path: Path) -> None:
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
        by_time.plot(t, loss, "k.", ms=5, label="global model (eval)")
        by_tokens.plot(tokens, loss, "k.", ms=5, label="global model (eval)")
    by_time.set_xlabel("wall time (s)")
    by_tokens.set_xlabel("tokens per learner")
    by_time.set_ylabel("loss (nats per byte)")
    for ax in (by_time, by_tokens):
        ax.grid(alpha=0.3)
    by_tokens.legend(fontsize=8)
    fig.suptitle("atoll: learners' training loss and the global model's eval loss")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
