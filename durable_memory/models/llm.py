"""Messages API content as it crosses boundaries (activity I/O, recall, the scripted server)."""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

CacheTTL = Literal["5m", "1h"]
"""How long a prompt-cache entry lives after its last use (Anthropic: 5 minutes by default)."""


class CacheControl(BaseModel):
    """A prompt-cache breakpoint: the request's prefix through the block that carries it is
    cached (Anthropic's `cache_control`)."""

    model_config = ConfigDict(frozen=True)

    type: Literal["ephemeral"] = "ephemeral"
    ttl: CacheTTL = "5m"


class _Block(BaseModel):
    """A content block."""

    model_config = ConfigDict(frozen=True)


def _none(value: object) -> bool:
    return value is None


CacheMarker = Annotated[CacheControl | None, Field(exclude_if=_none)]
"""A block's `cache_control`: serialised only when set, so a block without a breakpoint has
the same bytes it always had (in recall, stored contexts and requests). A field-level rule,
not a serializer around the whole block: a context's thousands of blocks are dumped in
pydantic's core, without a Python call per block."""


class TextBlock(_Block):
    type: Literal["text"] = "text"
    text: str
    cache_control: CacheMarker = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheMarker = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str
    is_error: bool = False
    cache_control: CacheMarker = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True)

    role: Literal["user", "assistant"]
    content: list[ContentBlock]


CACHE_TTL_SECONDS: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
MAX_CACHE_BREAKPOINTS = 4
"""Blocks with `cache_control` one request may carry (the top-level automatic one included);
the API refuses a request with more."""
CACHE_LOOKBACK_BLOCKS = 20
"""How many blocks before a breakpoint the API looks back for an earlier cache entry."""
DEFAULT_MIN_CACHEABLE_TOKENS = 1024
MIN_CACHEABLE_TOKENS: tuple[tuple[str, int], ...] = (
    # Anthropic's prompt-caching docs: a shorter prefix is processed without caching, and
    # without an error. First matching model-name prefix wins; others get the default.
    ("claude-opus-4-5", 4096),
    ("claude-opus-4-6", 4096),
    ("claude-opus-4-7", 4096),
    ("claude-haiku-4-5", 4096),
    ("claude-3-5-haiku", 2048),
    ("claude-haiku-3-5", 2048),
    ("claude-3-haiku", 2048),
)


def min_cacheable_tokens(model: str) -> int:
    """The shortest prefix (in tokens) `model` caches at a breakpoint."""
    return next(
        (n for prefix, n in MIN_CACHEABLE_TOKENS if model.startswith(prefix)),
        DEFAULT_MIN_CACHEABLE_TOKENS,
    )


class CostFactors(BaseModel):
    """Input tokens priced relative to an uncached one (Anthropic's prompt-caching prices)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uncached: float = Field(default=1.0, ge=0)
    cache_write_5m: float = Field(default=1.25, ge=0)
    cache_write_1h: float = Field(default=2.0, ge=0)
    cache_read: float = Field(default=0.1, ge=0)


class TokenUsage(BaseModel):
    """The input of one or more model calls as the API reports it: uncached input, tokens
    written to the prompt cache (by TTL) and tokens read from it, and the output."""

    model_config = ConfigDict(frozen=True)

    input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_write_1h_tokens: int = 0
    """Of cache_creation_input_tokens, those written with the 1-hour TTL."""
    output_tokens: int = 0
    calls: int = 0

    def __add__(self, other: "TokenUsage") -> "TokenUsage":
        return TokenUsage(
            **{name: getattr(self, name) + getattr(other, name) for name in TokenUsage.model_fields}
        )

    @property
    def total_input_tokens(self) -> int:
        return self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens

    def describe(self, factors: CostFactors) -> str:
        """One line: the calls' input and its cost (`dmem context`, a turn's details)."""
        return (
            f"{self.calls} model call(s): input {self.input_tokens} uncached, "
            f"{self.cache_creation_input_tokens} written to the cache, "
            f"{self.cache_read_input_tokens} read from it; output {self.output_tokens}; "
            f"cost {self.input_equivalents(factors):.0f} input-token equivalents"
        )

    def input_equivalents(self, factors: CostFactors) -> float:
        """The input's cost in uncached input tokens."""
        written_5m = self.cache_creation_input_tokens - self.cache_write_1h_tokens
        return (
            self.input_tokens * factors.uncached
            + written_5m * factors.cache_write_5m
            + self.cache_write_1h_tokens * factors.cache_write_1h
            + self.cache_read_input_tokens * factors.cache_read
        )


class ModelRequest(BaseModel):
    """What one model call sends besides the model's settings: laid out by the context
    compiler (memory/agent/context.py: `model_request`), sent as it is by the adapter."""

    model_config = ConfigDict(frozen=True)

    system: list[TextBlock]
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]


class ModelReply(BaseModel):
    model_config = ConfigDict(frozen=True)

    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None
    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_write_1h_tokens: int = 0
    """The cache numbers are 0 in a reply stored before replies recorded them."""

    @property
    def text(self) -> str:
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def usage(self) -> TokenUsage:
        return TokenUsage(
            input_tokens=self.input_tokens,
            cache_creation_input_tokens=self.cache_creation_input_tokens,
            cache_read_input_tokens=self.cache_read_input_tokens,
            cache_write_1h_tokens=self.cache_write_1h_tokens,
            output_tokens=self.output_tokens,
            calls=1,
        )

    @property
    def tool_uses(self) -> list[ToolUseBlock]:
        return [b for b in self.content if isinstance(b, ToolUseBlock)]
