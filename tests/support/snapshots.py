"""What the bad-input suites share: hostile identifiers, and a snapshot of every store."""

import subprocess
from typing import Any

from hypothesis import strategies as st
from sqlalchemy import inspect, text

from durable_memory.bootstrap import MemoryStack

hostile_ids = st.one_of(
    st.sampled_from(
        [
            "..",
            "../x",
            "/etc",
            "a/b",
            "a\\b",
            "\x00",
            ".git",
            " ",
            "-x",
            "x" * 65,
            "ａ",
            "alice\n",
            "%2e%2e",
            "$(id)",
            "",
            "DROP TABLE",
            "a;b",
            "é",
        ]
    ),
    st.text(max_size=80),
)


def snapshot(stack: MemoryStack) -> dict[str, Any]:
    """Every row of every SQL table, every repository's refs, index and files, the archive."""
    engine = stack.engine
    tables: dict[str, Any] = {}
    with engine.connect() as conn:
        for table in inspect(engine).get_table_names():
            if table.startswith("recall_fts"):
                continue
            rows = conn.execute(text(f'SELECT * FROM "{table}"')).fetchall()
            tables[table] = sorted(repr(tuple(r)) for r in rows)
    repos: dict[str, Any] = {}
    users_dir = stack.git.users_dir
    if users_dir.exists():
        for repo in sorted(users_dir.iterdir()):
            head = subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout
            files = {
                str(p.relative_to(repo)): p.read_bytes()
                for p in sorted(repo.rglob("*"))
                if p.is_file() and ".git" not in p.parts
            }
            index = repo / ".git" / "index"  # `.git` may be a file in a hostile repository
            repos[repo.name] = (head, files, index.read_bytes() if index.is_file() else None)
    return {
        "tables": tables,
        "repos": repos,
        "archive": {user: [p.id for p in stack.archive.page(user, limit=1000)] for user in repos},
    }
