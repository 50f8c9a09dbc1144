"""The optional pre-receive hook: refuse a push whose blocks or records do not parse.

For people who push to the git server by hand. git runs the hook in the bare repository with
the pushed objects visible (quarantined) and one `<old> <new> <ref>` line per updated ref on
standard input; a non-zero exit refuses the whole push and what the hook printed reaches the
pusher. Each pushed tip is checked as a whole: its `profile.toml` (else the deployment's
default profile) names the blocks, every `blocks/*.toml` must be a regular file of a block
of that profile that parses, and `policies.toml` (the standing approvals), if there, must be
a regular file that the workers would trust (a record they would refuse approves nothing, so
a push of one is refused here rather than discovered at the next proposal). Run as
`python -m durable_memory.gitserver.pre_receive`.
"""

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.formats import from_toml
from durable_memory.memory.core.policies import parse_policies
from durable_memory.memory.core.profiles import ProfileCatalog, read_profile_record
from durable_memory.memory.service.access import block_spec
from durable_memory.memory.store.git.layout import (
    BLOCKS_DIR,
    POLICIES_FILE,
    PROFILE_FILE,
    block_label,
)
from durable_memory.memory.store.safe_files import MAX_FILE_BYTES
from durable_memory.models.blocks import AgentProfile

ZERO_SHA = "0" * 40
REGULAR_FILE_MODES = ("100644", "100755")


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], check=True, capture_output=True, timeout=60).stdout


def _blob_text(sha: str, where: str) -> str:
    size = int(_git("cat-file", "-s", sha))
    if size > MAX_FILE_BYTES:
        raise DurableMemoryError(f"{where}: {size} bytes, over the {MAX_FILE_BYTES} byte limit")
    try:
        return _git("cat-file", "blob", sha).decode("utf-8")
    except UnicodeDecodeError:
        raise DurableMemoryError(f"{where}: not valid UTF-8") from None


def problems_in(commit: str, profiles: ProfileCatalog) -> list[str]:
    """What is wrong with the blocks and records of the tree at `commit`, one line each."""
    entries: dict[str, tuple[str, str]] = {}  # path -> (mode, blob sha)
    listing = _git("ls-tree", "-z", commit, "--", PROFILE_FILE, POLICIES_FILE, f"{BLOCKS_DIR}/")
    for entry in filter(None, listing.split(b"\0")):
        meta, _, raw_path = entry.partition(b"\t")
        mode, _kind, sha = meta.decode().split()
        entries[raw_path.decode("utf-8", "replace")] = (mode, sha)
    problems: list[str] = []
    try:
        profile = profiles.default
        if PROFILE_FILE in entries:
            mode, sha = entries.pop(PROFILE_FILE)
            if mode not in REGULAR_FILE_MODES:
                raise DurableMemoryError(f"{PROFILE_FILE} is not a regular file")
            profile = profiles.get(read_profile_record(_blob_text(sha, PROFILE_FILE), PROFILE_FILE))
    except DurableMemoryError as error:
        return [str(error)]
    problems.extend(_policy_problems(entries.pop(POLICIES_FILE, None), profile))
    for path, (mode, sha) in sorted(entries.items()):
        name = path.removeprefix(f"{BLOCKS_DIR}/")
        label = block_label(name)
        spec = None if label is None else profile.block(label)
        try:
            if spec is None:
                raise DurableMemoryError(
                    f"{path}: not a block of profile '{profile.name}' (its blocks are "
                    f"{', '.join(block.label for block in profile.blocks)})"
                )
            if mode not in REGULAR_FILE_MODES:
                raise DurableMemoryError(f"{path}: not a regular file (mode {mode})")
            from_toml(spec, _blob_text(sha, path), path, enforce_limit=False)
        except DurableMemoryError as error:
            problems.append(str(error))
    return problems


def _policy_problems(entry: tuple[str, str] | None, profile: AgentProfile) -> list[str]:
    """The standing-approvals record checked as the workers read it (`parse_policies` with
    the pushed profile's blocks)."""
    if entry is None:
        return []
    mode, sha = entry
    try:
        if mode not in REGULAR_FILE_MODES:
            raise DurableMemoryError(f"{POLICIES_FILE}: not a regular file (mode {mode})")
        text = _blob_text(sha, POLICIES_FILE)
        parse_policies(text, POLICIES_FILE, lambda label: block_spec(profile, label))
    except DurableMemoryError as error:
        return [str(error)]
    return []


def check_push(lines: Sequence[str], profiles: ProfileCatalog) -> list[str]:
    """The problems of every pushed tip (`<old> <new> <ref>` lines), each prefixed by its ref."""
    problems: list[str] = []
    for line in lines:
        _old, new, ref = line.split(maxsplit=2)
        if new != ZERO_SHA:
            problems.extend(f"{ref}: {problem}" for problem in problems_in(new, profiles))
    return problems


def hook_script(python: str, profile: str) -> str:
    """The hook file: this module, run by `python`, with `profile` as the default profile."""
    command = shlex.join([python, "-m", __name__, "--profile", profile])
    return f"#!/bin/sh\n# installed by dmem git-serve --pre-receive-hook\nexec {command}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="default", help="the default profile")
    args = parser.parse_args(argv)
    problems = check_push(sys.stdin.read().splitlines(), ProfileCatalog(args.profile))
    for problem in problems:
        print(f"dmem pre-receive: refused: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
