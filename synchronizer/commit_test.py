from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services import codec as codecs
from services.config import JobConfig
from services.tape import Tape
from synchronizer.commit import FragmentState
from synchronizer.core.merge import REGISTRY, StreamingSum, register
from synchronizer.records import Update
from synchronizer.store.tensors import TensorStore
from synchronizer.summing import RoundSums


def _state(tmp_path: Path, config: JobConfig, sums: RoundSums) -> FragmentState:
    """Fragment 0 of `sums`' size, its value all ones, stepped on `sums`' worker."""
    state = FragmentState(
        fragment=0,
        size=sums.size,
        epoch=1,
        replica="r",
        fragments=1,
        config=config,
        store=None,  # type: ignore[arg-type]  # a step touches no store
        tensors=TensorStore(str(tmp_path)),
        tape=Tape(None, "r"),
        ahead=sums.ahead,
    )
    state.theta = np.ones(sums.size, np.float32)
    state.residual = np.zeros(sums.size, np.float32)
    state.state = state.optimizer.init(state.theta)
    return state


@pytest.fixture
def summed_rule() -> Iterator[str]:
    """A merge rule that is not shipped, written as a new rule is: one class over the shared
    streaming-sum mechanics, registered by name."""

    @register
    class Summed(StreamingSum):
        """The round's outer gradients added up at their weights, not averaged."""

        name = "example-sum"
        help = "the token-weighted sum of the outer gradients"

        def gradient_factor(self, scale: float) -> float | None:
            return scale

    try:
        yield Summed.name
    finally:
        del REGISTRY[Summed.name]


def test_a_new_merge_rule_registers_by_name_and_merges_through_the_owners_sums_and_step(
    tmp_path: Path, summed_rule: str
) -> None:
    """Two updates streamed into a round summed by the new rule, the round stepped: the
    fragment moves by -lr times their weighted sum (what its downlink delta does not carry
    is in the residual)."""
    size = 512
    rule = REGISTRY[summed_rule]
    assert (rule.help, rule.sums_in_parts, rule.needs_norms) == (
        "the token-weighted sum of the outer gradients",
        True,
        False,
    )
    config = JobConfig(outer_lr=0.5)
    sums = RoundSums(0, size, (size,), rule, config)
    state = _state(tmp_path, config, sums)
    codec = codecs.by_name("fp32")
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=size).astype(np.float32) for _ in range(2)]
    for k, (delta, weight) in enumerate(zip(deltas, (1.0, 3.0), strict=True)):
        update = Update(f"l{k}", "i", 1, 0, 10, 100, 1.0, weight, (1.0,), codec, 0, sums.current)
        for s in codecs.encode_segments(codec, delta, 0, 400)[0]:
            sums.add_now(update, s.offset, s.count, s.data)
        sums.counted(update)
    sealed = sums.seal()
    assert type(sealed).__name__ == "Summed"
    state.step(sealed, 1.0)
    want = 1.0 - 0.5 * (1.0 * deltas[0] + 3.0 * deltas[1])
    np.testing.assert_allclose(state.theta + state.residual, want, rtol=1e-5, atol=1e-5)
    sums.close()


def test_the_merge_rule_in_the_docs_registers_as_written() -> None:
    text = (Path(__file__).parents[1] / "docs" / "synchronizer.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert example is not None, "docs/synchronizer.md lost its merge rule example"
    try:
        exec(example.group(1), {})
        rule = REGISTRY["summed"]
        assert rule.new(4, (4,)).gradient_factor(0.5) == 0.5
    finally:
        REGISTRY.pop("summed", None)


def test_the_direction_is_kept_only_from_a_round_with_no_clipped_member(tmp_path: Path) -> None:
    """A round stepped as clean sets the direction to its sum's signs; one with a clipped
    member (which can still outweigh the others in the sum) leaves it as it was."""
    size = 256
    config = JobConfig()
    sums = RoundSums(0, size, (size,), REGISTRY[config.merge], config)
    state = _state(tmp_path, config, sums)
    codec = codecs.by_name("fp32")
    rng = np.random.default_rng(1)

    def round_of(delta: np.ndarray, clean: bool) -> None:
        update = Update("l", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 0, sums.current)
        for s in codecs.encode_segments(codec, delta, 0, 400)[0]:
            sums.add_now(update, s.offset, s.count, s.data)
        sums.counted(update)
        state.step(sums.seal(), 1.0, clean)

    first = rng.normal(size=size).astype(np.float32)
    round_of(first, clean=True)
    assert state.direction is not None
    np.testing.assert_array_equal(state.direction, first > 0)
    round_of(-first, clean=False)  # a clipped member in it: the direction stays
    np.testing.assert_array_equal(state.direction, first > 0)
    round_of(-first, clean=True)
    np.testing.assert_array_equal(state.direction, first < 0)
    sums.close()
