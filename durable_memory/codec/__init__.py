"""Per-user payload encryption (`payload_encryption: per_user`, docs/governance.md): the
Temporal payload codec that encrypts the payloads of a user's workflows with that user's key
(`payload_codec.py`), the keys wrapped by a master key and kept in the memory database
(`keys.py`), and `dmem codec-server`, Temporal's codec-server protocol for the Web UI and
the CLI (`server.py`)."""

from durable_memory.codec.payload_codec import data_converter_for

__all__ = ["data_converter_for"]
