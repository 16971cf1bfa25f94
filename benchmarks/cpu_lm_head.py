"""A tied LM head on CPU: XLA's default dots (YNNPACK) against XLA's own dot
(`compiler.CPU_COMPILER_OPTIONS`), by rows (RESULTS 7m).

The product is `[rows, hidden] x [vocab, hidden]^T`, the logits of a model
whose LM head is its embedding table (SmolLM2-135M's `[49152, 576]` by
default), float32, seeded random values; each form is compiled once per row
count and called in turn (`--calls` each, after one warm-up call), medians.
Its result decides `compiler.xla_dots_suit`.

  PYTHONPATH=. python -m benchmarks.cpu_lm_head [--rows 1,2,5,8,16,32]
      [--vocab 49152] [--hidden 576] [--calls 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_linear_chain import positive, row_counts
from paged_jax.serving import compiler


def _time(fn, *args) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--rows", type=row_counts, default="1,2,5,8,16,32")
  p.add_argument("--vocab", type=positive, default=49152)
  p.add_argument("--hidden", type=positive, default=576)
  p.add_argument("--calls", type=positive, default=9)
  args = p.parse_args(argv)
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.standard_normal((args.vocab, args.hidden), np.float32))
  head = jax.jit(lambda x, e: jax.lax.dot_general(x, e, (((1,), (1,)), ((), ()))))
  out = {}
  for rows in args.rows:
    x = jnp.asarray(rng.standard_normal((rows, args.hidden), np.float32))
    lowered = head.trace(x, table).lower()
    forms = {"ynnpack": lowered.compile(),
             "xla": lowered.compile(dict(compiler.CPU_COMPILER_OPTIONS))}
    times = {k: [] for k in forms}
    for f in forms.values():
      _time(f, x, table)
    for _ in range(args.calls):
      for k, f in forms.items():
        times[k].append(_time(f, x, table))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    out[rows] = ms
    print(f"rows {rows:>3}: YNNPACK {ms['ynnpack']:8.2f} ms  XLA's own dot "
          f"{ms['xla']:8.2f} ms  XLA / YNNPACK {ms['xla'] / ms['ynnpack']:.2f}", flush=True)
  return out


if __name__ == "__main__":
  main()
