"""The worker passes our modules through the workflow sandbox (docs/temporal.md, "The
sandbox"): every run of a workflow then shares its module. That is safe only while our
workflow modules keep no mutable state at module level; this pins it, for the modules there
are now and any added later."""

import dataclasses
import importlib
import pkgutil
import types
import typing
from datetime import timedelta, timezone

from temporalio.common import RetryPolicy
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

import durable_memory.workflows
from durable_memory.workers.worker import WORKFLOW_RUNNER, WORKFLOWS

IMMUTABLE = (str, int, float, bool, bytes, type(None), timedelta, timezone, frozenset)
READ_ONLY = (RetryPolicy,)
"""Mutable dataclasses the SDK only reads when a workflow passes them as options."""


def _immutable(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(item) for item in value)
    if isinstance(value, (*IMMUTABLE, *READ_ONLY)):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return bool(value.__dataclass_params__.frozen)  # type: ignore[attr-defined]
    # Classes, functions, imported modules, type variables and aliases: definitions.
    return (
        isinstance(
            value, type | types.FunctionType | types.ModuleType | typing.TypeVar | types.UnionType
        )
        or type(value).__module__ == "typing"
    )


def test_workflow_modules_hold_no_mutable_state() -> None:
    shared = []
    for module_info in pkgutil.iter_modules(durable_memory.workflows.__path__):
        module = importlib.import_module(f"durable_memory.workflows.{module_info.name}")
        shared += [
            f"{module.__name__}.{name}: {type(value).__name__}"
            for name, value in vars(module).items()
            if not name.startswith("__") and not _immutable(value)
        ]
    assert shared == [], "module-level state every run of a workflow would share"


async def test_every_workflow_runs_in_the_sandbox_with_our_modules_passed_through() -> None:
    assert isinstance(WORKFLOW_RUNNER, SandboxedWorkflowRunner)
    assert "durable_memory" in WORKFLOW_RUNNER.restrictions.passthrough_modules
    assert {w.__module__.split(".")[0] for w in WORKFLOWS} == {"durable_memory"}
    for workflow_class in WORKFLOWS:  # each still loads under the runner's restrictions
        WORKFLOW_RUNNER.prepare_workflow(
            typing.cast(typing.Any, workflow_class).__temporal_workflow_definition
        )
