"""Replacing the master key that wraps the users' payload keys (`dmem rewrap-keys`,
docs/governance.md "Replacing the master key"): every key is re-wrapped from the previous
master key to the new one, payloads encrypted before still decrypt after, the previous key
alone opens no row any more, and a run killed half-way leaves every row readable by one of
the two keys and is finished by running it again."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlmodel import Session, select
from temporalio.api.common.v1 import Payload

from durable_memory.codec.keys import Keyring, PayloadKeyError, master_key_id
from durable_memory.codec.payload_codec import UserPayloadCodec, keyring_for
from durable_memory.config import (
    PAYLOAD_MASTER_KEY_ENV,
    PAYLOAD_PREVIOUS_MASTER_KEY_ENV,
    ConfigError,
    MemorySettings,
    PayloadEncryptionSettings,
    Settings,
)
from durable_memory.faults import MID_REWRAP
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.users import PayloadKeyRow, PayloadKeyStore

OLD = bytes(range(32))
NEW = bytes(range(100, 132))
OTHER = bytes(range(200, 232))
USERS = [f"user{i}" for i in range(5)]


def rows(engine: Engine) -> dict[str, tuple[str, bytes]]:
    """Every key row: key id -> (master key id, wrapped key)."""
    with Session(engine) as session:
        return {
            row.key_id: (row.master_key_id, row.wrapped_key)
            for row in session.exec(select(PayloadKeyRow)).all()
        }


async def encrypt_for_each_user(keyring: Keyring) -> dict[str, list[Payload]]:
    """A payload of each user, encrypted as a worker encrypts their workflows' payloads."""
    encrypted = {}
    for user in USERS:
        codec = UserPayloadCodec(keyring, encrypt=True, user_id=user)
        encrypted[user] = await codec.encode([Payload(data=f"said by {user}".encode())])
    return encrypted


async def assert_decrypt(keyring: Keyring, encrypted: dict[str, list[Payload]]) -> None:
    codec = UserPayloadCodec(keyring, encrypt=False)
    for user, payloads in encrypted.items():
        (plain,) = await codec.decode(payloads)
        assert plain.data == f"said by {user}".encode()


def assert_opens_no_row(store: PayloadKeyStore, master_key: bytes) -> None:
    alone = Keyring(store, master_key)
    for key_id in rows(store.engine):
        with pytest.raises(PayloadKeyError, match="wrapped by master key"):
            alone.keys_by_id({key_id})


async def test_every_key_moves_to_the_new_master_key(engine: Engine) -> None:
    store = PayloadKeyStore(engine)
    encrypted = await encrypt_for_each_user(Keyring(store, OLD))
    rotating = Keyring(store, NEW, OLD)  # what every process holds during the rotation
    await assert_decrypt(rotating, encrypted)
    made_during, _ = rotating.key_for("newcomer")  # a new user's key: wrapped by NEW at once
    assert rows(engine)[made_during][0] == master_key_id(NEW)

    report = rotating.rewrap(batch=2)
    assert (report.rewrapped, report.already, report.unreadable) == (len(USERS), 1, ())
    assert {master for master, _ in rows(engine).values()} == {master_key_id(NEW)}
    await assert_decrypt(Keyring(store, NEW), encrypted)  # the new key alone reads them
    assert_opens_no_row(store, OLD)
    again = rotating.rewrap()  # idempotent
    assert (again.rewrapped, again.already) == (0, len(USERS) + 1)


async def test_a_rewrap_that_cannot_be_right_changes_nothing(engine: Engine) -> None:
    store = PayloadKeyStore(engine)
    await encrypt_for_each_user(Keyring(store, OLD))
    Keyring(store, OTHER).key_for("elsewhere")  # wrapped by a third master key
    before = rows(engine)
    for keyring, error in (
        (Keyring(store, NEW, OLD), "wrapped by neither the master key nor the previous one"),
        (Keyring(store, NEW), "no previous master key is configured"),
        (Keyring(store, OLD, OLD), "the previous master key is the master key"),
    ):
        with pytest.raises(PayloadKeyError, match=error):
            keyring.rewrap()
        assert rows(engine) == before
    # A row whose wrapping was altered is reported and left; the others move.
    with Session(engine) as session:
        elsewhere = session.exec(
            select(PayloadKeyRow).where(PayloadKeyRow.user_id == "elsewhere")
        ).one()
        session.delete(elsewhere)
        altered = session.exec(select(PayloadKeyRow).where(PayloadKeyRow.user_id == "user0")).one()
        altered.wrapped_key = altered.wrapped_key[:-1] + bytes([altered.wrapped_key[-1] ^ 1])
        session.add(altered)
        altered_id = altered.key_id
        session.commit()
    report = Keyring(store, NEW, OLD).rewrap()
    assert report.rewrapped == len(USERS) - 1
    assert report.unreadable == (altered_id,)
    assert rows(engine)[altered_id][0] == master_key_id(OLD)


def test_the_previous_master_key_is_given_like_the_master_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PAYLOAD_MASTER_KEY_ENV, raising=False)
    monkeypatch.setenv(PAYLOAD_PREVIOUS_MASTER_KEY_ENV, OLD.hex())
    settings = Settings(memory=MemorySettings(data_dir=tmp_path / "data"))
    with pytest.raises(ConfigError, match="no master key"):
        keyring_for(settings)  # the previous one alone: never
    (tmp_path / "previous.key").write_text("not hex\n")
    encryption = PayloadEncryptionSettings(previous_master_key_file=tmp_path / "previous.key")
    with pytest.raises(ConfigError, match=r"previous_master_key_file .* 64 hex characters"):
        encryption.previous_master_key()


def dmem_rewrap(data_dir: Path, *extra_env: tuple[str, str]) -> subprocess.CompletedProcess[str]:
    """`dmem rewrap-keys --batch 2` as an operator runs it, in a process of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMEM_")}
    config = data_dir.parent / "temporal.yaml"
    config.write_text("{}\n")
    env.update(
        {
            "DMEM_CONFIG": str(config),
            PAYLOAD_MASTER_KEY_ENV: NEW.hex(),
            PAYLOAD_PREVIOUS_MASTER_KEY_ENV: OLD.hex(),
            **dict(extra_env),
        }
    )
    command = [sys.executable, "-m", "durable_memory.cli", "rewrap-keys", "--batch", "2"]
    return subprocess.run(
        [*command, "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_a_rewrap_killed_half_way_is_finished_by_running_it_again(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    engine = make_engine(f"sqlite:///{data_dir / 'memory.db'}")
    store = PayloadKeyStore(engine)
    encrypted = await encrypt_for_each_user(Keyring(store, OLD))

    killed = dmem_rewrap(
        data_dir, ("DMEM_CRASH_AT", MID_REWRAP), ("DMEM_CRASH_MARKER", str(tmp_path / "crashed"))
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    masters = [master for master, _ in rows(engine).values()]
    assert masters.count(master_key_id(NEW)) == 2  # the first batch, committed
    assert masters.count(master_key_id(OLD)) == len(USERS) - 2
    await assert_decrypt(Keyring(store, NEW, OLD), encrypted)  # every row, by one of the two

    finished = dmem_rewrap(data_dir)  # the crash point fires once: this run goes through
    assert finished.returncode == 0, finished.stderr
    assert f"re-wrapped {len(USERS) - 2} user key(s)" in finished.stdout
    assert "2 already wrapped" in finished.stdout
    await assert_decrypt(Keyring(store, NEW), encrypted)
    assert_opens_no_row(store, OLD)
    engine.dispose()
