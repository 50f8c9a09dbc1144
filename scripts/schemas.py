"""The JSON Schemas of what a caller in any language sends to and gets from `TurnWorkflow`,
generated from the pydantic models into `schemas/` (the published contract; see
docs/integration.md).

    python scripts/schemas.py            write schemas/*.json
    python scripts/schemas.py --check    exit 1, naming the stale files, if they differ

What a caller sends is described as the workflow validates it (mode "validation"), what it
gets back as the worker serialises it (mode "serialization").
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    DiffView,
    RejectedSignals,
    SignalledDecision,
    TurnInput,
    TurnOutcome,
    TurnReply,
)

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMAS_DIR = Path(__file__).resolve().parent.parent / "schemas"
REGENERATE = "python scripts/schemas.py"

Mode = Literal["validation", "serialization"]
CONTRACT: dict[str, tuple[type[BaseModel], Mode]] = {
    "TurnInput": (TurnInput, "validation"),
    "DiffDecision": (DiffDecision, "validation"),
    "SignalledDecision": (SignalledDecision, "validation"),
    "TurnReply": (TurnReply, "serialization"),
    "DecisionOutcome": (DecisionOutcome, "serialization"),
    "TurnOutcome": (TurnOutcome, "serialization"),
    "DiffView": (DiffView, "serialization"),
    "RejectedSignals": (RejectedSignals, "serialization"),
}
"""File name (without .json) -> the model and which side of the wire it describes."""


def rendered_schemas() -> dict[str, str]:
    """Each schema file's name and its exact text, as the models generate it now."""
    files = {}
    for name, (model, mode) in CONTRACT.items():
        schema = {"$schema": SCHEMA_DIALECT, **model.model_json_schema(mode=mode)}
        files[f"{name}.json"] = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    return files


def stale_files(directory: Path) -> list[str]:
    """The schema files in `directory` that are missing, differ from the models, or are no
    longer generated."""
    expected = rendered_schemas()
    present = {path.name for path in directory.glob("*.json")}
    stale = [
        name
        for name, text in expected.items()
        if name not in present or (directory / name).read_text(encoding="utf-8") != text
    ]
    return sorted(stale + [name for name in present if name not in expected])


def write_schemas(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    expected = rendered_schemas()
    for path in directory.glob("*.json"):
        if path.name not in expected:
            path.unlink()
    for name, text in expected.items():
        (directory / name).write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; write nothing")
    parser.add_argument("--dir", type=Path, default=SCHEMAS_DIR, help="default: schemas/")
    args = parser.parse_args(argv)
    if not args.check:
        write_schemas(args.dir)
        return 0
    stale = stale_files(args.dir)
    if stale:
        print(
            f"{args.dir}: {', '.join(stale)} no longer match the models; "
            f"regenerate with `{REGENERATE}` and commit the result",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
