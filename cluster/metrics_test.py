from __future__ import annotations

import json
from pathlib import Path

from cluster.metrics import Target, write_file_sd


def test_file_sd_gives_every_target_stable_labels(tmp_path: Path) -> None:
    path = tmp_path / "targets.json"
    write_file_sd(
        path,
        [
            Target("127.0.0.1:9000", "cluster"),
            Target("127.0.0.1:9001", "synchronizer", "synchronizer-0"),
            Target("127.0.0.1:9002", "learner", "learner-0"),
        ],
        {"atoll_job": "j", "run": "r"},
    )
    groups = json.loads(path.read_text())
    assert groups == [
        {
            "targets": ["127.0.0.1:9000"],
            "labels": {"job": "atoll-up", "role": "cluster", "atoll_job": "j", "run": "r"},
        },
        {
            "targets": ["127.0.0.1:9001"],
            "labels": {
                "job": "atoll-synchronizer",
                "role": "synchronizer",
                "slot": "synchronizer-0",
                "atoll_job": "j",
                "run": "r",
            },
        },
        {
            "targets": ["127.0.0.1:9002"],
            "labels": {
                "job": "atoll-learner",
                "role": "learner",
                "slot": "learner-0",
                "pool": "main",
                "atoll_job": "j",
                "run": "r",
            },
        },
    ]
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then moved in place


def test_an_emptied_file_lists_no_target(tmp_path: Path) -> None:
    path = tmp_path / "targets.json"
    write_file_sd(path, [Target("127.0.0.1:9000", "cluster")])
    write_file_sd(path, [])
    assert json.loads(path.read_text()) == []
