"""The anthropic SDK against the scripted Messages API server: replies, errors, retry classes."""

from typing import Any

import anthropic
import httpx
import pytest

from durable_memory.memory.agent.llm import AnthropicModel, ModelCallError, ModelConfigError
from durable_memory.models.blocks import ModelSettings
from durable_memory.models.llm import (
    CacheControl,
    ChatMessage,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from durable_memory.scripted_model import ScriptedModelServer, ScriptError, load_script

SETTINGS = ModelSettings(name="claude-sonnet-4-6", max_tokens=256, temperature=0.2)
HELLO = [ChatMessage(role="user", content=[TextBlock(text="hello")])]


def _call(script: list[dict[str, Any]]) -> tuple[Any, ScriptedModelServer]:
    with ScriptedModelServer(script) as server:
        model = AnthropicModel(base_url=server.url)
        try:
            return model.create(SETTINGS, "be brief", HELLO, []), server
        finally:
            model.close()


def test_text_reply_and_recorded_request() -> None:
    reply, server = _call([{"text": "Hi there"}])
    assert reply.text == "Hi there"
    assert reply.stop_reason == "end_turn"
    assert reply.model == "scripted:claude-sonnet-4-6"
    assert reply.input_tokens > 0
    request = server.requests[0]
    assert request["system"] == "be brief"
    assert request["max_tokens"] == 256
    assert request["temperature"] == 0.2
    assert request["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]


def test_the_request_is_the_one_the_sdks_messages_create_sends() -> None:
    """The body is encoded by us and sent with the SDK's `post`: the same JSON, headers and
    endpoint as `messages.create` (cache breakpoints, tools, temperature and all)."""
    marker = CacheControl(ttl="1h")
    system = [TextBlock(text="stable", cache_control=marker), TextBlock(text="blocks")]
    messages = [
        ChatMessage(role="user", content=[TextBlock(text="hello")]),
        ChatMessage(
            role="assistant",
            content=[ToolUseBlock(id="toolu_1", name="search", input={"q": "é \u2028 ✓"})],
        ),
        ChatMessage(
            role="user",
            content=[ToolResultBlock(tool_use_id="toolu_1", content="found", cache_control=marker)],
        ),
    ]
    tools = [{"name": "search", "description": "d", "input_schema": {"type": "object"}}]
    with ScriptedModelServer([{"text": "ours"}, {"text": "sdk's"}]) as server:
        model = AnthropicModel(base_url=server.url)
        sdk = anthropic.Anthropic(api_key="no-key-local-server", base_url=server.url)
        try:
            model.create(SETTINGS, system, messages, tools)
            sdk.messages.create(
                model=SETTINGS.name,
                max_tokens=SETTINGS.max_tokens,
                extra_body={"temperature": SETTINGS.temperature},
                system=[b.model_dump(mode="json") for b in system],  # type: ignore[misc]
                messages=[m.model_dump(mode="json") for m in messages],  # type: ignore[misc]
                tools=tools,  # type: ignore[arg-type]
            )
        finally:
            model.close()
            sdk.close()
    ours, theirs = server.requests
    assert ours == theirs
    assert ours["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert "cache_control" not in ours["system"][1]


def test_a_request_without_json_or_the_api_version_is_refused_as_the_api_does() -> None:
    with ScriptedModelServer([{"text": "never"}]) as server:
        for headers in (
            {"content-type": "text/plain", "anthropic-version": "2023-06-01"},
            {"content-type": "application/json"},
        ):
            reply = httpx.post(f"{server.url}/v1/messages", content=b"{}", headers=headers)
            assert reply.status_code == 400
            assert reply.json()["error"]["type"] == "invalid_request_error"
        assert server.requests == []


def test_tool_use_reply() -> None:
    reply, _ = _call(
        [
            {
                "content": [
                    {"type": "text", "text": "Noting that."},
                    {
                        "type": "tool_use",
                        "name": "core_memory_append",
                        "input": {"label": "notes", "content": "x"},
                    },
                ]
            }
        ]
    )
    assert reply.stop_reason == "tool_use"
    assert reply.tool_uses == [
        ToolUseBlock(
            id="toolu_scripted_0001",
            name="core_memory_append",
            input={"label": "notes", "content": "x"},
        )
    ]


@pytest.mark.parametrize(
    ("status", "kind", "headers", "retryable", "retry_after"),
    [
        (429, "rate_limit_error", {"retry-after": "7"}, True, 7.0),
        (529, "overloaded_error", {}, True, None),
        (500, "api_error", {}, True, None),
        (503, "api_error", {"retry-after": "0.5"}, True, 0.5),
        (408, "timeout_error", {}, True, None),
        (409, "conflict_error", {}, True, None),
        (400, "invalid_request_error", {}, False, None),
        (401, "authentication_error", {}, False, None),
        (403, "permission_error", {}, False, None),
        (404, "not_found_error", {}, False, None),
        (413, "request_too_large", {}, False, None),
    ],
)
def test_errors_are_classified_for_retry(
    status: int, kind: str, headers: dict[str, str], retryable: bool, retry_after: float | None
) -> None:
    script = [
        {"status": status, "error_type": kind, "message": f"scripted {status}", "headers": headers}
    ]
    with pytest.raises(ModelCallError) as info:
        _call(script)
    error = info.value
    assert (error.status, error.retryable, error.retry_after) == (status, retryable, retry_after)
    assert f"scripted {status}" in str(error)
    assert kind in str(error)


def test_sdk_retries_are_off() -> None:
    """One failing response is consumed once: the SDK did not retry behind our back."""
    script: list[dict[str, Any]] = [
        {"status": 529, "error_type": "overloaded_error"},
        {"text": "late"},
    ]
    with ScriptedModelServer(script) as server:
        model = AnthropicModel(base_url=server.url)
        with pytest.raises(ModelCallError):
            model.create(SETTINGS, "s", HELLO, [])
        assert len(server.requests) == 1
        assert model.create(SETTINGS, "s", HELLO, []).text == "late"


@pytest.mark.parametrize("keep_alive", [False, True])
def test_the_benchmarks_server_keeps_connections_alive_as_the_api_does(keep_alive: bool) -> None:
    """The benchmarks' server (`keep_alive`) answers in HTTP/1.1 and the SDK's client sends
    every call on one connection, as with the Messages API, so no benchmark's floor pays a
    TCP connect per model call; the tests' server closes each one (HTTP/1.0)."""
    script: list[dict[str, Any]] = [{"text": f"reply {i}"} for i in range(3)]
    with ScriptedModelServer(script, keep_alive=keep_alive) as server:
        model = AnthropicModel(base_url=server.url)
        try:
            texts = [model.create(SETTINGS, "s", HELLO, []).text for _ in range(3)]
        finally:
            model.close()
        assert texts == ["reply 0", "reply 1", "reply 2"]
        assert server.connections_accepted == (1 if keep_alive else 3)


def test_exhausted_script_is_a_clear_non_retryable_error() -> None:
    with pytest.raises(
        ModelCallError,
        match="the script is exhausted: reply 1 was asked for, but the script has only 0 replies",
    ) as info:
        _call([])
    assert not info.value.retryable


def test_unreachable_server_is_retryable() -> None:
    with ScriptedModelServer([]) as server:
        url = server.url
    model = AnthropicModel(base_url=url, timeout_s=2)
    with pytest.raises(ModelCallError, match="cannot reach the model API") as info:
        model.create(SETTINGS, "s", HELLO, [])
    assert info.value.retryable


def test_no_key_and_no_base_url_says_how_to_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    with pytest.raises(ModelConfigError, match=r"set ANTHROPIC_API_KEY .* or ANTHROPIC_BASE_URL"):
        AnthropicModel()


def test_base_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with ScriptedModelServer([{"text": "from env"}]) as server:
        monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        assert AnthropicModel().create(SETTINGS, "s", HELLO, []).text == "from env"


def test_script_files(tmp_path: Any) -> None:
    good = tmp_path / "s.json"
    good.write_text('{"responses": [{"text": "a"}]}', encoding="utf-8")
    assert load_script(good) == [{"text": "a"}]
    bad = tmp_path / "b.json"
    bad.write_text('{"responses": 3}', encoding="utf-8")
    with pytest.raises(ScriptError, match="a script is a JSON list"):
        load_script(bad)
    with pytest.raises(ScriptError, match="cannot read the model script"):
        load_script(tmp_path / "missing.json")
