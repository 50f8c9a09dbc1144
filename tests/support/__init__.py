"""Shared test support: rigs (Temporal, workers, PostgreSQL), snapshots, helpers."""
