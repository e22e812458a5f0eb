"""Which replica owns which fragment: rendezvous hashing over the live replicas, leases with
fencing epochs in Redis, rebalanced as replicas come and go.

Each replica registers itself (with the address learners reach it at) every second. A
fragment's rightful owner is the live replica with the highest hash of (replica, fragment):
when a replica dies its fragments spread over the others, and when one comes back only its
own fragments move back. The rightful owner takes a fragment once its lease is free (the last
owner released it, or its lease lapsed); each take raises the fragment's epoch, which voids
what the last owner had received but not committed (learners resend it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import structlog
import xxhash

from services.config import JobConfig
from services.layout import FragmentLayout
from services.outage import OutageLog
from services.tape import Tape
from synchronizer.live_view import LiveView
from synchronizer.owner import EVALUATE_EVERY_S, FragmentOwner
from synchronizer.records import OwnerLost
from synchronizer.store.control import ControlStore
from synchronizer.store.tensors import TensorStore

log = structlog.get_logger("atoll.synchronizer.ownership")
# A replica's registration and its fragments' leases lapse this long after its last renewal
# (every TICK_S): long enough that no stall of a large model's merge or fetch loses them.
REPLICA_TTL_S = 8.0
OWNER_TTL_S = 8.0
TICK_S = 0.5
# How old the live learners a round is decided on may be (`LiveView`; a learner with an update
# in the round is in them if it is live). What a read this old misses is seen late already: a
# dead learner's lease lapses seconds after its last heartbeat, step times and finishing come
# with heartbeats (a second apart by default), and with no update arriving a round is decided
# only every EVALUATE_EVERY_S. So a round merges at most this much sooner or later than with a
# read of its own, and the replica reads the live set about ten times a second, not once per
# fragment per update (once more when a round holds a learner the last read lacked).
LIVE_MAX_AGE_S = EVALUATE_EVERY_S


def rightful_owners(fragments: int, replicas: Sequence[str]) -> list[str | None]:
    """Each fragment's owner: rendezvous (highest random weight) hashing with bounded load.
    A fragment goes to the first replica of its hash ranking that holds fewer than
    ceil(P/R) fragments, so replicas own near-equal shares however few fragments there are,
    and a replica coming or going moves few fragments."""
    if not replicas:
        return [None] * fragments
    cap = -(-fragments // len(replicas))
    load = dict.fromkeys(replicas, 0)
    owners: list[str | None] = []
    for p in range(fragments):
        ranking = sorted(replicas, key=lambda r: (xxhash.xxh3_64_intdigest(f"{r}\x00{p}"), r))
        owner = next(r for r in reversed(ranking) if load[r] < cap)
        load[owner] += 1
        owners.append(owner)
    return owners


class Ownership:
    """This replica's fragments: takes, renews and gives them back; runs their rounds."""

    def __init__(
        self,
        *,
        replica: str,
        address: str,
        config: JobConfig,
        store: ControlStore,
        tensors: TensorStore,
        tape: Tape,
        layout: Callable[[], FragmentLayout | None],
    ) -> None:
        self.replica, self.address = replica, address
        self.config, self.store, self.tensors, self.tape = config, store, tensors, tape
        self._layout = layout
        self.owned: dict[int, FragmentOwner] = {}
        self.replicas: dict[str, str] = {}  # live replica -> address
        self._rounds: dict[int, asyncio.Task[None]] = {}
        self.live = LiveView(store.live, max_age_s=LIVE_MAX_AGE_S)  # for all owned fragments
        self._stopping = False

    async def run_forever(self) -> None:
        outage = OutageLog(log, "ownership_tick_failed", "ownership_tick_resumed")
        while not self._stopping:
            try:
                await self.tick()
                outage.succeeded()
            except Exception as err:  # Redis away: leases lapse by themselves; try again
                outage.failed(err)
            await asyncio.sleep(TICK_S)

    async def tick(self) -> None:
        self.replicas = await self.store.register(self.replica, self.address, REPLICA_TTL_S)
        layout = self._layout()
        if layout is None:
            return
        rightful = rightful_owners(layout.num_fragments, sorted(self.replicas))
        for p in range(layout.num_fragments):
            mine = rightful[p] == self.replica
            owner = self.owned.get(p)
            if owner is not None:
                if owner.lost:
                    await self._drop(p, "lost")
                    continue
                status, _ = await self.store.own(
                    "renew" if mine else "release", p, self.replica, owner.epoch, OWNER_TTL_S
                )
                if status != "owned" or not mine:
                    await self._drop(p, "lost" if status != "owned" else "rebalanced")
            elif mine:
                status, epoch = await self.store.own("acquire", p, self.replica, 0, OWNER_TTL_S)
                if status == "owned":
                    await self._take(p, epoch, layout)

    async def _take(self, p: int, epoch: int, layout: FragmentLayout) -> None:
        spec = layout.fragments[p]
        owner = FragmentOwner(
            fragment=p,
            size=spec.num_elements,
            segments=[leaf.size for leaf in spec.leaves],
            epoch=epoch,
            replica=self.replica,
            config=self.config,
            store=self.store,
            tensors=self.tensors,
            tape=self.tape,
            fragments=layout.num_fragments,
        )
        try:
            await owner.load(await self.store.pointer(p))
        except Exception:
            owner.close()
            await self.store.own("release", p, self.replica, epoch)
            raise
        self.owned[p] = owner
        self._rounds[p] = asyncio.create_task(self._round_loop(owner))
        self.tape.write("owned", fragment=p, epoch=epoch)
        log.info("fragment_owned", fragment=p, epoch=epoch, version=owner.version)

    async def _drop(self, p: int, why: str) -> None:
        owner = self.owned.pop(p)
        owner.lost = True
        task = self._rounds.pop(p, None)
        if task is not None:
            task.cancel()
        owner.close()
        log.info("fragment_released", fragment=p, epoch=owner.epoch, why=why)

    async def _round_loop(self, owner: FragmentOwner) -> None:
        """Evaluate the fragment's round whenever an update arrives, and at least every
        EVALUATE_EVERY_S (grace windows end, learners die or finish)."""
        outage = OutageLog(log, "round_failed", "round_resumed", fragment=owner.fragment)
        while not owner.lost:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(owner.wake.wait(), EVALUATE_EVERY_S)
            owner.wake.clear()
            try:
                round_learners = owner.open.contributors() | owner.open.sending()
                await owner.evaluate(await self.live.get(round_learners))
                outage.succeeded()
            except OwnerLost:
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:  # Redis or the tensor store away: try again
                outage.failed(err)
                await asyncio.sleep(EVALUATE_EVERY_S)

    async def stop(self) -> None:
        """Give every fragment back, so another replica takes them at once."""
        self._stopping = True
        for p in list(self.owned):
            epoch = self.owned[p].epoch
            await self._drop(p, "stopping")
            with contextlib.suppress(Exception):
                await self.store.own("release", p, self.replica, epoch)
        with contextlib.suppress(Exception):
            await self.store.register(self.replica, self.address, 0)
