"""Bare repositories shared by many workers: `<shared dir>/<user>.git`, on a shared filesystem
(a `file://` git remote) or behind `dmem git-serve`.

A missing repository is made the way the local store makes a working one: `git init --bare` in
a directory beside it, configured, then renamed into place, so no reader or pusher ever sees a
half-made repository and of two creators racing the loser's rename fails and it uses the
winner's. Every repository refuses non-fast-forward pushes and ref deletions: a refused push is
the compare-and-set a worker relies on (another writer won; fetch and retry).
"""

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from durable_memory.memory.core.errors import DurableMemoryError, UnsafeFile
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.safe_files import kind_of

GIT_TOKEN_ENV = "DMEM_GIT_TOKEN"
"""The git server's token: read by `dmem git-serve` and by every host that pushes to it."""

BARE_SETTINGS = (
    ("receive.denyNonFastForwards", "true"),
    ("receive.denyDeletes", "true"),
)
"""What makes a push a compare-and-set: history on the remote is only ever extended."""


def bare_repository_path(shared_dir: Path, user_id: str) -> Path:
    """Where user `user_id`'s bare repository lives; the id is validated before the path is
    built, so no id can name anything but a direct child of `shared_dir`."""
    return shared_dir / f"{validate_user_id(user_id)}.git"


EXISTING_REPOSITORY_HEADER = "Dmem-Existing-Repository"
"""Sent with a push of commits onto a main the pusher fetched from the remote: `dmem
git-serve` then refuses the push if the repository is gone (a forget deleted it meanwhile)
instead of making it anew, which would bring the forgotten history back. A push onto no main
(a user's first commit) is sent without it, and the repository is made."""


def existing_bare_repository(shared_dir: Path, user_id: str) -> Path | None:
    """The user's bare repository if it exists; None if absent. A path that is there but is a
    symbolic link, a file or a directory that is not a bare repository is UnsafeFile."""
    path = bare_repository_path(shared_dir, user_id)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        raise UnsafeFile(f"{path} is {kind_of(mode)}, not a bare repository: refused")
    head = path / "HEAD"
    try:
        head_mode = os.lstat(head).st_mode
    except FileNotFoundError:
        head_mode = 0
    if not stat.S_ISREG(head_mode) or not (path / "objects").is_dir():
        raise UnsafeFile(f"{path} is a directory but not a bare git repository: refused")
    return path


def install_hook(repository: Path, name: str, script: str) -> None:
    """Write hook `name` (executable) into a bare repository, atomically."""
    hooks = repository / "hooks"
    hooks.mkdir(exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{name}-", dir=hooks)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(script)
        os.chmod(temporary, 0o755)
        os.replace(temporary, hooks / name)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _git(*args: str) -> None:
    subprocess.run(["git", *args], check=True, capture_output=True, timeout=60)


def ensure_bare_repository(
    shared_dir: Path, user_id: str, *, pre_receive_hook: str | None = None
) -> Path:
    """The user's bare repository, made (atomically, configured, with the pre-receive hook
    script if one is given) when it is missing. Safe to call from many processes at once."""
    found = existing_bare_repository(shared_dir, user_id)
    if found is not None:
        return found
    path = bare_repository_path(shared_dir, user_id)
    shared_dir.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=f".init-{path.name}-", dir=shared_dir))
    try:
        _git("init", "--quiet", "--bare", "--initial-branch=main", str(fresh))
        for key, value in BARE_SETTINGS:
            _git("--git-dir", str(fresh), "config", key, value)
        if pre_receive_hook is not None:
            install_hook(fresh, "pre-receive", pre_receive_hook)
        try:
            os.rename(fresh, path)
        except OSError:  # another creator won the race (or something else is in the way)
            if existing_bare_repository(shared_dir, user_id) is None:
                raise DurableMemoryError(f"cannot create the bare repository {path}") from None
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return path


DISCARD_PREFIX = ".forget."
"""A directory being deleted is first renamed to `.forget.<name>`: no reader, pusher or lister
sees it (they skip names starting with '.'), and a kill mid-delete leaves it under that name,
where the next attempt finds it (a user id has no '.', so the name is unambiguous)."""


def discard_tree(path: Path) -> bool:
    """Remove `path` (a directory, or whatever an attacker put there: never followed) by an
    atomic rename out of the way and then a delete, and what an interrupted earlier attempt
    left; idempotent. Whether anything was there."""
    parked = path.parent / f"{DISCARD_PREFIX}{path.name}"
    found = False
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        found = True
        if not stat.S_ISDIR(mode):
            os.unlink(path)
        else:
            if os.path.lexists(parked):  # left by an attempt killed after its rename
                _remove(parked)
            os.rename(path, parked)
    if os.path.lexists(parked):
        found = True
        _remove(parked)
    return found


def _remove(path: Path) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)  # refuses to follow a symlink; never reached for one
    else:
        os.unlink(path)


def delete_bare_repository(shared_dir: Path, user_id: str) -> bool:
    """Delete the user's bare repository (see `discard_tree`); whether there was one."""
    return discard_tree(bare_repository_path(shared_dir, user_id))


def read_git_token(token_file: Path | None) -> str | None:
    """The git server's token: `token_file`'s first line, else $DMEM_GIT_TOKEN; None if
    neither gives one."""
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise DurableMemoryError(f"cannot read the token file {token_file}: {error}") from None
    else:
        token = os.environ.get(GIT_TOKEN_ENV, "").strip()
    return token or None
