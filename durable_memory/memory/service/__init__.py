"""The memory's public faces, one per job, over the stores each needs:

- `Blocks`: read and render a user's blocks (and create their repository);
- `DirectEdits`: changes committed at once, by the user (author = the user) or by a backend
  service calling a domain operation (author = the service);
- `Review`: the model's proposals as pending diffs and the human decisions on them (a diff
  approved is committed with author = the approver);
- `History`: versions of a block, restoring one, importing hand edits;
- `Policies`: the user's standing approvals, set and revoked by a person (`Review` asks it
  whether one covers a proposal).

They share one `BlockAccess` (access.py), so a block is read and committed one way; the
composition root builds them over it (`bootstrap.memory_faces`).
"""

from dataclasses import dataclass, fields
from typing import Any

from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.service.edits import DirectEdits
from durable_memory.memory.service.history import History
from durable_memory.memory.service.policies import Policies
from durable_memory.memory.service.review import Review


@dataclass(frozen=True)
class MemoryFaces:
    blocks: Blocks
    edits: DirectEdits
    review: Review
    history: History
    policies: Policies

    def faces(self) -> dict[str, Any]:
        """The faces by field name, to build a whole that holds them and more (the
        stack): `MemoryStack(**faces.faces(), recall=...)`."""
        return {field.name: getattr(self, field.name) for field in fields(MemoryFaces)}
