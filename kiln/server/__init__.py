"""`kiln serve`: OpenAI- and Ollama-compatible HTTP APIs over the batching scheduler."""
