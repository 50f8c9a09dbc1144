"""`dmem git-serve`: real git over smart HTTP on loopback, and the shared bare repositories."""

import http.client
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from durable_memory.cli import main
from durable_memory.gitserver.pre_receive import hook_script
from durable_memory.gitserver.server import GitServer, ServeSettings
from durable_memory.loopback_server import ThreadedHTTPServer
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    GitRemoteRefused,
    InvalidIdentifier,
)
from durable_memory.memory.core.policies import StandingApproval, format_policies
from durable_memory.memory.store.bare_repos import ensure_bare_repository
from durable_memory.memory.store.git.advertisement import (
    advertised_main,
    remote_main,
    served_main,
)
from durable_memory.memory.store.git.refs import Unreadable

TOKEN = "s3cret-token"
GIT_ENV = {
    **os.environ,
    "GIT_TERMINAL_PROMPT": "0",  # a 401 is a failure, never a password prompt
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.org",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.org",
}


def git(
    *args: str, cwd: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=GIT_ENV,
        capture_output=True,
        text=True,
        check=check,
        timeout=120,
    )


def tree_of(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def serve(root: Path, **options: object) -> Iterator[GitServer]:
    server = GitServer(ServeSettings(root=root, **options)).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "repos"


@pytest.fixture
def server(root: Path) -> Iterator[GitServer]:
    yield from serve(root, token=TOKEN)


def remote(server: GitServer, user: str, token: str | None = TOKEN) -> str:
    credentials = f"git:{token}@" if token else ""
    return server.url.replace("http://", f"http://{credentials}") + f"/{user}.git"


def work_repo(path: Path, files: dict[str, str]) -> Path:
    git("init", "-q", "-b", "main", str(path))
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "files", cwd=path)
    return path


def test_push_clone_fetch_with_the_token(server: GitServer, root: Path, tmp_path: Path) -> None:
    work = work_repo(tmp_path / "w", {"a.txt": "one\n"})
    git("push", remote(server, "alice"), "main", cwd=work)
    bare = root / "alice.git"
    assert git("--git-dir", str(bare), "config", "receive.denyNonFastForwards").stdout == "true\n"
    assert git("--git-dir", str(bare), "config", "receive.denyDeletes").stdout == "true\n"
    git("clone", "-q", remote(server, "alice"), str(tmp_path / "c"))
    assert (tmp_path / "c" / "a.txt").read_text() == "one\n"
    (work / "a.txt").write_text("two\n")
    git("commit", "-qam", "two", cwd=work)
    git("push", remote(server, "alice"), "main", cwd=work)
    git("pull", "-q", cwd=tmp_path / "c")
    assert (tmp_path / "c" / "a.txt").read_text() == "two\n"
    assert not [p for p in root.iterdir() if p.name.startswith(".init-")]


def test_without_the_token_every_request_is_401(
    server: GitServer, root: Path, tmp_path: Path
) -> None:
    work = work_repo(tmp_path / "w", {"a.txt": "one\n"})
    for token in (None, "wrong"):
        refused = git("push", remote(server, "alice", token), "main", cwd=work, check=False)
        assert refused.returncode != 0
        # git asks for credentials only after a 401; prompts are off, so it gives up at once.
        assert "Authentication failed" in refused.stderr or "Username" in refused.stderr
    host, port = server.url.removeprefix("http://").split(":")
    for method, path in (("GET", "/alice.git/info/refs?service=git-upload-pack"), ("POST", "/x")):
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request(method, path, headers={"Authorization": "Bearer nope"})
        assert connection.getresponse().status == 401
        connection.close()
    assert not root.exists() or tree_of(root) == []


@pytest.mark.parametrize(
    "path",
    [
        "/../etc.git/info/refs?service=git-receive-pack",
        "/%2e%2e.git/info/refs?service=git-receive-pack",
        "/..%2Fescape.git/info/refs?service=git-receive-pack",
        "/.hidden.git/info/refs?service=git-receive-pack",
        "/a%00b.git/info/refs?service=git-receive-pack",
        "/-dash.git/info/refs?service=git-receive-pack",
        "/" + "x" * 65 + ".git/info/refs?service=git-receive-pack",
        "/alice.git/HEAD",
        "/alice.git/objects/info/packs",
        "/alice.git/info/refs?service=git-upload-archive",
    ],
)
def test_hostile_paths_are_refused_and_create_nothing(
    server: GitServer, root: Path, path: str
) -> None:
    before = tree_of(root)
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert connection.getresponse().status in (403, 404)
    connection.close()
    assert tree_of(root) == before
    assert not (root.parent / "etc.git").exists()
    assert not (root.parent / "escape.git").exists()


def test_a_symlinked_repository_is_refused(server: GitServer, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.git"
    git("init", "-q", "--bare", str(outside))
    (root / "mallory.git").symlink_to(outside)
    work = work_repo(tmp_path / "w", {"a.txt": "x\n"})
    refused = git("push", remote(server, "mallory"), "main", cwd=work, check=False)
    assert refused.returncode != 0
    assert (
        git("--git-dir", str(outside), "rev-parse", "--verify", "-q", "main", check=False).stdout
        == ""
    )


def test_a_non_fast_forward_push_is_refused(server: GitServer, tmp_path: Path) -> None:
    first = work_repo(tmp_path / "first", {"a.txt": "one\n"})
    git("push", remote(server, "bob"), "main", cwd=first)
    other = work_repo(tmp_path / "other", {"a.txt": "other\n"})
    refused = git("push", remote(server, "bob"), "main", cwd=other, check=False)
    assert refused.returncode != 0
    assert "rejected" in refused.stderr
    forced = git("push", "--force", remote(server, "bob"), "main", cwd=other, check=False)
    assert forced.returncode != 0
    deleted = git("push", remote(server, "bob"), ":main", cwd=first, check=False)
    assert deleted.returncode != 0
    head = git("ls-remote", remote(server, "bob"), "main").stdout.split()[0]
    assert head == git("rev-parse", "HEAD", cwd=first).stdout.strip()


def test_concurrent_first_pushes_of_one_user(server: GitServer, root: Path, tmp_path: Path) -> None:
    works = [work_repo(tmp_path / f"w{i}", {"a.txt": f"{i}\n"}) for i in range(4)]
    results: list[subprocess.CompletedProcess[str]] = [None] * len(works)  # type: ignore[list-item]

    def push(i: int) -> None:
        results[i] = git("push", remote(server, "carol"), "main", cwd=works[i], check=False)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(len(works))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [i for i, result in enumerate(results) if result.returncode == 0]
    assert winners, [result.stderr for result in results]
    for result in results:
        assert result.returncode == 0 or "rejected" in result.stderr, result.stderr
    head = git("--git-dir", str(root / "carol.git"), "rev-parse", "main").stdout.strip()
    assert head in {git("rev-parse", "HEAD", cwd=works[i]).stdout.strip() for i in winners}
    assert [p.name for p in root.iterdir()] == ["carol.git"]


def test_the_shared_directory_helper_creates_once_under_a_race(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    made: list[Path] = []
    threads = [
        threading.Thread(target=lambda: made.append(ensure_bare_repository(shared, "dave")))
        for _ in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert made == [shared / "dave.git"] * 6
    assert [p.name for p in shared.iterdir()] == ["dave.git"]
    config = git("--git-dir", str(shared / "dave.git"), "config", "--list").stdout
    assert "receive.denynonfastforwards=true" in config
    assert "receive.denydeletes=true" in config
    with pytest.raises(InvalidIdentifier):
        ensure_bare_repository(shared, "../evil")
    (shared / "file.git").write_text("not a repository")
    with pytest.raises(DurableMemoryError):
        ensure_bare_repository(shared, "file")
    assert sorted(p.name for p in shared.iterdir()) == ["dave.git", "file.git"]


PROFILE_RECORD = {"profile.toml": 'name = "default"\n'}
GOOD_NOTES = {**PROFILE_RECORD, "blocks/notes.toml": 'value = "likes tea"\n'}


def policies_record(label: str, operations: tuple[str, ...] = ("append",)) -> str:
    """A standing-approvals record as `dmem policy set` writes it."""
    now = datetime.now(UTC)
    approval = StandingApproval(
        id="0123456789ab",
        label=label,
        operations=operations,
        set_by="ms-rivera",
        set_at=now,
        expires_at=now + timedelta(days=30),
    )
    return format_policies([approval])


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({**PROFILE_RECORD, "blocks/notes.toml": "value = [unclosed\n"}, "not valid TOML"),
        ({**PROFILE_RECORD, "blocks/notes.toml": "colour = 3\n"}, "blocks/notes.toml"),
        ({**PROFILE_RECORD, "blocks/shopping.toml": 'value = "x"\n'}, "not a block of profile"),
        ({"profile.toml": 'name = "nope"\n'}, "unknown profile"),
        ({**GOOD_NOTES, "policies.toml": "[[approval]\n"}, "policies.toml is refused"),
        ({**GOOD_NOTES, "policies.toml": policies_record("persona")}, "may never be pre-approved"),
        ({**GOOD_NOTES, "policies.toml": policies_record("shopping")}, "no block 'shopping'"),
        ({**GOOD_NOTES, "policies.toml": policies_record("notes", ("fly",))}, "unknown operation"),
    ],
)
def test_the_pre_receive_hook_refuses_a_bad_block_file(
    root: Path, tmp_path: Path, files: dict[str, str], problem: str
) -> None:
    hook = hook_script(sys.executable, "default")
    for server in serve(root, token=TOKEN, pre_receive_hook=hook):
        bad = work_repo(tmp_path / "bad", files)
        refused = git("push", remote(server, "erin"), "main", cwd=bad, check=False)
        assert refused.returncode != 0
        assert "dmem pre-receive: refused" in refused.stderr
        assert problem in refused.stderr
        assert git("ls-remote", remote(server, "erin")).stdout == ""
        good = work_repo(tmp_path / "good", GOOD_NOTES)
        git("push", remote(server, "erin"), "main", cwd=good)


def test_the_pre_receive_hook_takes_a_standing_approvals_record_the_workers_trust(
    root: Path, tmp_path: Path
) -> None:
    hook = hook_script(sys.executable, "default")
    for server in serve(root, token=TOKEN, pre_receive_hook=hook):
        good = work_repo(
            tmp_path / "good", {**GOOD_NOTES, "policies.toml": policies_record("notes")}
        )
        git("push", remote(server, "erin"), "main", cwd=good)
        assert git("ls-remote", remote(server, "erin")).stdout.strip()


def test_the_pre_receive_hook_refuses_a_symlinked_block(root: Path, tmp_path: Path) -> None:
    hook = hook_script(sys.executable, "default")
    for server in serve(root, token=TOKEN, pre_receive_hook=hook):
        work = work_repo(tmp_path / "w", GOOD_NOTES)
        (work / "blocks" / "human.toml").symlink_to("/etc/passwd")
        git("add", "-A", cwd=work)
        git("commit", "-qm", "link", cwd=work)
        refused = git("push", remote(server, "hal"), "main", cwd=work, check=False)
        assert "blocks/human.toml: not a regular file" in refused.stderr
        assert git("ls-remote", remote(server, "hal")).stdout == ""


def test_a_request_too_large_is_refused(root: Path, tmp_path: Path) -> None:
    for server in serve(root, token=TOKEN, max_body_bytes=64 * 1024):
        for size in (
            200_000,
            3_000_000,
        ):  # under git's postBuffer (Content-Length) and over (chunked)
            work = work_repo(tmp_path / f"w{size}", {"big.bin": os.urandom(size).hex()})
            refused = git("push", remote(server, "frank"), "main", cwd=work, check=False)
            assert refused.returncode != 0
            assert "413" in refused.stderr, refused.stderr
        assert git("ls-remote", remote(server, "frank")).stdout == ""


def test_no_auth_is_refused_off_loopback(root: Path) -> None:
    with pytest.raises(DurableMemoryError, match="without a token"):
        GitServer(ServeSettings(root=root, token=None), host="0.0.0.0")


def test_a_hanging_backend_is_killed(root: Path, tmp_path: Path) -> None:
    hang = "#!/bin/sh\nexec sleep 600\n"  # a pre-receive hook that never returns
    for server in serve(root, token=TOKEN, pre_receive_hook=hang, cgi_timeout_seconds=1.0):
        work = work_repo(tmp_path / "w", {"a.txt": "x\n"})
        refused = git("push", remote(server, "gina"), "main", cwd=work, check=False)
        assert refused.returncode != 0
        assert "504" in refused.stderr, refused.stderr
        assert git("ls-remote", remote(server, "gina")).stdout == ""


def test_dmem_git_serve_refuses_to_start_without_a_token(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DMEM_GIT_TOKEN", raising=False)
    assert main(["git-serve", str(root)]) != 0
    assert "no token" in capsys.readouterr().err
    assert main(["git-serve", str(root), "--no-auth", "--host", "0.0.0.0"]) != 0
    assert "loopback" in capsys.readouterr().err
    assert not root.exists()


def test_dmem_main_answers_what_the_advertisement_says(
    server: GitServer, root: Path, tmp_path: Path
) -> None:
    """`GET <repo>/dmem-main` (no git process on the server) names the commit the ref
    advertisement names: nothing before the first push, each push's commit after, and after
    the refs were packed."""
    url = f"{server.url}/alice.git"
    assert served_main(url, TOKEN) is None  # no repository
    assert remote_main(url, TOKEN) is None
    assert not root.exists() or tree_of(root) == []  # asking created nothing
    work = work_repo(tmp_path / "w", {"a.txt": "one\n"})
    for text in ("two\n", "three\n"):
        git("push", remote(server, "alice"), "main", cwd=work)
        head = git("rev-parse", "HEAD", cwd=work).stdout.strip()
        assert served_main(url, TOKEN) == advertised_main(url, TOKEN) == head
        (work / "a.txt").write_text(text)
        git("commit", "-qam", text, cwd=work)
    git("--git-dir", str(root / "alice.git"), "pack-refs", "--all")
    assert not (root / "alice.git" / "refs" / "heads" / "main").exists()
    assert served_main(url, TOKEN) == head
    with pytest.raises(GitRemoteRefused):
        served_main(url, "wrong")


def test_dmem_main_refuses_hostile_repositories_and_creates_nothing(
    server: GitServer, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.git"
    git("init", "-q", "--bare", str(outside))
    root.mkdir(parents=True, exist_ok=True)
    (root / "mallory.git").symlink_to(outside)
    before = tree_of(root)
    for user in ("mallory", "..", "%2e%2e", "a%00b", "-dash", "x" * 65):
        with pytest.raises(Unreadable) as refused:
            served_main(f"{server.url}/{user}.git", TOKEN)
        assert "HTTP 422" in str(refused.value)  # refused by dmem-main itself, for this user
    assert tree_of(root) == before
    assert not (root.parent / ".git").exists()


def test_a_server_without_dmem_main_is_asked_for_its_advertisement() -> None:
    """Another smart HTTP server: the first read finds no `dmem-main` and falls back to the
    advertisement; later reads go straight to it."""
    sha = "a" * 40
    line = f"{sha} refs/heads/main\n".encode()
    advertisement = b"001e# service=git-upload-pack\n0000" + b"%04x" % (len(line) + 4) + line
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            ok = self.path.endswith("/info/refs?service=git-upload-pack")
            body = advertisement + b"0000" if ok else b"no such thing\n"
            self.send_response(200 if ok else 404)
            kind = "application/x-git-upload-pack-advertisement" if ok else "text/plain"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    with ThreadedHTTPServer("127.0.0.1", 0, Handler) as other:
        assert remote_main(f"{other.url}/alice.git", TOKEN) == sha
        assert remote_main(f"{other.url}/bob.git", TOKEN) == sha
    assert paths == [
        "/alice.git/dmem-main",
        "/alice.git/info/refs?service=git-upload-pack",
        "/bob.git/info/refs?service=git-upload-pack",
    ]
