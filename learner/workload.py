"""What a learner trains: parameters, a loss and batches. The built-in byte transformer, or
any model a user names as `module:function`.

A user function receives the learner's settings and returns a `Workload`. Its parameters
may be any pytree of float arrays: leaves are named by their paths (`a/b/0`), which is what
the fragment layout and the wire see.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

from learner.data import Batches, cached_corpus, eval_batches
from learner.model import TransformerConfig, init_params, make_loss, resolve_dtype
from learner.settings import data_shard

if TYPE_CHECKING:
    from learner.settings import LearnerSettings

FlatParams = dict[str, jax.Array]


@dataclass
class Workload:
    """`params`: the initial parameters, or a function that makes them. A function is called
    only when the values are needed (the first learner of a job sends them; a learner joining
    a job still at its initial values compares them): a restarted learner that restores its
    checkpoint and fetches the global model never spends time making values it overwrites.

    `optimizer`: the inner optimizer (any optax transformation over the parameters); None:
    AdamW with warm-up and cosine decay from the learner's flags (`learner.loop.adamw`)."""

    params: Any  # pytree of float32 arrays, or a function returning one
    loss_fn: Callable[[Any, jax.Array], jax.Array]
    batches: Batches
    eval_batches: list[np.ndarray]
    tokens_per_batch: int
    optimizer: optax.GradientTransformation | None = None
    # How the training text was read (learner.data.Corpus.facts); {} for a workload's own.
    data_facts: dict[str, Any] = field(default_factory=dict)

    def initial(self) -> Any:
        """The initial parameters (made once, on first use)."""
        if callable(self.params):
            self.params = self.params()
        return self.params

    def make(self) -> Any:
        """The initial parameters, made anew and not kept: what a caller that traces the
        making (to make each process only its own shards) calls."""
        return self.params() if callable(self.params) else self.params

    def shapes(self) -> Any:
        """The parameters' shapes and dtypes, without making their values."""
        return jax.eval_shape(self.params if callable(self.params) else lambda: self.params)


def _name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


@dataclass
class Named:
    """A pytree seen as a flat dict of named leaves, and back."""

    names: list[str]
    treedef: Any

    @classmethod
    def of(cls, tree: Any) -> Named:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        return cls([_name(path) for path, _ in leaves], treedef)

    def flatten(self, tree: Any) -> FlatParams:
        return dict(zip(self.names, jax.tree.leaves(tree), strict=True))

    def unflatten(self, flat: FlatParams) -> Any:
        return jax.tree.unflatten(self.treedef, [flat[n] for n in self.names])


def builtin(settings: LearnerSettings) -> Workload:
    cfg = TransformerConfig(
        settings.layers,
        settings.width,
        settings.heads,
        settings.context,
        compute_dtype=resolve_dtype(settings.dtype),
    )
    shard = data_shard(settings)
    corpus = cached_corpus(
        settings.data,
        shard,
        settings.num_shards,
        settings.state_dir,
        settings.eval_data,
        settings.data_split,
        settings.max_corpus_bytes,
    )
    # files: each shard in an order of its own; windows: one stream, this learner's part of
    # each global batch.
    whole = settings.data_split == "windows"
    batches = Batches(
        corpus.train,
        settings.batch_size,
        settings.context,
        seed=settings.seed * 100_003 + (0 if whole else shard),
        part=shard if whole else 0,
        parts=settings.num_shards if whole else 1,
    )
    return Workload(
        params=partial(init_params, cfg, settings.seed),
        loss_fn=make_loss(cfg),
        batches=batches,
        eval_batches=eval_batches(
            corpus.eval,
            settings.batch_size,
            settings.context,
            settings.eval_windows or settings.eval_batches * settings.batch_size,
        ),
        tokens_per_batch=settings.batch_size * settings.context,
        data_facts=corpus.facts,
    )


def load(settings: LearnerSettings) -> Workload:
    if settings.model == "builtin":
        return builtin(settings)
    module_name, sep, function = settings.model.partition(":")
    if not sep:
        raise ValueError(f"--model {settings.model!r}: use 'builtin' or 'module:function'")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {settings.model!r} cannot be loaded: {err}") from None
    workload = factory(settings)
    if not isinstance(workload, Workload):
        raise ValueError(f"--model {settings.model!r} must return a learner.workload.Workload")
    return workload
