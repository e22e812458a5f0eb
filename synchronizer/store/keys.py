"""The one Redis key schema of a job. Services, tools and tests all build keys here.

Job-wide keys carry the hash tag `{job}`; each fragment's keys carry `{job:p}`, so a Redis
Cluster spreads fragments over its nodes, and no script touches two fragments or a fragment
and the job (every script's keys share one tag).
"""

from __future__ import annotations

PREFIX = "atoll"


def job_key(job: str, *parts: object) -> str:
    """A job-wide key: `atoll:{job}:a:b` (learner liveness, spec, config, replicas, stats)."""
    return f"{PREFIX}:{{{job}}}:" + ":".join(str(p) for p in parts)


def fragment_key(job: str, fragment: int, *parts: object) -> str:
    """A key of one fragment: `atoll:{job:p}:a:b` (version pointer, owner lease, round
    membership, idempotency records, commit log, the fragment's counters)."""
    return f"{PREFIX}:{{{job}:{fragment}}}:" + ":".join(str(p) for p in parts)


class JobKeys:
    """Every key of one job, by name."""

    def __init__(self, job: str) -> None:
        self.job = job

    # --- job-wide -------------------------------------------------------------------------
    @property
    def config(self) -> str:
        return job_key(self.job, "config")

    @property
    def spec(self) -> str:
        return job_key(self.job, "spec")

    @property
    def init_claim(self) -> str:
        return job_key(self.job, "init_claim")

    @property
    def learners(self) -> str:
        """Sorted set: learner id -> lease expiry (ms, Redis time)."""
        return job_key(self.job, "learners")

    def learner(self, learner: str) -> str:
        """Hash: the slot's current incarnation and its last heartbeat's fields."""
        return job_key(self.job, "learner", learner)

    @property
    def ema(self) -> str:
        """Hash: learner id -> step-time EMA (s)."""
        return job_key(self.job, "ema")

    @property
    def slot_steps(self) -> str:
        return job_key(self.job, "slot_steps")

    @property
    def finished(self) -> str:
        return job_key(self.job, "finished")

    @property
    def finishing(self) -> str:
        return job_key(self.job, "finishing")

    @property
    def stats(self) -> str:
        """Hash of job-wide counters (bytes, rejections); merge counters are per fragment."""
        return job_key(self.job, "stats")

    @property
    def replicas(self) -> str:
        """Sorted set: replica id -> lease expiry (ms)."""
        return job_key(self.job, "replicas")

    def replica(self, replica: str) -> str:
        """Hash: the address learners reach a replica at."""
        return job_key(self.job, "replica", replica)

    # --- per fragment ---------------------------------------------------------------------
    def frag(self, p: int) -> str:
        """Hash: version, committed_ms, and the tensor-store names of the value, the
        optimizer state and the delta that made this version (the pointer a commit swings)."""
        return fragment_key(self.job, p, "frag")

    def owner(self, p: int) -> str:
        """String `replica epoch` with an expiry: the owner's lease (fencing token: epoch)."""
        return fragment_key(self.job, p, "owner")

    def epoch(self, p: int) -> str:
        return fragment_key(self.job, p, "epoch")

    def round(self, p: int) -> str:
        """Hash: uid -> record of each update received into the open round (this epoch)."""
        return fragment_key(self.job, p, "round")

    def seen(self, p: int, learner: str) -> str:
        """Hash: seq -> `epoch checksum state` of the updates of fragment p from the slot's
        newest incarnation to send there, named with its generation (`lua/receive.lua`)."""
        return fragment_key(self.job, p, "seen", learner)

    def orphans(self, p: int) -> str:
        """Set: uids received into this epoch's rounds whose slot's records a newer
        incarnation replaced (`lua/receive.lua`): dropped with their sender if their round
        dies with its owner, let go of once committed."""
        return fragment_key(self.job, p, "orphans")

    def norms(self, p: int) -> str:
        """Hash: learner slot -> `norm steps` of its last accepted update of fragment p (the
        norm as merged: clipped), which bound the next updates (`admission.Guards.clip_bound`)."""
        return fragment_key(self.job, p, "norms")

    def log(self, p: int) -> str:
        return fragment_key(self.job, p, "log")

    def fragment_stats(self, p: int) -> str:
        """Hash of the fragment's merge counters (useful seconds, tokens merged, ...)."""
        return fragment_key(self.job, p, "stats")
