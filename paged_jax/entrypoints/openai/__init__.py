"""The OpenAI-compatible HTTP server (`api_server`)."""
