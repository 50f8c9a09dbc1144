"""The users' data keys: 256-bit AES keys, one per user, made on the first payload of theirs
that is encrypted and kept in the memory database wrapped (AES-GCM) by the master key from the
configuration. The wrapping binds the key to its user and id, so a row moved to another user
or id no longer unwraps.

Why wrapped: the database and its backups then hold no usable key; reading a user's turns
takes the database, the master key and Temporal's histories together. Why the key is a row
and not derived from the master key: deleting the row destroys it (crypto-shredding), which a
derivation could never do.
"""

import hashlib
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from durable_memory.faults import MID_REWRAP, crash_point
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.store.users import PayloadKeyStore, StoredKey

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
REWRAP_BATCH = 500
"""Keys re-wrapped per transaction by `dmem rewrap-keys`."""


class PayloadKeyError(DurableMemoryError):
    """A payload or a key that cannot be decrypted: the key was destroyed (its user was
    forgotten), another master key wrapped it, or the bytes were altered."""


def master_key_id(master_key: bytes) -> str:
    """A fingerprint of the master key, stored beside each key it wraps."""
    return hashlib.sha256(b"dmem-master-key-id\0" + master_key).hexdigest()[:16]


def _aes_gcm(key: bytes) -> "AESGCM":
    """cryptography is imported at the first payload or key sealed or unsealed, not with the
    codec: every worker and client imports the codec, and a deployment that does not encrypt
    would carry its ~8 MiB for nothing (docs/benchmarks.md, memory)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-GCM with a random nonce: nonce || ciphertext || tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + _aes_gcm(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes, what: str) -> bytes:
    from cryptography.exceptions import InvalidTag  # see _aes_gcm

    try:
        return _aes_gcm(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise PayloadKeyError(f"{what} does not decrypt: its bytes were altered") from None


@dataclass(frozen=True)
class RewrapReport:
    previous_master_key_id: str
    master_key_id: str
    rewrapped: int
    """Keys now wrapped by the master key that the previous one wrapped."""
    already: int
    """Keys the master key wrapped already (made since the rotation began, or re-wrapped by
    an earlier run)."""
    unreadable: tuple[str, ...]
    """Ids of keys wrapped by the previous master key that it does not open: left as they
    are."""


def _associated(key_id: str, user_id: str) -> bytes:
    """What a wrapping is bound to: the key's user and id."""
    return f"dmem-data-key:{user_id}:{key_id}".encode()


class Keyring:
    """The users' data keys, unwrapped on demand (nothing is cached: a key deleted by a
    forget is unusable by every process at once).

    Every key it makes is wrapped by the master key. During a master-key rotation it also
    holds the previous master key, so it reads a key whichever of the two wraps it (each row
    names its master key): `dmem rewrap-keys` can then move the rows over one by one while
    the deployment runs."""

    def __init__(
        self, store: PayloadKeyStore, master_key: bytes, previous_master_key: bytes | None = None
    ) -> None:
        self.store = store
        self._master = master_key
        self._master_id = master_key_id(master_key)
        self._masters = {self._master_id: master_key}
        self._previous_id = None
        if previous_master_key is not None:
            self._previous_id = master_key_id(previous_master_key)
            self._masters.setdefault(self._previous_id, previous_master_key)

    def _unwrap(self, stored: StoredKey) -> bytes:
        master = self._masters.get(stored.master_key_id)
        if master is None:
            raise PayloadKeyError(
                f"the key {stored.key_id} was wrapped by master key {stored.master_key_id}, "
                f"but the configured one is {self._master_id}: configure the master key the "
                "deployment encrypted with (payload_encryption.master_key_file; while it is "
                "being replaced, the old one as previous_master_key_file)"
            )
        associated = _associated(stored.key_id, stored.user_id)
        return unseal(master, stored.wrapped_key, associated, f"the key {stored.key_id}")

    def _wrap(self, key_id: str, user_id: str, key: bytes) -> StoredKey:
        """The key wrapped by the master key."""
        wrapped = seal(self._master, key, _associated(key_id, user_id))
        return StoredKey(key_id, user_id, wrapped, self._master_id)

    def key_for(self, user_id: str) -> tuple[str, bytes]:
        """(key id, key) of the user, made now if they have none."""
        stored = self.store.for_user(user_id)
        if stored is None:
            key_id = secrets.token_hex(16)
            stored = self.store.add(self._wrap(key_id, user_id, secrets.token_bytes(32)))
        return stored.key_id, self._unwrap(stored)

    def keys_by_id(self, key_ids: set[str]) -> dict[str, bytes]:
        """The keys of these ids that still exist, unwrapped; a destroyed one is absent."""
        return {key_id: self._unwrap(s) for key_id, s in self.store.by_ids(key_ids).items()}

    def rewrap(self, *, batch: int = REWRAP_BATCH) -> RewrapReport:
        """Wrap every key the previous master key wraps by the master key instead, `batch`
        rows a transaction (idempotent and resumable: a rerun finds the rows still wrapped by
        the previous key). Refused, with nothing changed, without a previous key, or when a
        row is wrapped by a third master key. A row the previous key does not open (altered
        bytes) is left as it is and reported."""
        previous_id = self._previous_id
        if previous_id is None:
            raise PayloadKeyError(
                "no previous master key is configured (payload_encryption."
                "previous_master_key_file or $DMEM_PAYLOAD_PREVIOUS_MASTER_KEY): there is "
                "nothing to re-wrap from"
            )
        if previous_id == self._master_id:
            raise PayloadKeyError(
                f"the previous master key is the master key ({previous_id}): configure the new "
                "one as payload_encryption.master_key_file and the old one as "
                "previous_master_key_file"
            )
        counts = self.store.count_by_master_key()
        foreign = {m: n for m, n in counts.items() if m not in self._masters}
        if foreign:
            raise PayloadKeyError(
                "key(s) wrapped by neither the master key nor the previous one: "
                + ", ".join(f"{n} by {m}" for m, n in sorted(foreign.items()))
                + f" (the master key is {self._master_id}, the previous {previous_id}); "
                "configure the master keys these were wrapped with"
            )
        rewrapped, unreadable, after = 0, [], ""
        while found := self.store.wrapped_by(previous_id, after, batch):
            after = found[-1].key_id
            moved = []
            for stored in found:
                try:
                    key = self._unwrap(stored)
                except PayloadKeyError:
                    unreadable.append(stored.key_id)
                    continue
                moved.append((stored, self._wrap(stored.key_id, stored.user_id, key)))
            rewrapped += self.store.rewrap(moved)
            crash_point(MID_REWRAP)
        return RewrapReport(
            previous_master_key_id=previous_id,
            master_key_id=self._master_id,
            rewrapped=rewrapped,
            already=counts.get(self._master_id, 0),
            unreadable=tuple(unreadable),
        )
