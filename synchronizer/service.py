"""The synchronizer's gRPC service: control sessions (`session`), state fetches (`fetch`),
and ingest into (`ingest`) and new values from (`followers`) the fragments this replica
owns (`ownership`, `owner`).

A replica keeps nothing that is not in Redis or the tensor store except what it owns while it
owns it (fragment values and the open rounds' sums), which the next owner rebuilds: the
committed state from the tensor store, the uncommitted updates from the learners, who keep
each one until it is committed.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from services import codec as codecs
from services import telemetry as tm
from services.config import SynchronizerSettings
from services.gen.atoll.v1 import fragment_pb2, session_pb2, synchronizer_pb2
from services.layout import FragmentLayout, LeafSpec, fragment_layout
from services.tape import Tape
from services.wirecount import counting_parser, counting_serializer, passing_bytes
from synchronizer.core.admission import parse_chunk
from synchronizer.fetch import StateFetch
from synchronizer.followers import Followers
from synchronizer.ingest import Ingest
from synchronizer.owner import FragmentOwner
from synchronizer.ownership import Ownership
from synchronizer.session import Sessions, spec_from_json, spec_to_json
from synchronizer.store.control import ControlStore, StoreError
from synchronizer.store.tensors import TensorStore
from synchronizer.values import RebuiltValues

SERVICE_NAME = synchronizer_pb2.DESCRIPTOR.services_by_name["Synchronizer"].full_name


class SynchronizerService:
    def __init__(
        self,
        settings: SynchronizerSettings,
        store: ControlStore,
        tensors: TensorStore,
        address: str,
    ) -> None:
        self.settings, self.store, self.tensors = settings, store, tensors
        self.layout: FragmentLayout | None = None
        self.tape = Tape(settings.tape, settings.replica_id)
        self.ownership = Ownership(
            replica=settings.replica_id,
            address=address,
            config=settings,
            store=store,
            tensors=tensors,
            tape=self.tape,
            layout=lambda: self.layout,
        )
        # Whole values served (joins, followers too far behind for deltas, shard fetches).
        rebuilt = RebuiltValues(codecs.by_name(settings.downlink_codec), settings.block_size)
        self.sessions = Sessions(
            settings, store, self.ownership, self.tape, lambda: self.layout, self.adopt_spec
        )
        self.fetch = StateFetch(settings, store, tensors, rebuilt, lambda: self.layout)
        self.followers = Followers(
            settings.job,
            settings.downlink_codec,
            settings.block_size,
            settings.max_chunk_bytes,
            store,
            tensors,
            self.ownership,
            rebuilt,
            lambda: self.layout,
        )
        self.ingest = Ingest(
            settings,
            store,
            self.ownership,
            lambda: self.layout,
            settings.max_ingest_per_slot,
            settings.parts_timeout_s,
            self.followers.downlink.caught_up,
            first_chunk_timeout_s=settings.hello_timeout_s,
        )
        self._bytes = {"up": 0, "down": 0}

    def adopt_spec(self, spec_json: str) -> None:
        """Learn the job's parameter spec (first learner's, or the checkpoint's)."""
        if self.layout is None:
            self.layout = fragment_layout(spec_from_json(spec_json), self.settings.fragments)

    async def load_known_spec(self) -> None:
        stored = await self.store.spec()
        if stored is not None:
            self.adopt_spec(stored)

    async def initialize_from(self, arrays: dict[str, np.ndarray]) -> int:
        """Set the job's initial parameters from named arrays, fragment by fragment
        (set-if-absent); return how many fragments took them."""
        specs = [LeafSpec(k, tuple(v.shape), "float32") for k, v in arrays.items()]
        job_spec = await self.store.register_spec(spec_to_json(specs))
        if job_spec != spec_to_json(specs):
            raise StoreError("the checkpoint's parameters differ from the job's registered model")
        self.adopt_spec(job_spec)
        assert self.layout is not None
        taken = 0
        for p in range(self.layout.num_fragments):
            owner = FragmentOwner(
                fragment=p,
                size=self.layout.fragments[p].num_elements,
                segments=[leaf.size for leaf in self.layout.fragments[p].leaves],
                epoch=0,
                replica=self.settings.replica_id,
                config=self.settings,
                store=self.store,
                tensors=self.tensors,
                tape=self.tape,
                fragments=self.layout.num_fragments,
            )
            value, state = await owner.initial_state(self.layout.gather(p, arrays))
            owner.close()
            if await self.store.init_fragment(p, value, state):
                taken += 1
            else:
                await self.tensors.delete([value, *state])
        return taken

    # --- wiring -------------------------------------------------------------------------
    def _count_up(self, size: int) -> None:
        self._bytes["up"] += size
        tm.BYTES.labels(direction="up").inc(size)

    def _count_down(self, size: int) -> None:
        self._bytes["down"] += size
        tm.BYTES.labels(direction="down").inc(size)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The service's RPC handlers, counting every message's bytes as it is (de)serialized."""
        up, down = self._count_up, self._count_down
        handlers = {
            "Session": grpc.stream_stream_rpc_method_handler(
                self.sessions.Session,
                request_deserializer=counting_parser(session_pb2.LearnerMessage.FromString, up),
                response_serializer=counting_serializer(
                    session_pb2.SynchronizerMessage.SerializeToString, down
                ),
            ),
            "Follow": grpc.unary_stream_rpc_method_handler(
                self.followers.Follow,
                request_deserializer=counting_parser(synchronizer_pb2.FollowRequest.FromString, up),
                # Chunks come serialized once for every follower: they pass as they are.
                response_serializer=counting_serializer(
                    passing_bytes(session_pb2.SynchronizerMessage.SerializeToString), down
                ),
            ),
            "Ingest": grpc.stream_unary_rpc_method_handler(
                self.ingest.Ingest,
                request_deserializer=counting_parser(parse_chunk, up),
                response_serializer=counting_serializer(session_pb2.Ack.SerializeToString, down),
            ),
            "FetchState": grpc.unary_stream_rpc_method_handler(
                self.fetch.FetchState,
                request_deserializer=counting_parser(
                    synchronizer_pb2.FetchStateRequest.FromString, up
                ),
                response_serializer=counting_serializer(
                    fragment_pb2.GlobalFragmentChunk.SerializeToString, down
                ),
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    async def flush_stats(self) -> None:
        """Add the bytes counted since the last flush to the job's totals in Redis."""
        up, down = self._bytes["up"], self._bytes["down"]
        self._bytes = {"up": 0, "down": 0}
        try:
            await self.store.add_stats(bytes_up=up, bytes_down=down)
        except Exception:  # Redis is away: keep the counts for the next flush
            self._bytes["up"] += up
            self._bytes["down"] += down

    async def flush_stats_forever(self, interval: float = 1.0) -> None:
        import asyncio

        while True:
            await asyncio.sleep(interval)
            await self.flush_stats()
