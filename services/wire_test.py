import numpy as np

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2
from services.wire import segments_header


def test_the_header_checks_the_segments_as_one_payload() -> None:
    x = np.random.default_rng(0).normal(size=3000).astype(np.float32)
    segments, _ = codecs.encode_segments(codecs.by_name("int8"), x, 256, 700)
    h = segments_header(3, fragment_pb2.CODEC_INT8, 256, x.size, segments)
    joined = b"".join(s.data for s in segments)
    assert h.checksum == codecs.checksum(joined)
    assert (h.chunk_count, h.total_bytes) == (len(segments), len(joined))
    assert (h.fragment, h.num_elements, h.block_size) == (3, x.size, 256)
