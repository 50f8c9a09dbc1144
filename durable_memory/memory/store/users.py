"""The users this deployment serves, as a SQL table: what the rotation sweep lists.

A user's repository may live on any worker's disk, or (distributed) behind a git server, so
no one disk can list every user; the shared database can. A user is registered whenever their
memory is ensured (`Blocks.ensure_user`, which every turn's first step runs), after their
repository exists, so every listed user has one somewhere.

Migration: a deployment from before this table has users on disk only. Each `dmem worker`
registers the users of its own data dir when it starts (`Blocks.register_local_users`), and
any user's next turn registers them too; registering is idempotent, so both are cheap.
"""

from collections.abc import Iterable
from datetime import UTC, datetime

from sqlalchemy import Engine
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Field, Session, SQLModel, col, select

from durable_memory.memory.store.erasure import ErasureLedger

REGISTER_BATCH = 1000


class UserRow(SQLModel, table=True):
    __tablename__ = "users"

    user_id: str = Field(primary_key=True, max_length=64)
    """The primary key is the index: listing reads it in order, registering probes it."""
    registered_at: datetime


class UserDirectory:
    """Every user who has memory, whichever host holds their repository."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def register(self, user_ids: Iterable[str]) -> None:
        """Record the users; those already recorded are left as they are. Safe under
        concurrent registration of the same user (insert ... on conflict do nothing)."""
        now = datetime.now(UTC)
        rows = [{"user_id": user_id, "registered_at": now} for user_id in user_ids]
        insert = postgresql_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        with self.engine.begin() as conn:
            # In batches: a statement's bound parameters are limited (SQLite: 32766).
            for start in range(0, len(rows), REGISTER_BATCH):
                batch = rows[start : start + REGISTER_BATCH]
                conn.execute(
                    insert(UserRow).values(batch).on_conflict_do_nothing(index_elements=["user_id"])
                )

    def refuse_if_forgetting(self, user_id: str) -> None:
        """UserBeingForgotten while the user's erasure is under way (store/erasure.py)."""
        ErasureLedger(self.engine).refuse_if_open(user_id)

    def users(self) -> list[str]:
        """Every registered user, in id order."""
        with Session(self.engine) as session:
            return list(session.exec(select(UserRow.user_id).order_by(col(UserRow.user_id))))
