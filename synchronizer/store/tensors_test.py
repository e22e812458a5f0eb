import asyncio
from pathlib import Path

import numpy as np
import pytest

from services import codec as codecs
from synchronizer.store.tensors import TensorStore, TensorStoreError, object_name, version_of


def test_objects_round_trip_list_and_delete(tmp_path: Path) -> None:
    async def run() -> None:
        store = TensorStore(str(tmp_path / "store"))
        names = [object_name("job", 3, v, 2, "value") for v in range(3)]
        for v, name in enumerate(names):
            await store.put(name, np.full(5, v, np.float32))
        assert [version_of(n) for n in names] == [0, 1, 2]
        assert await store.names("job/fragment-00003/") == names
        (value,) = await store.get_arrays(names[2], 5)
        assert value.tolist() == [2.0] * 5
        await asyncio.wait_for(store.delete(names[:2]), 5)
        assert await store.names("job/") == names[2:]
        with pytest.raises(TensorStoreError, match="missing"):
            await store.get(names[0])

    asyncio.run(run())


def test_an_unknown_scheme_is_refused_with_what_to_give() -> None:
    with pytest.raises(TensorStoreError, match="give a directory"):
        TensorStore("ftp://somewhere/x")


def test_a_delta_written_as_its_parts_reads_back_as_the_packed_blob(tmp_path: Path) -> None:
    data = np.arange(40, dtype=np.uint8)
    segments = [
        codecs.Segment(0, 10, data[:10].tobytes()),
        codecs.Segment(10, 30, memoryview(data.tobytes())[10:]),
    ]

    async def run() -> bytes:
        store = TensorStore(str(tmp_path / "store"))
        await store.put("job/delta", codecs.segment_parts(segments))
        return bytes(await store.get("job/delta"))

    blob = asyncio.run(run())
    assert blob == codecs.pack_segments(segments)
    back = codecs.unpack_segments(blob)
    assert [(s.offset, s.count, bytes(s.data)) for s in back] == [
        (0, 10, data[:10].tobytes()),
        (10, 30, data[10:].tobytes()),
    ]
