"""The worker: builds the memory stack and the model, registers workflows and activities."""

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import hashlib
import importlib.metadata
import logging
import platform
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError
from temporalio.worker import Worker, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxRestrictions

from durable_memory.activities.forget import ForgetActivities
from durable_memory.activities.offered_settings import offer_turn_settings
from durable_memory.activities.redact import RedactActivities
from durable_memory.activities.rotation import RotationActivities, SweepActivities
from durable_memory.activities.turn import TurnActivities
from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.config import ConfigError, Settings
from durable_memory.memory.agent.steps import ChatModel
from durable_memory.memory.core.tokens import load_encoding
from durable_memory.workers.heartbeats import Heartbeats
from durable_memory.workers.sandbox import sandboxed_runner
from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from durable_memory.workflows.forget import ForgetWorkflow
from durable_memory.workflows.redact import RedactWorkflow
from durable_memory.workflows.rotation import RotationSweepWorkflow, RotationWorkflow
from durable_memory.workflows.turn import TurnWorkflow

WORKFLOWS: Sequence[type] = (
    TurnWorkflow,
    RotationWorkflow,
    RotationSweepWorkflow,
    ForgetWorkflow,
    RedactWorkflow,
)
log = logging.getLogger(__name__)

ACTIVITY_THREADS = 16
WORKFLOW_RUNNER = sandboxed_runner(
    SandboxRestrictions.default.with_passthrough_modules("durable_memory")
)
"""The sandbox with our own modules passed through: a workflow run no longer imports its
workflow module (and the packages above it) afresh, which cost ~5 ms of CPU per turn. Safe
because our workflow modules hold no mutable state at module level (constants only; all of a
run's state is on its instance) and everything else of ours they use was already passed
through (`imports_passed_through`). The sandbox's restrictions on calls (builtins such as
`open`) still apply at run time; the module-member checks (`datetime.now`, `random`, ...)
apply to our workflow code in the tests, which run it in the default sandbox
(`STRICT_WORKFLOW_RUNNER`). docs/temporal.md ("The sandbox")."""

STRICT_WORKFLOW_RUNNER = sandboxed_runner(SandboxRestrictions.default)
"""The default sandbox, every module imported afresh in each run and every module-member check
on: what the test rigs run our workflows in (tests/support/temporal_helpers.py), so a
non-deterministic call added to a workflow fails the tests that reach it, not only the
recorded histories' replay."""


def activities_for(
    stack: MemoryStack, model: ChatModel, settings: Settings, client: Client
) -> list[Any]:
    """Every activity; the forget's use `client` to find and delete the user's executions,
    the sweep's to start rotations."""
    turns = TurnActivities(stack, stack.turn_steps(model), settings.turn_settings())
    rotation = RotationActivities(stack)
    sweep = SweepActivities(client)
    forget = ForgetActivities(stack, client)
    redact = RedactActivities(stack, client)
    return [
        turns.turn_settings,
        turns.prepare_turn,
        turns.start_turn,
        turns.call_model,
        turns.run_tools,
        turns.tools_then_model,
        turns.step_diffs,
        turns.finish_turn,
        turns.decide,
        turns.expire_diffs,
        turns.needs_rotation,
        rotation.plan_rotation,
        rotation.archive_rotation,
        rotation.commit_rotation,
        rotation.rotation_candidates,
        sweep.start_rotations,
        forget.begin_forget,
        forget.end_user_workflows,
        forget.forget_store,
        forget.delete_user_workflows,
        forget.complete_forget,
        forget.delete_forget_execution,
        redact.begin_redaction,
        redact.end_redaction,
        redact.redact_repository,
        redact.redact_rows,
        redact.redact_passages,
        redact.delete_executions_holding,
        redact.delete_redact_execution,
    ]


def build_worker(
    client: Client,
    settings: Settings,
    stack: MemoryStack,
    model: ChatModel,
    executor: concurrent.futures.ThreadPoolExecutor,
    workflow_runner: WorkflowRunner = WORKFLOW_RUNNER,
) -> Worker:
    """A worker on `settings.temporal.task_queue` whose turns run with `settings`' turn
    settings (step limit, approval TTL, activity timeouts and retries). The in-process test
    rigs pass the default sandbox (`STRICT_WORKFLOW_RUNNER`), whose checks then cover every
    path the tests drive through our workflow code."""
    offer_turn_settings(settings.temporal.task_queue, settings.turn_settings())
    return Worker(
        client,
        task_queue=settings.temporal.task_queue,
        workflows=list(WORKFLOWS),
        activities=activities_for(stack, model, settings, client),
        activity_executor=executor,
        max_concurrent_activities=ACTIVITY_THREADS,
        workflow_runner=workflow_runner,
        sticky_queue_schedule_to_start_timeout=timedelta(
            seconds=settings.temporal.sticky_schedule_to_start_s
        ),
        build_id=build_id(),
        interceptors=[Heartbeats()],
    )


@functools.cache
def build_id() -> str:
    """What this worker's workflow tasks are stamped with (the Temporal UI shows it on each
    completed task): a digest of our package's source and of the versions our workflows'
    replay depends on, so it changes when they do. The SDK's default digests the bytecode of
    every module loaded (~3,000 here, read back from disk): 0.7 s of each worker start,
    before it polls."""
    return f"durable-memory-{source_digest(Path(__file__).resolve().parent.parent)}"


def source_digest(package: Path) -> str:
    """A digest of the `.py` files under `package` (their paths within it and their bytes),
    the installed temporalio and pydantic, and Python's version."""
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode())
        digest.update(b"\0")
        digest.update(source.read_bytes())
        digest.update(b"\0")
    for dependency in ("temporalio", "pydantic"):
        digest.update(f"{dependency}=={importlib.metadata.version(dependency)}\0".encode())
    digest.update(platform.python_version().encode())
    return digest.hexdigest()[:20]


def freeze_startup_objects() -> None:
    """Load what every turn needs and would otherwise load in the first turn after a start
    (the tokenizer's encoding, ~0.4 s), then keep what the process built at start (modules,
    the tokenizer, the stack), which lives as long as it does, out of the collector's full
    passes, whose cost grows with the heap and made compiling a context of thousands of
    messages superlinear (bench/context_compile.py)."""
    load_encoding()
    gc.collect()
    gc.freeze()


def _type_name(key: SearchAttributeKey[Any]) -> str:
    """The type as the `temporal` CLI spells it: KEYWORD_LIST -> KeywordList."""
    return "".join(part.capitalize() for part in key.indexed_value_type.name.split("_"))


async def require_search_attributes(client: Client, namespace: str) -> None:
    """Refuse to start against a namespace that lacks one of our search attributes: a turn
    upserting it would fail its workflow task on every retry and never answer. A server that
    does not let us list them (permissions) is let through with a warning."""
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
    except RPCError as error:
        logging.getLogger(__name__).warning("cannot list search attributes: %s", error)
        return
    registered = dict(listed.custom_attributes)
    missing = [
        key for key in SEARCH_ATTRIBUTES if registered.get(key.name) != int(key.indexed_value_type)
    ]
    if missing:
        names = " ".join(f"--name {key.name} --type {_type_name(key)}" for key in missing)
        raise ConfigError(
            f"namespace {namespace!r} lacks the search attribute(s) (or has them with another "
            "type) "
            f"{', '.join(key.name for key in missing)}: register them once with "
            f"`temporal operator search-attribute create --namespace {namespace} {names}` "
            "(see docs/operations.md)"
        )


async def run_worker(
    client: Client,
    settings: Settings,
    model: ChatModel,
    stop: asyncio.Event,
    polling: Callable[[], None] = lambda: None,
) -> None:
    """Run until `stop` is set, then shut down gracefully. `polling` is called once the
    Temporal worker has started, its pollers with it (not before: what a start loads, the
    tokenizer and the freeze, comes first)."""
    stack = stack_from_settings(settings)
    with concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as executor:
        worker = build_worker(client, settings, stack, model, executor)
        freeze_startup_objects()
        async with worker:
            polling()
            if settings.memory.git_remote is None:
                await stop.wait()
            else:
                await drop_forgotten_clones_until(
                    stop, stack, settings.memory.forgotten_clone_sweep_s
                )
    stack.close()


async def drop_forgotten_clones_until(
    stop: asyncio.Event, stack: MemoryStack, every_s: float
) -> None:
    """Until `stop`: at start and every `every_s`, delete this host's clones of users a forget
    closed (a forget reaches only the clone of the host that ran its step). A failure (the
    database down) is logged and tried again at the next round."""
    while not stop.is_set():
        try:
            dropped = await asyncio.to_thread(stack.blocks.drop_forgotten_clones)
        except Exception as error:  # any failure: the next round tries again
            log.warning("dropping the clones of forgotten users failed: %s", error)
        else:
            if dropped:
                log.info("dropped this host's clones of %d forgotten user(s)", len(dropped))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
