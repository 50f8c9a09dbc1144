"""activities layer (see docs/architecture.md)."""
