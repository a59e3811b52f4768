"""kiln: a local LLM runtime that shows where the time goes."""

__version__ = "0.1.0"
