"""One git repository per user, holding `blocks/<label>.toml`, `profile.toml` (the
name of the user's profile) and `policies.toml` (the user's standing approvals). Every
change is a commit.

Writers for one user (threads or processes) are serialised by an flock on a file inside the
user's `.git` directory (locking.py), so there is no global lock and git's own `index.lock` is
never contended. Reads come from the HEAD commit, never from the working tree, so a
half-written or hand-edited file cannot leak into memory: hand edits are committed only
through `commit_hand_edits`, which validates them first.

A commit never changes, so the block files of a commit are cached in memory by (user, sha)
(snapshots.py): a turn resolves HEAD from the ref files (refs.py, no git process) and finds
its blocks in the cache. Only a commit this process has not seen (made by another worker or
by hand) costs a read of git objects.

Every transaction first repairs what a killed writer left (recovery.py); commits are written
by `git commit` with fsync and hooks off (commits.py), their messages and authors checked
(messages.py). With a git remote (the distributed mode), `RemoteGitBlockStore` (remote.py)
keeps these repositories as disposable clones of the remote's, pushing every commit. The names
below are the package's public face.
"""

from durable_memory.memory.store.git.layout import (
    BLOCKS_DIR,
    POLICIES_FILE,
    PROFILE_FILE,
    block_path,
)
from durable_memory.memory.store.git.messages import format_message, validate_author_name
from durable_memory.memory.store.git.remote import RemoteGitBlockStore
from durable_memory.memory.store.git.repository import GitBlockStore
from durable_memory.memory.store.git.snapshots import Snapshot, SnapshotCache
from durable_memory.memory.store.git.transaction import CLOCK_SKEW, RepoTransaction

__all__ = [
    "BLOCKS_DIR",
    "CLOCK_SKEW",
    "POLICIES_FILE",
    "PROFILE_FILE",
    "GitBlockStore",
    "RemoteGitBlockStore",
    "RepoTransaction",
    "Snapshot",
    "SnapshotCache",
    "block_path",
    "format_message",
    "validate_author_name",
]
