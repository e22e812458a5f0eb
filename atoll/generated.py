"""Files made from the registries and settings (the one way they are made; `make generated`).

The Helm chart's schema offers exactly the codecs and modes the services take, and the docs'
tables of codecs and merge rules say what each registered one is. Each is written from the
registry that holds the fact (services.codec.REGISTRY, synchronizer.core.merge.REGISTRY,
services.config.JobConfig); tests/test_generated.py fails when a committed file differs.
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from pathlib import Path

import numpy as np

from services import codec as codecs
from services.config import JobConfig
from services.gen.atoll.v1 import fragment_pb2
from synchronizer.core.merge import REGISTRY as MERGE_RULES

ROOT = Path(__file__).resolve().parent.parent
HELM_SCHEMA = Path("helm/atoll/values.schema.json")
ALGORITHM_DOC = Path("docs/algorithm.md")
_BLOCK = re.compile(r"(<!-- generated: (\w+) \(make generated\) -->\n).*?(<!-- end -->)", re.S)


def codec_choices() -> list[str]:
    """Every name `--codec` takes, in the registry's order."""
    return list(codecs.REGISTRY)


def merge_rules() -> dict[str, str]:
    """Every merge rule `--merge` names, and what it does (read here alone)."""
    return {name: rule.help for name, rule in MERGE_RULES.items()}


def mode_choices() -> list[str]:
    return list(typing.get_args(JobConfig.model_fields["mode"].annotation))


def helm_schema(text: str) -> str:
    """The chart's values schema with the job's enums of codecs and modes set."""
    schema = json.loads(text)
    job = schema["properties"]["job"]["properties"]
    job["codec"]["enum"] = codec_choices()
    job["mode"]["enum"] = mode_choices()
    return json.dumps(schema, indent=2) + "\n"


def _bytes_a_value(codec: codecs.Codec) -> float:
    n = 1 << 16
    return len(codec.encode(np.ones(n, np.float32), codecs.DEFAULT_BLOCK_SIZE)) / n


def _proto_name(wire: int) -> str:
    """The Codec enum's name of a value (the value itself, where the enum has none yet)."""
    names = {int(value): name for name, value in fragment_pb2.Codec.items()}
    return names.get(wire, str(wire))


def codec_table() -> str:
    """Every codec: its names, wire value, size, compiled paths and format."""
    rows = [
        "| codec | also | proto | bytes a value | compiled sum | on the device | a value becomes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    seen: dict[str, list[str]] = {}
    for name, codec in codecs.REGISTRY.items():
        seen.setdefault(codec.name, [])
        if name != codec.name:
            seen[codec.name].append(name)
    for name, aliases in seen.items():
        codec = codecs.REGISTRY[name]
        compiled = codec.float32_payload or (
            codec.blockwise is not None and codec.blockwise.fused is not None
        )
        rows.append(
            f"| `{name}` | {', '.join(f'`{a}`' for a in aliases)} "
            f"| `{_proto_name(codec.wire)}` | {_bytes_a_value(codec):.3f} "
            f"| {'yes' if compiled else ''} | {'yes' if codec.uniform else ''} | {codec.about} |"
        )
    return "\n".join(rows) + "\n"


def merge_table() -> str:
    rows = ["| merge | what a round's outer gradients become |", "| --- | --- |"]
    rows += [f"| `{name}` | {about} |" for name, about in merge_rules().items()]
    return "\n".join(rows) + "\n"


def algorithm_doc(text: str) -> str:
    """The doc with each generated block (between its markers) written anew."""
    tables = {"codecs": codec_table, "merge_rules": merge_table}

    def block(match: re.Match[str]) -> str:
        return match.group(1) + tables[match.group(2)]() + match.group(3)

    out, count = _BLOCK.subn(block, text)
    if count != len(tables):
        raise ValueError(f"{ALGORITHM_DOC}: expected {len(tables)} generated blocks, found {count}")
    return out


def generate(root: Path = ROOT) -> dict[Path, str]:
    """Each generated file's path (under `root`) and what it should hold."""
    makers = {HELM_SCHEMA: helm_schema, ALGORITHM_DOC: algorithm_doc}
    return {path: make((root / path).read_text()) for path, make in makers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository")
    root = parser.parse_args().root
    for path, text in generate(root).items():
        if (root / path).read_text() != text:
            (root / path).write_text(text)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
