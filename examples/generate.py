"""Batched generation with a paged KV cache: the first thing to run.

    python examples/generate.py [flags]

A thin script over `paged_jax.entrypoints.generate` (see its docstring and
`--help` for the flags).
"""

import sys

from paged_jax.entrypoints import generate

if __name__ == "__main__":
  sys.exit(generate.main())
