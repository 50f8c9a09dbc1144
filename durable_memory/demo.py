"""The memory core's demo: one student's memory under the seed's essay-coach profile.

Until the Temporal pipeline exists, the agent's proposals here are scripted calls to
`MemoryService.propose` (exactly what the model's tools will do) and are labelled as such.
"""

import json
import tempfile
from pathlib import Path
from typing import Any

from durable_memory.memory.service import open_service
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddItem, LearnPreference, SetField
from durable_memory.models.recall import MessageRole, NewMessage

USER = "alice"
TURN = "turn-demo-1"


def run_core_demo(data_dir: str | None = None, as_json: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dmem-demo-") as tmp:
        return _run(Path(data_dir or tmp), as_json)


def _run(root: Path, as_json: bool) -> dict[str, Any]:
    out: list[str] = []
    say = out.append
    service = open_service(root, profile="essay_coach")
    backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
    alice = Author(name="alice", kind=AuthorKind.USER)

    created = service.ensure_user(USER)
    say(f"== memory of '{USER}' created at {created[:12]} in {root}")
    service.edit_block(
        USER,
        "student",
        {"name": "Alice", "background": "High school senior", "strengths": ["Creativity"]},
        alice,
    )
    service.set_task(USER, "Brainstorm essay topics", backend, context="Starting session")
    say("== the student's own edit and the backend's set_task are committed directly")
    say(service.render(USER, "human", "prompt"))

    service.recall.append(
        USER,
        TURN,
        [
            NewMessage(role=MessageRole.USER, content="I love building robots with my sister."),
            NewMessage(role=MessageRole.ASSISTANT, content="What did building them teach you?"),
        ],
    )
    say("== [scripted agent] proposes three edits; memory is untouched until a human decides")
    proposals = [
        service.propose(
            USER,
            "student",
            AddItem(field="strengths", value="Persistence"),
            "She kept rebuilding the robot after each failure.",
            f"turn:{TURN}",
        ),
        service.propose(
            USER,
            "journey",
            SetField(field="stage", value="drafting"),
            "She wants to start writing.",
            f"turn:{TURN}",
        ),
        service.propose(
            USER,
            "human",
            LearnPreference(preference="Prefers Socratic questions"),
            "She engages more when asked questions.",
            f"turn:{TURN}",
        ),
    ]
    for diff in proposals:
        say(f"-- {diff.id}  {diff.summary}\n{service.preview(diff.id)}")

    approved = service.approve(proposals[0].id, "ms-rivera")
    rejected = service.reject(proposals[1].id, "ms-rivera", "Too early: still brainstorming")
    edited_md = service.render(USER, "human", "markdown").replace(
        "## Preferences\n", "## Preferences\n- Prefers Socratic questions, one at a time\n"
    )
    edited = service.approve(proposals[2].id, "alice", edited_markdown=edited_md)
    say(f"== approved {approved.id[:8]} -> commit {(approved.commit_sha or '')[:12]}")
    say(f"== rejected {rejected.id[:8]}: {rejected.decision_reason}")
    say(f"== edited then approved {edited.id[:8]} -> commit {(edited.commit_sha or '')[:12]}")

    say(f"== git log of users/{USER}")
    for commit in service.git.history(USER, None):
        trailers = ", ".join(f"{k}={v[:20]}" for k, v in commit.trailers.items())
        say(
            f"{commit.sha[:12]} {commit.author} ({commit.author_kind}): "
            f"{commit.message.splitlines()[0]}  [{trailers}]"
        )

    first = service.history(USER, "human")[-1]
    restored = service.restore(USER, "human", first.sha, alice)
    say(f"== restored human to {first.sha[:12]} as new commit {restored[:12]} (history kept)")
    hits = service.recall.search(USER, "robots")
    say(f"== recall search 'robots': {[m.content for m in hits.messages]}")
    summary = service.summary(USER)
    say(f"== human summary: {summary}")

    result = {
        "user": USER,
        "diffs": {d.id: service.diffs.get(d.id).status.value for d in proposals},
        "commits": [c.sha for c in service.git.history(USER, "human")],
        "recall_hits": [m.id for m in hits.messages],
    }
    print(json.dumps(result, indent=2) if as_json else "\n".join(out))
    return result
