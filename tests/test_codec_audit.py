"""`dmem codec-server` audit-logs every /decode request (docs/governance.md, "Reading
encrypted turns"): one JSON line each, answered or refused, with the time, the peer, the
namespace, the status, the number of payloads and the ids of the keys that decrypted them;
never a payload's content, never the token. Run as an operator runs it, in its own process,
the lines appended to its --audit-log file."""

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from temporalio.api.common.v1 import Payload

from durable_memory.codec.keys import Keyring
from durable_memory.codec.payload_codec import UserPayloadCodec
from durable_memory.config import CODEC_SERVER_TOKEN_ENV, PAYLOAD_MASTER_KEY_ENV
from durable_memory.demo import free_port
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.erasure import erase_user_rows
from durable_memory.memory.store.users import PayloadKeyStore
from tests.test_payload_codec import CANARY, MASTER_KEY, TOKEN, payloads_json

STARTUP_S = 60


@contextmanager
def codec_server_process(data_dir: Path, audit_log: Path) -> Iterator[httpx.Client]:
    """`dmem codec-server --audit-log FILE` on a free loopback port; a client of it."""
    port = free_port()
    config = data_dir.parent / "temporal.yaml"
    config.write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMEM_")}
    env.update(
        {
            "DMEM_CONFIG": str(config),
            PAYLOAD_MASTER_KEY_ENV: MASTER_KEY.hex(),
            CODEC_SERVER_TOKEN_ENV: TOKEN,
        }
    )
    command = [sys.executable, "-m", "durable_memory.cli", "codec-server", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--audit-log", str(audit_log), "--data-dir", str(data_dir)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                client.post("/encode")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the codec server did not start"
                time.sleep(0.1)
        yield client
    finally:
        client.close()
        process.terminate()
        process.communicate(timeout=30)


def test_every_decode_request_is_one_audit_line_without_content_or_token(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    engine = make_engine(f"sqlite:///{data_dir / 'memory.db'}")
    keyring = Keyring(PayloadKeyStore(engine), MASTER_KEY)

    def encrypted(user: str) -> Payload:
        codec = UserPayloadCodec(keyring, encrypt=True, user_id=user)
        return asyncio.run(codec.encode([Payload(data=f"{user} says {CANARY}".encode())]))[0]

    alice, bob, gone = encrypted("alice"), encrypted("bob"), encrypted("gone")
    erase_user_rows(engine, "gone")  # forgotten: their payload stays encrypted
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'"hello"')
    key_of = {
        user: p.metadata["encryption-key-id"].decode()
        for user, p in (("alice", alice), ("bob", bob))
    }
    bearer = {"Authorization": f"Bearer {TOKEN}"}

    audit_log = tmp_path / "audit.jsonl"
    with codec_server_process(data_dir, audit_log) as http:
        ok = http.post(
            "/decode", json=payloads_json([alice, bob, alice, plain, gone]), headers=bearer
        )
        assert ok.status_code == 200
        assert CANARY in base64.b64decode(ok.json()["payloads"][0]["data"]).decode()
        assert (
            http.post("/default/decode", json=payloads_json([bob]), headers=bearer).status_code
            == 200
        )
        assert http.post("/decode", json=payloads_json([alice])).status_code == 401
        assert (
            http.post(
                "/decode", json=payloads_json([alice]), headers={**bearer, "X-Namespace": "other"}
            ).status_code
            == 403
        )
        assert http.post("/encode", json=payloads_json([plain]), headers=bearer).status_code == 200
    engine.dispose()

    text = audit_log.read_text(encoding="utf-8")
    lines: list[dict[str, Any]] = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 4  # one per /decode request; /encode reveals nothing and is not logged
    for line in lines:
        assert line["event"] == "codec.decode"
        assert line["remote"].startswith("127.0.0.1:")
        assert line["time"].endswith("+00:00")
    first, by_path, no_token, other = lines
    assert first | {"time": None, "remote": None} == {
        "time": None,
        "event": "codec.decode",
        "remote": None,
        "namespace": "default",
        "status": 200,
        "payloads": 5,
        "key_ids": sorted(key_of.values()),
        "kept_encrypted": 1,
    }
    assert (by_path["namespace"], by_path["key_ids"]) == ("default", [key_of["bob"]])
    assert (no_token["status"], no_token["key_ids"]) == (401, [])
    assert (other["status"], other["namespace"], other["key_ids"]) == (403, "other", [])
    for secret in (CANARY, TOKEN, base64.b64encode(alice.data).decode()[:40], "alice says"):
        assert secret not in text
