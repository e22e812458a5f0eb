"""Updates on their way, without a network: kept until their final ack, sent to the owner
of now, sent again when their owner moves or its connection drops."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from learner.transport.calls import Channels, Identity
from learner.transport.ingest import Ingest, segments_of
from services.gen.atoll.v1 import fragment_pb2, session_pb2


def ingest() -> Ingest:
    return Ingest(
        Channels(["127.0.0.1:1"]), Identity("job", "l-0", "inc"), threading.Event(), lambda: None
    )


def owner(fragment: int, epoch: int, address: str = "10.0.0.1:1") -> session_pb2.FragmentOwner:
    return session_pb2.FragmentOwner(fragment=fragment, replica="r", address=address, epoch=epoch)


def test_a_whole_float32_payload_is_cut_into_chunks_and_a_blocked_one_refused() -> None:
    n = 3_000_000
    segments = segments_of(np.zeros(n, "<f4").tobytes(), fragment_pb2.CODEC_FP32, n)
    assert sum(s.count for s in segments) == n
    assert [s.offset for s in segments] == sorted({s.offset for s in segments})
    with pytest.raises(ValueError, match="segments"):
        segments_of(b"\0" * 8, fragment_pb2.CODEC_INT8, 2)


def test_an_update_goes_to_its_owner_of_now_and_is_kept_until_its_final_ack() -> None:
    i = ingest()
    seq = i.send_initial(0, np.ones(4, np.float32))
    chunk = i.kept()[0].chunks[0]
    assert (chunk.learner_id, chunk.incarnation, chunk.seq) == ("l-0", "inc", seq)
    assert i._next_to_send() is None  # no owner known yet
    i.set_owners({0: owner(0, epoch=1)})
    picked = i._next_to_send()
    assert picked is not None
    assert picked[1].epoch == 1
    picked[0].received_epoch, picked[0].received_at = 1, "10.0.0.1:1"
    assert i._next_to_send() is None  # its owner has it
    i.set_owners({0: owner(0, epoch=2)})  # a new owner (a higher epoch) may not
    assert i._next_to_send() is not None
    i.settle(session_pb2.Ack(seq=seq, status=session_pb2.ACK_STATUS_COMMITTED))
    assert i.unacked() == 0
    assert i.final_acks()[seq].status == session_pb2.ACK_STATUS_COMMITTED
    assert i.wait_ack(seq, timeout=0.1).seq == seq


def test_an_update_received_by_an_owner_whose_connection_dropped_is_sent_again() -> None:
    i = ingest()
    i.set_owners({0: owner(0, epoch=1)})
    i.send_initial(0, np.ones(4, np.float32))
    kept = i.kept()[0]
    kept.received_epoch, kept.received_at = 1, "10.0.0.1:1"
    i.channels.on_lost("10.0.0.2:1")  # another owner's: nothing to resend
    assert i._next_to_send() is None
    i.channels.on_lost("10.0.0.1:1")
    assert i._next_to_send() is not None
    kept.received_epoch = 1
    assert i.resend() == 1  # a session back from away asks every owner again
    assert kept.received_epoch is None


def test_waiting_for_a_received_ack_returns_once_an_owner_has_it() -> None:
    i = ingest()
    seq = i.send_initial(0, np.ones(4, np.float32))
    with pytest.raises(TimeoutError):
        i.wait_ack(seq, timeout=0.05, received=True)
    i.kept()[0].received_epoch = 3
    assert i.wait_ack(seq, timeout=0.05, received=True).epoch == 3


def test_a_fragments_updates_go_in_order_and_a_new_owner_is_tried_at_once() -> None:
    # A later update sent while an earlier one backed off took the learner's one place in
    # the owner's open round and pushed the earlier one a round back; the backoff kept
    # waiting for an owner that had died.
    i = ingest()
    i.set_owners({0: owner(0, epoch=1), 1: owner(1, epoch=1)})
    first = i.send_initial(0, np.ones(4, np.float32))
    later = i.send_initial(0, np.ones(4, np.float32))
    other = i.send_initial(1, np.ones(4, np.float32))
    picked = i._next_to_send()
    assert picked is not None
    assert picked[0].seq == first
    i._sending.add(first)
    i._failed(picked[0])  # its send failed: it backs off
    picked = i._next_to_send()
    assert picked is not None
    assert picked[0].seq == other
    i._sending.add(other)
    assert i._next_to_send() is None
    i.set_owners({0: owner(0, epoch=2, address="10.0.0.2:1"), 1: owner(1, epoch=1)})
    picked = i._next_to_send()
    assert picked is not None
    assert picked[0].seq == first
    assert later > first
