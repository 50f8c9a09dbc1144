"""Where blocks live in a user's repository: `blocks/<label>.toml`, one file per block, and
the records at the top: `profile.toml`, naming the profile the blocks follow, and
`policies.toml`, the user's standing approvals."""

import contextlib
from pathlib import Path

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.ids import validate_label
from durable_memory.memory.store.safe_files import open_dir

BLOCKS_DIR = "blocks"
PROFILE_FILE = "profile.toml"
"""The user's profile record, beside `blocks/`: not a block, so no label can name it."""
POLICIES_FILE = "policies.toml"
"""The user's standing approvals (memory/core/policies.py), beside the profile record."""
RECORD_FILES = (PROFILE_FILE, POLICIES_FILE)
"""The records at the top of a user's repository. A label has no '.', so no block (and no
journal line naming a block) can be mistaken for one."""


def block_path(label: str) -> str:
    return f"{BLOCKS_DIR}/{validate_label(label)}.toml"


def block_label(name: str) -> str | None:
    """The label of a file named `<label>.toml`, or None for any other name."""
    stem = name.removesuffix(".toml")
    if stem == name:
        return None
    try:
        return validate_label(stem)
    except DurableMemoryError:
        return None


def open_blocks_dir(
    users_dir: Path, user_id: str, *, create: bool = False
) -> contextlib.AbstractContextManager[int]:
    """The working tree's `blocks/` directory of a user, opened without following symlinks."""
    return open_dir(users_dir, [user_id, BLOCKS_DIR], "users", create=create)


def open_user_dir(users_dir: Path, user_id: str) -> contextlib.AbstractContextManager[int]:
    """The working tree's top directory of a user (where `profile.toml` lives), opened without
    following symlinks."""
    return open_dir(users_dir, [user_id], "users")
