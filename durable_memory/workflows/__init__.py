"""workflows layer (see docs/architecture.md)."""
