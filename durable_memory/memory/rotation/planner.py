"""Planning a rotation: how full each block is, whether its strategy says to rotate it, and
what the rotation would archive and commit (a `RotationPlan`). Reads only; the steps that
write are in steps.py."""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict

from durable_memory.memory.core.blocks import render_value, validate_fields, value_lines
from durable_memory.memory.core.formats import to_toml
from durable_memory.memory.core.ids import validate_label, validate_user_id
from durable_memory.memory.rotation.strategies import (
    AdaptiveRotation,
    AggressiveRotation,
    PreservativeRotation,
    RotationStrategy,
)
from durable_memory.memory.service.access import Block
from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.store.rotation_state import RotationStateStore
from durable_memory.models.blocks import BlockFields, BlockKind, BlockSpec, RotationStrategyName

DEFAULT_TARGET_RATIO = 0.5
"""After compression a block holds at most this share of its limit."""


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class BlockUsage:
    chars: int
    limit: int

    @property
    def usage(self) -> float:
        return self.chars / self.limit


@dataclass(frozen=True)
class ContextMetrics:
    """ContextMetrics of the seed 000_d8598551964ab573.txt, for every block of a profile."""

    blocks: dict[str, BlockUsage]

    def usage(self, label: str) -> float:
        return self.blocks[label].usage

    @property
    def persona_usage(self) -> float:
        return self.usage("persona")

    @property
    def human_usage(self) -> float:
        return self.usage("human")

    @property
    def total_usage(self) -> float:
        total_limit = sum(b.limit for b in self.blocks.values())
        return sum(b.chars for b in self.blocks.values()) / total_limit if total_limit else 0.0


def context_metrics(blocks: dict[str, Block]) -> ContextMetrics:
    return ContextMetrics(
        {label: BlockUsage(len(b.value), b.spec.limit) for label, b in blocks.items()}
    )


class RotationCheck(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
    usage: float
    threshold: float
    strategy: RotationStrategyName
    should_rotate: bool


class RotationPlan(BaseModel):
    """Everything both steps need; small enough to travel between Temporal activities."""

    model_config = ConfigDict(frozen=True)

    user_id: str
    label: str
    base_sha: str
    strategy: RotationStrategyName
    usage: float
    threshold: float
    archive_text: str
    dedupe_key: str
    compressed_toml: str
    chars_before: int
    chars_after: int
    planned_at: datetime


def archive_header(when: datetime) -> str:
    """The archival header of the seed 000_d8598551964ab573.txt."""
    return f"[ARCHIVED {when.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%S')}]"


class RotationPlanner:
    """Checks blocks against their strategy's threshold and plans their rotation."""

    def __init__(
        self,
        blocks: Blocks,
        states: RotationStateStore,
        target_ratio: float = DEFAULT_TARGET_RATIO,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        if not 0.05 <= target_ratio <= 1.0:
            raise ValueError(f"target ratio must be within [0.05, 1], got {target_ratio}")
        self.blocks = blocks
        self.states = states
        self.target_ratio = target_ratio
        self.clock = clock
        """When a new plan is made: its archive header, and the bound of the walk that finds
        its commit."""

    def strategy(self, user_id: str, spec: BlockSpec) -> RotationStrategy:
        if spec.rotation is RotationStrategyName.AGGRESSIVE:
            return AggressiveRotation()
        if spec.rotation is RotationStrategyName.PRESERVATIVE:
            return PreservativeRotation()
        saved = self.states.load(user_id, spec.label)
        return AdaptiveRotation(*saved) if saved else AdaptiveRotation()

    def metrics(self, user_id: str) -> ContextMetrics:
        return context_metrics(self.blocks.read_blocks(user_id))

    def check(self, user_id: str, label: str) -> RotationCheck:
        """Is the block over its threshold? The adaptive strategy learns from every check."""
        block = self.blocks.read_block(validate_user_id(user_id), validate_label(label))
        strategy = self.strategy(user_id, block.spec)
        usage = len(block.value) / block.spec.limit
        if isinstance(strategy, AdaptiveRotation):
            strategy.observe(usage)
            self.states.save(user_id, label, strategy.threshold, strategy.history)
        return RotationCheck(
            user_id=user_id,
            label=label,
            usage=round(usage, 4),
            threshold=strategy.threshold,
            strategy=strategy.name,
            should_rotate=strategy.should_rotate(usage),
        )

    def _compressed(self, strategy: RotationStrategy, block: Block) -> BlockFields:
        spec, target = block.spec, max(1, int(block.spec.limit * self.target_ratio))
        if spec.kind is BlockKind.TEXT:
            return validate_fields(spec, {"value": strategy.compress(block.value, target)})
        lines = value_lines(spec, block.fields)
        required = {f.name for f in spec.fields if f.required}
        forced = {i for i, line in enumerate(lines) if set(line.fields) & required}
        keep = strategy.select_lines([line.text for line in lines], target, forced)
        dropped = {name for i, line in enumerate(lines) if i not in keep for name in line.fields}
        new = dict(block.fields)
        for field in spec.fields:
            if field.name in dropped:
                new[field.name] = [] if isinstance(new[field.name], list) else None
        return validate_fields(spec, new)

    def plan(
        self,
        user_id: str,
        label: str,
        *,
        force: bool = False,
        at_sha: str | None = None,
        planned_at: datetime | None = None,
    ) -> RotationPlan | None:
        """What rotating the block now would do; None if it is under its threshold, empty, or
        already within the compression target. Reads only: nothing changes until `archive_step`
        and `commit_step`. `at_sha` and `planned_at` re-derive the plan of an earlier check (a
        Temporal activity holds only the ticket between steps): the same text to archive, the
        same header, the same bound for the walk that finds its commit, whenever a step runs."""
        validate_user_id(user_id)
        block = (
            self.blocks.read_block_at(user_id, validate_label(label), at_sha)
            if at_sha
            else self.blocks.read_block(user_id, validate_label(label))
        )
        if block.sha is None or not block.value:
            return None
        strategy = self.strategy(user_id, block.spec)
        usage = len(block.value) / block.spec.limit
        if not force and not strategy.should_rotate(usage):
            return None
        compressed = self._compressed(strategy, block)
        if compressed == block.fields:
            return None  # already within the target: rotating would archive and change nothing
        now = planned_at or self.clock()
        return RotationPlan(
            user_id=user_id,
            label=label,
            base_sha=block.sha,
            strategy=strategy.name,
            usage=round(usage, 4),
            threshold=strategy.threshold,
            archive_text=f"{archive_header(now)}\n{block.value}",
            dedupe_key=f"{label}@{block.sha}\n{block.value}",
            compressed_toml=to_toml(block.spec, compressed),
            chars_before=len(block.value),
            chars_after=len(render_value(block.spec, compressed)),
            planned_at=now,
        )
