import random

import numpy as np
import pytest

from services.layout import LayoutError, LeafSpec, fragment_layout


def transformer_spec(layers: int = 12, width: int = 64) -> list[LeafSpec]:
    specs = [LeafSpec("embed", (256, width)), LeafSpec("ln_f/scale", (width,))]
    for i in range(layers):
        specs += [
            LeafSpec(f"blocks/{i}/ln1/scale", (width,)),
            LeafSpec(f"blocks/{i}/attn/qkv", (width, 3 * width)),
            LeafSpec(f"blocks/{i}/attn/out", (width, width)),
            LeafSpec(f"blocks/{i}/ln2/scale", (width,)),
            LeafSpec(f"blocks/{i}/mlp/in", (width, 4 * width)),
            LeafSpec(f"blocks/{i}/mlp/out", (4 * width, width)),
        ]
    return specs


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_every_leaf_in_exactly_one_fragment_and_balanced(p: int) -> None:
    specs = transformer_spec()
    layout = fragment_layout(specs, p)
    names = [leaf.name for f in layout.fragments for leaf in f.leaves]
    assert sorted(names) == sorted(s.name for s in specs)
    ideal = sum(s.size for s in specs) / p
    assert max(f.num_elements for f in layout.fragments) <= 4 / 3 * ideal


def test_same_layout_on_every_call_whatever_the_leaf_order() -> None:
    specs = transformer_spec()
    first = fragment_layout(specs, 4)
    shuffled = specs[:]
    random.Random(1).shuffle(shuffled)
    assert fragment_layout(shuffled, 4) == first
    assert fragment_layout(specs, 4) == first


def test_equal_layers_land_strided() -> None:
    layout = fragment_layout(transformer_spec(layers=8), 4)
    for f in layout.fragments:
        layers = {
            int(leaf.name.split("/")[1]) for leaf in f.leaves if leaf.name.startswith("blocks")
        }
        assert layers == {f.index, f.index + 4}


def test_gather_and_scatter_round_trip() -> None:
    specs = transformer_spec(layers=3, width=16)
    layout = fragment_layout(specs, 2)
    rng = np.random.default_rng(0)
    leaves = {s.name: rng.normal(size=s.shape).astype(np.float32) for s in specs}
    for f in layout.fragments:
        back = layout.scatter(f.index, layout.gather(f.index, leaves))
        for name, value in back.items():
            np.testing.assert_array_equal(value, leaves[name])


@pytest.mark.parametrize(
    ("specs", "p", "match"),
    [
        ([LeafSpec("a", (2,))], 2, "at most one fragment per leaf"),
        ([LeafSpec("a", (2,))], 0, "at least 1"),
        ([], 1, "empty"),
        ([LeafSpec("a", (2,)), LeafSpec("a", (3,))], 1, "twice"),
        ([LeafSpec("a", (2,), "int32")], 1, "dtype"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(specs: list[LeafSpec], p: int, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        fragment_layout(specs, p)
