"""The published JSON Schemas (schemas/) are exactly what the models generate: a change to a
model that crosses the turn workflow's boundary fails here, naming the command that
regenerates them, until the schemas are regenerated and committed with it."""

import json
import subprocess
import sys
from pathlib import Path

from temporalio import workflow

from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from durable_memory.workflows.turn import TurnWorkflow
from durable_memory.workflows.turn_boundary import (
    DECISION_REFUSED,
    DIFF_ALREADY_DECIDED,
    INVALID_INPUT,
    TURN_FAILED,
    TURN_WORKFLOW,
    UNKNOWN_DIFF,
)

REPO = Path(__file__).resolve().parent.parent
GENERATOR = REPO / "scripts" / "schemas.py"
CALLER_ERROR_TYPES = (
    INVALID_INPUT,
    TURN_FAILED,
    UNKNOWN_DIFF,
    DIFF_ALREADY_DECIDED,
    DECISION_REFUSED,
)


def _check(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), "--check", "--dir", str(directory)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )


def test_the_committed_schemas_match_the_models() -> None:
    checked = _check(REPO / "schemas")
    assert checked.returncode == 0, checked.stderr


def test_a_stale_schema_fails_naming_the_file_and_the_command(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(GENERATOR), "--dir", str(tmp_path)], check=True)
    assert _check(tmp_path).returncode == 0
    turn_input = tmp_path / "TurnInput.json"
    schema = json.loads(turn_input.read_text(encoding="utf-8"))
    del schema["properties"]["message"]  # as if the model had gained a field since
    turn_input.write_text(json.dumps(schema, indent=2) + "\n", encoding="utf-8")
    (tmp_path / "Retired.json").write_text("{}\n", encoding="utf-8")
    (tmp_path / "DiffDecision.json").unlink()

    checked = _check(tmp_path)

    assert checked.returncode == 1
    assert "DiffDecision.json, Retired.json, TurnInput.json" in checked.stderr
    assert "python scripts/schemas.py" in checked.stderr


def test_each_schema_describes_one_json_object() -> None:
    for path in sorted((REPO / "schemas").glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        assert schema["type"] == "object", path.name
        assert schema["title"] == path.stem, path.name


def test_the_integration_doc_names_every_handler_error_and_search_attribute() -> None:
    """docs/integration.md is the contract for callers in other languages: a handler, an
    error type or a search attribute added to the turn workflow must be documented there."""
    text = (REPO / "docs" / "integration.md").read_text(encoding="utf-8")
    definition = workflow._Definition.must_from_class(TurnWorkflow)
    handlers = [*definition.queries, *definition.signals, *definition.updates]
    assert definition.name == TURN_WORKFLOW
    names = [
        TURN_WORKFLOW,
        *(name for name in handlers if name is not None),  # None would be a dynamic handler
        *(key.name for key in SEARCH_ATTRIBUTES),
        *CALLER_ERROR_TYPES,
        *(path.name for path in sorted((REPO / "schemas").glob("*.json"))),
    ]
    missing = [name for name in names if f"`{name}`" not in text and f"{name})" not in text]
    assert not missing, f"docs/integration.md does not name: {', '.join(missing)}"
