"""A throwaway PostgreSQL server on loopback for the test session, from Debian's packages.

CI installs the `postgresql` package (.ci/run and `make test` do it when it is missing). When
the binaries are missing locally and DMEM_REQUIRE_POSTGRES is not set, the PostgreSQL legs are
skipped with that reason; in CI they are required.
"""

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine


def find_pg_bin() -> Path | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def running_postgres(bin_dir: Path) -> Iterator[str]:
    """Start initdb + postgres in a temp dir; yield a SQLAlchemy URL; stop and delete after."""
    root = Path(tempfile.mkdtemp(prefix="dmem-pg-"))
    data = root / "data"
    run_as: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    subprocess.run(
        [
            *run_as,
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            "dmem",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
        ],
        check=True,
        capture_output=True,
    )
    server = subprocess.Popen(
        [
            *run_as,
            str(bin_dir / "postgres"),
            "-D",
            str(data),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-k",
            str(root),
            "-F",
            "-c",
            "max_connections=200",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run(
                [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                capture_output=True,
            )
            if probe.returncode == 0:
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("PostgreSQL did not start")
            time.sleep(0.1)
        subprocess.run(
            [
                str(bin_dir / "createdb"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "dmem",
                "dmem_test",
            ],
            check=True,
            capture_output=True,
        )
        yield f"postgresql+psycopg://dmem@127.0.0.1:{port}/dmem_test"
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def fresh_schema_url(url: str) -> str:
    """`url` with a new, empty schema first on its search path: one schema per test keeps
    PostgreSQL tests as isolated as a fresh SQLite file."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    admin.dispose()
    return f"{url}?options=-csearch_path%3D{schema}"
