"""durable-memory: durable, human-approved, git-versioned memory for LLM agents."""

__version__ = "0.1.0"
