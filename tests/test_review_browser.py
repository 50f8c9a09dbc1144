"""The review page in a real browser: Debian's headless chromium driven by Selenium through
Debian's chromium-driver (scripts/ensure-chromium installs both; nothing is downloaded at run
time), against `dmem serve`'s app on uvicorn, a real Temporal dev server, a worker and the
scripted model. The browser and the server share the test's event loop: each browser step
runs in a thread, so the server answers while the browser waits."""

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait
from temporalio.testing import WorkflowEnvironment

from durable_memory.cli import main
from durable_memory.config import ReviewSettings
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import LearnPreference
from durable_memory.review.app import build_app
from durable_memory.review.server import review_link
from durable_memory.review.signing import Signer
from tests.support.review import HOSTILE, TWO_DIFFS, with_review
from tests.support.temporal_helpers import rig_settings, running_rig

T = TypeVar("T")

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT_S = 15
"""How long the browser waits for a page to show something (a bound, never asserted)."""


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI") or os.environ.get("DMEM_REQUIRE_CHROMIUM"):
            pytest.fail("chromium or chromedriver missing: run scripts/ensure-chromium")
        pytest.skip("chromium or chromedriver missing (run scripts/ensure-chromium)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1100,900",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


@dataclass
class Browser:
    """The browser, each step in a thread so the server on the test's loop keeps answering."""

    driver: WebDriver

    async def run(self, step: Callable[[WebDriver], T]) -> T:
        return await asyncio.to_thread(step, self.driver)

    async def open(self, url: str) -> str:
        """Open `url` and return the page's visible text."""

        def step(d: WebDriver) -> str:
            d.get(url)
            return d.find_element(By.TAG_NAME, "body").text

        return await self.run(step)

    async def text(self, css: str) -> str:
        return await self.run(lambda d: d.find_element(By.CSS_SELECTOR, css).text)

    async def click(self, css: str) -> str:
        """Click, wait for the next page, return its visible text."""

        def step(d: WebDriver) -> str:
            old = d.find_element(By.TAG_NAME, "html")
            d.find_element(By.CSS_SELECTOR, css).click()
            WebDriverWait(d, WAIT_S).until(
                lambda d: old.id != d.find_element(By.TAG_NAME, "html").id
            )
            return d.find_element(By.TAG_NAME, "body").text

        return await self.run(step)

    async def screenshot(self, name: str) -> None:
        """With DMEM_REVIEW_SCREENSHOTS=DIR (`make docs-images`), save the page as DIR/NAME.png:
        the pictures of docs/review.md are taken from this test."""
        folder = os.environ.get("DMEM_REVIEW_SCREENSHOTS")
        if folder:
            path = Path(folder) / f"{name}.png"
            await self.run(lambda d: d.get_screenshot_as_file(str(path)))

    async def wait_until(self, check: Callable[[WebDriver], bool]) -> None:
        await self.run(lambda d: WebDriverWait(d, WAIT_S, poll_frequency=0.1).until(check))


@asynccontextmanager
async def served(review: ReviewSettings, app: Any) -> AsyncIterator[ReviewSettings]:
    """The app on uvicorn on a free loopback port; yields the settings with that base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield review.model_copy(update={"base_url": f"http://127.0.0.1:{port}"})
    finally:
        server.should_exit = True
        await task


@contextmanager
def cli_env(
    monkeypatch: pytest.MonkeyPatch, temporal_env: WorkflowEnvironment, queue: str
) -> Iterator[None]:
    monkeypatch.setenv(
        "DMEM_TEMPORAL_ADDRESS", temporal_env.client.service_client.config.target_host
    )
    monkeypatch.setenv("DMEM_TASK_QUEUE", queue)
    monkeypatch.delenv("DMEM_CONFIG", raising=False)
    yield


async def test_review_a_turn_in_the_browser(
    temporal_env: WorkflowEnvironment,
    browser: WebDriver,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = with_review(rig_settings(tmp_path / "data"), tmp_path, "http://127.0.0.1:1")
    async with running_rig(temporal_env.client, settings, TWO_DIFFS) as rig:
        stack = rig.stack
        reply = await rig.client.send_message("alice", "I kept going", turn_id="b1")
        grit, stage = (d.id for d in reply.diffs)
        stack.edits.learn_fact("alice", HOSTILE, Author(name="alice", kind=AuthorKind.USER))
        stack.blocks.ensure_user("bob")
        bobs = stack.review.propose(
            "bob", "human", LearnPreference(preference="Chess"), "he said", Proposer.turn("x")
        )
        page = Browser(browser)
        async with served(settings.review, build_app(rig.client, settings.review)) as review:
            base = review.base_url
            # Links: an expired one and a tampered one are refused with a clear page.
            expired = Signer(review.secret()).link("alice", 60, now=1_000_000)
            text = await page.open(f"{base}/open?{expired.query()}")
            assert "Refused (403)" in text
            assert "expired" in text
            tampered = review_link(review, "alice").replace("u=alice", "u=bob")
            assert "not valid" in await page.open(tampered)
            assert "no review session" in await page.open(f"{base}/")

            # Alice's link, followed from another site (a mail, a chat): the session starts
            # there, SameSite=Strict though it is. Her blocks, the hostile fact as text, both
            # pending diffs.
            link = review_link(review, "alice").replace("&", "&amp;")
            await page.open(f"data:text/html,<a id=go href='{link}'>your review</a>")
            await page.click("#go")
            await page.wait_until(lambda d: "Memory of alice" in d.page_source)
            text = await page.text("body")
            assert "Memory of alice" in text
            assert HOSTILE in text  # shown as text, never run
            assert await page.run(lambda d: d.execute_script("return window.pwned")) is None
            assert "Pending changes (2)" in text
            await page.screenshot("review-overview")
            usage = await page.text("#block-student .usage")
            assert usage.endswith("characters (0%)") or "/ 1500 characters" in usage

            # The diff: the unified preview, the reasoning as text, edit then approve.
            text = await page.click(f"#diff-{grit} a")
            assert "+- Grit" in await page.text("#preview")
            assert HOSTILE in await page.text("#reasoning")
            assert await page.run(lambda d: d.execute_script("return window.pwned")) is None
            count_before = await page.text("#char-count")  # our script runs under the CSP
            assert "characters of Markdown (the block's limit: 1500)" in count_before

            def edit(d: WebDriver) -> None:
                area = d.find_element(By.ID, "markdown")
                edited = str(area.get_attribute("value")).replace("- Grit", "- Grit and patience")
                area.clear()
                area.send_keys(edited)

            await page.screenshot("review-diff")
            await page.run(edit)
            assert await page.text("#char-count") != count_before  # counted live
            text = await page.click("#edit-approve")
            assert "Status: approved by alice" in text
            commit = await page.text("#commit")
            diff = stack.review.get(grit, "alice")
            assert diff.status is DiffStatus.APPROVED
            assert diff.commit_sha is not None
            assert diff.commit_sha.startswith(commit)

            # The commit in the block's history: who proposed, who approved, why.
            text = await page.click("#commit")
            assert "Grit and patience" in await page.text("#block-student .value")
            top = await page.text("#history tbody tr:first-child")
            assert commit in top
            assert "Approved-By: alice" in top
            assert "Proposed-By: turn:b1" in top
            await page.click("#compare")
            assert "+- Grit and patience" in await page.text("#comparison")
            await page.screenshot("review-history")

            # Restore the version before it: an attributed commit; memory as it was.
            text = await page.click("#history tbody tr:nth-child(2) .restore")
            top = await page.text("#history tbody tr:first-child")
            assert "Restore student to" in top
            assert "alice (user)" in top
            assert "Grit" not in await page.text("#block-student .value")
            assert "Grit" not in str(stack.blocks.read_block("alice", "student").value)

            # Another user's diff id: refused, nothing shown.
            text = await page.open(f"{base}/diffs/{bobs.id}")
            assert "Refused (404)" in text
            assert "Chess" not in text

            # Memory changed elsewhere while an edit is being typed: the page says so and
            # keeps the edit instead of reloading it away.
            await page.open(f"{base}/diffs/{stage}")
            await page.run(lambda d: d.find_element(By.ID, "markdown").send_keys("my draft"))
            learned = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
            await asyncio.to_thread(stack.edits.learn_fact, "alice", "Plays the cello", learned)
            await page.wait_until(lambda d: bool(d.find_elements(By.ID, "changed")))
            draft = await page.run(
                lambda d: d.find_element(By.ID, "markdown").get_attribute("value")
            )
            assert "my draft" in str(draft)

            # A POST without the CSRF token (the field removed from the form): refused.
            await page.open(f"{base}/diffs/{stage}")
            await page.run(
                lambda d: d.execute_script(
                    "for (const f of document.querySelectorAll('input[name=csrf]')) f.remove()"
                )
            )
            text = await page.click("#approve")
            assert "Refused (403)" in text
            assert "CSRF token" in text
            assert stack.review.get(stage, "alice").status is DiffStatus.PENDING

            # A decision made from the CLI shows on the open page without a reload.
            text = await page.open(f"{base}/")
            assert "Pending changes (1)" in text
            with cli_env(monkeypatch, temporal_env, settings.temporal.task_queue):
                code = await asyncio.to_thread(
                    main,
                    [
                        "--data-dir",
                        str(settings.memory.data_dir),
                        "--profile",
                        "essay_coach",
                        "reject",
                        stage,
                        "--as",
                        "ms-rivera",
                        "--reason",
                        "too early",
                    ],
                )
            assert code == 0
            await page.wait_until(lambda d: "Nothing is waiting for you." in d.page_source)
            text = await page.open(f"{base}/diffs/{stage}")
            assert "Status: rejected by ms-rivera" in text
            assert "too early" in text
