"""The host a secure channel checks a server's certificate against, from gRPC targets; why
an address cannot be listened on."""

from __future__ import annotations

import socket

import pytest

from services.grpcopts import bind_error, cannot_listen, target_host


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


def test_bind_error_says_why_an_address_cannot_be_listened_on() -> None:
    assert bind_error("127.0.0.1:0") is None
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        err = bind_error(address)
        assert err is not None
        assert cannot_listen("--listen", address, err) == (
            f"cannot listen on --listen {address}: address already in use; choose a free "
            "port, or stop the process that holds it"
        )
    assert bind_error(address) is None  # free again
    assert bind_error("192.0.2.1:9400") is not None  # not this machine's address
