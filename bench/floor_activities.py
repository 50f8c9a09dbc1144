"""The floors' activities that do real work, outside the workflow sandbox: one request to the
same scripted model our turns call (the SDK's client, kept alive, no retries, as ours is),
and one plain `git commit` (+ `git push`) of the same file our approvals commit."""

from pathlib import Path
from typing import Any, cast

import anthropic
from temporalio import activity

from bench.floor import COMMIT, MODEL_CALL, FloorCommit, plain_git_commit, plain_git_push


class FloorActivities:
    def __init__(self, model_url: str) -> None:
        self._client = anthropic.Anthropic(api_key="floor", base_url=model_url, max_retries=0)

    @activity.defn(name=MODEL_CALL)
    def model_call(self, message: str) -> str:
        api = cast(Any, self._client.messages)
        reply = api.create(
            model="floor", max_tokens=64, messages=[{"role": "user", "content": message}]
        )
        return "".join(block.text for block in reply.content if block.type == "text")

    @activity.defn(name=COMMIT)
    def commit(self, commit: FloorCommit) -> None:
        repo = Path(commit.repo)
        plain_git_commit(repo, commit.content)
        if commit.push_token is not None:
            plain_git_push(repo, commit.push_token)
