"""Training text: files or folders given by path, by default this Python's standard library.

Every learner sees the same file list (sorted), holds out the same evaluation files (or reads
the evaluation files it is given), and trains on the rest, split one of two ways:

- `files`: each learner reads only its own shard of the files (every num_shards-th), and
  draws its batches from its shard's windows in an order of its own: what pods of a pool
  reading their own part of a large corpus do.
- `windows`: every learner reads all the training text, and batch k of learner m holds rows
  m*B..(m+1)*B of global batch k of one token stream (every window of the text in a seeded
  order, epoch after epoch). M learners at step k then train on exactly the windows that
  data-parallel training's global batch k holds, whatever M is: the split a fair quality
  comparison needs.

Batches are drawn by a counter (batch k is a fixed function of k), so a restarted learner
resumes where it stopped by setting one number, `position`; what it trained on is known
from that number too (`Batches.digest`).
"""

from __future__ import annotations

import json
import os
import sysconfig
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".html"}
MAX_CORPUS_BYTES = 256 << 20
EVAL_EVERY_NTH_FILE = 50
SNIFF_BYTES = 4096

DataSplit = Literal["files", "windows"]
DATA_SPLITS: tuple[DataSplit, ...] = ("files", "windows")


class DataError(ValueError):
    """The data paths give nothing to train on; the message says what to change."""


def default_paths() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def is_text(path: Path, any_text: bool = False) -> bool:
    """A file of a folder is text when its suffix says so (TEXT_SUFFIXES); with `any_text`
    also when it has no suffix (LICENSE, COPYING, README) and its first bytes are UTF-8
    without a NUL byte."""
    if path.suffix in TEXT_SUFFIXES:
        return True
    if path.suffix or not any_text:
        return False
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return False
    if not head or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.start >= len(head) - 3  # a character cut off at the sniff's end
    return True


def list_files(paths: Sequence[Path], any_text: bool = False) -> list[Path]:
    """The text files of `paths`: a file named is read whatever it is; a folder gives its
    text files (`is_text`), outside any site-packages folder below it. Training text is
    listed by suffix alone (an installed package's RECORD or METADATA is not source);
    evaluation text with `any_text`, so a folder of license texts can be scored."""
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                f
                for f in path.rglob("*")
                # The standard library's own site-packages holds installed packages, not it;
                # a site-packages folder named on purpose is read.
                if "site-packages" not in f.relative_to(path).parts
                and f.is_file()
                and is_text(f, any_text)
            ]
        else:
            raise DataError(f"data path {path} does not exist; give text files or folders")
    return sorted(set(files))


def no_text(paths: Sequence[Path], flag: str) -> DataError:
    return DataError(
        f"no text files under {flag} {[str(p) for p in paths]}: a folder is read for files "
        f"ending in {' '.join(sorted(TEXT_SUFFIXES))} (and, to evaluate on, files with no "
        "suffix holding UTF-8 text); name other files one by one"
    )


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes this learner trains on (its shard, or all: `windows`)
    eval: np.ndarray  # uint8 bytes of the held-out files (the same for every learner)
    files: int
    # How the training text was read: files listed and read, and whether the cap cut it.
    facts: dict[str, Any] = field(default_factory=dict)


def held_out(files: Sequence[Path]) -> list[Path]:
    """The evaluation files a learner holds out of a sorted file list: every 50th file (the
    last one of a short list)."""
    return list(files[::EVAL_EVERY_NTH_FILE] if len(files) >= EVAL_EVERY_NTH_FILE else files[-1:])


def load_corpus(
    paths: Sequence[Path],
    shard: int,
    num_shards: int,
    eval_paths: Sequence[Path] = (),
    split: DataSplit = "files",
    cap_bytes: int = MAX_CORPUS_BYTES,
) -> Corpus:
    """The training text this learner reads (its shard of the files, or all of them with
    `split="windows"`) and the evaluation text: the files of `eval_paths`, or those held out
    of `paths` (`held_out`). Evaluation files are never trained on. At most about
    `cap_bytes` of training text is read, in file order; `Corpus.facts` says if it was cut."""
    if not 0 <= shard < num_shards:
        raise DataError(f"--shard {shard} must be in 0..{num_shards - 1} (--num-shards)")
    if split not in DATA_SPLITS:
        raise DataError(f"--data-split {split!r}: use one of {', '.join(DATA_SPLITS)}")
    files = list_files(paths or default_paths())
    if not files:
        raise no_text(paths, "--data")
    eval_files = list_files(eval_paths, any_text=True) if eval_paths else held_out(files)
    if not eval_files:
        raise no_text(eval_paths, "--eval-data")
    train_files = [f for f in files if f not in set(eval_files)] or files
    mine = train_files[shard::num_shards] if split == "files" else train_files
    if not mine:
        raise DataError(
            f"shard {shard} of {num_shards} gets no files from {len(train_files)}; use fewer shards"
        )
    train, read = read_capped(mine, cap_bytes)
    facts = {
        "split": split,
        "train_files": len(mine),
        "train_files_read": read,
        "train_bytes": int(train.size),
        "cap_bytes": cap_bytes,
        "capped": read < len(mine),
        "eval_files": len(eval_files),
    }
    return Corpus(train, read_text(eval_files), len(files), facts)


def cached_corpus(
    paths: Sequence[Path],
    shard: int,
    num_shards: int,
    cache_dir: Path | None,
    eval_paths: Sequence[Path] = (),
    split: DataSplit = "files",
    cap_bytes: int = MAX_CORPUS_BYTES,
) -> Corpus:
    """`load_corpus`, kept in `cache_dir` (a learner slot's state folder) after the first
    time: a restarted learner reads one file instead of walking and reading the sources."""
    if cache_dir is None:
        return load_corpus(paths, shard, num_shards, eval_paths, split, cap_bytes)
    names: list[Any] = [sorted(str(p) for p in paths), shard, num_shards, cap_bytes, split]
    if eval_paths:
        names.append(sorted(str(p) for p in eval_paths))
    key = xxhash.xxh3_64_hexdigest(json.dumps(names).encode())
    path = cache_dir / f"corpus-{key}.npz"
    try:
        with np.load(path) as saved:
            facts = json.loads(str(saved["facts"]))
            return Corpus(saved["train"], saved["eval"], int(saved["files"]), facts)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        pass  # none yet, or torn: read the sources
    corpus = load_corpus(paths, shard, num_shards, eval_paths, split, cap_bytes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes of one learner write it alike
    with tmp.open("wb") as f:
        np.savez(
            f,
            train=corpus.train,
            eval=corpus.eval,
            files=np.asarray(corpus.files),
            facts=np.asarray(json.dumps(corpus.facts)),
        )
    os.replace(tmp, path)
    return corpus


def read_capped(files: Sequence[Path], cap_bytes: int) -> tuple[np.ndarray, int]:
    """The files' bytes joined by newlines, up to the file that reaches `cap_bytes`; and how
    many files that is."""
    parts: list[bytes] = []
    total = 0
    for f in files:
        data = f.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= cap_bytes:
            break
    return np.frombuffer(b"\n".join(parts), np.uint8), len(parts)


def read_text(files: Sequence[Path]) -> np.ndarray:
    """The files' bytes joined by newlines, up to about MAX_CORPUS_BYTES."""
    return read_capped(files, MAX_CORPUS_BYTES)[0]


class Batches:
    """Batch k: windows of context+1 bytes, a fresh permutation of the text's windows per
    epoch. With `parts` M, the stream's global batch k holds M x batch_size windows and this
    reader's batch k is rows `part` x batch_size.. of it (`windows` split); M=1: the whole."""

    def __init__(
        self,
        data: np.ndarray,
        batch_size: int,
        context: int,
        seed: int,
        part: int = 0,
        parts: int = 1,
    ) -> None:
        window = context + 1
        if data.size < window * 2:
            raise DataError(
                f"the training text holds {data.size} bytes, too few for windows of {window}; "
                "give more text or a shorter --context"
            )
        if not 0 <= part < parts:
            raise DataError(f"part {part} of the global batch must be in 0..{parts - 1}")
        self.data, self.batch_size, self.window, self.seed = data, batch_size, window, seed
        self.part, self.parts = part, parts
        self.windows = (data.size - 1) // window
        self.position = 0  # batches drawn so far
        self._epoch = -1
        self._perm = np.zeros(0, np.int64)

    def next(self) -> np.ndarray:
        starts = self._window_ids(self.position) * self.window
        self.position += 1
        return np.stack([self.data[s : s + self.window] for s in starts]).astype(np.int32)

    def _window_ids(self, k: int) -> np.ndarray:
        """The windows (their numbers in the text) of this reader's batch k."""
        first = (k * self.parts + self.part) * self.batch_size
        return np.array([self._window_at(first + i) for i in range(self.batch_size)])

    def _window_at(self, n: int) -> int:
        epoch, i = divmod(n, self.windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return int(self._perm[i])

    def digest(self) -> dict[str, Any]:
        """What batches 0..position-1 held: their window count and the sum (mod 2^64) of each
        window's content hash. Sums of several readers add up, and equal sums over equal
        counts mean the same windows, so M learners' digests added give data-parallel's
        digest exactly when they trained on the same text (`combine_digests`)."""
        total = 0
        for k in range(self.position):
            for s in self._window_ids(k) * self.window:
                total += xxhash.xxh3_64_intdigest(self.data[s : s + self.window].tobytes())
        return {"windows": self.position * self.batch_size, "sum": total % DIGEST_MOD}


DIGEST_MOD = 1 << 64


def windows_digest(rows: np.ndarray) -> dict[str, Any]:
    """`Batches.digest` of given windows (an evaluation set's, say), as uint8 bytes."""
    total = sum(xxhash.xxh3_64_intdigest(np.asarray(r, np.uint8).tobytes()) for r in rows)
    return {"windows": len(rows), "sum": total % DIGEST_MOD}


def combine_digests(digests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The digest of several readers' windows together, with its fingerprint: a hex string
    that names the multiset of windows (equal fingerprints: the same windows trained on)."""
    windows = sum(int(d["windows"]) for d in digests)
    total = sum(int(d["sum"]) for d in digests) % DIGEST_MOD
    print_ = xxhash.xxh3_64_hexdigest(f"{windows}:{total}".encode())
    return {"windows": windows, "sum": total, "fingerprint": print_}


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
