"""The job's config on the wire: what a joining learner receives, both ways."""

from __future__ import annotations

import pytest

from services import codec as codecs
from services.config import (
    WELCOME_FIELDS,
    JobConfig,
    job_config_from_proto,
    job_config_to_proto,
)
from services.gen.atoll.v1 import fragment_pb2, session_pb2

CONFIG = JobConfig(
    job="j",
    mode="sync",
    fragments=7,
    inner_steps=9,
    overlap_steps=3,
    codec="e3m0",
    block_size=128,
    merge_alpha=0.25,
    max_staleness=5,
    max_chunk_bytes=4096,
    job_steps=1234,
    keep_overlap_progress=False,
    outer_lr=0.5,
)


def test_every_field_the_proto_declares_is_a_job_config_field() -> None:
    assert len(WELCOME_FIELDS) == 12
    assert set(WELCOME_FIELDS) <= set(JobConfig.model_fields)


def test_the_config_goes_to_the_proto_and_back() -> None:
    message = job_config_to_proto(CONFIG)
    assert message.codec == fragment_pb2.CODEC_E3M0
    back = job_config_from_proto(session_pb2.JobConfig.FromString(message.SerializeToString()))
    carried = set(WELCOME_FIELDS)
    assert back.model_dump(include=carried) == CONFIG.model_dump(include=carried)
    assert back.outer_lr == JobConfig().outer_lr  # not carried: the synchronizer's alone
    assert job_config_to_proto(back) == message


def test_a_codec_alias_comes_back_as_the_codec_it_names() -> None:
    back = job_config_from_proto(job_config_to_proto(JobConfig(codec="int4")))
    assert codecs.by_name(back.codec) is codecs.by_name("int4")


def test_a_codec_not_registered_or_a_value_out_of_range_is_refused() -> None:
    message = job_config_to_proto(CONFIG)
    message.codec = 99  # type: ignore[assignment]
    with pytest.raises(codecs.CodecError, match="99"):
        job_config_from_proto(message)
    message = job_config_to_proto(CONFIG)
    message.fragments = 0
    with pytest.raises(ValueError, match="fragments"):
        job_config_from_proto(message)
