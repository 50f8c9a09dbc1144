"""One conversation turn: compile, call the model, run its tools, reply; then wait for a
human decision on each proposed diff, commit the approved ones, and trigger rotation.

Deterministic orchestration only: every side effect is an activity. Decisions arrive as
signals (`approve`, `reject`: fire-and-forget, accepted while workers are down) or as the
`decide` Update, whose validator refuses unknown, foreign or already-decided diffs before
anything enters history. The reply is returned through the `reply` Update, so a caller that
starts the turn with update-with-start gets it in the same call.

Strict boundary: the input, the Update and the signals take raw payloads and validate them
(`turn_boundary`), so a caller in any language (default JSON converter) with an unknown,
missing or mistyped field gets an `InvalidInput` failure naming the field, never a workflow
task that fails and retries forever. Decisions are serialised through one `DecisionQueue` and
each is decided again when its turn comes: the loser of a race gets `DiffAlreadyDecided` with
the real outcome (status, commit, who decided), never the winner's outcome as its own.

A decision whose commit cannot reach the git remote (unavailable, contended) is not answered
at once: the turn says "waiting for git remote" in its details and tries again with backoff,
for at most the worker's `git_remote_wait_s` (patch `wait-for-git-remote`).

A step that fails for good (retries exhausted or non-retryable) ends the turn with a short
`TurnFailed` error naming the step; the `reply` Update and the workflow result carry it.
Diffs the failed turn had proposed are expired (nobody was shown them in a reply), so none
stays pending without a turn waiting for its decision.

Why this module is longer than ~300 lines: a Temporal workflow is one class whose run method,
handlers and queries share its state, so the turn's orchestration stays together here; the
parts that need none of that state live beside it (`turn_boundary`: decoding and failure
types; `decision_queue`: the queue and its answers).
"""

import contextlib
import dataclasses
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from temporalio import workflow
from temporalio.common import RawValue, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, FailureError
from temporalio.types import MethodSyncSingleParam

with workflow.unsafe.imports_passed_through():
    from durable_memory.activities.offered_settings import offered_turn_settings
    from durable_memory.activities.turn import TurnActivities
    from durable_memory.memory.agent.steps import turn_reply
    from durable_memory.memory.core.errors import (
        DurableMemoryError,
        GitRemoteContended,
        GitRemoteUnavailable,
        short_message,
    )
    from durable_memory.memory.store.git import validate_author_name
    from durable_memory.models.activity_settings import ActivitiesSettings
    from durable_memory.models.diffs import DiffStatus
    from durable_memory.models.llm import CostFactors, TokenUsage
    from durable_memory.models.turn import (
        DecisionOutcome,
        DiffDecision,
        DiffPreview,
        DiffView,
        FinishedTurn,
        FinishInput,
        ModelStepResult,
        ProposedDiff,
        RejectedSignals,
        RotationCandidate,
        RotationInput,
        SignalledDecision,
        StartedTurn,
        StepInput,
        ToolStepResult,
        TurnInput,
        TurnOutcome,
        TurnReply,
        TurnStatus,
        WorkerTurnSettings,
        turn_workflow_id,
    )
    from durable_memory.workflows.common import (
        DIFF_IDS,
        FAILED_STEP,
        PENDING_DIFFS,
        PROFILE,
        TURN_STATUS,
        activity_options,
        backoff_delays,
        local_activity_options,
        starting_attributes,
        worker_settings,
    )
    from durable_memory.workflows.decision_queue import DecisionQueue, QueuedDecision
    from durable_memory.workflows.rotation import start_rotation
    from durable_memory.workflows.turn_boundary import (
        INVALID_INPUT,
        TURN_WORKFLOW,
        UNKNOWN_DIFF,
        LocalStepFailed,
        activity_name,
        already_decided,
        decision_refused,
        decode_input,
        is_own_outcome,
        local_step_failure,
        step_failure,
    )
    from durable_memory.workflows.turn_details import (
        GitRemoteWait,
        TurnDetails,
        diff_markdown,
        render_details,
    )

ANSWER_BEFORE_ROTATION_CHECK = "answer-decision-before-rotation-check"
"""Patch: a decision's Update is answered once its commit exists; the rotation check after
it no longer delays the approver. Histories recorded before it replay the old order."""

OPERATOR_SEARCH_ATTRIBUTES = "operator-search-attributes"
"""Patch: the turn upserts DmemProfile, DmemDiffIds and DmemFailedStep. Histories recorded
before it issue none of those commands and replay without them."""

FAILED_INPUT_STEP = "input"
"""DmemFailedStep of a turn whose input was refused: no step ran."""

WORKER_TURN_SETTINGS = "worker-turn-settings"
"""Patch: the turn's step limit, approval TTL and activity options are the worker's
configuration (the `dmem.turn_settings` local activity), lowered where the caller asked. A
turn started before it runs on with what its input carried (or the defaults it had then)."""

GIT_REMOTE_WAIT = "wait-for-git-remote"
"""Patch: a decision whose commit meets a git remote outage (the failure types below, not
retried by Temporal then) is tried again by the turn with backoff, shown in its details, for
at most `git_remote_wait_s`, before it is answered as not applied. Turns before it answered
"not applied" once the commit activity's own retries ran out."""

GIT_REMOTE_OUTAGE = (GitRemoteUnavailable.__name__, GitRemoteContended.__name__)
"""The decide activity's failure types that the turn waits out (see the patch)."""

MAX_GIT_REMOTE_WAIT_ROUNDS = 500
"""About the most attempts a whole git remote wait takes (some 11 history events each): the
longest interval between two grows past the commit retry's maximum when `git_remote_wait_s`
would otherwise need more, so a long wait cannot push the turn's history toward Temporal's
limits (a warning at 10,240 events, the workflow terminated at 51,200)."""

LOCAL_TURN_STEPS = "local-turn-steps"
"""Patch: the turn's cheap steps on the worker's own stores (prepare_turn, run_tools,
finish_turn) run as local activities, inside the workflow task that needs them, instead of
each costing a task round trip through the server; the model call, the decisions' commits,
expiry and the rotation check stay regular activities. Why that keeps every guarantee:
docs/temporal.md ("Local steps"). A turn that proposed no diff and did not stop at the step
limit has nothing to finish and skips finish_turn. Turns started before the patch schedule
every step as a regular activity."""

ONE_ACTIVITY_START = "one-activity-start"
"""Patch: a turn's first activity, `dmem.start_turn`, prepares the turn, makes the first model
call and returns the deployment's settings: the first workflow task runs no local activity
(the settings and prepare steps cost ~2-4 ms of SDK round trips each, more than prepare's own
work). Its options come from the settings the worker offered for its task queue (options are
not replay-checked); everything else from the recorded result. Turns started before it fetch
the settings and prepare as local activities (`worker-turn-settings`, `local-turn-steps`).
Why a crash anywhere in it costs nothing: docs/temporal.md ("The first step")."""

TOOLS_IN_MODEL_STEP = "tools-in-model-step"
"""Patch: a step's tool calls and the next model call are one activity,
`dmem.tools_then_model`, where a tool-using turn ran `run_tools` as a local activity and then
the model call (each local activity cost ~2-4 ms of SDK round trips, more than the tools on
local data). The tools of the step at the limit run alone, as before (no model call follows).
Only turns under `one-activity-start` take it, at their first tool step. Why a crash anywhere
in it costs nothing: docs/temporal.md ("Tools and the next model call")."""

ROTATION_CHECK_AFTER_STANDING_APPROVALS = "rotation-check-after-standing-approvals"
"""Patch: a block that a standing approval changed during the turn is checked for rotation
(and its rotation started) as one a person approves is, right after the reply; turns before it
left such a block to the next scheduled sweep. Histories without a standing approval take no
marker: the check is asked only when one applied."""

SETTLED_PATCHES = "turn-patches-settled"
"""Patch: every turn patch above applies, asked once. A turn records one patch marker (and the
`TemporalChangeVersion` search attribute upsert the SDK adds to each) where it recorded one per
patch it reached: three for a tool-using turn, two for a plain one, two more for its first
decision, each an event the server writes into the turn's history and visibility on the path
of its reply (benchmarks.md, the twelfth pass). Asked at the first patch a turn reaches, so
histories recorded before it, which lack its marker, answer False and ask each older patch
where it was asked (`TurnWorkflow._patched`)."""

PROFILE_WITH_STATUS = "turn-profile-with-status"
"""Patch: every turn patch above applies, as under `turn-patches-settled` (which it replaces as
the one patch a new turn asks), and the turn sets `DmemProfile` in its next upsert of search
attributes (its status at the reply, or the diffs its tools proposed) instead of in an upsert
of its own right after its first step: one command fewer on the reply's path, which the server
took ~1 ms to record (benchmarks.md, the thirteenth pass). Asked first, at the first patch a
turn reaches; a history recorded before it lacks its marker, so `turn-patches-settled` is
asked next, and then each older patch, as before (`TurnWorkflow._patched`). A patch added after
this one needs a settled patch of its own, asked before this one, in the same way: under a
settled patch `_patched` answers True for every patch."""

STARTER_ATTRIBUTES = "turn-starter-attributes"
"""Patch: every turn patch above applies, as under `turn-profile-with-status` (which it replaces
as the one patch a new turn asks), and the turn's first search attributes (its user, status
`replying`, no pending diffs) are upserted only where the start request did not carry them
with those values: `MemoryClient.send_message` sets them at the start, so its turns record
one upsert fewer in their first workflow task, on the reply's path (benchmarks.md, the
fourteenth pass); a caller that sets none, or others, still gets them set by the turn.
Asked first, before that upsert, where a history recorded before it asks nothing: lacking its
marker, it upserts them as before and asks `turn-profile-with-status` where it did
(`TurnWorkflow._patched`). A patch added after this one needs a settled patch of its own,
asked before this one, in the same way."""

LEARN_ATTEMPTS = 3
"""The most attempts of `dmem.step_diffs`, the read a failed turn makes of its step's diffs."""

MIN_TIMER = timedelta(milliseconds=1)

RECENT_REJECTIONS = 10

DecisionAnswer = DecisionOutcome | ApplicationError
"""What a decision's caller is told: the outcome that applied, or why it did not."""

StepArg = TypeVar("StepArg")
StepResult = TypeVar("StepResult")


@workflow.defn(name=TURN_WORKFLOW)
class TurnWorkflow:
    @workflow.init
    def __init__(self, turn: RawValue) -> None:
        # All of the turn's state is set up here, before any handler can run. The input is
        # decoded here too, so the `reply` Update of an update-with-start can answer a refused
        # input with its message.
        self._turn: TurnInput | None = None
        self._settings: WorkerTurnSettings | None = None
        self._failure: ApplicationError | None = None
        try:
            self._turn = decode_input(turn, TurnInput)
        except ApplicationError as error:
            self._failure = error
        self._reply: TurnReply | None = None
        self._status = TurnStatus.REPLYING
        self._proposed: list[str] = []
        self._erasures_seen: int | None = None
        """The user's newest erasure record when the turn was admitted: every later step
        refuses the turn if a forget began after it (store/erasure.py)."""
        self._open: dict[str, ProposedDiff] = {}
        self._outcomes: dict[str, DecisionOutcome] = {}
        self._decisions: DecisionQueue[DecisionAnswer] = DecisionQueue()
        self._previews: dict[str, DiffPreview] = {}
        self._rejected = 0
        self._usage = TokenUsage()
        self._recent_rejections: list[str] = []
        self._git_remote_down_since: datetime | None = None
        """When the decisions applied since the queue was last empty first met a git remote
        outage: the wait's bound counts from here, so decisions queued behind one that gave up
        do not each wait the whole bound again."""
        self._git_remote_wait: GitRemoteWait | None = None
        self._local_steps = False
        """Whether the cheap steps run as local activities (patch `local-turn-steps`)."""
        self._one_activity_start = False
        """Whether the turn began with `dmem.start_turn` (patch `one-activity-start`)."""
        self._merged_tool_steps: bool | None = None
        """Whether a step's tools and the next model call are one activity (patch
        `tools-in-model-step`); asked at the first tool step."""
        self._settled: bool | None = None
        """Whether every turn patch applies (patch `turn-starter-attributes`, asked first,
        `turn-profile-with-status` or `turn-patches-settled`, asked at the turn's first patch
        without it: `_patched`)."""
        self._profile_with_status = False
        """Whether DmemProfile goes with the turn's next upsert (patch
        `turn-profile-with-status`)."""
        self._profile_due: str | None = None
        """The profile to set with the next upsert, under that patch."""

    # -- the turn --------------------------------------------------------------------------

    @workflow.run
    async def run(self, turn: RawValue) -> TurnOutcome:  # noqa: ARG002 (decoded in __init__)
        if self._turn is None:
            assert self._failure is not None
            return await self._fail(self._failure, FAILED_INPUT_STEP)
        try:
            return await self._run(self._turn)
        except ActivityError as error:
            return await self._fail(step_failure(error), error.activity_type)
        except LocalStepFailed as failed:
            return await self._fail(failed.failure, failed.step)

    async def _run(self, turn: TurnInput) -> TurnOutcome:
        if workflow.patched(STARTER_ATTRIBUTES):  # asked before anything, see the patch
            self._settled = self._profile_with_status = True
        # Set by the turn unless the start request carried them, so that a caller in any
        # language gets them.
        attributes = starting_attributes(turn.user_id)
        carried = workflow.info().typed_search_attributes
        if not (self._settled and all(carried.get(a.key) == a.value for a in attributes)):
            workflow.upsert_search_attributes([a.key.value_set(a.value) for a in attributes])
        first: ModelStepResult | None = None
        if self._patched(ONE_ACTIVITY_START):
            started = await self._start(turn)
            settings = self._settings_of(turn, started)
            prepared, first = started.prepared, started.first
            self._local_steps = True  # the later cheap steps run locally, as in the patch
            self._one_activity_start = True
        else:
            settings = await self._turn_settings(turn)
            self._local_steps = self._patched(LOCAL_TURN_STEPS)
            prepared = await self._memory_step(
                TurnActivities.prepare_turn, turn, "record the message, compile context"
            )
        self._erasures_seen = prepared.erasures_seen
        if prepared.profile is not None:
            if self._profile_with_status:
                self._profile_due = prepared.profile  # set with the next upsert (`_upsert`)
            else:
                self._upsert_for_operators(PROFILE.value_set(prepared.profile))
        text, stopped = await self._steps(turn, first)
        finished = await self._finish(turn, stopped)
        reply = turn_reply(text, stopped, settings.max_steps)
        self._reply = TurnReply(
            user_id=turn.user_id,
            turn_id=turn.turn_id,
            workflow_id=workflow.info().workflow_id,
            reply=reply,
            diffs=finished.diffs,
            stopped_at_step_limit=stopped,
            usage=self._usage,
            input_equivalents=self._usage.input_equivalents(settings.cost_factors),
        )
        self._previews = {p.diff_id: p for p in finished.previews}
        for diff in finished.diffs:
            if diff.status is DiffStatus.PENDING:
                self._open.setdefault(diff.id, diff)
            else:
                self._outcomes[diff.id] = diff.outcome or DecisionOutcome(
                    diff_id=diff.id, status=diff.status, label=diff.label
                )
        self._show_details()
        await self._rotate_after_standing_approvals(turn, finished.diffs)
        if self._open:
            await self._await_decisions(turn)
        self._close_decisions()
        final = (
            TurnStatus.EXPIRED
            if any(o.status is DiffStatus.EXPIRED for o in self._outcomes.values())
            else TurnStatus.DONE
        )
        self._set_status(final)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return TurnOutcome(
            turn_id=turn.turn_id,
            reply=reply,
            decisions=list(self._outcomes.values()),
            status=final,
        )

    async def _start(self, turn: TurnInput) -> StartedTurn:
        """The first activity (patch `one-activity-start`), with the options of a model call
        as the worker polling this task queue configured them (the built-in defaults, or the
        input's, where none were offered)."""
        options = (offered_turn_settings() or turn.legacy_settings()).activities.model_call
        return await workflow.execute_activity_method(
            TurnActivities.start_turn,
            turn,
            summary="record the message, compile context, model call 1",
            **activity_options(options),
        )

    def _settings_of(self, turn: TurnInput, started: StartedTurn) -> WorkerTurnSettings:
        """The settings the turn runs with from here on: those its first activity recorded,
        lowered where the caller asked."""
        self._settings = turn.settings_under(started.settings)
        return self._settings

    async def _turn_settings(self, turn: TurnInput) -> WorkerTurnSettings:
        """The settings this turn runs with, fixed for its whole run (see the patch)."""
        if self._patched(WORKER_TURN_SETTINGS):
            worker = await worker_settings("the deployment's turn settings")
            self._settings = turn.settings_under(worker)
        else:
            self._settings = turn.legacy_settings()
        return self._settings

    async def _finish(self, turn: TurnInput, stopped: bool) -> FinishedTurn:
        """The proposed diffs described for the reply, and a step-limit stop noted in recall.
        Under `local-turn-steps`, a turn that did neither has nothing to finish: no step."""
        if self._local_steps and not self._proposed and not stopped:
            return FinishedTurn(diffs=[])
        assert self._settings is not None
        return await self._memory_step(
            TurnActivities.finish_turn,
            FinishInput(
                user_id=turn.user_id,
                turn_id=turn.turn_id,
                diff_ids=self._proposed,
                stopped_at_step_limit=stopped,
                max_steps=self._settings.max_steps,
                erasures_seen=self._erasures_seen,
            ),
            "describe the proposed diffs",
        )

    async def _memory_step(
        self,
        step: MethodSyncSingleParam[TurnActivities, StepArg, StepResult],
        arg: StepArg,
        summary: str,
    ) -> StepResult:
        """One of the cheap steps on the worker's stores, with the `memory` options: a local
        activity under the patch `local-turn-steps`, a regular one in turns from before."""
        memory = self._activities.memory
        if self._local_steps:
            try:
                return await workflow.execute_local_activity_method(
                    step, arg, summary=summary, **local_activity_options(memory)
                )
            except FailureError as error:
                if isinstance(error, ActivityError | CancelledError):
                    raise
                # The SDK raises a local activity's final failure bare, not as the
                # ActivityError a regular one gives: the turn must fail the same way.
                name = activity_name(step)
                raise LocalStepFailed(local_step_failure(error, name), name) from None
        return await workflow.execute_activity_method(
            step, arg, summary=summary, **activity_options(memory)
        )

    @property
    def _activities(self) -> ActivitiesSettings:
        """The activities' options; known once the turn has its settings, which every step
        that uses them comes after."""
        assert self._settings is not None
        return self._settings.activities

    async def _fail(self, failure: ApplicationError, step: str) -> TurnOutcome:
        """End the turn with `failure` at `step`: its diffs expired, waiting callers
        answered."""
        self._failure = failure
        self._upsert_for_operators(FAILED_STEP.value_set(step))
        self._close_decisions()
        undecided = [d for d in self._proposed if d not in self._outcomes]
        if undecided and self._settings is not None:
            try:
                await self._expire(undecided, f"expire {len(undecided)} diff(s) of the failed turn")
            except ActivityError as error:  # the turn's own failure is the one to report
                workflow.logger.warning("could not expire the failed turn's diffs: %s", error)
        self._close_decisions()
        self._set_status(TurnStatus.FAILED)
        self._show_details()
        await workflow.wait_condition(workflow.all_handlers_finished)
        raise failure

    async def _steps(self, turn: TurnInput, first: ModelStepResult | None) -> tuple[str, bool]:
        """The agent loop: (last reply text, stopped at the step limit); the diffs it proposes
        are collected in `self._proposed`. `first`: the first model step, if the turn's first
        activity made it. Under `tools-in-model-step` a step's tools and the next model call
        are one activity; the tools of the step at the limit run alone (no call follows)."""
        assert self._settings is not None
        max_steps = self._settings.max_steps
        result = first if first is not None else await self._model_call(self._where(turn, 1))
        for step in range(1, max_steps + 1):
            self._usage += result.usage
            self._show_details()
            if result.tool_calls == 0:
                return result.text, False
            where = self._where(turn, step)
            summary = f"run {result.tool_calls} tool call(s) of step {step}"
            following: ModelStepResult | None = None
            if step < max_steps and self._tools_in_model_step():
                try:
                    merged = await workflow.execute_activity_method(
                        TurnActivities.tools_then_model,
                        where,
                        summary=f"{summary}, model call {step + 1}",
                        **activity_options(self._activities.model_call),
                    )
                except ActivityError:
                    await self._learn_stored_tools(turn, where, summary)
                    raise
                tools, following = merged.tools, merged.next
            else:
                tools = await self._memory_step(TurnActivities.run_tools, where, summary)
            await self._took(turn, tools)
            if step == max_steps:
                return result.text, True
            if following is None:
                following = await self._model_call(self._where(turn, step + 1))
            result = following
        raise AssertionError("unreachable: the loop returns at the step limit")

    async def _took(self, turn: TurnInput, tools: ToolStepResult) -> None:
        """What a tool step did, taken in: its diffs proposed (for operators too), and each
        older turn whose diff one of them superseded told to stop waiting for it."""
        self._proposed.extend(d for d in tools.diff_ids if d not in self._proposed)
        if tools.diff_ids:
            self._upsert_for_operators(DIFF_IDS.value_set(list(self._proposed)))
        for old in tools.superseded:
            if old.turn_id and old.turn_id != turn.turn_id:
                await self._tell_superseded(turn.user_id, old.turn_id, old.diff_id)

    async def _learn_stored_tools(self, turn: TurnInput, where: StepInput, summary: str) -> None:
        """After `dmem.tools_then_model` failed for good: what its tools did (the model call
        may be what failed, after they proposed), so the failed turn expires the diffs they
        stored as it does every diff it proposed, and the older turns whose diffs those
        superseded stop waiting for them. Read from the store by a local activity that runs
        no tool: the turn's failure is decided, so no tool may run in its name now (one that
        failed on an outage would propose or archive for a failed turn). A read is safe to
        retry: under the `memory` policy, at most `LEARN_ATTEMPTS` times, so the failure's
        answer is not held back long. If the read fails too, the turn's own failure is the
        one reported."""
        options = local_activity_options(self._activities.memory)
        policy = options["retry_policy"]
        attempts = min(policy.maximum_attempts or LEARN_ATTEMPTS, LEARN_ATTEMPTS)
        options["retry_policy"] = dataclasses.replace(policy, maximum_attempts=attempts)
        try:
            tools = await workflow.execute_local_activity_method(
                TurnActivities.step_diffs,
                where,
                summary=f"what the failed step's tools proposed ({summary})",
                **options,
            )
        except FailureError as error:
            workflow.logger.warning("could not learn the failed step's diffs: %s", error)
            return
        await self._took(turn, tools)

    def _where(self, turn: TurnInput, step: int) -> StepInput:
        return StepInput(
            user_id=turn.user_id,
            turn_id=turn.turn_id,
            step=step,
            erasures_seen=self._erasures_seen,
        )

    async def _model_call(self, where: StepInput) -> ModelStepResult:
        return await workflow.execute_activity_method(
            TurnActivities.call_model,
            where,
            summary=f"model call {where.step}",
            **activity_options(self._activities.model_call),
        )

    def _tools_in_model_step(self) -> bool:
        """Asked at the first tool step only (the patch's marker is in the histories of
        tool-using turns alone), and only in turns under `one-activity-start`: older turns'
        tool steps keep their shape."""
        if self._merged_tool_steps is None:
            self._merged_tool_steps = self._one_activity_start and self._patched(
                TOOLS_IN_MODEL_STEP
            )
        return self._merged_tool_steps

    async def _tell_superseded(self, user_id: str, turn_id: str, diff_id: str) -> None:
        """End the older turn's wait for a diff this turn superseded."""
        handle = workflow.get_external_workflow_handle(turn_workflow_id(user_id, turn_id))
        try:
            await handle.signal(TurnWorkflow.superseded, diff_id)
        except ApplicationError:
            workflow.logger.info("turn %s has already ended; nothing to tell", turn_id)

    async def _await_decisions(self, turn: TurnInput) -> None:
        assert self._settings is not None
        deadline = workflow.now() + self._settings.approval_ttl
        self._set_status(TurnStatus.AWAITING_APPROVAL)
        while self._open:
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: bool(self._decisions) or not self._open,
                        timeout=timedelta(seconds=remaining),
                    )
            # Decisions that arrived in time are applied even if applying them runs past the
            # deadline; leaving one queued would keep its Update (and this workflow) waiting.
            while self._decisions:
                await self._apply(turn, self._decisions.pop())
            self._git_remote_down_since = None  # a later decision waits an outage out anew
            if workflow.now() >= deadline:
                break
        if self._open:
            # No decision is taken from here on: one queued during the expiry would wait
            # for an answer that never comes.
            self._close_decisions()
            await self._expire(list(self._open), f"expire {len(self._open)} undecided diff(s)")

    async def _expire(self, diff_ids: list[str], summary: str) -> None:
        outcomes = await workflow.execute_activity_method(
            TurnActivities.expire_diffs,
            diff_ids,
            summary=summary,
            **activity_options(self._activities.memory),
        )
        for outcome in outcomes:
            self._resolve(outcome)

    async def _apply(self, turn: TurnInput, queued: QueuedDecision) -> None:
        decision = queued.decision
        if decision.diff_id not in self._open:  # decided while this one was queued
            self._answer(queued, self._not_open(decision))
            return
        self._set_status(TurnStatus.COMMITTING)
        try:
            outcome = await self._decide(decision)
        except ActivityError as error:
            self._set_status(TurnStatus.AWAITING_APPROVAL)
            cause = error.cause.message if isinstance(error.cause, FailureError) else str(error)
            self._answer(
                queued,
                decision_refused(f"the decision on {decision.diff_id} was not applied: {cause}"),
            )
            return
        answer = self._judge(decision, outcome)
        early = self._patched(ANSWER_BEFORE_ROTATION_CHECK)
        if early:
            self._answer(queued, answer)
        if answer is outcome and outcome.status is DiffStatus.APPROVED and outcome.label:
            await self._maybe_rotate(turn, outcome.label)
        self._set_status(TurnStatus.AWAITING_APPROVAL)
        if not early:
            self._answer(queued, answer)

    async def _decide(self, decision: DiffDecision) -> DecisionOutcome:
        """The `decide` activity's outcome; under the patch, a git remote outage is waited
        out (see GIT_REMOTE_WAIT). Raises the activity's failure when it stays failed."""
        summary = f"{decision.decision} {decision.diff_id[:8]} by {decision.approver}"
        commit = self._activities.commit
        if not self._patched(GIT_REMOTE_WAIT):
            return await workflow.execute_activity_method(
                TurnActivities.decide, decision, summary=summary, **activity_options(commit)
            )
        options = activity_options(commit, also_final=GIT_REMOTE_OUTAGE)
        delays = backoff_delays(commit.retry, self._longest_git_remote_delay())
        attempt = 0
        try:
            while True:
                attempt += 1
                try:
                    outcome = await workflow.execute_activity_method(
                        TurnActivities.decide, decision, summary=summary, **options
                    )
                except ActivityError as error:
                    await self._wait_for_git_remote(error, summary, attempt, next(delays))
                else:
                    self._git_remote_down_since = None
                    return outcome
        finally:
            if self._git_remote_wait is not None:
                self._git_remote_wait = None
                self._show_details()

    def _longest_git_remote_delay(self) -> timedelta:
        """The commit retry's maximum interval, or longer if the whole wait would otherwise
        take more than MAX_GIT_REMOTE_WAIT_ROUNDS attempts."""
        assert self._settings is not None
        retry = self._activities.commit.retry
        return max(
            timedelta(seconds=retry.maximum_interval_s),
            self._settings.git_remote_wait / MAX_GIT_REMOTE_WAIT_ROUNDS,
        )

    async def _wait_for_git_remote(
        self, failed: ActivityError, summary: str, attempt: int, delay: timedelta
    ) -> None:
        """Sleep before the next attempt of a decision the git remote failed, showing why in
        the details; re-raise `failed` if it is no outage or the wait's bound has passed."""
        assert self._settings is not None
        cause = failed.cause
        if not (isinstance(cause, ApplicationError) and cause.type in GIT_REMOTE_OUTAGE):
            raise failed
        now = workflow.now()
        since = self._git_remote_down_since = self._git_remote_down_since or now
        gives_up_at = since + self._settings.git_remote_wait
        if now >= gives_up_at:
            raise failed
        # The last attempt comes at the bound itself; a timer needs a positive duration.
        delay = max(min(delay, gives_up_at - now), MIN_TIMER)
        self._git_remote_wait = GitRemoteWait(
            decision=summary,
            since=since,
            attempt=attempt,
            last_error=cause.message,
            next_attempt_at=now + delay,
            gives_up_at=gives_up_at,
        )
        self._show_details()
        await workflow.sleep(delay, summary=f"waiting for git remote: {summary}")

    def _judge(self, decision: DiffDecision, outcome: DecisionOutcome) -> DecisionAnswer:
        """Record what the store says became of the diff, and what to answer its decider:
        the outcome only if this decision applied and an approval has its commit."""
        self._resolve(outcome)
        if not is_own_outcome(decision, outcome):
            return already_decided(outcome)
        committed = outcome.status is not DiffStatus.APPROVED or outcome.commit_sha is not None
        if outcome.status in (DiffStatus.PENDING, DiffStatus.CONFLICTED) or not committed:
            if not committed:  # stays open: approving again completes the commit
                self._open.setdefault(outcome.diff_id, self._diff_of(outcome))
                self._outcomes.pop(outcome.diff_id, None)
                self._show_details()
            reason = outcome.message or "the approval has no commit yet"
            return decision_refused(
                f"the {decision.decision} of diff {decision.diff_id} was not applied "
                f"(the diff is {outcome.status.value}): {reason}",
                outcome,
            )
        return outcome

    def _diff_of(self, outcome: DecisionOutcome) -> ProposedDiff:
        for diff in self._reply.diffs if self._reply else []:
            if diff.id == outcome.diff_id:
                return diff
        return ProposedDiff(
            id=outcome.diff_id, label=outcome.label or "", summary="", status=outcome.status
        )

    def _not_open(self, decision: DiffDecision) -> ApplicationError:
        """The truth for a decision on a diff this turn no longer (or never) waits for."""
        done = self._outcomes.get(decision.diff_id)
        if done is not None:
            return already_decided(done)
        if self._decisions.closed and decision.diff_id in self._open:
            return decision_refused(
                f"diff {decision.diff_id}: the turn is closing and takes no more decisions"
            )
        return ApplicationError(
            f"diff {decision.diff_id} is not awaiting a decision in this turn",
            type=UNKNOWN_DIFF,
            non_retryable=True,
        )

    def _answer(self, queued: QueuedDecision, answer: DecisionAnswer) -> None:
        if queued.ticket is not None:  # an Update waits for it
            self._decisions.post(queued.ticket, answer)
        elif isinstance(answer, ApplicationError):  # a signal has nobody to tell
            decision = queued.decision
            self._reject_signal(f"{decision.decision} by {decision.approver}: {answer.message}")

    def _close_decisions(self) -> None:
        """Take no more decisions; answer every queued one with the truth."""
        for queued in self._decisions.close():
            self._answer(queued, self._not_open(queued.decision))

    async def _rotate_after_standing_approvals(
        self, turn: TurnInput, diffs: list[ProposedDiff]
    ) -> None:
        """The blocks that standing approvals committed to during the turn, checked for
        rotation like a person's approval (see the patch): an edit nobody waits on must not
        leave its block over its limit until the next sweep."""
        labels = sorted({d.label for d in diffs if d.status is DiffStatus.APPROVED and d.label})
        if labels and self._patched(ROTATION_CHECK_AFTER_STANDING_APPROVALS):
            for label in labels:
                await self._maybe_rotate(turn, label)

    async def _maybe_rotate(self, turn: TurnInput, label: str) -> None:
        candidate = RotationCandidate(user_id=turn.user_id, label=label)
        try:
            needed = await workflow.execute_activity_method(
                TurnActivities.needs_rotation,
                candidate,
                summary=f"check rotation of {label}",
                **activity_options(self._activities.memory),
            )
        except ActivityError as error:  # the commit stands; the next sweep checks again
            workflow.logger.warning("rotation check of %s failed: %s", label, error)
            return
        if needed:
            await start_rotation(
                RotationInput(user_id=turn.user_id, label=label, activities=self._activities)
            )

    def _resolve(self, outcome: DecisionOutcome) -> None:
        if outcome.status is not DiffStatus.PENDING:
            self._open.pop(outcome.diff_id, None)
            self._outcomes[outcome.diff_id] = outcome
        self._upsert([PENDING_DIFFS.value_set(len(self._open))])
        self._show_details()

    def _upsert_for_operators(self, update: SearchAttributeUpdate[Any]) -> None:
        """Set one of the search attributes added for operators (see the patch's note)."""
        if self._patched(OPERATOR_SEARCH_ATTRIBUTES):
            self._upsert([update])

    def _upsert(self, updates: list[SearchAttributeUpdate[Any]]) -> None:
        """Upsert `updates`, and the profile due, if any (patch `turn-profile-with-status`)."""
        if self._profile_due is not None:
            updates = [*updates, PROFILE.value_set(self._profile_due)]
            self._profile_due = None
        workflow.upsert_search_attributes(updates)

    def _patched(self, patch: str) -> bool:
        """Whether `patch` applies to this turn: every one does under
        `turn-starter-attributes` (asked at the start of `_run`), `turn-profile-with-status`
        or `turn-patches-settled`, the last two asked here, in that order, at the first patch
        a turn without the first reaches, and not again; a turn recorded before all three
        asks `patch` itself, where it always did."""
        if self._settled is None:
            self._profile_with_status = workflow.patched(PROFILE_WITH_STATUS)
            self._settled = self._profile_with_status or workflow.patched(SETTLED_PATCHES)
        return self._settled or workflow.patched(patch)

    def _set_status(self, status: TurnStatus) -> None:
        self._status = status
        self._upsert(
            [TURN_STATUS.value_set(status.value), PENDING_DIFFS.value_set(len(self._open))]
        )

    def _reject_signal(self, reason: str) -> None:
        """A refused signal has no caller: log it, count it, show it in the current details."""
        workflow.logger.warning("refused decision signal: %s", reason)
        self._rejected += 1
        self._recent_rejections = [*self._recent_rejections, short_message(reason, 300)][
            -RECENT_REJECTIONS:
        ]
        self._show_details()

    def _show_details(self) -> None:
        """Render the current details from the live state: called on every change."""
        details = TurnDetails(
            diffs=self._reply.diffs if self._reply else [],
            outcomes=self._outcomes,
            previews=self._previews,
            failure=self._failure.message if self._failure else None,
            rejected_signals=self._recent_rejections,
            rejected_count=self._rejected,
            git_remote_wait=self._git_remote_wait,
            usage=self._usage,
            cost_factors=self._settings.cost_factors if self._settings else CostFactors(),
        )
        workflow.set_current_details(render_details(details))

    # -- handlers --------------------------------------------------------------------------

    @workflow.update
    async def reply(self) -> TurnReply:
        """Returns the reply as soon as it exists (the caller's update-with-start), or the
        turn's failure if it fails first."""
        await workflow.wait_condition(lambda: self._reply is not None or self._failure is not None)
        if self._reply is None:
            assert self._failure is not None
            raise self._failure
        return self._reply

    @reply.validator
    def _validate_reply(self) -> None:
        if self._turn is None and self._failure is not None:  # refused input: say why
            raise self._failure

    def _owned(self, decision: DiffDecision) -> DiffDecision:
        """The decision with this turn's user filled in (a payload may omit it); a decision
        naming another user is refused like an unknown diff."""
        if self._turn is None or decision.user_id not in (None, self._turn.user_id):
            raise ApplicationError(
                f"no diff {decision.diff_id} for user '{decision.user_id}'",
                type=UNKNOWN_DIFF,
                non_retryable=True,
            )
        return decision.model_copy(update={"user_id": self._turn.user_id})

    def _check(self, decision: DiffDecision) -> DiffDecision:
        """Refuse what cannot be decided here; the decision as this turn applies it. Passing
        does not promise the decision wins: the handler decides again when its turn in the
        queue comes."""
        decision = self._owned(decision)
        if decision.diff_id not in self._open or self._decisions.closed:
            raise self._not_open(decision)
        try:  # the approver's name goes into a commit: refuse a bad one before history
            validate_author_name(decision.approver)
        except DurableMemoryError as error:
            raise ApplicationError(str(error), type=INVALID_INPUT, non_retryable=True) from None
        return decision

    @workflow.update
    async def decide(self, decision: RawValue) -> DecisionOutcome:
        checked = self._owned(decode_input(decision, DiffDecision))
        # A decision validated together with the one that closed its diff, or the turn,
        # gets the truth now rather than waiting in a queue nobody reads any more.
        if checked.diff_id not in self._open or self._decisions.closed:
            raise self._not_open(checked)
        ticket = self._decisions.add_update(checked)
        await workflow.wait_condition(lambda: self._decisions.is_answered(ticket))
        answer = self._decisions.take_answer(ticket)
        if isinstance(answer, ApplicationError):
            raise answer
        return answer

    @decide.validator
    def _validate_decide(self, decision: RawValue) -> None:
        self._check(decode_input(decision, DiffDecision))

    def _enqueue_signal(self, raw: RawValue, kind: Literal["approve", "reject"]) -> None:
        """The signal's name is its decision; a payload that names the other one is refused
        like any bad signal (logged, counted, shown, and nothing decided)."""
        try:
            payload = decode_input(raw, SignalledDecision)
            try:
                decision = self._check(payload.as_decision(kind))
            except ValueError as contradiction:
                raise ApplicationError(str(contradiction), type=INVALID_INPUT) from None
        except ApplicationError as error:
            self._reject_signal(f"{kind}: {error.message}")
            return
        self._decisions.add_signal(decision)

    @workflow.signal
    def approve(self, decision: RawValue) -> None:
        self._enqueue_signal(decision, "approve")

    @workflow.signal
    def reject(self, decision: RawValue) -> None:
        self._enqueue_signal(decision, "reject")

    @workflow.signal
    def superseded(self, diff_id: str) -> None:
        diff = self._open.get(diff_id)
        if diff is not None:
            self._resolve(
                DecisionOutcome(
                    diff_id=diff_id,
                    status=DiffStatus.SUPERSEDED,
                    label=diff.label,
                    message="superseded by a newer proposal",
                    decided_at=workflow.now(),
                )
            )

    @workflow.query
    def diff(self, diff_id: str) -> DiffView:
        """One of this turn's diffs: its status, outcome and preview (Markdown as the UI
        shows it). `UnknownDiff` if the turn did not propose it, or is still replying."""
        proposed = (
            next((d for d in self._reply.diffs if d.id == diff_id), None) if self._reply else None
        )
        if self._turn is None or proposed is None:
            why = (
                "is still replying; ask again once it has"
                if diff_id in self._proposed
                else f"proposed no diff {diff_id!r}"
            )
            raise ApplicationError(
                short_message(f"turn {workflow.info().workflow_id} {why}"), type=UNKNOWN_DIFF
            )
        outcome = self._outcomes.get(diff_id)
        return DiffView(
            diff_id=diff_id,
            user_id=self._turn.user_id,
            turn_id=self._turn.turn_id,
            workflow_id=workflow.info().workflow_id,
            label=proposed.label,
            summary=proposed.summary,
            status=outcome.status if outcome else DiffStatus.PENDING,
            outcome=outcome,
            preview_markdown=diff_markdown(
                proposed, outcome, self._previews.get(diff_id), with_preview=True
            ),
        )

    @workflow.query
    def open_diffs(self) -> list[str]:
        return list(self._open)

    @workflow.query
    def status(self) -> TurnStatus:
        return self._status

    @workflow.query
    def rejected_signals(self) -> RejectedSignals:
        return RejectedSignals(count=self._rejected, recent=self._recent_rejections)
