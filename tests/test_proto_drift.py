"""The committed bindings are exactly what `make proto` makes from proto/."""

from pathlib import Path

from services import protogen


def test_generated_bindings_match_proto(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path): p.read_text() for p in protogen.generate(tmp_path)}
    committed_root = protogen.DEFAULT_OUT
    committed = {
        p.relative_to(committed_root): p.read_text()
        for p in committed_root.rglob("*")
        if p.suffix in {".py", ".pyi"}
    }
    assert fresh.keys() == committed.keys(), "run `make proto` and commit services/gen"
    drifted = [str(k) for k in fresh if fresh[k] != committed[k]]
    assert not drifted, f"bindings drifted from proto/: {drifted}; run `make proto`"
