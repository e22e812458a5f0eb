"""Generate the Python bindings of `proto/` (the one way they are made; `make proto`).

The generated modules import each other as `atoll.v1.x_pb2`, the proto package path; they
live inside `services.gen`, so those imports are rewritten to relative ones.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
DEFAULT_OUT = ROOT / "services" / "gen"
_ABSOLUTE_IMPORT = re.compile(r"^from atoll\.v1 import ", re.MULTILINE)


def generate(out: Path) -> list[Path]:
    """Write the bindings of every proto file under proto/ into `out`; return the files."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    files = sorted(p for p in out.rglob("*") if p.suffix in {".py", ".pyi"})
    for path in files:
        path.write_text(_ABSOLUTE_IMPORT.sub("from . import ", path.read_text()))
    packages = {out} | {d for f in files for d in f.parents if d.is_relative_to(out)}
    for package in packages:
        init = package / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ by `make proto`; do not edit."""\n')
    return sorted(p for p in out.rglob("*") if p.is_file() and p.suffix in {".py", ".pyi"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    sys.exit(0)


if __name__ == "__main__":
    main()
