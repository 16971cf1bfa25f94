"""An OpenAI-compatible HTTP server over the paged-KV engine.

    pip install -e ".[serve]"
    python examples/serve.py                      # the tiny model, 127.0.0.1:8000
    python examples/serve.py --checkpoint DIR     # a Hugging Face Llama

A thin script over `paged_jax.entrypoints.openai.api_server` (see its
docstring and `--help` for the endpoints and flags).
"""

import sys

from paged_jax.entrypoints.openai import api_server

if __name__ == "__main__":
  sys.exit(api_server.main())
