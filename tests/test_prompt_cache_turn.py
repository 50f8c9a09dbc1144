"""A turn's cache usage where people see it: the reply (`TurnReply.usage` and its cost in
input-token equivalents), the turn's current details in the Temporal UI, `dmem context`;
and, with ANTHROPIC_API_KEY set, a live leg comparing the scripted server's accounting with
the API's on the same short conversation (`dmem context` is tested in test_cli.py)."""

import contextlib
import os
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.store.db import make_engine
from durable_memory.models.llm import CostFactors, TokenUsage
from durable_memory.models.turn import TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import agent_test_profile, run_turn_steps, turn_steps
from tests.support.memory import memory_rig
from tests.support.temporal_helpers import current_details, rig_settings, running_rig


async def test_the_reply_and_the_details_show_the_turns_usage_and_cost(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, [{"text": "a"}, {"text": "b"}]) as rig:
        first = await rig.client.send_message("ann", "Hello, I am Ann")
        second = await rig.client.send_message("ann", "Still me")
        handle = temporal_env.client.get_workflow_handle(second.workflow_id)
        details = await current_details(handle)
    assert (first.usage.calls, second.usage.calls) == (1, 1)
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens > 0
    # The second turn reads everything the first one cached.
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert second.input_equivalents == second.usage.input_equivalents(CostFactors())
    assert second.input_equivalents < 0.5 * second.usage.total_input_tokens
    assert "**Tokens**: 1 model call(s)" in details
    assert f"{second.usage.cache_read_input_tokens} read from it" in details


LIVE_MODEL = os.environ.get("DMEM_LIVE_MODEL", "claude-sonnet-4-6")


@pytest.mark.skipif(
    not os.environ.get("ANTHROPIC_API_KEY"), reason="the live leg needs ANTHROPIC_API_KEY"
)
def test_live_api_and_scripted_server_agree_on_what_is_cached(tmp_path: Path) -> None:
    """Three turns against Claude and against the scripted server: both write on the first
    call and read the previous turn's prefix after it (token counts differ: cl100k is an
    estimate of Claude's tokenizer, so only the pattern and the rough size are compared)."""
    usages: dict[str, list[TokenUsage]] = {}
    for leg in ("scripted", "live"):
        engine = make_engine(f"sqlite:///{tmp_path / leg / 'm.db'}")
        memory = memory_rig(engine, tmp_path / leg, agent_test_profile(name=LIVE_MODEL))
        memory.blocks.ensure_user("alice")
        with contextlib.ExitStack() as stack:
            if leg == "scripted":
                server = stack.enter_context(ScriptedModelServer([{"text": "ok"}] * 3))
                model = AnthropicModel(base_url=server.url)
            else:
                model = AnthropicModel(base_url="https://api.anthropic.com")
            stack.callback(model.close)
            steps = turn_steps(memory, engine, model)
            usages[leg] = [
                run_turn_steps(
                    steps, TurnInput(user_id="alice", turn_id=f"t{n}", message=f"Say ok ({n})"), 1
                ).usage[0]
                for n in range(3)
            ]
        engine.dispose()
    for leg, usage in usages.items():
        assert usage[0].cache_creation_input_tokens > 0, (leg, usage)
        assert all(u.cache_read_input_tokens > 0 for u in usage[1:]), (leg, usage)
    scripted, live = usages["scripted"][1], usages["live"][1]
    assert 0.5 < scripted.cache_read_input_tokens / live.cache_read_input_tokens < 2.0
