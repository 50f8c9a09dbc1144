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
from temporalio import activity
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
from durable_memory.workers import sandbox
from durable_memory.workers.sandbox import COMPILES_ONCE, CompiledSandboxRunner, compiled
from durable_memory.workers.worker import STRICT_WORKFLOW_RUNNER, WORKFLOW_RUNNER, WORKFLOWS
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.restricted_workflow import OpensAFile, SchedulesAndUpserts

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


@activity.defn(name="shout")
async def _shout(word: str) -> str:
    return word.upper() + "+"


async def _run_schedules_and_upserts(client: typing.Any, runner: SandboxedWorkflowRunner) -> str:
    queue = f"sandbox-{uuid.uuid4().hex}"
    async with Worker(
        client,
        task_queue=queue,
        workflows=[SchedulesAndUpserts],
        activities=[_shout],
        workflow_runner=runner,
    ):
        result: str = await client.execute_workflow(
            SchedulesAndUpserts.run,
            "hi",
            id=f"contexts-{uuid.uuid4().hex}",
            task_queue=queue,
            execution_timeout=timedelta(seconds=60),
        )
        return result


@pytest.mark.parametrize("runner", ["passthrough", "strict"])
async def test_a_payloads_contexts_are_what_the_sandbox_would_answer(
    temporal_env: WorkflowEnvironment, runner: str
) -> None:
    """The runners answer a payload's serialization and external-store contexts from the
    run's instance directly (durable_memory/workers/sandbox.py): each answer is the one the
    SDK's own path through the sandbox gives, for every payload of a run that schedules an
    activity and a local activity, upserts a memo and returns."""
    assert sandbox.LOOKS_UP_DIRECTLY, "temporalio moved its context lookups: the runner fell back"
    chosen = WORKFLOW_RUNNER if runner == "passthrough" else STRICT_WORKFLOW_RUNNER
    through_sandbox = typing.cast(typing.Any, sandbox._SdkInstance)
    ours = sandbox._CompiledOnceInstance
    compared: list[tuple[str, object, object]] = []

    def both(name: str) -> typing.Callable[..., object]:
        direct = getattr(ours, name)

        def answer(self: object, command_info: object) -> object:
            mine = direct(self, command_info)
            compared.append((name, mine, getattr(through_sandbox, name)(self, command_info)))
            return mine

        return answer

    with (
        mock.patch.object(ours, "get_serialization_context", both("get_serialization_context")),
        mock.patch.object(ours, "get_external_store_context", both("get_external_store_context")),
    ):
        assert await _run_schedules_and_upserts(temporal_env.client, chosen) == "HI++!"
    kinds = {type(theirs).__name__ for _, _, theirs in compared}
    assert {"ActivitySerializationContext", "WorkflowSerializationContext"} <= kinds
    assert {name for name, _, _ in compared} == {
        "get_serialization_context",
        "get_external_store_context",
    }
    assert [mine for _, mine, _ in compared] == [theirs for _, _, theirs in compared]


@pytest.mark.parametrize("runner", ["passthrough", "strict"])
async def test_only_activations_and_the_runs_start_enter_the_sandbox(
    temporal_env: WorkflowEnvironment, runner: str
) -> None:
    """No payload's context lookup enters the sandbox: the snippets run there are the
    workflow's import and the start of its instance (once when the worker checks the workflow,
    once for the run), and the run's activations: the only ones that run workflow code."""
    chosen = WORKFLOW_RUNNER if runner == "passthrough" else STRICT_WORKFLOW_RUNNER
    ours = sandbox._CompiledOnceInstance
    entered: list[str] = []
    run_code = ours._run_code

    def entering(self: sandbox._CompiledOnceInstance, code: str, **extra_globals: object) -> None:
        entered.append(code)
        run_code(self, code, **extra_globals)

    with mock.patch.object(ours, "_run_code", entering):
        assert await _run_schedules_and_upserts(temporal_env.client, chosen) == "HI++!"
    activations = [code for code in entered if ".activate(" in code]
    assert len(activations) >= 3  # the start, the activity's result, the local activity's
    assert not [code for code in entered if "context" in code]
    others = [code for code in entered if code not in activations]
    imports = [code for code in others if "import SchedulesAndUpserts" in code]
    starts = [code for code in others if "= InSandbox(" in code]
    assert (len(imports), len(starts), len(others)) == (2, 2, 4)
