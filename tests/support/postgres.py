"""A throwaway PostgreSQL server on loopback for the test session, from Debian's packages.

CI installs the `postgresql` package (.ci/run and `make test` do it when it is missing). When
the binaries are missing locally and DMEM_REQUIRE_POSTGRES is not set, the PostgreSQL legs are
skipped with that reason; in CI they are required.
"""

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine


def find_pg_bin() -> Path | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def required_pg_bin() -> Path:
    """The PostgreSQL binaries' directory; missing, the test is skipped, or failed where
    PostgreSQL is required (CI, DMEM_REQUIRE_POSTGRES)."""
    bin_dir = find_pg_bin()
    if bin_dir is None:
        if os.environ.get("DMEM_REQUIRE_POSTGRES") or os.environ.get("CI"):
            pytest.fail("PostgreSQL binaries not found; install Debian's postgresql package")
        pytest.skip("PostgreSQL binaries not found (install Debian's postgresql package)")
    return bin_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PostgresServer:
    """A throwaway PostgreSQL cluster in a temp dir on a loopback port: `start()`, `url`,
    `restart()` (the same data and port: what a database restart looks like to a client),
    `stop()`."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="dmem-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.url = f"postgresql+psycopg://dmem@127.0.0.1:{self.port}/dmem_test"
        self._run_as: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._run_as = ["runuser", "-u", "postgres", "--"]
        self._server: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """initdb, the server, and the test database."""
        subprocess.run(
            [
                *self._run_as,
                str(self.bin_dir / "initdb"),
                *("-D", str(self.data), "-U", "dmem", "-A", "trust", "--no-sync", "-E", "UTF8"),
            ],
            check=True,
            capture_output=True,
        )
        self.serve()
        subprocess.run(
            [
                str(self.bin_dir / "createdb"),
                *("-h", "127.0.0.1", "-p", str(self.port), "-U", "dmem", "dmem_test"),
            ],
            check=True,
            capture_output=True,
        )

    def serve(self) -> None:
        """Start the server on the cluster made by `start` and wait until it accepts."""
        self._server = subprocess.Popen(
            [
                *self._run_as,
                str(self.bin_dir / "postgres"),
                *("-D", str(self.data), "-h", "127.0.0.1", "-p", str(self.port)),
                *("-k", str(self.root), "-F", "-c", "max_connections=200"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run(
                [str(self.bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
            )
            if probe.returncode == 0:
                return
            if self._server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("PostgreSQL did not start")
            time.sleep(0.1)

    def halt(self) -> None:
        """Stop the server, closing every client's connection; the data stays."""
        if self._server is not None:
            # SIGINT: PostgreSQL's fast shutdown, which closes every client's connection (its
            # SIGTERM waits for them to leave: a pool's idle connections never do). Sent to the
            # postmaster itself: `runuser` in between does not pass SIGINT on.
            try:
                postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
                os.kill(postmaster, signal.SIGINT)
            except (OSError, ValueError, IndexError):  # not running, or not yet
                self._server.terminate()
            self._server.wait(timeout=30)
            self._server = None

    def restart(self) -> None:
        """Stop the server (every client connection is closed) and start it again on the same
        data and port."""
        self.halt()
        self.serve()

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def running_postgres(bin_dir: Path) -> Iterator[str]:
    """Start initdb + postgres in a temp dir; yield a SQLAlchemy URL; stop and delete after."""
    with restartable_postgres(bin_dir) as server:
        yield server.url


@contextmanager
def restartable_postgres(bin_dir: Path) -> Iterator[PostgresServer]:
    """A server of its own (a test that restarts it must not share the session's)."""
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def fresh_schema_url(url: str) -> str:
    """`url` with a new, empty schema first on its search path: one schema per test keeps
    PostgreSQL tests as isolated as a fresh SQLite file."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    admin.dispose()
    return f"{url}?options=-csearch_path%3D{schema}"
