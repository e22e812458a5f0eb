"""Identity: which slots a credential speaks for, and the tokens file."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc
import pytest

from services import tls
from synchronizer.auth import Authenticator, AuthError, Identity, load_tokens, token_digest


def test_a_certificate_names_its_slots_and_a_pool_pattern_its_prefix(tmp_path: Path) -> None:
    files = tls.generate(tmp_path, ["learner-3"])
    cert, _ = files.client("learner-3")
    assert tls.learner_patterns(cert.read_bytes()) == ("learner-3",)
    assert tls.learner_patterns(files.server_cert.read_bytes()) == ()
    pool = Identity("certificate", ("atoll-learner-main-*",))
    assert pool.allows("atoll-learner-main-0")
    assert not pool.allows("atoll-learner-other-0")
    exact = Identity("certificate", ("learner-3",))
    assert exact.allows("learner-3")
    assert not exact.allows("learner-30")


def test_the_tokens_file_holds_digests_and_refuses_anything_else(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# slot digest\nl0 {token_digest('t0')}\n\nl1 {token_digest('t1')}  # x\n")
    tokens = load_tokens(path)
    assert sorted(tokens) == ["l0", "l1"]
    assert tokens["l0"].hex() == token_digest("t0")
    path.write_text("l0 not-hex\n")
    with pytest.raises(ValueError, match=":1: expected"):
        load_tokens(path)


class _Context:
    """What the interceptor reads of a call: its peer; abort raises."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AuthError(code, details)


def test_a_slots_state_fetches_are_counted_per_slot_whatever_its_connections() -> None:
    auth = Authenticator(
        "atoll.v1.Synchronizer",
        mtls=False,
        tokens={"l0": hashlib.sha256(b"t0").digest()},
        shared_token="shared",
        anonymous=False,
    )
    slot = (("authorization", "Bearer t0"),)
    shared = (("authorization", "Bearer shared"),)

    async def run() -> None:
        for peer in ("ipv4:10.0.0.1:1", "ipv4:10.0.0.1:2"):
            await auth._enter("FetchState", slot, _Context(peer))
        with pytest.raises(AuthError) as err:
            await auth._enter("FetchState", slot, _Context("ipv4:10.0.0.1:3"))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The job's shared token speaks for any slot: counted per connection, as before.
        for peer in ("ipv4:10.0.0.2:1", "ipv4:10.0.0.2:1", "ipv4:10.0.0.2:2"):
            await auth._enter("FetchState", shared, _Context(peer))

    asyncio.run(run())


def test_a_pool_credentials_state_fetches_are_counted_over_its_connections() -> None:
    """With --pool-size 2, the job's shared token (a credential of any slot) may have 4 state
    fetches in flight over all its connections, 2 on each; the fifth is refused on a fresh
    connection, and one ending frees its place."""
    auth = Authenticator(
        "atoll.v1.Synchronizer",
        mtls=False,
        tokens=None,
        shared_token="shared",
        anonymous=False,
        pool_size=2,
    )
    shared = (("authorization", "Bearer shared"),)

    async def run() -> None:
        keys = []
        for peer in ("ipv4:10.0.0.2:1", "ipv4:10.0.0.2:2", "ipv4:10.0.0.2:3", "ipv4:10.0.0.2:3"):
            keys.append(await auth._enter("FetchState", shared, _Context(peer)))
        with pytest.raises(AuthError) as err:
            await auth._enter("FetchState", shared, _Context("ipv4:10.0.0.2:4"))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "pool" in err.value.details
        with pytest.raises(AuthError):  # the per-connection limit still holds
            await auth._enter("FetchState", shared, _Context("ipv4:10.0.0.2:3"))
        auth._leave(keys[0])
        keys.append(await auth._enter("FetchState", shared, _Context("ipv4:10.0.0.2:4")))
        for key in keys[1:]:
            auth._leave(key)
        assert not auth.in_flight
        # Other methods are not counted against the pool.
        for peer in ("ipv4:10.0.0.2:5", "ipv4:10.0.0.2:6", "ipv4:10.0.0.2:7"):
            await auth._enter("Follow", shared, _Context(peer))

    asyncio.run(run())
