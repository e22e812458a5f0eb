import pytest

from sim.plan import bits_per_value, plan


def test_codec_bits_include_block_scales() -> None:
    assert bits_per_value("fp32") == 32.0
    assert bits_per_value("int8") == pytest.approx(8.125)
    assert bits_per_value("int4") == pytest.approx(4.125)


def test_data_parallel_reproduces_the_formula_and_atoll_scales_with_its_knobs() -> None:
    p = plan(1e9, 1.0, 2, 100, 4, 5, "int4", "int4", utilization=0.9)
    # 2(M-1)/M x 4 bytes x 1e9 over 1/9 s: 36 GB/s = 288 Gbps.
    assert p.dp_gbps == pytest.approx(288.0)
    # A fragment round trip (1e9/4 x 8.25 bits) over tau + (H/P)(1/u - 1) steps.
    assert p.atoll_gbps == pytest.approx(1e9 / 4 * 8.25 / 1e9 / (5 + 25 / 9))
    assert plan(1e9, 1.0, 2, 100, 4, 10).atoll_gbps < p.atoll_gbps  # more overlap, less
    assert plan(1e9, 1.0, 2, 200, 4, 5).atoll_mean_gbps == pytest.approx(p.atoll_mean_gbps / 2)
    assert plan(1e9, 1.0, 2, 100, 4, 5, "int8", "int8").atoll_gbps > p.atoll_gbps
    with pytest.raises(ValueError, match="utilization"):
        plan(1e9, 1.0, 2, 100, 4, 5, utilization=1.0)
