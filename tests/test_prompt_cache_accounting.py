"""The scripted server's usage, by Anthropic's documented prompt-caching rules, through the SDK.

Prefix hashing in tools -> system -> messages order up to each breakpoint, the model's minimum
cacheable length, the lookback window, TTL expiry and refresh, and the 400s the API answers
for too many breakpoints or a 1-hour one after a 5-minute one.
"""

from collections.abc import Iterator
from typing import Any, cast

import anthropic
import pytest

from durable_memory.models.llm import CACHE_LOOKBACK_BLOCKS, TokenUsage, min_cacheable_tokens
from durable_memory.scripted_model import USAGE_HEADER, ScriptedModelServer, cache_blocks

SONNET = "claude-sonnet-4-6"
EPHEMERAL = {"type": "ephemeral"}
LONG = "The essay's thesis needs a sharper claim. " * 150
"""Well over the 1024 tokens Sonnet caches at least."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server(clock: Clock) -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer([], respond=lambda _: {"text": "ok"}, clock=clock) as running:
        yield running


@pytest.fixture
def client(server: ScriptedModelServer) -> Iterator[anthropic.Anthropic]:
    sdk = anthropic.Anthropic(api_key="none", base_url=server.url, max_retries=0)
    yield sdk
    sdk.close()


def _system(marker: dict[str, str] | None = EPHEMERAL, text: str = LONG) -> list[dict[str, Any]]:
    block: dict[str, Any] = {"type": "text", "text": text}
    return [block | {"cache_control": marker}] if marker else [block]


def _user(*texts: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": t} for t in texts]}


def _send(client: anthropic.Anthropic, model: str = SONNET, **request: Any) -> TokenUsage:
    """The usage of one request, its TTL breakdown checked against its total."""
    request.setdefault("messages", [_user("Hello")])
    api = cast(Any, client.messages)  # plain JSON requests; the TypedDict overloads add nothing
    usage: anthropic.types.Usage = api.create(model=model, max_tokens=64, **request).usage
    assert usage.cache_creation is not None
    written = usage.cache_creation_input_tokens or 0
    by_ttl = usage.cache_creation
    assert by_ttl.ephemeral_5m_input_tokens + by_ttl.ephemeral_1h_input_tokens == written
    return TokenUsage(
        input_tokens=usage.input_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=usage.cache_read_input_tokens or 0,
        cache_write_1h_tokens=by_ttl.ephemeral_1h_input_tokens,
    )


def _tokens(model: str = SONNET, **request: Any) -> list[int]:
    """Each block's tokens as the server counts them (its local estimate)."""
    request.setdefault("messages", [_user("Hello")])
    return [b.tokens for b in cache_blocks({"model": model, **request})]


def test_a_breakpoint_writes_its_prefix_once_and_later_requests_read_it(
    client: anthropic.Anthropic,
) -> None:
    system_tokens, message_tokens = _tokens(system=_system())
    first = _send(client, system=_system())
    assert (first.cache_creation_input_tokens, first.cache_read_input_tokens) == (system_tokens, 0)
    assert first.input_tokens == message_tokens
    assert first.cache_write_1h_tokens == 0
    second = _send(client, system=_system(), messages=[_user("Another question")])
    assert (second.cache_creation_input_tokens, second.cache_read_input_tokens) == (
        0,
        system_tokens,
    )


def test_the_response_says_its_usage_is_computed_by_the_documented_rules(
    client: anthropic.Anthropic,
) -> None:
    raw = client.messages.with_raw_response.create(
        model=SONNET, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    )
    assert raw.headers.get(USAGE_HEADER[0]) == USAGE_HEADER[1]


def test_a_prefix_below_the_models_minimum_is_not_cached_and_not_an_error(
    client: anthropic.Anthropic,
) -> None:
    short = _system(text="Be brief.")
    for _ in range(2):
        usage = _send(client, system=short)
        assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == (0, 0)
    assert usage.input_tokens == sum(_tokens(system=short))


def test_the_minimum_depends_on_the_model(client: anthropic.Anthropic) -> None:
    assert min_cacheable_tokens("claude-haiku-4-5") == 4096
    assert min_cacheable_tokens("claude-opus-4-5-20251101") == 4096
    assert min_cacheable_tokens(SONNET) == 1024
    # LONG is above Sonnet's minimum and below Haiku 4.5's.
    assert 1024 <= _tokens(system=_system())[0] < 4096
    haiku = _send(client, model="claude-haiku-4-5", system=_system())
    assert haiku.cache_creation_input_tokens == 0


def test_order_is_tools_then_system_then_messages(client: anthropic.Anthropic) -> None:
    tool = {"name": "lookup", "description": LONG, "input_schema": {"type": "object"}}
    marked_tool = tool | {"cache_control": EPHEMERAL}
    tool_tokens = _tokens(tools=[tool], system=_system(None))[0]
    _send(client, tools=[marked_tool], system=_system(None, "v1"))
    # A different system prompt after the tools: the tools' entry still reads.
    usage = _send(client, tools=[marked_tool], system=_system(None, "v2"))
    assert usage.cache_read_input_tokens == tool_tokens
    # A different tool before the same system: nothing reads.
    other = marked_tool | {"description": LONG + "!"}
    usage = _send(client, tools=[other], system=_system(None, "v2"))
    assert usage.cache_read_input_tokens == 0


def test_a_change_before_a_breakpoint_invalidates_it_and_the_model_is_part_of_the_key(
    client: anthropic.Anthropic,
) -> None:
    _send(client, system=_system())
    changed = _send(client, system=_system(text=LONG + "."))
    assert changed.cache_read_input_tokens == 0
    assert changed.cache_creation_input_tokens > 0
    other_model = _send(client, model="claude-opus-4-1", system=_system())
    assert other_model.cache_read_input_tokens == 0


def test_the_conversation_breakpoint_reads_the_last_entry_within_the_lookback(
    client: anthropic.Anthropic,
) -> None:
    def conversation(turns: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        for n in range(turns):
            messages += [_user(f"question {n}"), {"role": "assistant", "content": f"answer {n}"}]
        messages.append(_user(f"question {turns}"))
        last = messages[-1]["content"][-1]
        last["cache_control"] = EPHEMERAL
        return messages

    _send(client, system=_system(None), messages=conversation(1))
    grown = _send(client, system=_system(None), messages=conversation(2))
    earlier = sum(_tokens(system=_system(None), messages=conversation(1)))
    assert grown.cache_read_input_tokens == earlier
    # Grown by more blocks than the lookback window: the old entry is out of reach.
    far = conversation(2 + CACHE_LOOKBACK_BLOCKS)
    assert _send(client, system=_system(None), messages=far).cache_read_input_tokens == 0


def test_an_entry_expires_after_its_ttl_and_a_read_refreshes_it(
    client: anthropic.Anthropic, clock: Clock
) -> None:
    _send(client, system=_system())
    clock.now += 299
    assert _send(client, system=_system()).cache_read_input_tokens > 0
    clock.now += 299  # 598 s after the write, 299 s after the read that refreshed it
    assert _send(client, system=_system()).cache_read_input_tokens > 0
    clock.now += 301
    expired = _send(client, system=_system())
    assert (expired.cache_read_input_tokens, expired.cache_creation_input_tokens > 0) == (0, True)


def test_a_one_hour_entry_outlives_five_minutes(client: anthropic.Anthropic, clock: Clock) -> None:
    hour = _system({"type": "ephemeral", "ttl": "1h"})
    first = _send(client, system=hour)
    assert first.cache_write_1h_tokens == first.cache_creation_input_tokens > 0
    clock.now += 3000
    assert _send(client, system=hour).cache_read_input_tokens > 0
    clock.now += 3601
    assert _send(client, system=hour).cache_read_input_tokens == 0


def test_the_top_level_marker_is_a_breakpoint_on_the_last_block(
    client: anthropic.Anthropic,
) -> None:
    messages = [_user(LONG)]
    first = _send(client, messages=messages, extra_body={"cache_control": EPHEMERAL})
    assert first.cache_creation_input_tokens == sum(_tokens(messages=messages))
    assert first.input_tokens == 0


def test_more_than_four_breakpoints_is_refused_like_the_api(
    client: anthropic.Anthropic, server: ScriptedModelServer
) -> None:
    system = [{"type": "text", "text": f"part {n}", "cache_control": EPHEMERAL} for n in range(4)]
    _send(client, system=system)  # four: accepted
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks"):
        _send(client, system=system, extra_body={"cache_control": EPHEMERAL})
    assert len(server.requests) == 1


def test_a_one_hour_breakpoint_after_a_five_minute_one_is_refused(
    client: anthropic.Anthropic,
) -> None:
    system = [
        {"type": "text", "text": "a", "cache_control": EPHEMERAL},
        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    with pytest.raises(anthropic.BadRequestError, match="ttl '1h' must not come after"):
        _send(client, system=system)
