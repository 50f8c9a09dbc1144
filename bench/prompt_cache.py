"""What a conversation's input costs with Anthropic's prompt cache: 40 turns of the
essay-coach profile (a tool call every 3rd turn, an approved memory edit every 5th), in
input-token equivalents per turn. The conversation runs twice, with the same script: with
the memory update (the profile's default: the system prompt keeps the prompt base's blocks,
blocks changed since come before the turn note) and without it (`memory_delta = false`:
every turn shows HEAD's blocks in the system prompt). Priced:

- uncached: main's layout before prompt caching (the per-turn metadata inside the system
  prompt, no breakpoints), made from the second run's requests: every input token at 1x;
- per_turn: the second run as sent, priced from the usage the scripted server reports by
  Anthropic's documented caching rules (scripted_model.py);
- cached: the first run as sent (memory/agent/context.py, `model_request`), priced the same;
- floor: each block of the second run's requests (a tool, a system block, a message's
  content block) that an earlier request had read, every other block written once;
- prefix_floor: every prefix of the first run's requests an earlier request had read.

Tokens are the local estimate (cl100k), the same for all three; the prices are the
configured cost factors (Anthropic's: write 1.25x, read 0.1x).

    .venv/bin/python -m bench.prompt_cache [--turns 40] [--out bench/results/prompt_cache.json]
"""

import argparse
import hashlib
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from bench.common import describe, machine
from bench.context_compile import WORDS
from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.memory.agent.context import MEMORY_UPDATE_START, TURN_NOTE_START
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.agent.steps import TurnSteps
from durable_memory.memory.core.profiles import load_profile
from durable_memory.models.llm import CostFactors, TokenUsage
from durable_memory.models.turn import FinishInput, StepInput, TurnInput
from durable_memory.scripted_model import ScriptedModelServer, cache_blocks

USER = "bench"
TOOL_EVERY, EDIT_EVERY = 3, 5


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words)).capitalize() + "."


def _replies(turn: int, rng: random.Random) -> list[dict[str, Any]]:
    """The scripted model's replies for one turn: a tool call or an edit first, when due."""
    calls: list[dict[str, Any]] = []
    if turn % TOOL_EVERY == 0:
        query = {"query": rng.choice(WORDS), "limit": 3}
        calls.append({"type": "tool_use", "name": "conversation_search", "input": query})
    if turn % EDIT_EVERY == 0:
        fact = {
            "label": "human",
            "operation": "learn_fact",
            "value": f"Fact {turn}: {_prose(rng, 8)}",
            "reasoning": "said so",
        }
        calls.append({"type": "tool_use", "name": "edit_memory_block", "input": fact})
    first = [{"content": calls}] if calls else []
    return [*first, {"text": _prose(rng, rng.randint(90, 160))}]


def _main_layout(body: dict[str, Any]) -> dict[str, Any]:
    """The same request as main laid it out: the turn note back inside the system prompt
    (after the memory blocks, before the summary), no breakpoints. From a request without a
    memory update, whose system prompt shows HEAD's blocks."""
    messages = [dict(m) for m in body["messages"]]
    last = messages[-1]["content"]
    note = last[-1]["text"]
    assert note.startswith(TURN_NOTE_START)
    assert not any(b.get("text", "").startswith(MEMORY_UPDATE_START) for b in last)
    messages[-1]["content"] = last[:-1]
    if not messages[-1]["content"]:
        messages.pop()
    sections = [b["text"] for b in body["system"]]
    system = "\n\n".join([*sections[:2], note, *sections[2:]])
    return {"model": body["model"], "tools": body["tools"], "system": system, "messages": messages}


class Floor:
    """The floor: a block (a tool, a system block, a message's content block) any earlier
    request had is read wherever it sits, every other block written once. A prefix cache
    cannot reach it when something early changes (an approved edit changes the memory
    blocks, so the conversation after them is written again); `prefix_cost` is the best a
    prefix cache can do with each request's content in its order."""

    def __init__(self, factors: CostFactors) -> None:
        self.factors = factors
        self.blocks: set[str] = set()
        self.prefixes: set[str] = set()

    def _price(self, written: int, read: int) -> float:
        return written * self.factors.cache_write_5m + read * self.factors.cache_read

    def cost(self, body: dict[str, Any]) -> tuple[float, float]:
        """(the floor, the prefix floor) of one request."""
        digest = hashlib.sha256(str(body["model"]).encode())
        total = known = shared = 0
        for block in cache_blocks(body):
            digest.update(block.key.encode())
            total += block.tokens
            known += block.tokens if block.key in self.blocks else 0
            prefix = digest.hexdigest()
            if prefix in self.prefixes and shared == total - block.tokens:
                shared = total
            self.blocks.add(block.key)
            self.prefixes.add(prefix)
        return self._price(total - known, known), self._price(total - shared, shared)


def _tokens(body: dict[str, Any]) -> int:
    return sum(b.tokens for b in cache_blocks(body))


def _turn(steps: TurnSteps, turn: int, message: str) -> tuple[list[TokenUsage], list[str]]:
    """One turn through the same steps TurnWorkflow runs: each call's usage, the diffs."""
    turn_id = f"t{turn:03d}"
    steps.prepare(TurnInput(user_id=USER, turn_id=turn_id, message=message))
    usage, diffs = [], []
    for step in range(1, 9):
        where = StepInput(user_id=USER, turn_id=turn_id, step=step)
        result = steps.call_model(where)
        usage.append(result.usage)
        if result.tool_calls == 0:
            break
        diffs += steps.run_tools(where).diff_ids
    steps.finish(
        FinishInput(
            user_id=USER, turn_id=turn_id, diff_ids=diffs, stopped_at_step_limit=False, max_steps=8
        )
    )
    return usage, diffs


def _conversation(turns: int, memory_delta: bool, seed: int) -> list[dict[str, Any]]:
    """Each turn's requests and usage, with the prompt base's memory update or without."""
    rng = random.Random(seed)
    essay_coach = load_profile("essay_coach")
    model_settings = essay_coach.model.model_copy(update={"memory_delta": memory_delta})
    profile = essay_coach.model_copy(update={"model": model_settings})
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, ScriptedModelServer([]) as server:
        stack: MemoryStack = open_stack(Path(tmp), profile=profile)
        stack.blocks.ensure_user(USER)
        model = AnthropicModel(base_url=server.url)
        try:
            steps = stack.turn_steps(model)
            for turn in range(1, turns + 1):
                server.extend(_replies(turn, rng))
                before = len(server.requests)
                usage, diffs = _turn(steps, turn, _prose(rng, rng.randint(30, 90)))
                for diff in diffs:  # a person approves the edit before the next turn
                    stack.review.approve(diff, "reviewer", user_id=USER)
                context = stack.turns.context(USER, f"t{turn:03d}")
                out.append(
                    {
                        "requests": server.requests[before:],
                        "usage": sum(usage, TokenUsage()),
                        "approved_edits": len(diffs),
                        "memory_update_tokens": context.overview.memory_update_tokens,
                    }
                )
        finally:
            model.close()
            stack.close()
    return out


def run(turns: int, factors: CostFactors, seed: int = 19) -> dict[str, Any]:
    floor, delta_floor = Floor(factors), Floor(factors)
    rows: list[dict[str, Any]] = []
    with_update = _conversation(turns, True, seed)
    per_turn = _conversation(turns, False, seed)
    for turn, (new, old) in enumerate(zip(with_update, per_turn, strict=True), start=1):
        total: TokenUsage = new["usage"]
        rows.append(
            {
                "turn": turn,
                "requests": len(new["requests"]),
                "approved_edits": new["approved_edits"],
                "memory_update_tokens": new["memory_update_tokens"],
                "input_tokens": total.total_input_tokens,
                "uncached": float(sum(_tokens(_main_layout(r)) for r in old["requests"])),
                "per_turn": old["usage"].input_equivalents(factors),
                "cached": total.input_equivalents(factors),
                "floor": sum(floor.cost(r)[0] for r in old["requests"]),
                "prefix_floor": sum(delta_floor.cost(r)[1] for r in new["requests"]),
                "usage": total.model_dump(),
            }
        )
    kinds = ("uncached", "per_turn", "cached", "floor", "prefix_floor")
    totals = {key: sum(r[key] for r in rows) for key in kinds}
    return {
        "turns": rows,
        "totals": totals,
        "requests": sum(r["requests"] for r in rows),
        "cached_over_floor": totals["cached"] / totals["floor"],
        "cached_over_prefix_floor": totals["cached"] / totals["prefix_floor"],
        "cached_over_uncached": totals["cached"] / totals["uncached"],
        "per_turn_over_floor": totals["per_turn"] / totals["floor"],
        "per_turn_over_uncached": totals["per_turn"] / totals["uncached"],
        "uncached_over_floor": totals["uncached"] / totals["floor"],
        "cost_factors": factors.model_dump(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    info = machine()
    print(f"machine: {describe(info)}")
    results = run(args.turns, CostFactors())
    t = results["totals"]
    print(
        f"{args.turns} turns, {results['requests']} requests, input-token equivalents: "
        f"uncached {t['uncached']:.0f}, per-turn layout {t['per_turn']:.0f}, "
        f"cached {t['cached']:.0f}, floor {t['floor']:.0f}; "
        f"cached/floor {results['cached_over_floor']:.2f} (goal <= 1.25), cached/prefix floor "
        f"{results['cached_over_prefix_floor']:.2f}, "
        f"cached/uncached {results['cached_over_uncached']:.2f} (goal <= 0.2), "
        f"uncached/floor {results['uncached_over_floor']:.1f}; per-turn layout: "
        f"{results['per_turn_over_floor']:.2f}x floor, {results['per_turn_over_uncached']:.2f}x "
        "uncached"
    )
    if args.out:
        args.out.write_text(json.dumps({"machine": info, **results}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
