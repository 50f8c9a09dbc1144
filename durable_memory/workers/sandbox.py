"""temporalio's workflow sandbox, with the code it runs for each call into a run compiled once.

The sandbox (`SandboxedWorkflowRunner`) reaches a workflow run's instance through `exec` of a
short snippet: one per activation, and two per payload the worker encodes or decodes for the
run (its serialization context and its external-store context: every activity argument and
result, search attribute, summary and update answer). temporalio 1.35 passes `exec` the
snippet's text, so Python compiles it again on every call: ~35 us each on the machine of
docs/benchmarks.md, dozens of times a turn (one run of bench/pipeline.py made 8,563 such
calls; py-spy put the compiling at ~4 ms of the worker's CPU per tool-using turn).
`CompiledSandboxRunner` hands `exec` the same snippet compiled once: the same code, run in the
same globals, under the same restrictions; only the compilation is shared. It imports nothing
of ours, so the benchmarks' floors run on it too.

Two of those entries run no workflow code at all: for every payload the worker visits, the SDK
asks the run's instance for the payload's serialization context and its external-store
context, and it asks by entering the sandbox (the snippet, then the sandbox's import
restrictions put in place and taken down again: py-spy put those entries at ~17% of the
workflow tasks' CPU in a tool-using turn, some 2 ms). What answers is the SDK's own lookup in
the instance's state (`_WorkflowInstanceImpl.get_serialization_context`: the pending
activity, child or signal a command names, or the workflow's own context), which imports
nothing, calls nothing of the workflow's and changes nothing. `CompiledSandboxRunner` calls
that lookup directly, the same method on the same instance from the same thread, without the
restrictions around it; activations, the only entries that run workflow code, go through the
sandbox as before.

It overrides private methods of the SDK (`_Instance._run_code` and the two context lookups);
if a temporalio release moves them, `CompiledSandboxRunner` runs as the plain runner
(tests/test_workflow_sandbox.py says when the installed SDK is not the one this was written
against)."""

import __future__

import functools
import types
from dataclasses import dataclass
from typing import Any, cast

from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions
from temporalio.worker.workflow_sandbox import _runner as sdk_runner
from temporalio.worker.workflow_sandbox._in_sandbox import InSandbox

SNIPPETS = 64
"""Distinct snippets kept compiled: a handful per workflow class (their imports name it)."""

_SdkInstance: Any = getattr(sdk_runner, "_Instance", None)
COMPILES_ONCE = callable(getattr(_SdkInstance, "_run_code", None))
"""Whether the installed temporalio has the method overridden here (1.35 does)."""

_CONTEXT_LOOKUPS = ("get_serialization_context", "get_external_store_context")
LOOKS_UP_DIRECTLY = COMPILES_ONCE and all(
    callable(getattr(_SdkInstance, name, None)) and callable(getattr(InSandbox, name, None))
    for name in _CONTEXT_LOOKUPS
)
"""Whether the installed temporalio asks the sandboxed instance for a payload's contexts by
the methods overridden here, and its in-sandbox object answers them (1.35 does)."""
_IN_SANDBOX = "__temporal_in_sandbox"
"""Where the SDK's snippets keep the run's in-sandbox object, in the sandbox's globals."""


_FUTURE_FLAGS: int = sum(
    feature.compiler_flag
    for feature in vars(sdk_runner).values()
    if isinstance(feature, __future__._Feature)  # what `from __future__ import` binds
)
"""The `from __future__` features of the SDK's module, which its `exec(text)` inherits."""


@functools.lru_cache(maxsize=SNIPPETS)
def compiled(code: str) -> types.CodeType:
    """`code` as the SDK's `exec(code)` compiles it (its module's future features included),
    once per distinct text."""
    code_object: types.CodeType = compile(
        code, "<string>", "exec", flags=_FUTURE_FLAGS, dont_inherit=True
    )
    return code_object


class _CompiledOnceInstance(_SdkInstance if COMPILES_ONCE else object):  # type: ignore[misc]
    def _run_code(self, code: str, **extra_globals: Any) -> None:
        # The SDK's method, handed a code object: `exec` takes either.
        super()._run_code(cast(str, compiled(code)), **extra_globals)

    def get_serialization_context(self, command_info: Any) -> Any:
        in_sandbox = self._in_sandbox()
        if in_sandbox is None:
            return super().get_serialization_context(command_info)
        return in_sandbox.get_serialization_context(command_info)

    def get_external_store_context(self, command_info: Any) -> Any:
        in_sandbox = self._in_sandbox()
        if in_sandbox is None:
            return super().get_external_store_context(command_info)
        return in_sandbox.get_external_store_context(command_info)

    def _in_sandbox(self) -> InSandbox | None:
        """The run's in-sandbox object, for a lookup that runs none of the workflow's code
        (the module doc); None where the SDK is not the one this was written against."""
        if not LOOKS_UP_DIRECTLY:
            return None
        found = self.globals_and_locals.get(_IN_SANDBOX)
        return found if isinstance(found, InSandbox) else None


@dataclass(frozen=True)
class CompiledSandboxRunner(SandboxedWorkflowRunner):
    """`SandboxedWorkflowRunner` whose instances compile each snippet once (the plain one's,
    where the installed temporalio lacks the method overridden)."""

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        if not COMPILES_ONCE:
            return super().create_instance(det)
        return cast(
            WorkflowInstance, _CompiledOnceInstance(det, self.runner_class, self.restrictions)
        )


def sandboxed_runner(restrictions: SandboxRestrictions) -> SandboxedWorkflowRunner:
    """The sandbox under `restrictions`, compiling its snippets once where the SDK allows."""
    return CompiledSandboxRunner(restrictions=restrictions)
