from pathlib import Path

import numpy as np
import pytest

from learner.data import Batches, DataError, eval_batches, load_corpus


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    for i in range(120):
        (tmp_path / f"f{i:03d}.py").write_text(f"# file {i}\n" + "x = 1\n" * (50 + i))
    return tmp_path


def test_shards_are_disjoint_and_eval_is_shared(corpus_dir: Path) -> None:
    a = load_corpus([corpus_dir], 0, 2)
    b = load_corpus([corpus_dir], 1, 2)
    assert a.eval.tobytes() == b.eval.tobytes()
    assert a.train.tobytes() != b.train.tobytes()
    assert b"# file 0\n" in a.eval.tobytes()  # every 50th file is held out
    assert b"# file 0\n" not in a.train.tobytes() + b.train.tobytes()


def test_batches_are_deterministic_and_resume_from_their_position(corpus_dir: Path) -> None:
    data = load_corpus([corpus_dir], 0, 1).train
    first = Batches(data, 4, 16, seed=3)
    seen = [first.next() for _ in range(5)]
    assert all(b.shape == (4, 17) for b in seen)
    assert first.position == 5
    expected_next = first.next()
    resumed = Batches(data, 4, 16, seed=3)
    resumed.position = 5
    np.testing.assert_array_equal(resumed.next(), expected_next)
    # Across an epoch boundary too: the permutation depends only on the epoch.
    whole = Batches(data, 4, 16, seed=3)
    far = [whole.next() for _ in range(whole.windows)][-1]
    jump = Batches(data, 4, 16, seed=3)
    jump.position = whole.windows - 1
    np.testing.assert_array_equal(jump.next(), far)


def test_eval_batches_are_fixed(corpus_dir: Path) -> None:
    data = load_corpus([corpus_dir], 0, 1).eval
    one, two = eval_batches(data, 2, 8, 6), eval_batches(data, 2, 8, 6)
    assert len(one) == 3
    for x, y in zip(one, two, strict=True):
        np.testing.assert_array_equal(x, y)


def test_bad_data_paths_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_corpus([tmp_path / "missing"], 0, 1)
    with pytest.raises(DataError, match="--shard"):
        load_corpus([tmp_path], 3, 2)


def test_the_ordinal_of_a_pod_name_picks_the_shard() -> None:
    from learner.settings import LearnerSettings, data_shard

    def pod(name: str) -> LearnerSettings:
        return LearnerSettings(id=name, shard=4, num_shards=16, ordinal_shard=True)

    assert data_shard(pod("atoll-learner-eu-west-3")) == 7
    assert data_shard(LearnerSettings(id="x", shard=2)) == 2  # without --ordinal-shard
    with pytest.raises(ValueError, match="ending in a number"):
        data_shard(pod("learner"))
    with pytest.raises(ValueError, match="past --num-shards"):
        data_shard(pod("l-12"))


def test_a_cached_corpus_is_the_corpus(tmp_path: Path) -> None:
    from learner.data import cached_corpus, load_corpus

    (tmp_path / "src").mkdir()
    for i in range(60):
        (tmp_path / "src" / f"f{i}.py").write_text(f"print({i})\n" * (i + 1))
    direct = load_corpus([tmp_path / "src"], 1, 2)
    first = cached_corpus([tmp_path / "src"], 1, 2, tmp_path / "state")
    assert len(list((tmp_path / "state").glob("corpus-*.npz"))) == 1
    second = cached_corpus([tmp_path / "src"], 1, 2, tmp_path / "state")  # from the file
    for c in (first, second):
        assert c.train.tobytes() == direct.train.tobytes()
        assert c.eval.tobytes() == direct.eval.tobytes()
        assert c.files == direct.files


def test_eval_windows_do_not_depend_on_batching(corpus_dir: Path) -> None:
    from learner.data import eval_windows, mean_loss

    data = load_corpus([corpus_dir], 0, 1).eval
    rows = eval_windows(data, 8, 7)
    assert rows.shape == (7, 9)
    assert len(eval_windows(data, 8, 0)) == (data.size - 1) // 9  # 0: every window
    for size in (1, 3, 7):
        batches = eval_batches(data, size, 8, 7)
        np.testing.assert_array_equal(np.concatenate(batches), rows)
        # One loss per window (its first byte): the mean is over windows, not batches.
        assert mean_loss(lambda b: float(b[:, 0].mean()), batches) == pytest.approx(
            rows[:, 0].mean()
        )


def test_eval_data_replaces_the_held_out_files(corpus_dir: Path, tmp_path: Path) -> None:
    extra = tmp_path / "eval.txt"
    extra.write_text("held apart\n" * 20)
    corpus = load_corpus([corpus_dir], 0, 1, eval_paths=[extra])
    assert corpus.eval.tobytes() == extra.read_bytes()
    assert b"# file 0\n" in corpus.train.tobytes()  # nothing held out of --data now


def test_a_site_packages_folder_named_on_purpose_is_read(tmp_path: Path) -> None:
    from learner.data import list_files

    lib = tmp_path / "lib"
    (lib / "site-packages" / "pkg").mkdir(parents=True)
    (lib / "os.py").write_text("x = 1\n")
    (lib / "site-packages" / "pkg" / "m.py").write_text("y = 2\n")
    assert [f.name for f in list_files([lib])] == ["os.py"]
    assert [f.name for f in list_files([lib / "site-packages"])] == ["m.py"]


def test_m_learners_of_one_stream_train_on_data_parallels_windows(corpus_dir: Path) -> None:
    from learner.data import combine_digests

    whole = load_corpus([corpus_dir], 0, 1, split="windows").train
    dp = Batches(whole, 6, 16, seed=5)
    parts = []
    for m in range(3):
        # Each learner reads all the text: its corpus is data-parallel's.
        mine = load_corpus([corpus_dir], m, 3, split="windows").train
        assert mine.tobytes() == whole.tobytes()
        parts.append(Batches(mine, 2, 16, seed=5, part=m, parts=3))
    for _ in range(4):
        np.testing.assert_array_equal(dp.next(), np.concatenate([b.next() for b in parts]))
    together = combine_digests([b.digest() for b in parts])
    assert together == combine_digests([dp.digest()])
    assert together["windows"] == 24
    # Other windows, another fingerprint: one step more, or the files split among learners.
    parts[0].next()
    assert combine_digests([b.digest() for b in parts]) != together
    by_files = [Batches(load_corpus([corpus_dir], m, 3).train, 2, 16, seed=5) for m in range(3)]
    for b in by_files:
        for _ in range(4):
            b.next()
    assert combine_digests([b.digest() for b in by_files])["windows"] == 24
    assert combine_digests([b.digest() for b in by_files]) != together


def test_a_cap_is_stated_and_files_without_a_suffix_are_text(tmp_path: Path) -> None:
    from learner.data import list_files

    (tmp_path / "LICENSE").write_text("Permission is hereby granted, free of charge\n" * 40)
    (tmp_path / "COPYING").write_text("caf\u00e9 " * 300)
    (tmp_path / "blob").write_bytes(b"\x00\x01\x02" * 100)  # binary: not text
    (tmp_path / "image.png").write_bytes(b"not read by suffix")
    assert [f.name for f in list_files([tmp_path], any_text=True)] == ["COPYING", "LICENSE"]
    assert list_files([tmp_path]) == []  # training text: by suffix alone
    (tmp_path / "a.txt").write_text("text " * 300)
    corpus = load_corpus([tmp_path], 0, 1, eval_paths=[tmp_path], cap_bytes=1024)
    assert b"Permission is hereby granted" in corpus.eval.tobytes()
    assert corpus.facts["capped"] is False  # one training file: the cap reads it whole
    assert corpus.facts["train_files"] == 1
    for i in range(5):
        (tmp_path / f"more{i}.txt").write_text("text " * 400)
    capped = load_corpus([tmp_path], 0, 1, eval_paths=[tmp_path / "LICENSE"], cap_bytes=1024)
    assert capped.facts["capped"] is True
    assert capped.facts["train_files_read"] < capped.facts["train_files"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"\x00")
    with pytest.raises(DataError, match="no suffix"):
        load_corpus([empty], 0, 1)
