"""The tensor store: fragment values, optimizer states and encoded deltas, as immutable objects.

Redis holds only pointers to them (the names a commit swings to). One interface, one backend:
obstore, which speaks local directories, S3, GCS and Azure with the same calls, async and
without holding the event loop (its I/O runs in Rust threads). A local directory is the
embedded default (`atoll up`); object storage is for production.

Objects are named by fragment, version and owner epoch, so two owners of one fragment (a
fenced old one and its successor) never write the same name: an object, once a commit points
at it, never changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import obstore
from obstore.store import LocalStore, from_url

REMOTE_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "http", "https", "memory")


class TensorStoreError(RuntimeError):
    """The tensor store refused or lost an object; the message says which and what to do."""


def object_name(job: str, fragment: int, version: int, epoch: int, kind: str) -> str:
    """`job/fragment-00003/v0000000012-e5.value` (kinds: value, state, delta)."""
    return f"{job}/fragment-{fragment:05d}/v{version:010d}-e{epoch}.{kind}"


def version_of(name: str) -> int:
    """The version an object name carries."""
    return int(name.rsplit("/", 1)[-1].split("-", 1)[0].removeprefix("v"))


class TensorStore:
    """Immutable objects of raw bytes (little-endian float32 arrays, or encoded deltas)."""

    def __init__(self, url: str) -> None:
        self.url = url
        scheme = urlparse(url).scheme
        try:
            if scheme in REMOTE_SCHEMES:
                self._store = from_url(url)
            else:
                path = Path(url.removeprefix("file://")) if scheme in ("", "file") else None
                if path is None:
                    raise TensorStoreError(
                        f"unsupported tensor store {url!r}: give a directory, file:///dir, "
                        "s3://bucket/prefix, gs://bucket/prefix or az://container/prefix"
                    )
                path.mkdir(parents=True, exist_ok=True)
                self._store = LocalStore(str(path.resolve()))
        except TensorStoreError:
            raise
        except Exception as err:  # the library's configuration errors
            raise TensorStoreError(f"cannot open tensor store {url!r}: {err}") from None

    async def put(self, name: str, data: bytes | np.ndarray | list[bytes | memoryview]) -> None:
        """Write an object (an array is written as its little-endian float32 bytes; a list of
        buffers as their bytes one after the other; neither copied first)."""
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data, "<f4").view(np.uint8).data  # type: ignore[assignment]
        await obstore.put_async(self._store, name, data)

    async def get(self, name: str) -> memoryview:
        """An object's bytes, read-only, where the store's library put them (no copy: a
        delta or a value is tens of megabytes, read on the event loop)."""
        try:
            result = await obstore.get_async(self._store, name)
            return memoryview(await result.bytes_async())
        except FileNotFoundError:
            raise TensorStoreError(
                f"object {name!r} is missing from the tensor store at {self.url}; it was "
                "deleted or the store was changed under a running job"
            ) from None

    async def get_arrays(self, name: str, size: int) -> list[np.ndarray]:
        """An object of float32 arrays of `size` values each, back to back."""
        data = await self.get(name)
        flat = np.frombuffer(data, "<f4")
        if size <= 0 or flat.size % size:
            raise TensorStoreError(f"object {name!r} does not hold arrays of {size} values")
        # Copied off the event loop (a large fragment's value is gigabytes).
        return await asyncio.to_thread(
            lambda: [flat[i : i + size].copy() for i in range(0, flat.size, size)]
        )

    async def delete(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                await obstore.delete_async(self._store, name)

    async def names(self, prefix: str) -> list[str]:
        """Every object name under `prefix`."""
        listed = await obstore.list(self._store, prefix).collect_async()
        return sorted(str(meta["path"]) for meta in listed)
