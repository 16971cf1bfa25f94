"""What the swap-aware step bookkeeping costs when nothing swaps, and one swap.

    PYTHONPATH=. python benchmarks/swap_bookkeeping.py          # ~1 min, loaded CPU
    PYTHONPATH=. python benchmarks/swap_bookkeeping.py --quick  # smoke test

A pool of 4,096 blocks of 16 (64 slots, 128 blocks wide), 32 live sequences
of 100-1,000 tokens, one decode step's bookkeeping (every sequence reserves
one token; no release, fork or prefix caching), `S = 8` rows for each of swap-out, swap-in and drop:

* device: `step.bookkeeping` against `swap_step.bookkeeping` with all-padding
  swaps, and with one sequence swapped out (jitted, not donated: each call
  copies the state, the same for all), median wall of calls interleaved
  round-robin;
* host: `HostPool.bookkeeping` against `HostTierPool.bookkeeping` (the
  scheduler's models) with no swap and with one swap-out, each call inside a
  trial rolled back.

Results in benchmarks/results/swap_bookkeeping.json.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from benchmarks import common
from paged_jax import block_manager as bm
from paged_jax import host_tier
from paged_jax.serving import step as step_lib
from paged_jax.serving import swap_step
from paged_jax.serving.host_pool import HostPool
from paged_jax.serving.host_tier_pool import HostTierPool

S = 8


def _setup(num_blocks, live, rng):
  state = bm.init(num_blocks=num_blocks, block_size=16, max_seqs=64,
                  max_blocks_per_seq=128)
  lens = rng.integers(100, 1000, size=live).astype(np.int32)
  state, _ = jax.jit(bm.reserve)(state, np.arange(live, dtype=np.int32), lens)
  tier = host_tier.init(state, num_host_blocks=num_blocks)
  ms = state.max_seqs
  pad = lambda n: np.full(n, -1, np.int32)
  args = (pad(0), pad(0), pad(ms), pad(32), pad(32), pad(ms), pad(0),
          np.zeros((0, 128), np.int32), np.ones(0, np.int32),
          np.arange(live, dtype=np.int32), np.ones(live, np.int32))
  return state, tier, args


def main():
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=30)
  args = p.parse_args()
  repeats = 5 if args.quick else args.repeats
  rng = np.random.default_rng(0)
  state, tier, bk = _setup(512 if args.quick else 4096, 32, rng)
  none, one = np.full(S, -1, np.int32), np.array([5] + [-1] * (S - 1), np.int32)
  plain = jax.jit(step_lib.bookkeeping)
  swapping = jax.jit(swap_step.bookkeeping)
  device = {
      "plain": lambda: jax.block_until_ready(plain(state, *bk)),
      "swap_aware_no_swap": lambda: jax.block_until_ready(
          swapping(state, tier, *bk, none, none, none)),
      "swap_aware_one_swap_out": lambda: jax.block_until_ready(
          swapping(state, tier, *bk, one, none, none)),
  }
  pool, tiers = HostPool(state), HostTierPool(tier)

  def host(fn):
    def run():
      pool.begin()
      tiers.begin()
      fn()
      tiers.rollback()
      pool.rollback()
    return run

  hosted = {
      "plain": host(lambda: pool.bookkeeping(*bk)),
      "swap_aware_no_swap": host(lambda: tiers.bookkeeping(pool, *bk, none, none, none)),
      "swap_aware_one_swap_out": host(lambda: tiers.bookkeeping(pool, *bk, one, none, none)),
  }
  out = {}
  for name, fns in (("device", device), ("host", hosted)):
    for fn in fns.values():  # compile / warm
      fn()
      fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved
      for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out[name] = {k: {"median_ms": 1e3 * v, "ratio_to_plain": v / med["plain"]}
                 for k, v in med.items()}
    print(name, {k: f"{1e3 * v:.3f} ms" for k, v in med.items()})
  path = common.write_json(args.out, "swap_bookkeeping",
                           {"repeats": repeats, "swap_rows": S, **out},
                           quick=args.quick)
  print("wrote", path)


if __name__ == "__main__":
  main()
