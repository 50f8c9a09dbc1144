"""`dmem demo`: an essay-coach session that shows the whole memory loop on one machine.

By default the model is the scripted Messages API server replaying the packaged script
(`scripts/essay_coach_demo.json`), used through the real anthropic SDK: every reply it prints
is labelled as scripted. `--live` uses Claude with ANTHROPIC_API_KEY instead.
"""

import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from durable_memory.memory.agent import TurnResult, run_turn
from durable_memory.memory.errors import DurableMemoryError
from durable_memory.memory.llm import AnthropicModel
from durable_memory.memory.stack import MemoryStack, open_stack
from durable_memory.models.archive import ArchiveSearch
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.history import Author, AuthorKind
from durable_memory.scripted_model import ScriptedModelServer, load_script

USER = "alice"
TURNS = [
    "Hi! I'm Alice, a high school senior. I want to write my college essay about building "
    "robots with my sister.",
    "Last spring we came second at the regional robotics competition. The night before, the "
    "drivetrain broke and my sister and I rebuilt it at 2am.",
]
BACKEND = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
SESSION_NOTES = [
    "Session 1: Alice described building robots with her sister since middle school. The "
    "robotics club meets on Thursdays in room 204 and she leads its drivetrain team of four "
    "students. She is proud of the team, less sure the story is essay material. We listed "
    "three moments worth exploring: the first robot, the club, the competition.",
    "Session 2: the regional robotics competition last spring, second place. The drivetrain "
    "broke the night before and the sisters rebuilt it together at 2am with borrowed parts "
    "from a rival team. She lights up when telling it; this is the heart of the story and "
    "the likely opening scene, told in the present tense.",
    "Session 3: she wants the essay to show persistence and teamwork rather than the trophy. "
    "Plan: open at 2am with the broken drivetrain and dialogue between the sisters, then "
    "step back to how they started building, then close on what she learned about asking "
    "for help. First draft due before the next session.",
]


def demo_script() -> list[dict[str, Any]]:
    path = resources.files("durable_memory.scripts") / "essay_coach_demo.json"
    with resources.as_file(path) as file:
        return load_script(file)


class _Printer:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, text: str = "") -> None:
        if not self.quiet:
            print(text, flush=True)


def run_demo(
    data_dir: str | None = None, as_json: bool = False, live: bool = False
) -> dict[str, Any]:
    if live and not os.environ.get("ANTHROPIC_API_KEY"):
        raise DurableMemoryError("--live needs ANTHROPIC_API_KEY; without it the demo is scripted")
    with tempfile.TemporaryDirectory(prefix="dmem-demo-") as tmp:
        stack = open_stack(Path(data_dir or tmp), profile="essay_coach")
        try:
            if live:
                model = AnthropicModel()
                return _session(stack, model, "Claude (live)", as_json)
            with ScriptedModelServer(demo_script()) as server:
                model = AnthropicModel(base_url=server.url)
                return _session(stack, model, f"scripted model at {server.url}", as_json)
        finally:
            stack.close()


def _decide(stack: MemoryStack, diffs: list[PendingDiff], say: _Printer) -> None:
    """First diff approved, second rejected, third edited by the student, then approved."""
    service = stack.service
    for n, diff in enumerate(diffs):
        if n == 1:
            service.reject(diff.id, "ms-rivera", "Too early: we are still exploring")
            say(f"   rejected {diff.id[:8]} ({diff.summary}) by ms-rivera")
            continue
        if n == 2 and diff.label == "human":
            block = service.read_block(USER, "human")
            edited = (
                service.render(USER, "human", "markdown")
                .replace("## Current Task\n", "## Current Task\nFind the story in the robot repair")
                .replace("## Session State\nidle", "## Session State\nactive_task")
            )
            if block.fields["current_task"] is None:
                result = service.approve(diff.id, USER, edited_markdown=edited)
                sha = (result.commit_sha or "")[:12]
                say(f"   edited then approved {diff.id[:8]} by {USER}: commit {sha}")
                continue
        result = service.approve(diff.id, "ms-rivera")
        say(
            f"   approved {diff.id[:8]} ({diff.summary}) by ms-rivera: "
            f"{result.status.value} {(result.commit_sha or '')[:12]}"
        )


def _turn(stack: MemoryStack, model: AnthropicModel, turn_id: str, message: str) -> TurnResult:
    return run_turn(
        stack.service,
        stack.summaries,
        model,
        stack.tools,
        USER,
        turn_id,
        message,
        archival_count=stack.archive.count(USER),
    )


def _session(
    stack: MemoryStack, model: AnthropicModel, source: str, as_json: bool
) -> dict[str, Any]:
    say = _Printer(as_json)
    service = stack.service
    service.ensure_user(USER)
    say(f"== durable-memory demo: essay coach, user '{USER}', model: {source}")
    turns: list[dict[str, Any]] = []
    all_diffs: list[str] = []
    for number, message in enumerate(TURNS, start=1):
        turn_id = f"demo-turn-{number}"
        say(f"\n-- turn {number}\n   student: {message}")
        result = _turn(stack, model, turn_id, message)
        say(f"   coach [{source.split(' at ')[0]}]: {result.reply}")
        proposed = [service.diffs.get(d) for d in result.diff_ids]
        pending = [d for d in proposed if d.status is DiffStatus.PENDING]
        for diff in proposed:
            say(f"   proposed {diff.id[:8]} {diff.summary} [{diff.status.value}]")
            say(
                "".join(
                    f"      {line}\n" for line in service.preview(diff.id).splitlines()
                ).rstrip()
            )
        _decide(stack, pending, say)
        turns.append({"turn_id": turn_id, "reply": result.reply, "steps": result.steps})
        all_diffs += result.diff_ids

    say("\n-- the tutoring backend logs session notes (committed directly, author tutor-backend)")
    for note in SESSION_NOTES:
        service.add_context(USER, note, BACKEND)
    for fact in (
        "Leads the drivetrain team of the robotics club",
        "Came second at the regional robotics competition",
    ):
        service.learn_fact(USER, fact, BACKEND)
    service.learn_preference(USER, "Prefers questions to ready-made suggestions", BACKEND)
    service.learn_preference(USER, "Likes to talk ideas through out loud first", BACKEND)
    check = stack.rotator.check(USER, "human")
    say(
        f"   human block at {check.usage:.0%} of its limit; {check.strategy.value} threshold "
        f"{check.threshold:.0%}: {'rotate' if check.should_rotate else 'no rotation'}"
    )
    rotation = stack.rotator.rotate(USER, "human")
    if rotation is None:
        raise DurableMemoryError("the demo's human block did not cross its rotation threshold")
    say(
        f"   archived the full text first ({', '.join(p[:8] for p in rotation.passage_ids)}), "
        f"then committed the {rotation.plan.strategy.value} compression "
        f"{rotation.plan.chars_before} -> {rotation.plan.chars_after} chars as "
        f"{(rotation.commit_sha or '')[:12]}"
    )

    say(f"\n-- git log of users/{USER}")
    log = service.git.history(USER, None, 50)
    for commit in log:
        trailers = " ".join(f"{k}={v[:16]}" for k, v in commit.trailers.items())
        say(
            f"   {commit.sha[:12]} {commit.author:<14} {commit.message.splitlines()[0][:60]}"
            + (f"  [{trailers}]" if trailers else "")
        )

    query = "robotics competition drivetrain at 2am"
    hits = stack.archive.search(USER, ArchiveSearch(query=query, top_k=3))
    say(f"\n-- archive search {query!r}")
    for hit in hits:
        lines = hit.passage.text.splitlines()
        say(f"   {hit.score:.3f} {hit.passage.id[:8]} {lines[0]} {' / '.join(lines[1:])[:90]}...")

    overview = stack.compile(USER).overview
    say("\n-- context overview for the next turn")
    say(
        f"   {overview.total_tokens} tokens of {overview.context_window} "
        f"({overview.share_used:.2%}): system {overview.system_tokens}, core memory "
        f"{overview.core_memory_tokens}, metadata {overview.metadata_tokens}, messages "
        f"{overview.messages_tokens}, tools {overview.tools_tokens}"
    )
    summary = {
        "model": source,
        "user": USER,
        "turns": turns,
        "diffs": {d: service.diffs.get(d).status.value for d in all_diffs},
        "commits": [c.sha for c in log],
        "rotation": {"commit": rotation.commit_sha, "passages": rotation.passage_ids},
        "search_hits": [h.passage.id for h in hits],
        "context_tokens": overview.total_tokens,
    }
    if as_json:
        print(json.dumps(summary, indent=2))
    return summary
