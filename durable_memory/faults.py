"""Named crash points for the fault tests (failpoints). Inert unless DMEM_CRASH_AT names the
point: the process then kills itself with SIGKILL the first time it gets there, and a marker
file (DMEM_CRASH_MARKER) records that it did, so the restarted process runs through.

Besides the points below, every activity has `before:<activity type>` and
`after:<activity type>` (its result computed, not yet reported to Temporal)."""

import os
import signal
from pathlib import Path

MID_START = "mid_start_turn"
"""`dmem.start_turn`: the user's message is recorded and the turn's context stored; the model
is not called yet."""
MID_TOOLS_THEN_MODEL = "mid_tools_then_model"
"""`dmem.tools_then_model`: a step's tool calls are run and their results in recall; the next
model call is not made yet."""
AFTER_MODEL_CALL = "after_model_call"
"""The model's reply is stored: with its messages in recall, by the one write of a step's first
attempt (`TurnStore.save_new_reply`); without them, on the long way after a reply stored before."""
MID_COMMIT = "mid_commit"
"""A block file is written and staged; the commit does not exist yet."""
BEFORE_PUSH = "before_push"
"""With a git remote: a commit is made in the host's clone; it is not pushed yet."""
AFTER_PUSH = "after_push"
"""With a git remote: the commit is on the remote; nothing else knows it yet (the diff has no
commit recorded)."""
AFTER_ARCHIVE = "after_archive"
"""A rotation's full text is archived; the compressed block is not committed yet."""
MID_REWRAP = "mid_rewrap"
"""`dmem rewrap-keys`: one batch of users' keys is re-wrapped by the new master key (committed);
the rest are still wrapped by the previous one."""


def crash_point(name: str) -> None:
    if os.environ.get("DMEM_CRASH_AT") != name:
        return
    marker = Path(os.environ.get("DMEM_CRASH_MARKER", f"/tmp/dmem-crash-{os.getpid()}"))
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
