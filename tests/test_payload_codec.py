"""Per-user payload encryption (issue 20 §1, `payload_encryption: per_user`): a user's turn
leaves no plaintext in Temporal (its history read raw, without the codec); `dmem
codec-server` gives it back to whoever holds the token, from an allowed origin only; a forget
destroys the user's key, after which a history kept from before cannot be read; and with
encryption off (the default) payloads are the plain JSON they always were.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import uvicorn
from google.protobuf import json_format
from google.protobuf.message import Message
from sqlalchemy import Engine
from temporalio.api.common.v1 import Payload, Payloads, SearchAttributes
from temporalio.api.history.v1 import History, MarkerRecordedEventAttributes
from temporalio.client import Client
from temporalio.converter import (
    ActivitySerializationContext,
    WorkflowSerializationContext,
)
from temporalio.testing import WorkflowEnvironment

from durable_memory.cli import main
from durable_memory.client import connect_temporal
from durable_memory.codec.keys import Keyring, PayloadKeyError
from durable_memory.codec.payload_codec import (
    ENCODING,
    UserPayloadCodec,
    data_converter_for,
    user_of_workflow,
)
from durable_memory.codec.server import MAX_PAYLOADS, codec_app_for
from durable_memory.config import (
    CODEC_SERVER_TOKEN_ENV,
    PAYLOAD_MASTER_KEY_ENV,
    CodecServerSettings,
    ConfigError,
    PayloadEncryptionSettings,
    Settings,
    load_settings,
)
from durable_memory.memory.core.errors import UserBeingForgotten, UserForgotten
from durable_memory.memory.store.erasure import ErasureLedger, erase_user_rows
from durable_memory.memory.store.users import PayloadKeyStore
from durable_memory.models.history import redact_workflow_id
from durable_memory.models.turn import (
    forget_workflow_id,
    legacy_turn_workflow_id,
    rotation_workflow_id,
    turn_workflow_id,
)
from durable_memory.workers.dev_server import temporal_binary
from durable_memory.workers.worker import WORKFLOWS
from durable_memory.workflows.forget import ForgetWorkflow
from durable_memory.workflows.redact import RedactWorkflow
from durable_memory.workflows.rotation import RotationSweepWorkflow, RotationWorkflow
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import default_converter_client, rig_settings, running_rig

CANARY = "zqcanary7x"
MASTER_KEY = bytes(range(32))
TOKEN = "t" * 40
UI = "http://127.0.0.1:8233"

SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            edit_block("student", "her name", field="name", operation="set", value=f"A {CANARY}")
        ]
    },
    {"text": f"I will keep {CANARY} in mind."},
]


def encrypted_settings(tmp_path: Path, mode: Literal["off", "per_user"] = "per_user") -> Settings:
    """A test rig's settings with the master key and the codec server's token in files."""
    (tmp_path / "master.key").write_text(MASTER_KEY.hex() + "\n")
    (tmp_path / "codec.token").write_text(TOKEN + "\n")
    base = rig_settings(tmp_path / "data")
    encryption = PayloadEncryptionSettings(
        mode=mode,
        master_key_file=tmp_path / "master.key",
        codec_server=CodecServerSettings(token_file=tmp_path / "codec.token", cors_origins=(UI,)),
    )
    return Settings(
        memory=base.memory, temporal=base.temporal, turn=base.turn, payload_encryption=encryption
    )


# -- whose payload: the workflow id ------------------------------------------------------------

USER_OF_KIND: dict[type, Any] = {
    TurnWorkflow: lambda user: turn_workflow_id(user, "t-1.2"),
    RotationWorkflow: lambda user: rotation_workflow_id(user, "human"),
    RotationSweepWorkflow: None,  # its schedule and runs carry user ids and labels only
    ForgetWorkflow: None,  # runs on after it destroyed the key; carries ids, who and why
    RedactWorkflow: redact_workflow_id,  # its input holds the text it removes
}
"""Every workflow the worker runs, and how its id names the user whose key encrypts it (None:
plain). A new kind of workflow must be placed here, or its payloads go out unencrypted."""


def test_every_workflow_kind_is_placed() -> None:
    assert set(USER_OF_KIND) == set(WORKFLOWS)


@pytest.mark.parametrize("user", ["alice", "a-b", "A_1", "x" * 64])
def test_the_user_of_a_workflow_is_read_from_its_id(user: str) -> None:
    for make_id in USER_OF_KIND.values():
        if make_id is not None:
            assert user_of_workflow(make_id(user)) == user
    for plain in (
        forget_workflow_id(user),
        legacy_turn_workflow_id(user, "t1"),  # ambiguous: 'a-b' + 'c' = 'a' + 'b-c'
        "durable-memory-rotation-sweep-run-2026-11-23T22:00:00Z",
        f"turn:{user}",
        f"turn:{user}:t1:more",
        f"turn:../{user}:t1",
        f"rotation-{user}-Bad-Label",
        "",
    ):
        assert user_of_workflow(plain) is None, plain


# -- keys ---------------------------------------------------------------------------------------


def test_one_key_per_user_wrapped_and_shredded_with_the_users_rows(engine: Engine) -> None:
    store = PayloadKeyStore(engine)
    keyring = Keyring(store, MASTER_KEY)
    alice_id, alice_key = keyring.key_for("alice")
    assert keyring.key_for("alice") == (alice_id, alice_key)  # made once
    bob_id, bob_key = keyring.key_for("bob")
    assert bob_id != alice_id
    assert bob_key != alice_key
    stored = store.for_user("alice")
    assert stored is not None
    assert alice_key not in stored.wrapped_key
    assert keyring.keys_by_id({alice_id, bob_id, "0" * 32}) == {
        alice_id: alice_key,
        bob_id: bob_key,
    }
    with pytest.raises(PayloadKeyError, match=r"wrapped by master key .* configured one is"):
        Keyring(store, bytes(32)).key_for("alice")

    ErasureLedger(engine).begin("alice", "dpo", "request 1")
    erase_user_rows(engine, "alice")  # the forget's rows step
    assert store.for_user("alice") is None
    assert keyring.keys_by_id({alice_id, bob_id}) == {bob_id: bob_key}  # hers is destroyed
    with pytest.raises(UserBeingForgotten):  # no key is made while the forget runs
        keyring.key_for("alice")
    assert store.for_user("alice") is None
    ErasureLedger(engine).complete("alice")
    with pytest.raises(UserForgotten):  # nor after it, by a late step of an old turn
        keyring.key_for("alice")
    assert store.for_user("alice") is None
    ErasureLedger(engine).readmit("alice")  # a caller starts her afresh
    assert keyring.key_for("alice")[0] != alice_id  # a new user of that id: a new key


# -- the codec, by serialization context ---------------------------------------------------------


def payload(value: str) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())


def activity_context(workflow_id: str | None) -> ActivitySerializationContext:
    return ActivitySerializationContext(
        namespace="default",
        activity_id="1",
        activity_type="dmem.prepare_turn",
        activity_task_queue="q",
        workflow_id=workflow_id,
        workflow_type="TurnWorkflow",
        is_local=False,
    )


async def test_the_codec_encrypts_for_the_user_of_the_context(tmp_path: Path) -> None:
    settings = encrypted_settings(tmp_path)
    converter = data_converter_for(settings)
    codec = converter.payload_codec
    assert isinstance(codec, UserPayloadCodec)
    plain = [payload(f"secret {CANARY}")]
    for context in (
        WorkflowSerializationContext(namespace="default", workflow_id="turn:alice:t1"),
        activity_context("rotation-alice-human"),
    ):
        sealed = await codec.with_context(context).encode(plain)
        assert sealed[0].metadata["encoding"] == ENCODING
        assert CANARY.encode() not in sealed[0].SerializeToString()
        assert await codec.decode(sealed) == plain  # no context needed to read it
        tampered = Payload()
        tampered.CopyFrom(sealed[0])
        tampered.data = sealed[0].data[:-1] + bytes([sealed[0].data[-1] ^ 1])
        with pytest.raises(PayloadKeyError, match="altered"):
            await codec.decode([tampered])
    for context in (
        WorkflowSerializationContext(namespace="default", workflow_id="forget:alice"),
        activity_context(None),  # an activity started by a client, not a workflow
    ):
        assert await codec.with_context(context).encode(plain) == plain
    assert await codec.encode(plain) == plain  # no context: no user
    assert await codec.decode(plain) == plain

    # Turned off with the master key kept: nothing new is encrypted, the old still reads.
    sealed = await codec.with_context(activity_context("turn:alice:t1")).encode(plain)
    off = data_converter_for(encrypted_settings(tmp_path, mode="off")).payload_codec
    assert isinstance(off, UserPayloadCodec)
    assert await off.with_context(activity_context("turn:alice:t1")).encode(plain) == plain
    assert await off.decode(sealed) == plain


# -- settings ---------------------------------------------------------------------------------


def test_encryption_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PAYLOAD_MASTER_KEY_ENV, raising=False)
    monkeypatch.delenv(CODEC_SERVER_TOKEN_ENV, raising=False)
    monkeypatch.delenv("DMEM_PAYLOAD_ENCRYPTION", raising=False)
    config = tmp_path / "temporal.yaml"
    config.write_text("payload_encryption: per_user\n")
    with pytest.raises(ConfigError, match="per_user needs the master key"):
        load_settings(config)
    monkeypatch.setenv(PAYLOAD_MASTER_KEY_ENV, "abc")
    with pytest.raises(ConfigError, match="64 hex characters"):
        load_settings(config)
    monkeypatch.setenv(PAYLOAD_MASTER_KEY_ENV, MASTER_KEY.hex())
    assert load_settings(config).payload_encryption.mode == "per_user"
    config.write_text("{}\n")
    assert load_settings(config).payload_encryption.mode == "off"  # the default
    config.write_text("payload_encryption: {mode: off}\n")  # YAML reads a bare off as false
    assert load_settings(config).payload_encryption.mode == "off"
    monkeypatch.setenv("DMEM_PAYLOAD_ENCRYPTION", "per_user")
    assert load_settings(config).payload_encryption.mode == "per_user"
    monkeypatch.setenv(CODEC_SERVER_TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="at least 32 characters"):
        codec_app_for(load_settings(config))


def test_dmem_codec_server_refuses_to_start_without_its_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DMEM_CONFIG", raising=False)
    monkeypatch.delenv("DMEM_PAYLOAD_ENCRYPTION", raising=False)
    monkeypatch.delenv(PAYLOAD_MASTER_KEY_ENV, raising=False)
    monkeypatch.setenv("DMEM_DATA_DIR", str(tmp_path / "data"))
    for token, master_key, missing in (
        (TOKEN, None, "no master key"),
        (None, MASTER_KEY.hex(), "a token of at least 32 characters"),
    ):
        for env, value in ((CODEC_SERVER_TOKEN_ENV, token), (PAYLOAD_MASTER_KEY_ENV, master_key)):
            if value is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, value)
        assert main(["codec-server", "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert missing in err
        assert err.count("\n") == 1


# -- a turn on a real Temporal dev server and worker ---------------------------------------------


def payloads_in(message: Message) -> Iterator[Payload]:
    """Every Payload anywhere in a protobuf message (history events nest them deeply), but
    search attributes': they are indexed by the server, never encoded, and hold ids only."""
    if isinstance(message, Payload):
        yield message
        return
    if isinstance(message, SearchAttributes):
        return
    if isinstance(message, MarkerRecordedEventAttributes):  # the SDK's own, see sdk_markers
        message = copy_without_sdk_data(message)
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            values = list(value.values())
        elif field.is_repeated:
            values = list(value)
        else:
            values = [value]
        for item in values:
            if isinstance(item, Message):
                yield from payloads_in(item)


SDK_MARKER_DATA = {"core_patch": "patch-data", "core_local_activity": "data"}
"""The marker details the SDK's core writes itself, past the codec: a patch's id, a local
activity's sequence number, type and time; never a value of ours (its result is encoded)."""


def copy_without_sdk_data(marker: MarkerRecordedEventAttributes) -> Message:
    copy = MarkerRecordedEventAttributes()
    copy.CopyFrom(marker)
    sdk_data = SDK_MARKER_DATA.get(marker.marker_name, "")
    if sdk_data in copy.details:
        del copy.details[sdk_data]
    return copy


async def raw_history(env: WorkflowEnvironment, workflow_id: str) -> list[Any]:
    """The history's events as the server keeps them: read without our codec."""
    raw: Client = await default_converter_client(env)
    return list((await raw.get_workflow_handle(workflow_id).fetch_history()).events)


def event_bytes(events: list[Any]) -> bytes:
    return b"".join(event.SerializeToString() for event in events)


def payloads_json(payloads: list[Payload]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json_format.MessageToJson(Payloads(payloads=payloads)))
    return body


@contextlib.asynccontextmanager
async def codec_server(settings: Settings) -> AsyncIterator[str]:
    """`dmem codec-server`'s app on uvicorn on a free loopback port; yields its URL."""
    config = uvicorn.Config(
        codec_app_for(settings), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def cli_show(env: WorkflowEnvironment, workflow_id: str, *codec: str) -> bytes:
    """`temporal workflow show --output json`, as an operator runs it (with `codec` options):
    the events' bytes (the JSON shows a payload's data in base64)."""
    process = await asyncio.create_subprocess_exec(
        str(temporal_binary()),
        "workflow",
        "show",
        "--address",
        env.client.service_client.config.target_host,
        "--namespace",
        env.client.namespace,
        "--workflow-id",
        workflow_id,
        "--output",
        "json",
        *codec,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, err.decode()
    history = json_format.Parse(out, History(), ignore_unknown_fields=True)
    return event_bytes(list(history.events))


async def test_an_encrypted_turn_shows_nothing_without_the_key_and_is_shredded_by_a_forget(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = encrypted_settings(tmp_path)
    address = temporal_env.client.service_client.config.target_host
    temporal = settings.temporal.model_copy(update={"address": address})
    settings = settings.model_copy(update={"temporal": temporal})
    client = await connect_temporal(settings)  # as `dmem worker` and MemoryClient connect
    workflow_id = turn_workflow_id("alice", "a1")
    async with running_rig(client, settings, SCRIPT) as rig, codec_server(settings) as url:
        reply = await rig.client.send_message("alice", f"My secret is {CANARY}", turn_id="a1")
        assert CANARY in reply.reply  # the caller, holding the key, reads it all
        outcome = await rig.client.approve(reply.diffs[0].id, "ms-rivera")  # Update, encrypted
        assert outcome is not None
        assert outcome.commit_sha

        # Read raw from the server: the message, the reply, the block value are nowhere, and
        # every payload of the turn is encrypted (the turn's static summary included).
        events = await raw_history(temporal_env, workflow_id)
        assert CANARY.encode() not in event_bytes(events)
        found = [p for event in events for p in payloads_in(event)]
        assert found
        assert all(p.metadata["encoding"] == ENCODING for p in found)
        assert CANARY.encode() not in await cli_show(temporal_env, workflow_id)

        # The codec server: with the token, from the UI's origin, the history reads again.
        body = payloads_json(found)
        http = httpx.AsyncClient(base_url=url, timeout=30)
        bearer = {"Authorization": f"Bearer {TOKEN}", "X-Namespace": "default"}
        preflight = await http.options(
            "/decode",
            headers={"Origin": UI, "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == UI
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        decoded = await http.post("/decode", json=body, headers={**bearer, "Origin": UI})
        assert decoded.status_code == 200, decoded.text
        assert decoded.headers["access-control-allow-origin"] == UI
        plain = json_format.Parse(decoded.text, Payloads()).payloads
        assert any(CANARY.encode() in p.data for p in plain)
        assert all(p.metadata["encoding"] != ENCODING for p in plain)
        shown = await cli_show(
            temporal_env, workflow_id, "--codec-endpoint", url, "--codec-auth", f"Bearer {TOKEN}"
        )
        assert CANARY.encode() in shown
        # ... and refuses without the token, with a wrong one, from another origin or namespace.
        for headers, status in (
            ({"X-Namespace": "default"}, 401),
            ({**bearer, "Authorization": "Bearer " + "x" * 40}, 401),
            ({**bearer, "Origin": "https://evil.example"}, 403),
            ({**bearer, "X-Namespace": "other"}, 403),
        ):
            refused = await http.post("/decode", json=body, headers=headers)
            assert refused.status_code == status, headers
            assert CANARY not in refused.text
            assert "access-control-allow-origin" not in refused.headers or status == 401
        evil_preflight = await http.options(
            "/decode",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert evil_preflight.status_code == 403
        assert "access-control-allow-origin" not in evil_preflight.headers
        assert (await http.post("/decode", content=b"{", headers=bearer)).status_code == 400
        too_many = {"payloads": [{"metadata": {}, "data": ""}] * (MAX_PAYLOADS + 1)}
        assert (await http.post("/decode", json=too_many, headers=bearer)).status_code == 413

        # While the forget runs, a turn of the user is refused before anything is encrypted.
        rig.stack.erasures.begin("carol", "dpo", "request 2")
        with pytest.raises(UserBeingForgotten):
            await rig.client.send_message("carol", f"hi {CANARY}", turn_id="c1")
        keys = PayloadKeyStore(rig.stack.engine)
        assert keys.for_user("carol") is None

        # The forget destroys alice's key: the history kept from before no longer reads.
        assert keys.for_user("alice") is not None
        await rig.client.forget_user("alice", "dpo@school", "erasure request 7")
        assert keys.for_user("alice") is None
        codec = client.data_converter.payload_codec
        assert isinstance(codec, UserPayloadCodec)
        with pytest.raises(PayloadKeyError, match="no longer exists"):
            await codec.decode(found)
        after = await http.post("/decode", json=body, headers=bearer)
        assert after.status_code == 200
        kept = json_format.Parse(after.text, Payloads()).payloads
        assert list(kept) == found  # answered still encrypted
        await http.aclose()


async def test_off_by_default_payloads_stay_plain_json(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    assert settings.payload_encryption.mode == "off"
    assert data_converter_for(settings).payload_codec is None
    async with running_rig(temporal_env.client, settings, SCRIPT[1:]) as rig:
        await rig.client.send_message("dora", f"My secret is {CANARY}", turn_id="d1")
        events = await raw_history(temporal_env, turn_workflow_id("dora", "d1"))
        found = [p for event in events for p in payloads_in(event)]
        assert {p.metadata["encoding"] for p in found} == {b"json/plain"}
        assert CANARY.encode() in event_bytes(events)  # what the encrypted test looks for
