"""workers layer (see docs/architecture.md)."""
