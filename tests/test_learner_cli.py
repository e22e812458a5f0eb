"""`atoll learner` as a new user meets it first: a synchronizer it cannot reach."""

from __future__ import annotations

import subprocess

from cluster.processes import atoll_command


def test_an_unreachable_synchronizer_is_one_clear_line_not_a_traceback() -> None:
    done = subprocess.run(
        [
            *atoll_command("learner"),
            "--synchronizer",
            "127.0.0.1:9",  # discard: nothing listens
            "--insecure",
            "--id",
            "probe",
            "--layers",
            "1",
            "--width",
            "32",
            "--heads",
            "2",
            "--context",
            "32",
            "--batch-size",
            "2",
            "--give-up-s",  # by default a learner never gives up on the synchronizer tier
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("atoll learner: no synchronizer answered for 5 s at 127.0.0.1:9")
