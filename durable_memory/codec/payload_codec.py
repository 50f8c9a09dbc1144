"""The payload codec of `payload_encryption: per_user`: every payload of a user's workflow is
encrypted (AES-256-GCM) with that user's key before it leaves the process, and decrypted when
it comes back; Temporal's server, its persistence, archives and backups hold only ciphertext.

Whose payload it is comes from the SDK's serialization context, the workflow id, on every
path that has one (temporalio 1.35): the client's start, signal, update, query and result of a
workflow, and in the worker a workflow's own payloads, its activities' input and output,
heartbeats, child workflows (the child's id) and failures. Which ids name a user is
`user_of_workflow`. A payload with no user is left as it is, in plain JSON:

- a workflow whose id names no user: the rotation sweep (its schedule and runs carry only
  user ids and labels), a forget (`forget:<user>`: it carries ids, who asked and why, and
  must run on after it has destroyed the key), a turn started under the legacy id
  `turn-<user>-<turn>` (ambiguous: a user id may hold '-');
- a payload encoded without a context: a schedule's memo, and `/encode` of the codec server
  (the Web UI sends no workflow id).

Decryption needs no context: an encrypted payload names its key (a random id, never the
user), so the codec server and any process with the database and the master key read it. A
failure's message and stack trace are moved into an encoded payload too (the SDK's
`DefaultFailureConverterWithEncodedAttributes`): error messages may quote a block's text.
"""

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Self

from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import (
    ActivitySerializationContext,
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    PayloadCodec,
    SerializationContext,
    WithSerializationContext,
    WorkflowSerializationContext,
)

from durable_memory.bootstrap import payload_keys_from_settings
from durable_memory.codec.keys import Keyring, PayloadKeyError, seal, unseal
from durable_memory.config import PAYLOAD_MASTER_KEY_ENV, ConfigError, Settings
from durable_memory.models.ids import LABEL, USER_ID
from durable_memory.models.turn import ID_SEPARATOR

ENCODING = b"binary/encrypted"
"""The `encoding` of an encrypted payload (Temporal's convention for encrypting codecs)."""
KEY_ID = "encryption-key-id"
"""The metadata key naming the data key an encrypted payload needs."""
TURN_PREFIX = f"turn{ID_SEPARATOR}"
ROTATION_PREFIX = "rotation-"
REDACT_PREFIX = f"redact{ID_SEPARATOR}"


def user_of_workflow(workflow_id: str) -> str | None:
    """The user whose key encrypts a workflow's payloads, read from its id: a turn
    (`turn:<user>:<turn>`, models/turn.py `turn_workflow_id`), a rotation
    (`rotation-<user>-<label>`) or a redaction (`redact:<user>`). None for every other id
    (see the module)."""
    if workflow_id.startswith(TURN_PREFIX):
        parts = workflow_id.split(ID_SEPARATOR)
        user = parts[1] if len(parts) == 3 else ""
    elif workflow_id.startswith(REDACT_PREFIX):  # its input holds the text it removes
        user = workflow_id.removeprefix(REDACT_PREFIX)
    elif workflow_id.startswith(ROTATION_PREFIX):
        # A label has no '-': the last one ends the user id.
        user, _, label = workflow_id.removeprefix(ROTATION_PREFIX).rpartition("-")
        if not LABEL.pattern.fullmatch(label):
            return None
    else:
        return None
    return user if USER_ID.pattern.fullmatch(user) else None


def user_of_context(context: SerializationContext) -> str | None:
    if isinstance(context, WorkflowSerializationContext | ActivitySerializationContext):
        return user_of_workflow(context.workflow_id) if context.workflow_id else None
    return None


class UserPayloadCodec(PayloadCodec, WithSerializationContext):
    """Encrypts for the user of its serialization context (when `encrypt`); decrypts any
    payload whose key still exists. Key lookups run off the event loop, one per call."""

    def __init__(self, keyring: Keyring, *, encrypt: bool, user_id: str | None = None) -> None:
        self.keyring = keyring
        self.encrypt = encrypt
        self.user_id = user_id

    def with_context(self, context: SerializationContext) -> Self:
        return type(self)(self.keyring, encrypt=self.encrypt, user_id=user_of_context(context))

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if not self.encrypt or self.user_id is None or not payloads:
            return list(payloads)
        key_id, key = await asyncio.to_thread(self.keyring.key_for, self.user_id)
        return [
            Payload(
                metadata={"encoding": ENCODING, KEY_ID: key_id.encode()},
                data=seal(key, payload.SerializeToString(), _associated(key_id)),
            )
            for payload in payloads
        ]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """PayloadKeyError for a payload whose key is destroyed (its user was forgotten)."""
        return await self._decode(payloads, keep_undecryptable=False)

    async def decode_for_view(self, payloads: Sequence[Payload]) -> list[Payload]:
        """As `decode`, but a payload whose key is destroyed is returned still encrypted: what
        the codec server answers, so the UI shows the rest of a history."""
        return await self._decode(payloads, keep_undecryptable=True)

    async def _decode(
        self, payloads: Sequence[Payload], *, keep_undecryptable: bool
    ) -> list[Payload]:
        wanted = {key_id_of(p) for p in payloads if p.metadata.get("encoding") == ENCODING}
        keys = await asyncio.to_thread(self.keyring.keys_by_id, wanted) if wanted else {}
        decoded = []
        for payload in payloads:
            if payload.metadata.get("encoding") != ENCODING:
                decoded.append(payload)
                continue
            key_id = key_id_of(payload)
            key = keys.get(key_id)
            if key is None:
                if keep_undecryptable:
                    decoded.append(payload)
                    continue
                raise PayloadKeyError(
                    f"a payload needs the key {key_id}, which no longer exists: its user was "
                    "forgotten (the key was destroyed), or this is another deployment's database"
                )
            inner = Payload()
            inner.ParseFromString(
                unseal(key, payload.data, _associated(key_id), f"a payload of key {key_id}")
            )
            decoded.append(inner)
        return decoded


def key_id_of(payload: Payload) -> str:
    """The id of the key an encrypted payload names."""
    return payload.metadata.get(KEY_ID, b"").decode("ascii", "replace")


def _associated(key_id: str) -> bytes:
    return f"dmem-payload:{key_id}".encode()


def keyring_for(settings: Settings) -> Keyring | None:
    """The users' keys under the configured master key (and, while it is being replaced, the
    previous one); None when no master key is configured. A previous master key alone is a
    ConfigError: it is only ever read beside its successor."""
    encryption = settings.payload_encryption
    master_key = encryption.master_key()
    previous = encryption.previous_master_key()
    if master_key is None:
        if previous is not None:
            raise ConfigError(
                "payload_encryption: a previous master key is configured but no master key: "
                f"set {PAYLOAD_MASTER_KEY_ENV} or master_key_file to the new one"
            )
        return None
    return Keyring(payload_keys_from_settings(settings), master_key, previous)


def payload_codec_for(settings: Settings) -> UserPayloadCodec | None:
    """The codec for the settings: None when no master key is configured (plain JSON, as
    before); a decrypting one when the mode is off but a master key remains (payloads
    encrypted before the mode was turned off still read); an encrypting one for per_user."""
    keyring = keyring_for(settings)
    if keyring is None:
        return None
    return UserPayloadCodec(keyring, encrypt=settings.payload_encryption.mode == "per_user")


def data_converter_for(settings: Settings) -> DataConverter:
    """What every Temporal client and worker of the deployment converts payloads with: the
    pydantic converter, with the codec when one is configured."""
    codec = payload_codec_for(settings)
    if codec is None:
        return pydantic_data_converter
    if not codec.encrypt:
        return dataclasses.replace(pydantic_data_converter, payload_codec=codec)
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )
