"""Rotation: when a block grows past its threshold, its full text goes to archival memory and a
compressed version is committed. The seed's three strategies decide when and what to keep.

A rotation is two idempotent steps, in this order, so nothing is ever lost:
1. archive the full pre-rotation text (`[ARCHIVED <time>]` + the block's value); the passage
   id derives from the block's content at its commit, so a repeat stores nothing new;
2. commit the compressed block, with a `Rotation-Of: <label>@<base sha>` trailer; a repeat
   finds that commit and returns it; a block changed since the plan is left alone.
The pre-rotation text is also in git history (the base commit) before step 2 runs.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.core.blocks import render_value, validate_fields, value_lines
from durable_memory.memory.core.formats import from_toml, to_toml
from durable_memory.memory.core.ids import validate_label, validate_user_id
from durable_memory.memory.rotation.state import RotationStateStore
from durable_memory.memory.service import Block, MemoryService
from durable_memory.memory.store.git import format_message
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.blocks import BlockFields, BlockKind, BlockSpec, RotationStrategyName
from durable_memory.models.history import Author, AuthorKind

DEFAULT_TARGET_RATIO = 0.5
"""After compression a block holds at most this share of its limit."""
ROTATION_AUTHOR = Author(name="rotation", kind=AuthorKind.ROTATION)
ADAPTIVE_HISTORY = 10
ADAPTIVE_MIN_OBSERVATIONS = 3


# -- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockUsage:
    chars: int
    limit: int

    @property
    def usage(self) -> float:
        return self.chars / self.limit


@dataclass(frozen=True)
class ContextMetrics:
    """The seed's ContextMetrics, for every block of a profile."""

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


# -- strategies ----------------------------------------------------------------------------


def _fit(text: str, target: int) -> str:
    return text if len(text) <= target else text[: max(0, target - 3)] + "..."


def _join(lines: Sequence[str], keep: set[int]) -> str:
    return "\n".join(line for i, line in enumerate(lines) if i in keep)


def _greedy(lines: Sequence[str], order: Sequence[int], target: int, forced: set[int]) -> set[int]:
    """Keep `forced`, then lines in `order` while the joined text stays within `target`."""
    keep = set(forced)
    size = sum(len(lines[i]) for i in keep) + max(0, len(keep) - 1)
    for i in order:
        if i in keep:
            continue
        cost = len(lines[i]) + (1 if keep else 0)
        if size + cost <= target:
            keep.add(i)
            size += cost
    return keep


class RotationStrategy(Protocol):
    name: RotationStrategyName

    @property
    def threshold(self) -> float: ...

    def should_rotate(self, usage: float) -> bool: ...

    def compress(self, content: str, target_chars: int) -> str:
        """Free text compressed to at most `target_chars`."""
        ...

    def select_lines(self, lines: Sequence[str], target_chars: int, forced: set[int]) -> set[int]:
        """Indices of the lines of a typed block to keep (always `forced`)."""
        ...


class AggressiveRotation:
    """Rotates early (70%) and keeps the most recent content."""

    name = RotationStrategyName.AGGRESSIVE
    threshold = 0.7

    def should_rotate(self, usage: float) -> bool:
        return usage >= self.threshold

    def compress(self, content: str, target_chars: int) -> str:
        if len(content) <= target_chars:
            return content
        return (
            "..." + content[-(target_chars - 3) :] if target_chars > 3 else content[-target_chars:]
        )

    def select_lines(self, lines: Sequence[str], target_chars: int, forced: set[int]) -> set[int]:
        return _greedy(lines, range(len(lines) - 1, -1, -1), target_chars, forced)


class PreservativeRotation:
    """Rotates late (90%) and keeps structured `[`-prefixed lines first."""

    name = RotationStrategyName.PRESERVATIVE
    threshold = 0.9

    def should_rotate(self, usage: float) -> bool:
        return usage >= self.threshold

    @staticmethod
    def _order(lines: Sequence[str]) -> list[int]:
        priority = [i for i, line in enumerate(lines) if line.startswith("[")]
        return priority + [i for i, line in enumerate(lines) if not line.startswith("[")]

    def compress(self, content: str, target_chars: int) -> str:
        lines = content.split("\n")
        order = self._order(lines)
        keep = _greedy(lines, order, target_chars, set())
        # Priority lines first, then the others, as the seed does.
        kept = [lines[i] for i in order if i in keep]
        return "\n".join(kept) if kept else _fit(lines[order[0]], target_chars)

    def select_lines(self, lines: Sequence[str], target_chars: int, forced: set[int]) -> set[int]:
        return _greedy(lines, self._order(lines), target_chars, forced)


def line_score(line: str) -> int:
    """The seed's AdaptiveRotation scores: [TASK] 100, [USER] 90, [CONTEXT] 80, [..] 50, else 10."""
    for tag, score in (("[TASK]", 100), ("[USER]", 90), ("[CONTEXT]", 80)):
        if line.startswith(tag):
            return score
    return 50 if line.startswith("[") and "]" in line else 10


class AdaptiveRotation:
    """Starts at 80% and learns: the threshold moves by 0.05 within [0.6, 0.95].

    Each check records the block's usage. When the recent average is below 0.5, rotation has
    been keeping the block small, i.e. rotating too often: the threshold rises. Above 0.9 the
    block sits near full, rarely rotated: the threshold falls.
    """

    name = RotationStrategyName.ADAPTIVE
    BASE_THRESHOLD = 0.8

    def __init__(self, threshold: float = BASE_THRESHOLD, history: Sequence[float] = ()) -> None:
        self.threshold = threshold
        self.history = list(history)

    def observe(self, usage: float) -> None:
        self.history = [*self.history, round(usage, 4)][-ADAPTIVE_HISTORY:]
        if len(self.history) < ADAPTIVE_MIN_OBSERVATIONS:
            return
        average = sum(self.history) / len(self.history)
        if average < 0.5:
            self.threshold = min(0.95, round(self.threshold + 0.05, 2))
        elif average > 0.9:
            self.threshold = max(0.6, round(self.threshold - 0.05, 2))

    def should_rotate(self, usage: float) -> bool:
        return usage >= self.threshold

    @staticmethod
    def _order(lines: Sequence[str]) -> list[int]:
        # Highest score first; among equals, the most recent (lowest in the block) first.
        return sorted(range(len(lines)), key=lambda i: (-line_score(lines[i]), -i))

    def compress(self, content: str, target_chars: int) -> str:
        lines = content.split("\n")
        order = self._order(lines)
        keep = _greedy(lines, order, target_chars, set())
        return _join(lines, keep) if keep else _fit(lines[order[0]], target_chars)

    def select_lines(self, lines: Sequence[str], target_chars: int, forced: set[int]) -> set[int]:
        return _greedy(lines, self._order(lines), target_chars, forced)


# -- rotation ------------------------------------------------------------------------------


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


class RotationResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    plan: RotationPlan
    passage_ids: list[str]
    commit_sha: str | None
    """None when the block changed after the plan: nothing was committed (the archive keeps
    the text, and a later check rotates the new version if it is still over threshold)."""


def archive_header(when: datetime) -> str:
    """The seed's archival header."""
    return f"[ARCHIVED {when.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%S')}]"


class Rotator:
    def __init__(
        self,
        service: MemoryService,
        archive: ArchiveStore,
        states: RotationStateStore,
        target_ratio: float = DEFAULT_TARGET_RATIO,
    ) -> None:
        if not 0.05 <= target_ratio <= 1.0:
            raise ValueError(f"target ratio must be within [0.05, 1], got {target_ratio}")
        self.service = service
        self.archive = archive
        self.states = states
        self.target_ratio = target_ratio

    def strategy(self, user_id: str, spec: BlockSpec) -> RotationStrategy:
        if spec.rotation is RotationStrategyName.AGGRESSIVE:
            return AggressiveRotation()
        if spec.rotation is RotationStrategyName.PRESERVATIVE:
            return PreservativeRotation()
        saved = self.states.load(user_id, spec.label)
        return AdaptiveRotation(*saved) if saved else AdaptiveRotation()

    def metrics(self, user_id: str) -> ContextMetrics:
        return context_metrics(self.service.read_blocks(user_id))

    def check(self, user_id: str, label: str) -> RotationCheck:
        """Is the block over its threshold? The adaptive strategy learns from every check."""
        block = self.service.read_block(validate_user_id(user_id), validate_label(label))
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
        self, user_id: str, label: str, *, force: bool = False, at_sha: str | None = None
    ) -> RotationPlan | None:
        """What rotating the block now would do; None if it is under its threshold, empty, or
        already within the compression target. Reads only: nothing changes until `archive_step`
        and `commit_step`. `at_sha` re-derives the plan of an earlier check (a Temporal
        activity holds only the sha between steps)."""
        validate_user_id(user_id)
        block = (
            self.service.read_block_at(user_id, validate_label(label), at_sha)
            if at_sha
            else self.service.read_block(user_id, validate_label(label))
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
        now = datetime.now(UTC)
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

    def archive_step(self, plan: RotationPlan) -> list[str]:
        """Step 1: the full text into archival memory. Idempotent."""
        return self.archive.insert(
            NewPassage(
                user_id=plan.user_id,
                text=plan.archive_text,
                tags=("rotation", plan.label),
                source=PassageSource.ROTATION,
                label=plan.label,
                commit_sha=plan.base_sha,
                created_at=plan.planned_at,
                dedupe_key=plan.dedupe_key,
            ),
            chunk=True,
        )

    def commit_step(self, plan: RotationPlan, passage_ids: Sequence[str]) -> str | None:
        """Step 2: commit the compressed block. Idempotent; None if the block moved on."""
        spec = self.service.spec(plan.label)
        marker = f"{plan.label}@{plan.base_sha}"
        with self.service.git.transaction(plan.user_id) as tx:
            done = tx.find_trailer("Rotation-Of", marker, since=plan.planned_at)
            if done is not None:
                return done
            if tx.read(plan.label) != tx.read(plan.label, plan.base_sha):
                return None
            fields = from_toml(spec, plan.compressed_toml, f"rotation plan for {marker}")
            message = format_message(
                f"Rotate {plan.label}: {plan.strategy.value} compression "
                f"{plan.chars_before} -> {plan.chars_after} chars",
                f"Usage {plan.usage:.0%} reached the threshold {plan.threshold:.0%}; the full "
                "text is in archival memory and in this commit's parent.",
                {
                    "Rotation-Of": marker,
                    "Strategy": plan.strategy.value,
                    "Archived-Passages": ",".join(passage_ids),
                },
            )
            return tx.commit({plan.label: to_toml(spec, fields)}, message, ROTATION_AUTHOR)

    def rotate(self, user_id: str, label: str, *, force: bool = False) -> RotationResult | None:
        """Plan, archive, commit. Safe to run again after a crash at any point."""
        plan = self.plan(user_id, label, force=force)
        if plan is None:
            return None
        ids = self.archive_step(plan)
        return RotationResult(plan=plan, passage_ids=ids, commit_sha=self.commit_step(plan, ids))


class ArchiveTaskSink:
    """The MemoryService's TaskArchive on an ArchiveStore: finished tasks become passages."""

    def __init__(self, archive: ArchiveStore) -> None:
        self.archive = archive

    def archive_task(self, user_id: str, text: str, *, dedupe_key: str) -> list[str]:
        return self.archive.insert(
            NewPassage(
                user_id=user_id,
                text=text,
                tags=("task",),
                source=PassageSource.TASK,
                dedupe_key=dedupe_key,
            ),
            chunk=True,
        )
