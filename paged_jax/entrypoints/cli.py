"""The `paged-jax` command (`[project.scripts]`), vLLM-style subcommands:

    paged-jax generate [--model smollm2|tiny|DIR|FILE.gguf] [flags]
    paged-jax serve    [--model ...] [--host H] [--port P] [flags]
    paged-jax capacity --model llama-3.1-8b --mem-gib 80 ...

Each subcommand is its module's `main(argv)` (`paged_jax.entrypoints.generate`,
`paged_jax.entrypoints.openai.api_server`, `paged_jax.capacity`), so
`paged-jax generate --help` is generate's own help and its errors are its one
`error:` line, exit status 2.
"""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = """usage: paged-jax {generate,serve,capacity} [flags]

  generate   batched generation: a few chat answers, then paged vs contiguous
             KV cache on a synthetic workload (default model: smollm2)
  serve      the OpenAI-compatible HTTP server (/v1/completions,
             /v1/chat/completions, /v1/models; needs the `serve` extra)
  capacity   how many sequences fit in a device's memory, paged vs contiguous

`paged-jax SUBCOMMAND --help` lists that subcommand's flags."""


def _generate(argv):
  from paged_jax.entrypoints import generate  # pylint: disable=import-outside-toplevel
  return generate.main(argv)


def _serve(argv):
  try:
    from paged_jax.entrypoints.openai import api_server  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"error: paged-jax serve needs the `serve` extra (pip install "
          f"'paged-jax[serve]'): {e}", file=sys.stderr)
    return 2
  return api_server.main(argv)


def _capacity(argv):
  from paged_jax import capacity  # pylint: disable=import-outside-toplevel
  return capacity.main(argv)


COMMANDS = {"generate": _generate, "serve": _serve, "capacity": _capacity}


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `paged-jax ARGS`; returns the exit status (2: unknown subcommand)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command not in COMMANDS:
    print(f"error: unknown subcommand {command[:60]!r}; expected one of "
          f"{', '.join(COMMANDS)} (paged-jax --help)", file=sys.stderr)
    return 2
  code = COMMANDS[command](rest)
  return code if isinstance(code, int) else 0


if __name__ == "__main__":
  sys.exit(main())
