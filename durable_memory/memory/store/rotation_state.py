"""Persistent state of the adaptive rotation strategy: threshold and recent usage, per block.

A SQL table, so it lives with the others in store/ (db.make_engine creates every table); the
adaptive strategy in rotation/ reads and writes it.
"""

import json

from sqlalchemy import Engine
from sqlmodel import Field, Session, SQLModel


class RotationStateRow(SQLModel, table=True):
    __tablename__ = "rotation_state"

    user_id: str = Field(primary_key=True, max_length=64)
    label: str = Field(primary_key=True, max_length=48)
    threshold: float
    history: str
    """JSON list of the recent usage observations."""


class RotationStateStore:
    """The adaptive strategy's threshold and history, per user and block."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def load(self, user_id: str, label: str) -> tuple[float, list[float]] | None:
        with Session(self.engine) as session:
            row = session.get(RotationStateRow, (user_id, label))
        return (row.threshold, list(json.loads(row.history))) if row else None

    def save(self, user_id: str, label: str, threshold: float, history: list[float]) -> None:
        with Session(self.engine) as session:
            row = session.get(RotationStateRow, (user_id, label)) or RotationStateRow(
                user_id=user_id, label=label, threshold=threshold, history="[]"
            )
            row.threshold = threshold
            row.history = json.dumps(history)
            session.add(row)
            session.commit()
