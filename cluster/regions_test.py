"""The regions' plan: names, addresses and commands, checked without root or a network."""

from __future__ import annotations

import ipaddress

import pytest

from cluster import regions
from cluster.regions import LinkShape, Region, RegionError


def test_regions_parse_in_order_and_number_the_learners_through_them() -> None:
    parsed = regions.parse_regions("us:2, eu:1,asia:3")
    assert parsed == [Region("us", 2), Region("eu", 1), Region("asia", 3)]
    plan = regions.plan(parsed, LinkShape(100_000_000), owner=4242)
    assert plan.learners == 6
    assert [plan.of_learner(k).region.name for k in range(6)] == ["us"] * 2 + ["eu"] + ["asia"] * 3
    with pytest.raises(IndexError):
        plan.of_learner(6)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "at least one region"),
        ("us", "whole number"),
        ("us:x", "whole number"),
        ("us:0", "at least one learner"),
        ("US:1", "lower-case"),
        ("hub:1", "not 'hub'"),
        ("us:1,us:2", "named twice"),
        ("averyverylongname:1", "lower-case"),
    ],
)
def test_a_wrong_regions_flag_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(RegionError, match=says):
        regions.parse_regions(text)


def test_a_link_parses_rate_units_and_an_optional_delay() -> None:
    assert regions.parse_link("rate=100mbit") == LinkShape(100_000_000, 0.0)
    assert regions.parse_link("rate=2.5gbit, delay=40ms") == LinkShape(2_500_000_000, 0.04)
    assert regions.parse_link("delay=1s,rate=512kbit") == LinkShape(512_000, 1.0)
    assert regions.parse_link("rate=100mbit").rate_bytes_s == 12_500_000


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "needs rate="),
        ("rate=100mb", "needs rate="),
        ("rate=100mbit,delay=40", "needs ms or s"),
        ("rate=100mbit,loss=1%", "not rate=RATE or delay=DELAY"),
        ("rate=10bit", "below 8kbit"),
    ],
)
def test_a_wrong_link_flag_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(RegionError, match=says):
        regions.parse_link(text)


def test_the_bucket_holds_a_gso_segment_and_ten_milliseconds_at_high_rates() -> None:
    assert LinkShape(10_000_000).burst_bytes >= 64 * 1024
    assert LinkShape(10_000_000_000).burst_bytes == 12_500_000


def test_names_fit_the_kernel_and_addresses_stay_in_the_benchmarking_range() -> None:
    plan = regions.plan(regions.parse_regions("us:1,eu:1"), LinkShape(10**8), owner=4194304)
    bench = ipaddress.ip_network("198.18.0.0/15")
    assert plan.hub == "atoll-4194304-hub"
    assert [link.namespace for link in plan.links] == ["atoll-4194304-us", "atoll-4194304-eu"]
    for link in plan.links:
        assert len(link.hub_end) <= 15
        assert len(link.region_end) <= 15
        for address in (link.hub_address, link.region_address, regions.HUB_ADDRESS):
            assert ipaddress.ip_address(address) in bench
    ends = [e for link in plan.links for e in (link.hub_end, link.region_end)]
    assert len(set(ends)) == len(ends)
    assert len({link.hub_address for link in plan.links}) == 2


def test_every_command_names_its_namespace_and_both_ends_are_shaped() -> None:
    plan = regions.plan(regions.parse_regions("us:1,eu:2"), LinkShape(10**8), owner=77)
    commands = plan.setup_commands()
    for command in commands:
        in_a_namespace = (
            command[:3] == ["ip", "netns", "add"]
            or command[:3] == ["ip", "netns", "exec"]
            or command[1] == "-n"
        )
        assert in_a_namespace, command
        assert any(ns in command for ns in plan.namespaces), command
    shaped = {(c[2], c[6]) for c in commands if c[0] == "tc"}
    expected = {(plan.hub, link.hub_end) for link in plan.links}
    expected |= {(link.namespace, link.region_end) for link in plan.links}
    assert shaped == expected
    tbf = next(c for c in commands if c[0] == "tc")
    assert tbf[tbf.index("rate") + 1] == "100000000bit"
    # The hub exists before anything is put in it; the regions are removed before the hub.
    assert commands[0] == ["ip", "netns", "add", plan.hub]
    assert plan.teardown_commands()[-1] == ["ip", "netns", "delete", plan.hub]
    assert plan.in_region(2, ["x"]) == ["ip", "netns", "exec", "atoll-77-eu", "x"]


def test_only_the_namespaces_of_dead_runs_are_stale() -> None:
    names = ["atoll-10-hub", "atoll-10-us", "atoll-11-us", "atoll-x-us", "other", "atoll-12"]
    assert regions.stale(names, alive={11}) == ["atoll-10-hub", "atoll-10-us"]


def test_link_counters_and_utilisation_read_the_hub_end() -> None:
    stats = {"stats64": {"tx": {"bytes": 3000, "packets": 3}, "rx": {"bytes": 1000, "packets": 1}}}
    qdisc = {"bytes": 2900, "drops": 1, "overlimits": 4, "options": {"rate": 12_500_000}}
    counters = regions.link_counters(stats, qdisc)
    assert counters["bytes_down"] == 3000
    assert counters["bytes_up"] == 1000
    assert counters["shaped_drops_down"] == 1
    assert counters["shaped_rate_bits_s"] == 100_000_000
    use = regions.utilisation(counters, LinkShape(8_000), seconds=2.0)  # 2000 bytes capacity
    assert use == {"down": 1.5, "up": 0.5}


def test_without_root_the_refusal_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    problem = regions.refused()
    assert problem is not None
    assert "needs root" in problem
    assert "\n" not in problem
