"""`make test`'s two workers: which tests go to a worker together (tests/conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import UNTIMED_CLUSTERS, WHOLE_CLUSTERS, WHOLE_CLUSTERS_SCOPE, scope_of

HERE = Path(__file__).parent
RUNS_A_CLUSTER = re.compile(r'atoll_command\("(up|bench)"|from tests\.test_up import up\b')


def test_whole_cluster_tests_share_one_scope_and_every_other_test_goes_alone() -> None:
    assert scope_of("tests/test_faults.py::test_a") == WHOLE_CLUSTERS_SCOPE
    assert scope_of("tests/test_up.py::test_b[x-1]") == WHOLE_CLUSTERS_SCOPE
    for alone in (
        "tests/test_hostile.py::test_c",
        "services/codec_test.py::test_d[int8]",
        "tests/test_bench_quality.py::test_e",  # trains, times nothing: beside the chain
    ):
        assert scope_of(alone) == alone


def test_every_module_that_runs_a_cluster_or_a_bench_is_one_of_them() -> None:
    assert not WHOLE_CLUSTERS & UNTIMED_CLUSTERS
    for name in WHOLE_CLUSTERS | UNTIMED_CLUSTERS:
        assert (HERE / f"{name}.py").exists(), f"{name} is listed but gone"
    runs = {p.stem for p in HERE.glob("test_*.py") if RUNS_A_CLUSTER.search(p.read_text())}
    assert runs, "the pattern finds no module: it no longer matches how tests run atoll"
    assert runs <= WHOLE_CLUSTERS | UNTIMED_CLUSTERS, runs - WHOLE_CLUSTERS - UNTIMED_CLUSTERS
