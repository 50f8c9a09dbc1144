"""Bad-input suite, Temporal side: property-based attacks on the `decide` Update, the
`approve` / `reject` signals (raw payloads, as any Temporal client could send them) and the
MemoryClient methods, against a real dev server and worker, while a turn waits for a
decision. For each case: one clear refusal (the Update fails, the signal is ignored, the
client raises DurableMemoryError), every store and repository unchanged, the open diff
still pending, and, for what the Update validator refuses, nothing added to history."""

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment

from durable_memory.client import MemoryClient
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.formats import from_markdown
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.git import validate_author_name
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import MAX_MESSAGE_CHARS, TurnReply
from tests.support.agent_helpers import edit_block
from tests.support.snapshots import hostile_ids, snapshot
from tests.support.temporal_helpers import Rig, rig_settings, running_rig

CASES = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
USER = "vera"
SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            edit_block("student", field="name", operation="set", value="Vera"),
            edit_block("journey", field="stage", operation="set", value="drafting"),
        ]
    },
    {"text": "Noted."},
]


def _invalid(check: Any, value: object) -> bool:
    try:
        check(value)
    except DurableMemoryError:
        return True
    return False


bad_users = hostile_ids.filter(lambda u: _invalid(validate_user_id, u))
foreign_users = bad_users | st.just("mallory")  # a real user id, but not this turn's
bad_names = st.sampled_from(["", " ms-rivera", "a<b>", "x\n", "x" * 101, "\x00"]) | st.text(
    max_size=120
).filter(lambda n: _invalid(validate_author_name, n))
anything = st.none() | st.integers() | st.text(max_size=40) | st.lists(st.integers(), max_size=3)


class Turn:
    """A turn of USER waiting on two diffs: `decided` (already rejected) and `open`."""

    def __init__(self, rig: Rig, reply: TurnReply, handle: WorkflowHandle[Any, Any]) -> None:
        self.rig, self.reply, self.handle = rig, reply, handle
        self.decided, self.open = reply.diffs[0].id, reply.diffs[1].id

    async def accepted_updates(self) -> int:
        events = (await self.handle.fetch_history()).events
        return sum(
            e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED for e in events
        )

    async def settled(self) -> None:
        """Wait until the worker has handled the last signal and everything it started."""
        for _ in range(400):
            raw = (await self.handle.describe()).raw_description
            if not raw.pending_activities and not raw.HasField("pending_workflow_task"):
                events = (await self.handle.fetch_history()).events
                signalled = max(
                    e.event_id
                    for e in events
                    if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                )
                if any(
                    e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
                    and e.event_id > signalled
                    for e in events
                ):
                    return
            await asyncio.sleep(0.05)
        raise AssertionError("the turn never settled")

    def bad_markdown(self, text: str) -> bool:
        spec = self.rig.stack.blocks.spec(USER, "student")
        return _invalid(lambda t: from_markdown(spec, t), text)

    def still_waiting(self) -> None:
        assert self.rig.stack.review.get(self.open, USER).status is DiffStatus.PENDING


@pytest.fixture
async def turn(temporal_env: WorkflowEnvironment, tmp_path: Any) -> AsyncIterator[Turn]:
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), SCRIPT) as rig:
        reply = await rig.client.send_message(USER, "Hi, I'm Vera", turn_id="bad")
        await rig.client.reject(reply.diffs[0].id, "ms-rivera", "not yet")
        handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
        yield Turn(rig, reply, handle)
        await rig.client.reject(reply.diffs[1].id, "ms-rivera", "done testing")
        assert (await handle.result())["status"] == "done"


NOT_A_DIFF_ID = st.text(max_size=40).filter(lambda s: not re.fullmatch(r"[0-9a-f]{32}", s))
MALFORMED: dict[str, st.SearchStrategy[Any]] = {  # a value DiffDecision refuses to decode
    "diff_id": NOT_A_DIFF_ID | st.integers(),
    # (null is no longer malformed: a decision need not name the user, its turn knows it)
    "user_id": st.integers() | st.lists(st.text(max_size=3), max_size=2),
    "decision": st.text(max_size=10).filter(lambda s: s not in ("approve", "reject")),
    "approver": st.just("") | st.text(min_size=101, max_size=120) | st.integers(),
    "reason": st.text(min_size=2001, max_size=2100) | st.integers(),
    "edited_markdown": st.integers() | st.lists(st.integers(), max_size=2),
    "extra": st.text(max_size=5),  # DiffDecision forbids unknown fields
}
REFUSED_BEFORE_HISTORY = ["foreign user", "unknown diff", "decided diff", "bad name", "malformed"]


@st.composite
def hostile_decisions(draw: st.DrawFn, turn: Turn) -> tuple[str, dict[str, Any]]:
    """(kind, raw payload) of a decision on USER's turn that must not be applied."""
    kind = draw(st.sampled_from([*REFUSED_BEFORE_HISTORY, "bad markdown"]))
    decision: dict[str, Any] = {
        "diff_id": turn.open,
        "user_id": USER,
        "decision": draw(st.sampled_from(["approve", "reject"])),
        "approver": "ms-rivera",
        "reason": draw(st.none() | st.text(max_size=50)),
        "edited_markdown": None,
    }
    if kind == "foreign user":
        decision["user_id"] = draw(foreign_users)
    elif kind == "unknown diff":
        decision["diff_id"] = draw(st.text("0123456789abcdef", min_size=32, max_size=32))
    elif kind == "decided diff":
        decision["diff_id"] = turn.decided
    elif kind == "bad name":
        decision["approver"] = draw(bad_names)
    elif kind == "malformed":
        field = draw(st.sampled_from(sorted(MALFORMED)))
        decision[field] = draw(MALFORMED[field])
    else:  # reaches the turn (valid as a payload), refused when applied
        decision["decision"] = "approve"
        decision["edited_markdown"] = draw(st.text(max_size=200).filter(turn.bad_markdown))
    return kind, decision


@CASES
@given(data=st.data())
async def test_hostile_updates_are_refused(turn: Turn, data: st.DataObject) -> None:
    kind, decision = data.draw(hostile_decisions(turn))
    before, accepted = snapshot(turn.rig.stack), await turn.accepted_updates()
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await turn.handle.execute_update("decide", decision)
    assert str(refused.value.cause).strip()  # says why
    assert snapshot(turn.rig.stack) == before
    turn.still_waiting()
    if kind in REFUSED_BEFORE_HISTORY:
        assert await turn.accepted_updates() == accepted


@CASES
@given(data=st.data(), signal=st.sampled_from(["approve", "reject"]))
async def test_hostile_signals_are_ignored(turn: Turn, data: st.DataObject, signal: str) -> None:
    _kind, decision = data.draw(hostile_decisions(turn))
    if _kind == "bad markdown" and signal == "reject":
        decision["reason"] = 7  # a rejection ignores Markdown: make this one malformed too
    before = snapshot(turn.rig.stack)
    await turn.handle.signal(signal, decision)
    await turn.settled()
    assert snapshot(turn.rig.stack) == before
    turn.still_waiting()


@CASES
@given(
    user=bad_users,
    label=hostile_ids,
    text=st.text(max_size=60),
    diff_id=st.text(max_size=40),
    name=bad_names,
)
async def test_client_methods_with_hostile_arguments(
    turn: Turn, user: str, label: str, text: str, diff_id: str, name: str
) -> None:
    client: MemoryClient = turn.rig.client
    calls = [
        client.send_message(user, text or "hi"),
        client.send_message(USER, ""),  # an empty message
        client.send_message(USER, "x" * (MAX_MESSAGE_CHARS + 1)),
        client.approve(diff_id, "ms-rivera"),
        client.approve(turn.open, name),
        client.approve(turn.decided, "ms-rivera"),
        client.reject(turn.open, "ms-rivera", " "),  # a rejection needs a reason
        client.approve(turn.open, "ms-rivera", edited_markdown=text + "\n## Nope\n"),
        client.edit_block(user, label, text, "vera"),
        client.edit_block(USER, "student", text, name),
        client.history(user, label),
        client.restore(USER, "student", text + "z", "vera"),  # never a commit id
        client.search_archive(user, text),
        client.pending_diffs(user),
        client.context_overview(user),
        client.rotate_now(user, label),
    ]
    before = snapshot(turn.rig.stack)
    for call in calls:
        with pytest.raises(DurableMemoryError) as refused:
            await call
        assert str(refused.value).strip()
    assert snapshot(turn.rig.stack) == before
    turn.still_waiting()
