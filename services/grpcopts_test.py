"""The host a secure channel checks a server's certificate against, from gRPC targets."""

from __future__ import annotations

import pytest

from services.grpcopts import target_host


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("atoll-synchronizer:50051", "atoll-synchronizer"),
        ("127.0.0.1:50051", "127.0.0.1"),
        ("[::1]:50051", "::1"),
        (
            "dns:///atoll-synchronizer-headless.atoll.svc:50051",
            "atoll-synchronizer-headless.atoll.svc",
        ),
        ("dns://10.0.0.10:53/sync.example.com:443", "sync.example.com"),
        ("dns:sync.example.com:443", "sync.example.com"),
        ("ipv4:10.1.2.3:50051,10.1.2.4:50051", "10.1.2.3"),
        ("ipv6:[fd00::1]:50051", "fd00::1"),
        ("localhost", "localhost"),
        ("unix:/run/atoll.sock", ""),
        ("unix-abstract:atoll", ""),
    ],
)
def test_target_host(target: str, host: str) -> None:
    assert target_host(target) == host
