"""The model adapter: Claude through the official `anthropic` SDK.

The SDK's own retries are off (`max_retries=0`): whoever calls (a Temporal activity) owns
retries. Errors are classified once, here: 408, 409, 429, 5xx, overloaded and connection
errors are retryable (with the server's `retry-after` when it sends one); other 4xx are not.

Requests go out as laid out by the context compiler (`model_request`: system blocks and
messages with their cache breakpoints); each reply records the call's usage: uncached input,
cache writes (and of them, the 1-hour ones) and cache reads.
"""

import os
from typing import Any

import anthropic
import pydantic_core

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.models.blocks import ModelSettings
from durable_memory.models.llm import ChatMessage, ModelReply, TextBlock, ToolUseBlock

RETRYABLE_STATUS = frozenset({408, 409, 429})
DEFAULT_TIMEOUT_S = 120.0


class ModelConfigError(DurableMemoryError):
    """No way to reach a model was configured."""


class ModelCallError(DurableMemoryError):
    """A failed model call, classified for the caller's retry policy."""

    retryable_per_instance = True

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after


def _retry_after(headers: Any) -> float | None:
    value = headers.get("retry-after") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def classify(error: Exception) -> ModelCallError:
    """Turn an SDK exception into a ModelCallError that says whether to retry."""
    if isinstance(error, anthropic.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}
        detail = body.get("error", {}) if isinstance(body.get("error"), dict) else {}
        kind = detail.get("type", "")
        message = detail.get("message") or str(error)
        status = error.status_code
        retryable = status in RETRYABLE_STATUS or status >= 500 or kind == "overloaded_error"
        return ModelCallError(
            f"model API error {status} {kind}: {message}".replace("  ", " "),
            retryable=retryable,
            status=status,
            retry_after=_retry_after(error.response.headers),
        )
    if isinstance(error, anthropic.APIConnectionError):  # includes timeouts
        return ModelCallError(f"cannot reach the model API: {error}", retryable=True)
    return ModelCallError(f"model call failed: {error}", retryable=False)


class AnthropicModel:
    """Calls the Messages API. `ANTHROPIC_API_KEY` and `ANTHROPIC_BASE_URL` are respected."""

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        api_key = api_key or os.environ.get("ANTHROPIC_API_KEY")
        base_url = base_url or os.environ.get("ANTHROPIC_BASE_URL")
        if not api_key and not base_url:
            raise ModelConfigError(
                "no model configured: set ANTHROPIC_API_KEY to use Claude, or "
                "ANTHROPIC_BASE_URL to point at a Messages API server (such as the scripted "
                "model server `dmem scripted-model`)"
            )
        self.base_url = base_url
        self._client = anthropic.Anthropic(
            # A local Messages API server (the scripted one) needs no key, but the SDK wants one.
            api_key=api_key or "no-key-local-server",
            base_url=base_url,
            max_retries=0,
            timeout=timeout_s,
        )

    def create(
        self,
        settings: ModelSettings,
        system: str | list[TextBlock],
        messages: list[ChatMessage],
        tools: list[dict[str, Any]],
    ) -> ModelReply:
        # The body encoded here, in one pass (pydantic-core), and sent through the SDK's own
        # `post` (its documented way for a raw request: the same client, headers, timeout and
        # errors, and the reply parsed into its `Message`). `messages.create` would first walk
        # and copy every block of the conversation twice (its params transform, then its
        # request preparation): a third of the model step of a long conversation.
        body: dict[str, Any] = {
            "model": settings.name,
            "max_tokens": settings.max_tokens,
            "system": system,
            "messages": messages,
            "tools": tools,
        }
        if settings.temperature is not None:
            # The SDK dropped the keyword; the API still takes it for models that allow it.
            body["temperature"] = settings.temperature
        try:
            response = self._client.post(
                "/v1/messages", cast_to=anthropic.types.Message, content=pydantic_core.to_json(body)
            )
        except anthropic.AnthropicError as error:
            raise classify(error) from None
        content: list[TextBlock | ToolUseBlock] = []
        for block in response.content:
            if block.type == "text":
                content.append(TextBlock(text=block.text))
            elif block.type == "tool_use":
                content.append(ToolUseBlock(id=block.id, name=block.name, input=dict(block.input)))
        usage = response.usage
        by_ttl = usage.cache_creation
        return ModelReply(
            content=content,
            stop_reason=response.stop_reason,
            model=response.model,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_creation_input_tokens=usage.cache_creation_input_tokens or 0,
            cache_read_input_tokens=usage.cache_read_input_tokens or 0,
            cache_write_1h_tokens=by_ttl.ephemeral_1h_input_tokens if by_ttl else 0,
        )

    def close(self) -> None:
        self._client.close()
