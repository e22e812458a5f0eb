"""One config model per role. Flags, `ATOLL_*` environment variables and a TOML file named
by `ATOLL_CONFIG` all map onto it, in that order of precedence (flags win).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from services.codec import DEFAULT_BLOCK_SIZE, REGISTRY, by_wire
from services.gen.atoll.v1 import session_pb2
from services.wire import DEFAULT_MAX_CHUNK_BYTES

Mode = Literal["decoupled", "sync"]
if TYPE_CHECKING:
    CodecName = str
else:  # every name the codec registry answers to, in its order: `--codec`'s choices
    CodecName = Literal[tuple(REGISTRY)]


# Protocol: while a job has no parameters, one joining learner alone may send them for this
# long; the others wait for them instead of each uploading the whole model.
INIT_CLAIM_S = 60.0


class JobConfig(BaseModel):
    """The algorithm's settings. The synchronizer owns them; learners receive them on join."""

    job: str = Field("default", description="job name; keys in Redis are scoped by it")
    mode: Mode = Field(
        "decoupled",
        description="decoupled: learners never wait; sync: every learner waits for each merge "
        "(classic DiLoCo, quorum = all live learners, no grace)",
    )
    fragments: int = Field(
        4, ge=1, le=4096, description="P: fragments the parameters are split into"
    )
    inner_steps: int = Field(
        40, ge=1, description="H: inner steps between two syncs of the same fragment"
    )
    overlap_steps: int = Field(
        5, ge=0, description="tau: steps a fragment may be in flight (sets the grace window)"
    )
    codec: CodecName = Field(
        "int8",
        description="encoding of outer gradients on the wire: fp32, bf16, int8 (per-block "
        "absmax), int4 (the better 4-bit codec as measured: int4-uniform), e3m0 (sign and "
        "3-bit exponent), int2 (four levels scaled by the block's RMS), sign (1 bit, the "
        "block's mean magnitude), topk (each block's largest 1/32 in 4-bit); all with "
        "error feedback",
    )
    block_size: int = Field(
        DEFAULT_BLOCK_SIZE,
        ge=1,
        le=1 << 20,
        description="values per scale block (every codec but fp32 and bf16)",
    )
    quorum: int = Field(
        0,
        ge=0,
        description="K: minimum learners per merge (decoupled mode). 0: every live learner "
        "still training, a straggler waited for at most one fragment period (H steps) of the "
        "round's members and --max-grace-seconds: learners never wait, and each round holds "
        "every on-time learner's update (measured best, docs/algorithm.md)",
    )
    grace_gamma: float = Field(
        0.8, ge=0.0, le=10.0, description="gamma of the adaptive grace window (paper Eq. 3)"
    )
    grace_seconds: float | None = Field(
        None, ge=0.0, description="fixed grace window in seconds; unset: adaptive (Eq. 3)"
    )
    max_grace_seconds: float = Field(
        30.0,
        gt=0.0,
        description="the adaptive grace window never waits longer than this (a learner "
        "reporting a very slow step cannot hold every round open)",
    )
    outer_lr: float = Field(
        1.0,
        gt=0.0,
        description="outer Nesterov SGD learning rate (1.0 measured best for decoupled runs "
        "at 86M parameters on GPUs, docs/BENCHMARKS.md)",
    )
    outer_momentum: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="outer Nesterov momentum (DiLoCo's 0.9 suits H in the hundreds; measured "
        "here it destabilises decoupled partial rounds, see docs/algorithm.md)",
    )
    merge_alpha: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="learner merge when overlap progress is not kept: "
        "theta <- alpha*theta + (1-alpha)*global",
    )
    keep_overlap_progress: bool = Field(
        True,
        description="steps a learner takes while its update is in flight survive the reply "
        "(theta <- global + (theta - theta_sent)) and count toward its next update; off: the "
        "reply overwrites them (--merge-alpha) and their compute is lost",
    )
    partial_rounds: Literal["scaled", "full"] = Field(
        "scaled",
        description="scaled: a round with n of M live learners takes n/M of an outer step "
        "(missing learners count as zero progress); full: every round takes a full step",
    )
    merge: Literal["mean", "radial"] = Field(
        "mean",
        description="how a round combines outer gradients: mean (token-weighted mean) or "
        "radial (per tensor: the weighted mean of their norms along the direction of the "
        "weighted mean of their unit vectors)",
    )
    staleness_decay: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="an update s versions behind weighs decay^s in its round; 1: no decay",
    )
    max_staleness: int = Field(
        8,
        ge=0,
        description="updates more versions behind than this are refused (not one received "
        "before by an owner that then died: it merges when sent again)",
    )
    max_chunk_bytes: int = Field(
        DEFAULT_MAX_CHUNK_BYTES, ge=1024, le=1 << 22, description="payload chunk size on the wire"
    )
    downlink_codec: CodecName = Field(
        "int8",
        description="encoding of the new global values sent to learners, as deltas every "
        "learner applies exactly (server-side error feedback keeps what encoding loses); "
        "fp32 sends them nearly lossless",
    )
    job_steps: int = Field(
        0,
        ge=0,
        description="the job's budget of inner steps over all learner slots together: once "
        "reached, every learner does its final sync and stops (a learner slowed by a fault "
        "does fewer steps, the others more); 0: each learner runs its own --steps",
    )
    max_steps_per_s: float = Field(
        1000.0,
        gt=0.0,
        description="the fastest a learner slot's steps count toward --job-steps: a slot's "
        "count advances at most this many steps per second of its session, whatever it "
        "claims (set it a few times above your learners' real step rate)",
    )
    max_update_norm_ratio: float = Field(
        10.0,
        gt=1.0,
        description="an update whose L2 norm exceeds this many times the median norm of the "
        "other learners' last updates of its fragment, each scaled to the update's inner "
        "steps (square root for fewer, linear for more, at most 8x), or the fragment's own "
        "norm if larger, is refused (with none yet: this many times the fragment's own norm); "
        "one under that floor but over this many times the median is merged at no weight "
        "once whole (recorded; its round's step is cut as if its slot sent nothing); one "
        "within it is scaled down by --clip-norm-ratio",
    )
    initializer: str = Field(
        "",
        description="the learner slot whose hello fixes the job's model spec and whose "
        "first values initialize it (atoll up: learner-0; the chart: the first pool's pod 0); "
        "other slots wait for them. Empty: the first authenticated hello (any authorized slot "
        "may then fix the spec and first values: set it, or --init-from)",
    )
    clip_norm_ratio: float = Field(
        3.0,
        gt=1.0,
        description="an update whose L2 norm exceeds this many times the median norm of the "
        "other learner slots' last accepted updates of its fragment (each scaled to the "
        "update's inner steps; kept in Redis, so a new owner inherits them) is scaled down to "
        "that norm before it merges, not refused; colluding slots short of a majority of "
        "those with history cannot move the median",
    )
    min_update_agreement: float = Field(
        0.0,
        ge=-1.0,
        le=1.0,
        description="an update whose values point against the fragment's last merged outer "
        "gradient (its agreement: the share of its L1 mass on values whose sign matches that "
        "gradient's, minus the share on those that do not, on a random sample of its chunks "
        "drawn once it is whole) below this is merged at no weight, as if it were not sent: "
        "a sign-flipped update from a hostile slot steers nothing; not checked against a "
        "direction its own slot's updates made alone (-1 turns the check off)",
    )
    max_shrink_agreement: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="an update whose values' signs agree with the fragment's own values' "
        "over this (the same measure and sample as --min-update-agreement's: 1 where every "
        "value moves the fragment toward zero) is merged at no weight: one that replaces the "
        "fragment with a small vector carries no training (1 turns the check off)",
    )
    warmup_update_rms: float = Field(
        0.05,
        gt=0.0,
        description="with no other slot's accepted update of a fragment to measure against "
        "(its first, or a slot alone on it), an update is scaled down to at most this root "
        "mean square per value before it merges (raise it for a job of one learner whose "
        "outer gradients are larger)",
    )
    max_weight_share: float = Field(
        2.0,
        ge=1.0,
        description="an update weighs at most this many times the median weight of the "
        "other learners' last updates of its fragment (with none yet: of the other updates "
        "in its round), so no one learner's token count buys the merge",
    )


# How `--help` shows flags: no `null` among a type's choices, no JSON, plain defaults.
CLI_HELP = SettingsConfigDict(cli_hide_none_type=True, cli_avoid_json=True)


class HelpFormat(CliSettingsSource[Any]):
    """`--help` in a user's words: `PATH` for a path, `X,...` for a list of X and its default
    as the flag takes it (`a,b`). A default that means "unset" (None, "", False, an empty
    list) is not shown: the description says what happens when the flag is not given. A
    computed default is left to the description."""

    def _metavar_format(self, obj: Any) -> str:
        text = super()._metavar_format(obj)
        for name, shown in (("Path", "PATH"), ("{PATH,null}", "PATH")):
            text = text.replace(name, shown)
        if text.startswith("list[") and text.endswith("]"):
            return f"{text[5:-1]},..."
        return text

    def _help_format(
        self,
        field_name: str,
        field_info: FieldInfo,
        model_default: Any,
        is_model_suppressed: bool,
        env_var_names: tuple[str, ...] = (),
    ) -> str:
        default = field_info.default
        means_unset = default is None or default is False or default == "" or default == []
        listed = isinstance(default, list | tuple) and bool(default)  # shown here, not by repr
        computed = field_info.default_factory is not None  # an empty list or a function
        shown_default = (
            model_default not in (PydanticUndefined, None)
            or is_model_suppressed
            or self._is_field_suppressed(field_info)
            or not (means_unset or computed or listed)
        )
        if shown_default:
            return str(
                super()._help_format(
                    field_name, field_info, model_default, is_model_suppressed, env_var_names
                )
            )
        text = field_info.description or ""
        if listed:
            text += f" (default: {','.join(str(x) for x in default)})"
        text = self._help_format_env_vars(text, env_var_names)
        return text.replace("%", "%%")  # argparse formats help with %


class AtollSettings(BaseSettings):
    """Base of every command's settings: env vars `ATOLL_<FLAG>`, file `$ATOLL_CONFIG`."""

    model_config = SettingsConfigDict(
        **CLI_HELP,
        env_prefix="ATOLL_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="forbid",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config = os.environ.get("ATOLL_CONFIG")
        if config:
            if not Path(config).is_file():
                raise FileNotFoundError(
                    f"ATOLL_CONFIG names {config!r}, which is not a file; unset it or fix the path"
                )
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config))
        return tuple(sources)


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class SynchronizerSettings(JobConfig, AtollSettings):
    """`atoll synchronizer`: one stateless replica; all state lives in Redis."""

    listen: str = Field("127.0.0.1:50051", description="gRPC address HOST:PORT (port 0: any)")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis holding the control state: redis://HOST:PORT/DB, rediss://..., "
        "unix:///path.sock, redis+cluster://HOST:PORT (any node of a Redis Cluster) or "
        "redis+sentinel://HOST:PORT/SERVICE; the password is best given in the file named by "
        "ATOLL_REDIS_PASSWORD_FILE",
    )
    tensor_store: str = Field(
        str(Path(tempfile.gettempdir()) / "atoll-tensors"),
        description="where fragment values, optimizer states and deltas live: a directory "
        "(every replica of a job must see the same one) or s3://bucket/prefix, "
        "gs://bucket/prefix, az://container/prefix",
    )
    advertise: str | None = Field(
        None,
        description="HOST:PORT learners reach this replica at for the fragments it owns "
        "(default: the listen host, or this host's name when listening on all addresses, "
        "with the bound port)",
    )
    metrics_listen: str = Field(
        "127.0.0.1:9400", description="HOST:PORT serving Prometheus /metrics (port 0: any)"
    )
    replica_id: str = Field(
        default_factory=default_replica_id, description="this replica's name; default: HOST-PID"
    )
    lease_ttl_s: float = Field(
        10.0, gt=0.0, description="a learner is dead after this long without a heartbeat"
    )
    init_from: Path | None = Field(
        None, description=".npz of initial parameters (leaf name -> array); unset: first learner's"
    )
    token: str | None = Field(
        None,
        description="a secret shared by every learner of the job (sent as a bearer token): "
        "it authenticates the job, not a slot; prefer --learner-tokens-file or client "
        "certificates",
    )
    learner_tokens_file: Path | None = Field(
        None,
        description="per-slot tokens: lines 'SLOT SHA256HEX' (the token's SHA-256 in hex); a "
        "learner presents its token as 'authorization: Bearer TOKEN' and speaks only for SLOT",
    )
    insecure: bool = Field(
        False,
        description="serve plaintext gRPC (no TLS); only on loopback or a trusted network",
    )
    tls_cert: Path | None = Field(None, description="PEM server certificate (chain) for TLS")
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert")
    tls_ca: Path | None = Field(
        None,
        description="PEM CA that learners' client certificates must chain to (mTLS); a "
        "certificate's URI SAN 'learner:SLOT' (or 'learner:PREFIX*') names the slots it is for",
    )
    health_listen: str = Field(
        "",
        description="HOST:PORT of a plaintext gRPC port serving only the health service (for "
        "probes that cannot speak TLS, as the kubelet's); empty: none",
    )
    hello_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="a session that sends no hello, or an Ingest call that sends no first "
        "chunk, within this long is closed (DEADLINE_EXCEEDED)",
    )
    pool_size: int = Field(
        0,
        ge=0,
        description="the most live sessions one pool credential (a certificate naming slots "
        "by a prefix, URI SAN learner:PREFIX*) may hold at once: the pool's replicas (the "
        "chart sets its largest pool's); also bounds such a credential's state fetches in "
        "flight over all its connections (2 per slot of it); 0: no cap",
    )
    max_ingest_per_slot: int = Field(
        8,
        ge=1,
        description="Ingest calls one learner slot may have in flight at once (a learner of "
        "several processes: each process), counted from each call's start (before its first "
        "chunk: per caller, by its credential)",
    )
    parts_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="an update sent in parts (by a learner of several processes) whose last "
        "part has not come this long after its first is abandoned; its processes send it again",
    )
    log_level: str = Field("info", description="debug, info, warning or error")
    port_file: Path | None = Field(
        None, description="write the bound gRPC and metrics ports here (JSON) once serving"
    )
    tape: Path | None = Field(
        None, description="append this replica's state changes (JSON lines) to this tape file"
    )

    @model_validator(mode="after")
    def _check_init(self) -> SynchronizerSettings:
        if self.init_from is not None and not self.init_from.is_file():
            raise ValueError(f"--init-from {self.init_from}: no such file; give an .npz checkpoint")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        return self

    def transport_problem(self) -> str | None:
        """Why this replica may not start as configured (None: it may)."""
        if self.insecure or self.tls_cert is not None:
            if self.tls_ca is not None and self.tls_cert is None:
                return "--tls-ca needs --tls-cert and --tls-key (the server's certificate)"
            if not self.insecure and not (self.tls_ca or self.learner_tokens_file or self.token):
                return (
                    "TLS without a way for learners to authenticate: pass --tls-ca (learner "
                    "certificates), --learner-tokens-file or --token"
                )
            return None
        return (
            "no TLS certificate: pass --tls-cert and --tls-key (and --tls-ca to require learner "
            "certificates), or --insecure to serve plaintext on a trusted network"
        )


# The fields of the job's config a learner receives on join (session.proto's JobConfig):
# each bears its JobConfig field's name, so the proto message declares which travel.
WELCOME_FIELDS = tuple(session_pb2.JobConfig.DESCRIPTOR.fields_by_name)


def job_config_to_proto(config: JobConfig) -> session_pb2.JobConfig:
    """The job's config as a joining learner receives it; the codec by its wire value."""
    values: dict[str, Any] = {name: getattr(config, name) for name in WELCOME_FIELDS}
    values["codec"] = REGISTRY[config.codec].wire
    return session_pb2.JobConfig(**values)


def job_config_from_proto(message: session_pb2.JobConfig) -> JobConfig:
    """`job_config_to_proto`'s inverse: the fields it carries, checked as flags are (a codec
    by its registered name, ValueError for one not registered); every other field at its
    default."""
    values: dict[str, Any] = {name: getattr(message, name) for name in WELCOME_FIELDS}
    values["codec"] = by_wire(message.codec).name
    return JobConfig.model_validate(values)
