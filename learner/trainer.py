"""`atoll learner`'s learner: the built-in inner loop (learner/loop.py) joined to the sync
engine (learner/sync.py) by its hooks, the engine given its fragment I/O (whole fragments,
or this process's ranges of a learner of several) and both the slot's checkpointer; or the
loop alone with `--standalone`."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import structlog

from learner.checkpointer import Checkpointer
from learner.group import Group
from learner.loop import InnerLoop
from learner.process_ranges import ProcessRanges
from learner.settings import LearnerSettings
from learner.sync import SyncEngine
from learner.whole_fragments import WholeFragments
from learner.workload import Workload
from services import telemetry as tm
from services.lifecycle import PARENT_ENV
from services.tape import Tape

log = structlog.get_logger("atoll.learner")


class Learner:
    def __init__(
        self, settings: LearnerSettings, workload: Workload, group: Group | None = None
    ) -> None:
        self.settings = settings
        self.stop_requested = threading.Event()
        self.tape = Tape(settings.tape, settings.id)
        self.sync: SyncEngine | None = None
        checkpoints = None
        stopping = self.stop_requested
        if group is not None and group.many:
            # One process of several: the loop stops when the leader says (a tick), never
            # on a signal one process got alone.
            ranges = ProcessRanges(group)
            self.sync = self._engine(settings, workload, ranges, None)
            stopping = ranges.stopping
        elif not settings.standalone:
            checkpoints = Checkpointer(settings)
            whole = WholeFragments(checkpoints)
            self.sync = self._engine(settings, workload, whole, checkpoints)
        self.loop = InnerLoop(settings, workload, self.sync, self.tape, stopping, checkpoints)

    def _engine(
        self,
        settings: LearnerSettings,
        workload: Workload,
        fragment_io: WholeFragments | ProcessRanges,
        checkpoints: Checkpointer | None,
    ) -> SyncEngine:
        return SyncEngine(
            settings,
            workload.shapes(),
            tokens_per_step=workload.tokens_per_batch,
            fragment_io=fragment_io,
            checkpoints=checkpoints,
            tape=self.tape,
            stop_requested=self.stop_requested,
        )

    def run(self) -> dict[str, Any]:
        return self.loop.run()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.loop.save_position()
        self.tape.close()


def install_stop_handler(learner: Learner, group: Group | None = None) -> None:
    following = group is not None and not group.leader

    def handler(signum: int, _: Any) -> None:
        if following:
            # A follower stops when its leader says so; told to stop alone, it ends only if
            # its leader is gone (the parent that started it, if one did).
            parent = os.environ.get(PARENT_ENV)
            if parent and os.getppid() != int(parent):
                os._exit(128 + signum)
            log.info("stop_follows_the_leader", signal=signal.Signals(signum).name)
            return
        log.info("stop_requested", signal=signal.Signals(signum).name)
        learner.stop_requested.set()
        tm.GOODPUT.end()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def write_report(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(path)
