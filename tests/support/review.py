"""What the review page's tests share: a signing secret of their own, settings using it, a
turn script that proposes two diffs, and an HTTP session on the page (httpx, in process)."""

import re
from pathlib import Path
from typing import Any

import httpx

from durable_memory.config import ReviewSettings, Settings

REVIEW_SECRET = "review-tests-secret-0123456789abcdef"
HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
"""Text a page must show as text: run, it would set window.pwned."""


def with_review(settings: Settings, secret_dir: Path, base_url: str) -> Settings:
    """`settings` with a review section: the secret in a file under `secret_dir`, links made
    for `base_url`."""
    secret_file = secret_dir / "review-secret"
    secret_file.write_text(REVIEW_SECRET + "\n", encoding="utf-8")
    review = ReviewSettings(secret_file=secret_file, base_url=base_url)
    return settings.model_copy(update={"review": review})


def edit_call(label: str, field: str, operation: str, value: str, reasoning: str) -> dict[str, Any]:
    """The model's call of the edit_memory_block tool, as a scripted reply holds it."""
    arguments = {"label": label, "field": field, "operation": operation, "value": value}
    return {
        "type": "tool_use",
        "name": "edit_memory_block",
        "input": {**arguments, "reasoning": reasoning},
    }


TWO_DIFFS: list[dict[str, Any]] = [
    {
        "content": [
            edit_call("student", "strengths", "add", "Grit", f"She kept going. {HOSTILE}"),
            edit_call("journey", "stage", "set", "drafting", "She has an outline."),
        ]
    },
    {"text": "Noted both."},
]
"""A turn (essay_coach profile) proposing two diffs: a strength with hostile reasoning, and
the journey's stage."""


async def open_session(http: httpx.AsyncClient, link: str) -> None:
    """Open a review link: the session cookie is then in `http`'s jar."""
    response = await http.get(link)
    assert response.status_code == 200, response.text
    assert "set-cookie" in response.headers


async def csrf_of(http: httpx.AsyncClient, path: str) -> str:
    """The CSRF token in the forms of the page at `path`."""
    page = await http.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)
