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

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.store.users import PayloadKeyStore, StoredKey

NONCE_BYTES = 12


class PayloadKeyError(DurableMemoryError):
    """A payload or a key that cannot be decrypted: the key was destroyed (its user was
    forgotten), another master key wrapped it, or the bytes were altered."""


def master_key_id(master_key: bytes) -> str:
    """A fingerprint of the master key, stored beside each key it wraps."""
    return hashlib.sha256(b"dmem-master-key-id\0" + master_key).hexdigest()[:16]


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-GCM with a random nonce: nonce || ciphertext || tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes, what: str) -> bytes:
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise PayloadKeyError(f"{what} does not decrypt: its bytes were altered") from None


class Keyring:
    """The users' data keys, unwrapped on demand (nothing is cached: a key deleted by a
    forget is unusable by every process at once)."""

    def __init__(self, store: PayloadKeyStore, master_key: bytes) -> None:
        self.store = store
        self._master = master_key
        self._master_id = master_key_id(master_key)

    def _unwrap(self, stored: StoredKey) -> bytes:
        if stored.master_key_id != self._master_id:
            raise PayloadKeyError(
                f"the key {stored.key_id} was wrapped by master key {stored.master_key_id}, "
                f"but the configured one is {self._master_id}: configure the master key the "
                "deployment encrypted with (payload_encryption.master_key_file)"
            )
        associated = f"dmem-data-key:{stored.user_id}:{stored.key_id}".encode()
        return unseal(self._master, stored.wrapped_key, associated, f"the key {stored.key_id}")

    def key_for(self, user_id: str) -> tuple[str, bytes]:
        """(key id, key) of the user, made now if they have none."""
        stored = self.store.for_user(user_id)
        if stored is None:
            key_id = secrets.token_hex(16)
            associated = f"dmem-data-key:{user_id}:{key_id}".encode()
            wrapped = seal(self._master, secrets.token_bytes(32), associated)
            stored = self.store.add(StoredKey(key_id, user_id, wrapped, self._master_id))
        return stored.key_id, self._unwrap(stored)

    def keys_by_id(self, key_ids: set[str]) -> dict[str, bytes]:
        """The keys of these ids that still exist, unwrapped; a destroyed one is absent."""
        return {key_id: self._unwrap(s) for key_id, s in self.store.by_ids(key_ids).items()}
