"""The sampler alone (`sampling.sample_tokens`), by setting: what a step pays
to pick its tokens over a real vocabulary (RESULTS 7p).

`--rows` rows of `--vocab` logits (SmolLM2's 49,152 by default), float32,
seeded: `flat` rows are N(0, 1) (at temperature 0.7 a top-p of 0.9 keeps
tens of thousands of tokens: the sampler's worst case), `peaked` rows
N(0, 4) (a few hundred). Settings: greedy; temperature 0.7; with top-k 50;
with top-p 0.9; with both. Each compiled once, called `--calls` times in
turn after a warm-up, medians in ms.

It imports only the installed API, so the same file times two checkouts
(run it with each on PYTHONPATH, interleaved):

  PYTHONPATH=. python -m benchmarks.sampler_cost [--rows 1,8,32] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_linear_chain import positive, row_counts
from paged_jax.serving import sampling

SETTINGS = {"greedy": (0.0, 0, 1.0), "temperature 0.7": (0.7, 0, 1.0),
            "top-k 50": (0.7, 50, 1.0), "top-p 0.9": (0.7, 0, 0.9),
            "top-k 50, top-p 0.9": (0.7, 50, 0.9)}
SCALES = {"flat": 1.0, "peaked": 4.0}


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--rows", type=row_counts, default="1,8,32")
  p.add_argument("--vocab", type=positive, default=49152)
  p.add_argument("--calls", type=positive, default=7)
  p.add_argument("--tag", default="")
  args = p.parse_args(argv)
  fn = jax.jit(sampling.sample_tokens)
  out = []
  for kind, scale in SCALES.items():
    for rows in args.rows:
      logits = jnp.asarray(np.random.default_rng(rows).standard_normal(
          (rows, args.vocab)).astype(np.float32) * scale)
      calls = {}
      for name, (t, k, top_p) in SETTINGS.items():
        a = (logits, jnp.full(rows, t, jnp.float32), jnp.full(rows, k, jnp.int32),
             jnp.full(rows, top_p, jnp.float32), jnp.arange(rows, dtype=jnp.int32),
             jnp.arange(rows, dtype=jnp.int32))
        jax.block_until_ready(fn(*a))
        calls[name] = a
      times = {n: [] for n in calls}
      for _ in range(args.calls):
        for n, a in calls.items():
          s = time.perf_counter()
          jax.block_until_ready(fn(*a))
          times[n].append(time.perf_counter() - s)
      row = {"tag": args.tag, "logits": kind, "rows": rows, "vocab": args.vocab,
             "ms": {n: round(1e3 * statistics.median(v), 3) for n, v in times.items()}}
      print(json.dumps(row), flush=True)
      out.append(row)
  return out


if __name__ == "__main__":
  main()
