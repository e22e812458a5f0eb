"""Identity: which slots a credential speaks for, and the tokens file."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import tls
from synchronizer.auth import Identity, load_tokens, token_digest


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
