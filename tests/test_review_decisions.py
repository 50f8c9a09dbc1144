"""Decisions from the review page go the way every decision goes: the turn's Update through
`MemoryClient`, with a real Temporal dev server, a worker and the scripted model. A decision
that lost a race shows who decided what; a refused one changes nothing. And the page is a thin
client: in the distributed mode it runs on a host of its own, with nothing but clones on disk.
(In process, over httpx; the browser's view of the same flow is test_review_browser.py.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.demo import free_port
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.history import Author, AuthorKind
from durable_memory.review.app import build_app
from durable_memory.review.server import review_link
from tests.support.distributed import distributed_settings, git_server
from tests.support.interruptible import popen_interruptible
from tests.support.postgres import fresh_schema_url
from tests.support.review import (
    REVIEW_SECRET,
    TWO_DIFFS,
    csrf_of,
    edit_call,
    open_session,
    with_review,
)
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings, running_rig
from tests.support.worker_process import address

BASE = "http://review.test"


async def test_decisions_go_through_the_turn_and_a_lost_race_says_who_won(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = with_review(rig_settings(tmp_path / "data"), tmp_path, BASE)
    nickname = [{"content": [edit_call("student", "name", "set", "Ally", "her nickname")]}]
    script = [*TWO_DIFFS, *nickname, {"text": "Noted."}]
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await rig.client.send_message("alice", "I kept going", turn_id="d1")
        grit, stage = (d.id for d in reply.diffs)
        app = build_app(rig.client, settings.review)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
            await open_session(http, review_link(settings.review, "alice"))
            token = await csrf_of(http, f"/diffs/{grit}")

            async def decide(diff_id: str, **form: str) -> httpx.Response:
                return await http.post(f"/diffs/{diff_id}/decide", data={"csrf": token, **form})

            # Refused decisions: one clear message each, nothing changed.
            before = snapshot(rig.stack)
            no_reason = await decide(grit, action="reject", reason="  ")
            assert no_reason.status_code == 400
            assert "a rejection needs a reason" in no_reason.text
            broken = await decide(grit, action="edit", markdown="---\nblock: student\n---\nhi")
            assert broken.status_code == 400
            assert "hi</textarea>" in broken.text  # the person's edit is kept to fix
            assert 'id="message"' in broken.text
            unknown = await decide(grit, action="merge")
            assert unknown.status_code == 400
            assert "names no decision" in unknown.text
            assert snapshot(rig.stack) == before

            # The decision wins the race: the turn's Update commits it, attributed.
            approved = await decide(grit, action="approve")
            assert approved.status_code == 303
            assert approved.headers["location"] == f"/diffs/{grit}"
            diff = rig.stack.review.get(grit, "alice")
            assert (diff.status, diff.decided_by) == (DiffStatus.APPROVED, "alice")
            assert diff.commit_sha is not None
            head = rig.stack.blocks.last_change("alice")
            assert head is not None
            assert head.sha == diff.commit_sha
            assert head.trailers["Approved-By"] == "alice"
            assert head.trailers["Diff-Id"] == grit

            # Someone else decided first: the page says who decided what.
            await rig.client.reject(stage, "ms-rivera", "too early")
            before = snapshot(rig.stack)
            lost = await decide(stage, action="approve")
            assert lost.status_code == 409
            assert f"diff {stage} is already rejected by ms-rivera" in lost.text
            assert "too early" in lost.text
            assert "Status: <strong>rejected</strong> by" in lost.text
            assert snapshot(rig.stack) == before

            # The block changed under a proposal: the approval conflicts, memory is untouched,
            # and the page shows the block's current text beside the proposal.
            reply = await rig.client.send_message("alice", "Call me Ally", turn_id="d2")
            name = reply.diffs[0].id
            alice = Author(name="alice", kind=AuthorKind.USER)
            rig.stack.edits.edit_block("alice", "student", {"name": "Alicia"}, alice)
            head = rig.stack.blocks.last_change("alice")
            conflicted = await decide(name, action="approve")
            assert conflicted.status_code == 409
            assert "Status: <strong>conflicted</strong>" in conflicted.text
            assert "field &#39;name&#39; of block &#39;student&#39; changed" in conflicted.text
            assert '"value": "Ally"' in conflicted.text.replace("&#34;", '"')
            assert "Alicia" in conflicted.text.split('id="current"')[1]
            assert rig.stack.blocks.last_change("alice") == head


@pytest.mark.postgres
async def test_the_page_is_a_thin_client_in_the_distributed_mode(
    temporal_env: WorkflowEnvironment, tmp_path: Path, postgres_url: str
) -> None:
    database = fresh_schema_url(postgres_url)
    with git_server(tmp_path / "remote") as server:
        worker_host = distributed_settings(
            tmp_path / "worker", database_url=database, git_remote=server.url
        )
        page_host = with_review(
            distributed_settings(tmp_path / "page", database_url=database, git_remote=server.url),
            tmp_path,
            BASE,
        ).model_copy(update={"temporal": worker_host.temporal})
        async with running_rig(temporal_env.client, worker_host, TWO_DIFFS) as rig:
            reply = await rig.client.send_message("alice", "I kept going", turn_id="t1")
            grit = reply.diffs[0].id
            page_stack = stack_from_settings(page_host)
            client = MemoryClient(temporal_env.client, page_host, page_stack)
            transport = httpx.ASGITransport(app=build_app(client, page_host.review))
            try:
                async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
                    await open_session(http, review_link(page_host.review, "alice"))
                    overview = await http.get("/")
                    assert grit in overview.text
                    token = await csrf_of(http, f"/diffs/{grit}")
                    approved = await http.post(
                        f"/diffs/{grit}/decide", data={"csrf": token, "action": "approve"}
                    )
                    assert approved.status_code == 303
                    block = await http.get("/blocks/student")
                    assert "Grit" in block.text
            finally:
                client.close()
            # The worker's host sees the page's decision, committed on the shared remote.
            assert "Grit" in rig.stack.blocks.read_block("alice", "student").value
            on_disk = {p.name for p in (tmp_path / "page").iterdir()}
            assert on_disk <= {"clones"}, on_disk


def test_dmem_serve_serves_the_page_under_its_base_urls_path(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """`dmem serve` as a process, configured by its environment alone; behind a proxy that
    strips /review (as base_url says), its links, forms and cookie carry /review."""
    port = free_port()
    settings = rig_settings(tmp_path / "data")
    stack = stack_from_settings(settings)
    stack.blocks.ensure_user("alice")
    stack.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMEM_", "ANTHROPIC_"))}
    env.update(
        {
            "DMEM_TEMPORAL_ADDRESS": address(temporal_env),
            "DMEM_DATA_DIR": str(settings.memory.data_dir),
            "DMEM_PROFILE": settings.memory.profile,
            "DMEM_REVIEW_SECRET": REVIEW_SECRET,
            "DMEM_REVIEW_BASE_URL": f"http://127.0.0.1:{port}/review",
        }
    )
    dmem = [sys.executable, "-m", "durable_memory.cli"]
    link = subprocess.run(
        [*dmem, "review-link", "alice"], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert link.startswith(f"http://127.0.0.1:{port}/review/open?")
    server = popen_interruptible(
        [*dmem, "serve", "--port", str(port)], env=env, cwd=tmp_path, stderr=subprocess.PIPE
    )
    try:
        stripped = link.replace("/review/", "/", 1)  # what the proxy forwards
        opened = None
        for _ in range(300):  # until it listens
            try:
                opened = httpx.get(stripped, timeout=5)
                break
            except httpx.ConnectError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                time.sleep(0.1)
        assert opened is not None
        assert opened.status_code == 200
        assert 'content="0; url=/review/"' in opened.text
        assert "Path=/review/" in opened.headers["set-cookie"]
        cookie = opened.headers["set-cookie"].split(";")[0]
        overview = httpx.get(f"http://127.0.0.1:{port}/", headers={"cookie": cookie})
        assert "Memory of alice" in overview.text
        assert 'href="/review/blocks/student"' in overview.text
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) in (0, 130, -signal.SIGINT)
