"""Archival memory: the store protocol, the embedded SQLite store, Weaviate, embedders."""
