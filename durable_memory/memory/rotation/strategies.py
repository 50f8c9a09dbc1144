"""The three rotation strategies of the seed (`000_d8598551964ab573.txt`): when a block is full
enough to rotate (its threshold), and what of it to keep (free text compressed, or the lines
of a typed block chosen). No store is read or written here: the planner loads and saves the
adaptive strategy's state (store/rotation_state.py)."""

from collections.abc import Sequence
from typing import Protocol

from durable_memory.models.blocks import RotationStrategyName

ADAPTIVE_HISTORY = 10
ADAPTIVE_MIN_OBSERVATIONS = 3


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
        # Priority lines first, then the others, as the seed 000_d8598551964ab573.txt does.
        kept = [lines[i] for i in order if i in keep]
        return "\n".join(kept) if kept else _fit(lines[order[0]], target_chars)

    def select_lines(self, lines: Sequence[str], target_chars: int, forced: set[int]) -> set[int]:
        return _greedy(lines, self._order(lines), target_chars, forced)


def line_score(line: str) -> int:
    """AdaptiveRotation scores of the seed 000_d8598551964ab573.txt: [TASK] 100, [USER] 90,
    [CONTEXT] 80, [..] 50, else 10."""
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
