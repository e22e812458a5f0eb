"""Regions on one machine: network namespaces joined to a hub by links the kernel shapes.

`atoll up --regions 'us:2,eu:2' --link 'rate=100mbit'` puts each region in a network
namespace of its own and joins it to a hub namespace by a veth pair; both ends of the pair
are capped by a token bucket (`tbf`), so each direction of the region's link carries at most
the rate. Redis, the synchronizer replicas (listening on the hub's address) and `atoll up`
itself live in the hub; the learners of a region are started inside its namespace, so every
byte between a learner and the synchronizers crosses its region's shaped link. Learners of
two regions reach each other through the hub (it forwards), across both their links.

Addresses come from 198.18.0.0/15 (the benchmarking range) and exist only inside the
namespaces the run made: the hub holds 198.18.0.1 on its loopback, region i (from 1) has
198.18.i.0/24 on its link, the hub's end .1 and the region's end .2. Nothing in the host's
namespace changes. Namespace names carry the PID of the `atoll up` that made them, so a run
can tell the leftovers of a run that died (SIGKILL) from those of one still running.

The plan (names, addresses, the `ip`/`tc` commands) is pure and tested without root; the
few functions at the bottom run it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_ADDRESS = "198.18.0.1"  # where the synchronizers listen, on the hub's loopback
NETNS_DIR = Path("/run/netns")
PREFIX = "atoll-"
MAX_REGIONS = 32
CLONE_NEWNET = 0x40000000
_REGION_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit|bit)?$")
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")
_OURS = re.compile(r"^atoll-(\d+)-([a-z][a-z0-9]*)$")


class RegionError(ValueError):
    """A --regions or --link the user wrote that cannot be run (the message says why)."""


@dataclass(frozen=True)
class Region:
    name: str
    learners: int


@dataclass(frozen=True)
class LinkShape:
    """What each region's link to the hub is: a rate cap each way (the kernel's tbf), and a
    one-way delay added by atoll's proxy (this kernel may have no netem)."""

    rate_bits_s: int
    delay_s: float = 0.0

    @property
    def rate_bytes_s(self) -> float:
        return self.rate_bits_s / 8

    @property
    def burst_bytes(self) -> int:
        """The bucket: 10 ms at the rate, and at least a 64 KiB segment (GSO) and a few."""
        return max(int(self.rate_bytes_s / 100), 96 * 1024)


def parse_regions(text: str) -> list[Region]:
    """'us:2,eu:2' -> regions in that order, learners numbered through them."""
    regions: list[Region] = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, _, count = part.partition(":")
        name = name.strip()
        if not _REGION_NAME.match(name) or name == "hub":
            raise RegionError(
                f"--regions: region name {name!r}: use a lower-case letter then up to 11 "
                "letters or digits (not 'hub'), e.g. --regions 'us:2,eu:2'"
            )
        try:
            learners = int(count)
        except ValueError:
            raise RegionError(
                f"--regions: {part!r} needs NAME:LEARNERS with a whole number, e.g. 'us:2'"
            ) from None
        if learners < 1:
            raise RegionError(f"--regions: region {name} needs at least one learner")
        if any(r.name == name for r in regions):
            raise RegionError(f"--regions: region {name} is named twice")
        regions.append(Region(name, learners))
    if not regions:
        raise RegionError("--regions: give at least one region, e.g. --regions 'us:2,eu:2'")
    if len(regions) > MAX_REGIONS:
        raise RegionError(f"--regions: at most {MAX_REGIONS} regions, not {len(regions)}")
    return regions


def parse_link(text: str) -> LinkShape:
    """'rate=100mbit,delay=40ms': rate in bit, kbit, mbit or gbit per second (required);
    delay in ms or s (optional)."""
    values: dict[str, str] = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("rate", "delay"):
            raise RegionError(
                f"--link: {part!r} is not rate=RATE or delay=DELAY; e.g. "
                "--link 'rate=100mbit,delay=40ms'"
            )
        values[key.strip()] = value.strip().lower()
    rate = _RATE.match(values.get("rate", ""))
    if rate is None:
        raise RegionError(
            "--link needs rate=RATE with a unit of bit, kbit, mbit or gbit, e.g. "
            f"--link 'rate=100mbit' (got {text!r})"
        )
    unit = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
    bits = int(float(rate.group(1)) * unit[rate.group(2) or "bit"])
    if bits < 8_000:
        raise RegionError(f"--link: rate {values['rate']} is below 8kbit; give a higher rate")
    delay_s = 0.0
    if "delay" in values:
        delay = _DELAY.match(values["delay"])
        if delay is None:
            raise RegionError(f"--link: delay {values['delay']!r} needs ms or s, e.g. delay=40ms")
        delay_s = float(delay.group(1)) / (1000 if delay.group(2) == "ms" else 1)
    return LinkShape(bits, delay_s)


@dataclass(frozen=True)
class RegionLink:
    """One region's namespace and its veth pair to the hub."""

    region: Region
    index: int  # 1..: the third octet of its subnet
    namespace: str
    hub_end: str  # interface name in the hub
    region_end: str  # interface name in the region
    first_learner: int  # learner slots [first_learner, first_learner + learners)

    @property
    def hub_address(self) -> str:
        return f"198.18.{self.index}.1"

    @property
    def region_address(self) -> str:
        return f"198.18.{self.index}.2"


@dataclass(frozen=True)
class RegionPlan:
    """Every name, address and command of one run's regions."""

    owner: int  # PID of the `atoll up` that makes them
    hub: str
    links: tuple[RegionLink, ...]
    shape: LinkShape

    @property
    def learners(self) -> int:
        return sum(link.region.learners for link in self.links)

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, *(link.namespace for link in self.links)]

    def of_learner(self, slot: int) -> RegionLink:
        for link in self.links:
            if link.first_learner <= slot < link.first_learner + link.region.learners:
                return link
        raise IndexError(f"learner {slot}: no region holds it")

    def setup_commands(self) -> list[list[str]]:
        """The `ip`/`tc`/`sysctl` commands that make it, in order; each names its namespace
        (`ip -n`, `tc -n`, `ip netns exec`), so none runs in the host's."""
        hub = self.hub
        commands = [
            ["ip", "netns", "add", hub],
            ["ip", "-n", hub, "link", "set", "lo", "up"],
            ["ip", "-n", hub, "addr", "add", f"{HUB_ADDRESS}/32", "dev", "lo"],
            ["ip", "netns", "exec", hub, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
        ]
        for link in self.links:
            ns, subnet = link.namespace, f"198.18.{link.index}"
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                self.veth_command(link),
                ["ip", "-n", hub, "addr", "add", f"{subnet}.1/24", "dev", link.hub_end],
                ["ip", "-n", ns, "addr", "add", f"{subnet}.2/24", "dev", link.region_end],
                ["ip", "-n", hub, "link", "set", link.hub_end, "up"],
                ["ip", "-n", ns, "link", "set", link.region_end, "up"],
                ["ip", "-n", ns, "route", "add", "default", "via", f"{subnet}.1"],
                self.shape_command(hub, link.hub_end),
                self.shape_command(ns, link.region_end),
            ]
        return commands

    def veth_command(self, link: RegionLink) -> list[str]:
        """The pair, made in the hub with its region's end moved into the region."""
        return [
            "ip", "-n", self.hub, "link", "add", link.hub_end, "type", "veth",
            "peer", "name", link.region_end, "netns", link.namespace,
        ]  # fmt: skip

    def shape_command(self, namespace: str, device: str) -> list[str]:
        """A token bucket at the link's rate on `device`'s egress: one direction each end."""
        return [
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{self.shape.rate_bits_s}bit",
            "burst", str(self.shape.burst_bytes),
            "latency", "200ms",
        ]  # fmt: skip

    def teardown_commands(self) -> list[list[str]]:
        """Regions first (deleting a namespace deletes its veth end, and so the pair), the
        hub last."""
        return [["ip", "netns", "delete", ns] for ns in reversed(self.namespaces)]

    def in_region(self, slot: int, command: list[str]) -> list[str]:
        """`command` run inside learner `slot`'s region."""
        return ["ip", "netns", "exec", self.of_learner(slot).namespace, *command]


def plan(regions: list[Region], shape: LinkShape, owner: int) -> RegionPlan:
    links: list[RegionLink] = []
    first = 0
    for index, region in enumerate(regions, start=1):
        links.append(
            RegionLink(
                region=region,
                index=index,
                namespace=f"{PREFIX}{owner}-{region.name}",
                hub_end=f"a{owner}h{index}"[-15:],  # interface names: at most 15 bytes
                region_end=f"a{owner}r{index}"[-15:],
                first_learner=first,
            )
        )
        first += region.learners
    return RegionPlan(owner, f"{PREFIX}{owner}-hub", tuple(links), shape)


def stale(namespaces: list[str], alive: set[int]) -> list[str]:
    """Namespaces an `atoll up` made whose PID is no longer running (it was killed)."""
    out = []
    for name in namespaces:
        match = _OURS.match(name)
        if match and int(match.group(1)) not in alive:
            out.append(name)
    return out


def link_counters(stats: dict[str, Any], qdisc: dict[str, Any]) -> dict[str, int]:
    """Bytes each way over a link from its hub end's counters (`ip -j -s link`, `tc -j -s
    qdisc`): the hub end sends downstream (to the region) and receives upstream."""
    counters = stats.get("stats64") or stats.get("stats") or {}
    return {
        "bytes_down": int(counters.get("tx", {}).get("bytes", 0)),
        "bytes_up": int(counters.get("rx", {}).get("bytes", 0)),
        "packets_down": int(counters.get("tx", {}).get("packets", 0)),
        "packets_up": int(counters.get("rx", {}).get("packets", 0)),
        "shaped_bytes_down": int(qdisc.get("bytes", 0)),
        "shaped_drops_down": int(qdisc.get("drops", 0)),
        "shaped_overlimits_down": int(qdisc.get("overlimits", 0)),
        "shaped_rate_bits_s": int(qdisc.get("options", {}).get("rate", 0)) * 8,  # tc: bytes/s
    }


def utilisation(counters: dict[str, int], shape: LinkShape, seconds: float) -> dict[str, float]:
    """The share of the link's capacity each direction used over `seconds`."""
    capacity = shape.rate_bytes_s * max(seconds, 1e-9)
    return {
        "down": round(counters["bytes_down"] / capacity, 4),
        "up": round(counters["bytes_up"] / capacity, 4),
    }


# --- the shell: runs the plan (needs root) -------------------------------------------------
def refused() -> str | None:
    """Why this process cannot make regions, or None."""
    if os.geteuid() != 0:
        return (
            "--regions needs root (it creates network namespaces and veth links, and shapes "
            "them with tc); run atoll up as root, e.g. sudo .venv/bin/atoll up --regions ..."
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"--regions needs {' and '.join(missing)} (apt-get install iproute2)"
    return None


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def existing() -> list[str]:
    done = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete the namespaces of `atoll up` runs that were killed before they could."""
    gone = stale(existing(), {int(p) for p in os.listdir("/proc") if p.isdigit()})
    for name in gone:
        _run(["ip", "netns", "delete", name])
    return gone


def create(region_plan: RegionPlan) -> None:
    """Make the namespaces and links; a step that fails raises, saying which command failed
    and why (the caller removes what was made)."""
    for command in region_plan.setup_commands():
        done = _run(command)
        if done.returncode != 0:
            raise RuntimeError(f"--regions: `{' '.join(command)}` failed: {done.stderr.strip()}")


def remove(region_plan: RegionPlan) -> list[str]:
    """Delete every namespace of the plan that exists; returns those still there after."""
    present = set(existing())
    for command in region_plan.teardown_commands():
        if command[-1] in present:
            _run(command)
    return [ns for ns in region_plan.namespaces if ns in set(existing())]


def enter(namespace: str) -> None:
    """Move this thread (the main one, before any other starts) into `namespace`: what it
    starts from now on (Redis, replicas, threads) lives there. Python 3.11 has no os.setns."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise RuntimeError(f"--regions: cannot enter {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def measure(region_plan: RegionPlan) -> dict[str, dict[str, int]]:
    """Each region's link counters, read from the kernel at the hub end."""
    out: dict[str, dict[str, int]] = {}
    for link in region_plan.links:
        stats = _run(["ip", "-n", region_plan.hub, "-j", "-s", "link", "show", link.hub_end])
        qdisc = _run(
            ["tc", "-n", region_plan.hub, "-j", "-s", "qdisc", "show", "dev", link.hub_end]
        )
        link_stats: list[dict[str, Any]] = []
        qdiscs: list[dict[str, Any]] = []
        with contextlib.suppress(json.JSONDecodeError):
            link_stats = json.loads(stats.stdout or "[]")
            qdiscs = json.loads(qdisc.stdout or "[]")
        tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), {})
        out[link.region.name] = link_counters(link_stats[0] if link_stats else {}, tbf)
    return out


def link_report(region_plan: RegionPlan, wall_seconds: float) -> dict[str, Any]:
    """Each region's link as the kernel counted it: bytes each way at the hub's end, the
    bucket's drops, and the share of the link's capacity used over the run."""
    counters = measure(region_plan)
    out: dict[str, Any] = {
        "link": {
            "rate_bits_s": region_plan.shape.rate_bits_s,
            "delay_s": region_plan.shape.delay_s,
        }
    }
    for link in region_plan.links:
        taken = counters[link.region.name]
        out[link.region.name] = {
            "namespace": link.namespace,
            "learners": [
                f"learner-{k}"
                for k in range(link.first_learner, link.first_learner + link.region.learners)
            ],
            **taken,
            "utilisation": utilisation(taken, region_plan.shape, wall_seconds),
        }
    return out


def make(regions: str, link: str) -> RegionPlan:
    """Plan this run's regions (`--regions`, `--link`; named after this process), clear the
    leftovers of runs that were killed, make the namespaces and move this process into the
    hub."""
    region_plan = plan(parse_regions(regions), parse_link(link), os.getpid())
    for name in sweep_stale():
        print(f"atoll up: removed {name}, left by an atoll up that was killed", flush=True)
    try:
        create(region_plan)
        enter(region_plan.hub)
    except BaseException:  # a failed command, Ctrl-C: nothing half-made stays
        remove(region_plan)
        raise
    return region_plan


def unmake(region_plan: RegionPlan | None) -> None:
    """Remove what `make` made, saying what could not be removed."""
    if region_plan is None:
        return
    left = remove(region_plan)
    if left:
        print(
            f"atoll up: could not remove {', '.join(left)}; remove with `ip netns delete NAME`",
            file=sys.stderr,
        )
