"""docs/learner.md's own-loop example, run as written against a real Redis and synchronizer;
it uses only what `learner` names as its public face."""

from __future__ import annotations

import ast
import re
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis

import learner as learner_package
from cluster.redis_server import RedisServer
from learner.settings import LearnerSettings
from tests import support
from tests.conftest import SpawnSynchronizer

DOC = Path(__file__).resolve().parents[1] / "docs" / "learner.md"


def source() -> str:
    """The doc's example as written."""
    code = re.search(r"## Your own training loop.*?```python\n(.*?)```", DOC.read_text(), re.S)
    assert code is not None, "docs/learner.md lost its own-loop example"
    return code.group(1)


def example() -> dict[str, Any]:
    """The namespace of the doc's example (its functions), without its `__main__` part."""
    namespace: dict[str, Any] = {"__name__": "own_loop_example"}
    exec(compile(source(), str(DOC), "exec"), namespace)
    return namespace


def test_the_docs_own_loop_imports_only_the_learner_s_public_names() -> None:
    taken = []
    for node in ast.walk(ast.parse(source())):
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("learner") for a in node.names), ast.unparse(node)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("learner"):
            assert node.module == "learner", ast.unparse(node)
            taken += [a.name for a in node.names]
    assert taken, "the example no longer imports from learner"
    assert set(taken) <= set(learner_package.__all__), taken


def test_the_docs_own_loop_joins_syncs_and_ends_on_the_global_model(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    steps, h, fragments = 60, 10, 2
    # Sync mode (each fragment's round waits for both learners), so the count of rounds is
    # exact: the example's code does not change with the mode.
    sync = spawn_synchronizer(
        "--fragments", str(fragments), "--inner-steps", str(h), "--mode", "sync",
        "--quorum", "2",
    )  # fmt: skip
    ns = example()
    results: dict[str, tuple[Any, dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def learner(name: str) -> None:
        try:
            settings = LearnerSettings(
                synchronizer=[sync.address], id=name, heartbeat_s=0.2, insecure=True
            )
            results[name] = ns["train"](settings, steps)
        except BaseException as err:  # the main thread reports it
            errors.append(err)

    threads = [threading.Thread(target=learner, args=(f"mine-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert sorted(results) == ["mine-0", "mine-1"]
    r = redis.Redis.from_url(redis_server.url)
    committed = [support.version(r, p) for p in range(fragments)]
    assert min(committed) >= steps // h, committed  # every round, both learners' updates
    finals = []
    for name, (params, summary) in results.items():
        assert summary["versions"] == committed, (name, summary["versions"], committed)
        finals.append(jax.tree.leaves(params))
    for a, b in zip(*finals, strict=True):  # both end on the same global model
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x, y = next(ns["batches"](seed=99))
    trained = float(ns["loss_fn"](results["mine-0"][0], x, y))
    assert trained < 0.5 * float(ns["loss_fn"](ns["init"](), x, y))
