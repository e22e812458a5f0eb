"""Training text: files or folders given by path, by default this Python's standard library.

Every learner sees the same file list (sorted), holds out the same evaluation files (or reads
the evaluation files it is given), and reads only its own shard of the rest. Batches are
drawn by a counter (batch k of epoch e is a fixed permutation of the shard's windows), so a
restarted learner resumes its shard where it stopped by setting one number, `position`.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".html"}
MAX_CORPUS_BYTES = 256 << 20
EVAL_EVERY_NTH_FILE = 50


class DataError(ValueError):
    """The data paths give nothing to train on; the message says what to change."""


def default_paths() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def list_files(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                f
                for f in path.rglob("*")
                if f.is_file()
                and f.suffix in TEXT_SUFFIXES
                # The standard library's own site-packages holds installed packages, not it;
                # a site-packages folder named on purpose is read.
                and "site-packages" not in f.relative_to(path).parts
            ]
        else:
            raise DataError(f"data path {path} does not exist; give text files or folders")
    return sorted(set(files))


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes of this learner's shard
    eval: np.ndarray  # uint8 bytes of the held-out files (the same for every learner)
    files: int


def held_out(files: Sequence[Path]) -> list[Path]:
    """The evaluation files a learner holds out of a sorted file list: every 50th file (the
    last one of a short list)."""
    return list(files[::EVAL_EVERY_NTH_FILE] if len(files) >= EVAL_EVERY_NTH_FILE else files[-1:])


def load_corpus(
    paths: Sequence[Path], shard: int, num_shards: int, eval_paths: Sequence[Path] = ()
) -> Corpus:
    """This shard's training text and the evaluation text: the files of `eval_paths`, or
    those held out of `paths` (`held_out`). Evaluation files are never trained on."""
    if not 0 <= shard < num_shards:
        raise DataError(f"--shard {shard} must be in 0..{num_shards - 1} (--num-shards)")
    files = list_files(paths or default_paths())
    if not files:
        raise DataError(f"no text files under {[str(p) for p in paths]}")
    eval_files = list_files(eval_paths) if eval_paths else held_out(files)
    if not eval_files:
        raise DataError(f"no text files under --eval-data {[str(p) for p in eval_paths]}")
    train_files = [f for f in files if f not in set(eval_files)] or files
    mine = train_files[shard::num_shards]
    if not mine:
        raise DataError(
            f"shard {shard} of {num_shards} gets no files from {len(train_files)}; use fewer shards"
        )
    return Corpus(read_text(mine), read_text(eval_files), len(files))


def cached_corpus(
    paths: Sequence[Path],
    shard: int,
    num_shards: int,
    cache_dir: Path | None,
    eval_paths: Sequence[Path] = (),
) -> Corpus:
    """`load_corpus`, kept in `cache_dir` (a learner slot's state folder) after the first
    time: a restarted learner reads one file instead of walking and reading the sources."""
    if cache_dir is None:
        return load_corpus(paths, shard, num_shards, eval_paths)
    names = [sorted(str(p) for p in paths), shard, num_shards, MAX_CORPUS_BYTES]
    if eval_paths:
        names.append(sorted(str(p) for p in eval_paths))
    key = xxhash.xxh3_64_hexdigest(json.dumps(names))
    path = cache_dir / f"corpus-{key}.npz"
    try:
        with np.load(path) as saved:
            return Corpus(saved["train"], saved["eval"], int(saved["files"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        pass  # none yet, or torn: read the sources
    corpus = load_corpus(paths, shard, num_shards, eval_paths)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes of one learner write it alike
    with tmp.open("wb") as f:
        np.savez(f, train=corpus.train, eval=corpus.eval, files=np.asarray(corpus.files))
    os.replace(tmp, path)
    return corpus


def read_text(files: Sequence[Path]) -> np.ndarray:
    """The files' bytes joined by newlines, up to about MAX_CORPUS_BYTES."""
    parts: list[bytes] = []
    total = 0
    for f in files:
        data = f.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= MAX_CORPUS_BYTES:
            break
    return np.frombuffer(b"\n".join(parts), np.uint8)


class Batches:
    """Batch k of a shard: windows of context+1 bytes, a fresh permutation per epoch."""

    def __init__(self, data: np.ndarray, batch_size: int, context: int, seed: int) -> None:
        window = context + 1
        if data.size < window * 2:
            raise DataError(
                f"the shard holds {data.size} bytes, too few for windows of {window}; "
                "give more text or a shorter --context"
            )
        self.data, self.batch_size, self.window, self.seed = data, batch_size, window, seed
        self.windows = (data.size - 1) // window
        self.position = 0  # batches drawn so far
        self._epoch = -1
        self._perm = np.zeros(0, np.int64)

    def next(self) -> np.ndarray:
        first = self.position * self.batch_size
        idx = np.array([self._window_at(first + i) for i in range(self.batch_size)])
        self.position += 1
        starts = idx * self.window
        return np.stack([self.data[s : s + self.window] for s in starts]).astype(np.int32)

    def _window_at(self, n: int) -> int:
        epoch, i = divmod(n, self.windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return int(self._perm[i])


def eval_windows(data: np.ndarray, context: int, count: int) -> np.ndarray:
    """Fixed evaluation windows of context+1 bytes, evenly spread over the text: `count` of
    them, or every window with `count` 0. The one selection every evaluation uses (a
    learner's, `atoll eval`'s), so their losses agree."""
    window = context + 1
    n = (data.size - 1) // window
    if n < 1:
        raise DataError(
            f"the evaluation text holds {data.size} bytes, too few for one window of {window}; "
            "give more text or a shorter --context"
        )
    picks = np.linspace(0, n - 1, num=min(n, count) if count else n).astype(np.int64)
    return np.stack([data[p * window : p * window + window] for p in picks]).astype(np.int32)


def eval_batches(data: np.ndarray, batch_size: int, context: int, windows: int) -> list[np.ndarray]:
    """`eval_windows` of `windows` windows (0: all), in batches of at most `batch_size`."""
    rows = eval_windows(data, context, windows)
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]


def mean_loss(loss: Callable[[np.ndarray], float], batches: Sequence[np.ndarray]) -> float:
    """The mean per-byte loss over every window of `batches` (`loss` gives a batch's mean),
    each batch weighted by its windows, so how the windows are batched does not matter."""
    windows = sum(len(b) for b in batches)
    return sum(loss(b) * len(b) for b in batches) / windows if windows else float("nan")
