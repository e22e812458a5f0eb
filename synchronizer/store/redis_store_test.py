"""Secrets stay out of the URLs the synchronizer logs and puts in its errors."""

from __future__ import annotations

import pytest

from synchronizer.store.redis_store import redact


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:6379/0",
        "redis://user:s3cret@127.0.0.1:6379/0",
        "rediss://:s3cret@host:6380/0?ssl_cert_reqs=none",
        "redis://127.0.0.1:6379/0?password=s3cret",
        "redis+sentinel://:s3cret@host:26379/svc",
        "s3://bucket/prefix?secret_access_key=s3cret",
        "redis://:s3cret@[::1:6379/0",
    ],
)
def test_no_password_or_secret_survives_redaction(url: str) -> None:
    assert "s3cret" not in redact(url)


def test_a_url_without_secrets_is_unchanged() -> None:
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact("/tmp/atoll-tensors") == "/tmp/atoll-tensors"
