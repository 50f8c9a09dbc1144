"""Times stored in PostgreSQL read back as the same instant whatever the server's time zone.

Every time column is `timestamp with time zone` on PostgreSQL (checked here for each table),
so a server configured for another zone cannot shift what we read back; a column created as
`timestamp without time zone` would take the session zone's wall-clock time (hours off for an
approval window, the prompt cache's cold check, the order of recall)."""

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine, make_url

from durable_memory.memory.store.db import make_engine
from durable_memory.models.diffs import Proposer
from durable_memory.models.operations import SetField
from tests.support.memory import memory_rig

FAR_ZONE = "Pacific/Kiritimati"  # UTC+14: any mistake is many hours off


@pytest.fixture
def far_engine(postgres_url: str) -> Iterator[Engine]:
    """A database whose server-side default time zone is far from UTC."""
    admin = create_engine(
        postgres_url.replace("postgresql://", "postgresql+psycopg://", 1),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as connection:
        connection.exec_driver_sql("DROP DATABASE IF EXISTS dmem_far_zone")
        connection.exec_driver_sql("CREATE DATABASE dmem_far_zone")
        connection.exec_driver_sql(f"ALTER DATABASE dmem_far_zone SET timezone TO '{FAR_ZONE}'")
    admin.dispose()
    url = make_url(postgres_url).set(database="dmem_far_zone")
    engine = make_engine(url.render_as_string(hide_password=False))
    yield engine
    engine.dispose()


@pytest.mark.postgres
def test_times_read_back_as_written_on_a_server_in_another_zone(
    far_engine: Engine, tmp_path: Path
) -> None:
    memory = memory_rig(far_engine, tmp_path / "data")
    memory.blocks.ensure_user("alice")
    before = datetime.now(UTC)
    diff = memory.review.propose(
        "alice", "student", SetField(field="name", value="Al"), "her name", Proposer.turn("t1")
    )
    stored = memory.review.get(diff.id, "alice")
    assert stored.created_at.tzinfo is not None
    assert abs(stored.created_at - before) < timedelta(hours=1)
    with far_engine.connect() as connection:
        assert connection.exec_driver_sql("SHOW timezone").scalar() == FAR_ZONE
        naive = connection.exec_driver_sql(
            "SELECT table_name || '.' || column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() "
            "AND data_type = 'timestamp without time zone'"
        ).all()
    assert naive == []
