"""XLA paged decode vs dense contiguous decode, and block-manager cost vs pool size.

Measured in one run so the ratios share the machine's noise:

1. `paged_attention(implementation="xla")` over random non-contiguous block
   tables vs dense decode attention on the same tokens held contiguously
   (`[batch, kv_heads, kv_len, head_dim]`), for block sizes 8-64, batch 1-64,
   context 256-8192 (a sampled grid with issue #21's shapes in it; `--full`
   for the whole product, `--goal` for issue #21's five shapes alone). The
   two are interleaved (dense, paged, dense, ...): a round's ratio is the
   paged time over the mean of the dense runs either side of it, and the
   ratio reported is the median over rounds.
2. `reserve` for a batch of 64 (jitted, state donated) at num_blocks 2**10 and
   2**20: the cost must not grow with the pool.

`--cpu-time` times process CPU seconds with XLA on one thread (steadier than
wall time on a loaded machine: time spent descheduled is not counted).

Writes `benchmarks/results/xla_decode.json` (`xla_decode_goal.json` with
`--goal`) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention
from paged_jax import block_manager as bm

HERE = os.path.dirname(os.path.abspath(__file__))


# Issue #21's shapes (batch, context), block_size 16.
GOAL_SHAPES = [(1, 2048), (1, 8192), (8, 2048), (8, 8192), (32, 4096)]
CLOCK = time.perf_counter


def interleaved(paged, dense, reps, warmup=2):
  """(median paged s, median dense s, median of per-round paged / dense).

  Rounds run dense, paged, dense, ...; each paged run is divided by the mean
  of the dense runs either side of it, so slow drifts of the machine's load
  cancel."""
  for _ in range(warmup):
    jax.block_until_ready(paged())
    jax.block_until_ready(dense())

  def timed(fn):
    t0 = CLOCK()
    jax.block_until_ready(fn())
    return CLOCK() - t0

  t_dense = [timed(dense)]
  t_paged, ratios = [], []
  for _ in range(reps):
    t_paged.append(timed(paged))
    t_dense.append(timed(dense))
    ratios.append(t_paged[-1] / (0.5 * (t_dense[-2] + t_dense[-1])))
  return (float(np.median(t_paged)), float(np.median(t_dense)),
          float(np.median(ratios)))


@jax.jit
def dense_decode(q, k, v):
  """q [b, hq, d]; k, v [b, hkv, L, d] (the best contiguous layout for XLA):
  plain softmax attention, all L tokens visible."""
  b, hq, d = q.shape
  hkv = k.shape[1]
  qg = q.reshape(b, hkv, hq // hkv, d)
  s = jnp.einsum("bhgd,bhld->bhgl", qg, k) * d**-0.5
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhgl,bhld->bhgd", p, v).reshape(b, hq, d)


def bench_decode(batch, context, block_size, hq=8, hkv=2, d=128, seed=0):
  rng = np.random.default_rng(seed)
  nb = context // block_size
  num_blocks = batch * nb
  k = jnp.asarray(rng.standard_normal((batch, context, hkv, d), np.float32))
  v = jnp.asarray(rng.standard_normal((batch, context, hkv, d), np.float32))
  q = jnp.asarray(rng.standard_normal((batch, hq, d), np.float32))
  # Scatter the same tokens into randomly permuted blocks.
  perm = rng.permutation(num_blocks).reshape(batch, nb)
  inv = np.argsort(perm.reshape(-1))

  def to_pages(x):
    x = x.reshape(batch * nb, block_size, hkv, d)[inv]
    return jnp.transpose(x, (2, 0, 1, 3))

  k_pages, v_pages = to_pages(k), to_pages(v)
  tables = jnp.asarray(perm, jnp.int32)
  lens = jnp.full((batch,), context, jnp.int32)
  paged = jax.jit(functools.partial(attention.paged_attention,
                                    implementation="xla"))
  k, v = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
  err = float(jnp.max(jnp.abs(paged(q, k_pages, v_pages, tables, lens)
                              - dense_decode(q, k, v))))
  assert err < 1e-4, err
  reps = 7 if batch * context >= 2**18 else 21
  t_paged, t_dense, ratio = interleaved(
      lambda: paged(q, k_pages, v_pages, tables, lens),
      lambda: dense_decode(q, k, v), reps)
  return dict(batch=batch, context=context, block_size=block_size,
              paged_ms=t_paged * 1e3, dense_ms=t_dense * 1e3,
              ratio=ratio, max_abs_err=err)


def bench_reserve(num_blocks, batch=64, reps=200):
  """Median time of one jitted, donated reserve + release of `batch` sequences."""
  state = bm.init(num_blocks=num_blocks, block_size=16, max_seqs=batch,
                  max_blocks_per_seq=64)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, ids, n):
    state, res = bm.reserve(state, ids, n)
    state, ok = bm.release(state, ids)
    return state, res.ok & ok

  ids = jnp.arange(batch, dtype=jnp.int32)
  n = jnp.full((batch,), 100, jnp.int32)  # 7 blocks each
  for _ in range(3):
    state, ok = step(state, ids, n)
  assert bool(jnp.all(ok))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, ok = step(state, ids, n)
    ok.block_until_ready()
    times.append(time.perf_counter() - t0)
  bm.check_invariants(state)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--full", action="store_true", help="whole grid")
  parser.add_argument("--quick", action="store_true", help="tiny smoke run")
  parser.add_argument("--goal", action="store_true",
                      help="issue #21's five shapes only, no reserve timing")
  parser.add_argument("--cpu-time", action="store_true",
                      help="process CPU time, XLA on one thread")
  args = parser.parse_args()
  global CLOCK
  if args.cpu_time:
    # Read when the CPU client starts, i.e. at the first computation below.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1")
    CLOCK = time.process_time
  if args.goal:
    grid = [(b, c, 16) for b, c in GOAL_SHAPES]
  elif args.quick:
    grid = [(1, 256, 16), (8, 512, 8)]
  elif args.full:
    grid = list(itertools.product([1, 8, 64], [256, 1024, 8192],
                                  [8, 16, 32, 64]))
  else:
    grid = ([(b, c, 16) for b in (1, 8, 64) for c in (256, 1024, 8192)]
            + [(8, 1024, bs) for bs in (8, 32, 64)]
            + [(64, 4096, bs) for bs in (8, 32, 64)]
            + [(b, c, 16) for b, c in GOAL_SHAPES if c not in (256, 1024, 8192)])
  rows = []
  print(f"{'batch':>5} {'ctx':>5} {'bs':>3} {'paged ms':>9} {'dense ms':>9} "
        f"{'ratio':>6}")
  for b, c, bs in grid:
    r = bench_decode(b, c, bs)
    rows.append(r)
    print(f"{b:5d} {c:5d} {bs:3d} {r['paged_ms']:9.3f} {r['dense_ms']:9.3f} "
          f"{r['ratio']:6.2f}", flush=True)
  meta = dict(
      machine=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
      backend=jax.default_backend(), date=time.strftime("%Y-%m-%d"),
      clock="process CPU time, 1 XLA thread" if args.cpu_time else "wall")
  os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
  if args.goal:
    with open(os.path.join(HERE, "results", "xla_decode_goal.json"), "w") as f:
      json.dump(dict(meta, decode=rows), f, indent=1)
    return
  sizes = [2**10, 2**20] if not args.quick else [2**10, 2**14]
  reserve = {n: bench_reserve(n, reps=50 if args.quick else 300) for n in sizes}
  ratio = reserve[sizes[-1]] / reserve[sizes[0]]
  for n, t in reserve.items():
    print(f"reserve+release, batch 64, num_blocks={n}: {t * 1e6:.1f} us")
  print(f"reserve cost ratio {sizes[-1]}/{sizes[0]} blocks: {ratio:.2f}")
  out = dict(
      meta, decode=rows,
      reserve_us={str(n): t * 1e6 for n, t in reserve.items()},
      reserve_ratio=ratio)
  name = "xla_decode_quick.json" if args.quick else "xla_decode.json"
  with open(os.path.join(HERE, "results", name), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
