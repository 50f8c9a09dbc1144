"""The worker passes our modules through the workflow sandbox (docs/temporal.md, "The
sandbox"): every run of a workflow then shares its module. That is safe only while our
workflow modules keep no mutable state at module level; this pins it, for the modules there
are now and any added later."""

import dataclasses
import importlib
import pkgutil
import types
import typing
import uuid
from datetime import timedelta, timezone
from unittest import mock

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import (
    RestrictedWorkflowAccessError,
    SandboxedWorkflowRunner,
)

import durable_memory.workflows
from durable_memory.workers.sandbox import COMPILES_ONCE, CompiledSandboxRunner, compiled
from durable_memory.workers.worker import STRICT_WORKFLOW_RUNNER, WORKFLOW_RUNNER, WORKFLOWS
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.restricted_workflow import OpensAFile

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


async def test_the_runners_compile_the_sandboxs_snippets_once() -> None:
    """temporalio runs a snippet through `exec` per activation and two per payload; ours hand
    it the snippet compiled once (durable_memory/workers/sandbox.py). Written against the
    installed temporalio: if a release moves the method it overrides, this says so."""
    assert COMPILES_ONCE, "temporalio moved _Instance._run_code: the runner fell back"
    assert isinstance(WORKFLOW_RUNNER, CompiledSandboxRunner)
    assert isinstance(STRICT_WORKFLOW_RUNNER, CompiledSandboxRunner)
    definition = typing.cast(typing.Any, TurnWorkflow).__temporal_workflow_definition
    compiled.cache_clear()
    with mock.patch("builtins.compile", wraps=compile) as compiling:
        for _ in range(3):
            STRICT_WORKFLOW_RUNNER.prepare_workflow(definition)
    snippets = compiled.cache_info()
    assert snippets.misses == 2  # an import and a start, the same for every instance
    assert snippets.hits == 4
    compiled_here = [c for c in compiling.call_args_list if c.args[1:] == ("<string>", "exec")]
    assert len(compiled_here) == 2


@pytest.mark.parametrize("runner", ["passthrough", "strict"])
async def test_the_sandboxs_restrictions_still_apply_under_our_runners(
    temporal_env: WorkflowEnvironment, runner: str
) -> None:
    """Compiling a snippet once changes only the compiling: a workflow that calls `open`
    fails its workflow task with the sandbox's RestrictedWorkflowAccessError, as under the
    SDK's own runner."""
    chosen = WORKFLOW_RUNNER if runner == "passthrough" else STRICT_WORKFLOW_RUNNER
    queue = f"sandbox-{uuid.uuid4().hex}"
    async with Worker(
        temporal_env.client,
        task_queue=queue,
        workflows=[OpensAFile],
        workflow_runner=chosen,
        workflow_failure_exception_types=[RestrictedWorkflowAccessError],
    ):
        with pytest.raises(WorkflowFailureError) as failed:
            await temporal_env.client.execute_workflow(
                OpensAFile.run,
                id=f"opens-{uuid.uuid4().hex}",
                task_queue=queue,
                execution_timeout=timedelta(seconds=60),
            )
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == RestrictedWorkflowAccessError.__name__
    assert "open" in cause.message
