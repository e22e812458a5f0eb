import grpc
import numpy as np
import pytest

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.layout import LeafSpec, fragment_layout
from services.wire import make_header
from synchronizer.admission import Rejection, check_header, check_payload

LAYOUT = fragment_layout([LeafSpec("a", (100,)), LeafSpec("b", (50,))], 2)
OUTER = session_pb2.UPDATE_KIND_OUTER_GRADIENT


def header(**kw: int) -> fragment_pb2.PayloadHeader:
    h = make_header(0, fragment_pb2.CODEC_INT8, 256, 100, b"", 1024)
    for k, v in kw.items():
        setattr(h, k, v)
    return h


@pytest.mark.parametrize(
    ("kw", "kind", "c_steps", "reason"),
    [
        ({"fragment": 2}, OUTER, 1, "unknown_fragment"),
        ({"num_elements": 99}, OUTER, 1, "shape_mismatch"),
        ({"codec": 99}, OUTER, 1, "bad_codec"),
        ({}, 7, 1, "bad_request"),
        ({}, OUTER, 0, "bad_request"),
        ({}, session_pb2.UPDATE_KIND_INITIAL, 0, "bad_codec"),
    ],
)
def test_bad_headers_are_refused(kw: dict[str, int], kind: int, c_steps: int, reason: str) -> None:
    with pytest.raises(Rejection) as info:
        check_header(header(**kw), kind, c_steps, LAYOUT)
    assert info.value.reason == reason
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message


def test_payload_checks() -> None:
    codec = codecs.by_name("fp32")
    h = header(codec=fragment_pb2.CODEC_FP32, block_size=0)
    check_payload(h, codec, np.ones(100, np.float32).tobytes())
    with pytest.raises(Rejection, match="NaN") as info:
        check_payload(h, codec, np.full(100, np.inf, np.float32).tobytes())
    assert info.value.reason == "non_finite"
    with pytest.raises(Rejection) as info:
        check_payload(h, codec, b"\x00" * 12)
    assert info.value.reason == "bad_codec"
