"""Compaction of a fragmented pool, and the host tier's copy bandwidth (CPU).

    PYTHONPATH=. python benchmarks/compaction.py           # ~2-4 min, loaded CPU
    PYTHONPATH=. python benchmarks/compaction.py --quick   # smoke test

Sections (results in benchmarks/results/compaction.json):

* compact: `compaction.compact` jitted, on a pool of `2**16` blocks of 16
  (1,024 slots, 128 blocks wide) filled by ragged sequences of which a random
  half is then released (prefix caching off, and on with every other
  sequence's full blocks registered before the release, so they are cached).
  Median wall of `--repeats` calls, the state donated.
* cache copy: `kv_cache.copy_blocks` of the compaction's moves (the first
  `num_moves` pairs, rounded up to a power of two), on a one-layer,
  one-KV-head bfloat16 cache of head dim 32 (2 KiB per block, K and V).
* swap copy: `kv_offload.copy_to_host` and `copy_to_device` of `k` blocks
  between a device cache (4 layers, 2 KV heads, block 16, head dim 64,
  bfloat16: 32 KiB per block) and a host cache in `host_memory_kind()`
  memory, against a second pool in device memory; bandwidth = bytes moved /
  median wall (dispatch to `block_until_ready`). Also the time the call
  takes to return (dispatch only: the copy is not awaited).
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from paged_jax import block_manager as bm
from paged_jax import compaction
from paged_jax import kv_offload
from paged_jax.kv_cache import KVCache, copy_blocks


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def fragmented(num_blocks, block_size, max_seqs, width, prefix_caching, seed=0):
  """A pool about 90% full of ragged sequences, then a random half released."""
  rng = np.random.default_rng(seed)
  state = bm.init(num_blocks=num_blocks, block_size=block_size,
                  max_seqs=max_seqs, max_blocks_per_seq=width,
                  prefix_caching=prefix_caching)
  budget = int(0.9 * num_blocks * block_size)
  lens = rng.integers(1, width * block_size, max_seqs)
  lens = np.minimum(lens, max(budget // max_seqs * 2, 1))
  state, _ = jax.jit(bm.reserve)(state, jnp.arange(max_seqs, dtype=jnp.int32),
                                 jnp.asarray(lens, jnp.int32))
  if prefix_caching:
    seqs = np.repeat(np.arange(0, max_seqs, 2), width).astype(np.int32)
    cols = np.tile(np.arange(width), max_seqs // 2 + max_seqs % 2
                   ).astype(np.int32)[:seqs.size]
    state, _ = jax.jit(bm.register)(state, jnp.asarray(seqs), jnp.asarray(cols))
  dropped = np.nonzero(rng.random(max_seqs) < 0.5)[0].astype(np.int32)
  state, _ = jax.jit(bm.release)(state, jnp.asarray(dropped))
  return state


def time_compact(state, repeats):
  fn = jax.jit(compaction.compact, donate_argnums=0)
  copy = lambda s: jax.tree.map(jnp.copy, s)
  jax.block_until_ready(fn(copy(state)))  # compile
  times = []
  for _ in range(repeats):
    s = jax.block_until_ready(copy(state))
    t0 = time.perf_counter()
    new, moves = jax.block_until_ready(fn(s))
    times.append(time.perf_counter() - t0)
  bm.check_invariants(new)
  return statistics.median(times), moves


def time_cache_copy(num_blocks, block_size, moves, repeats):
  m = int(moves.num_moves)
  bucket = 1 << max(m - 1, 0).bit_length()
  cache = KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=num_blocks,
                         block_size=block_size, head_dim=32, dtype=jnp.bfloat16)
  fn = jax.jit(copy_blocks, donate_argnums=0)
  src, dst = moves.src[:bucket], moves.dst[:bucket]
  cache = jax.block_until_ready(fn(cache, src, dst))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    cache = jax.block_until_ready(fn(cache, src, dst))
    times.append(time.perf_counter() - t0)
  block_bytes = cache.nbytes // num_blocks
  return statistics.median(times), bucket, block_bytes


def swap_bandwidth(sizes, repeats, pool_blocks):
  cache = KVCache.create(num_layers=4, num_kv_heads=2, num_blocks=pool_blocks,
                         block_size=16, head_dim=64, dtype=jnp.bfloat16)
  cache = cache.replace(k_pages=cache.k_pages + 1, v_pages=cache.v_pages + 2)
  block_bytes = cache.nbytes // pool_blocks
  kinds = [kv_offload.host_memory_kind(), "device"]
  hosts = {kind: kv_offload.host_cache(cache, pool_blocks, memory_kind=kind)
           for kind in kinds}
  rows = []
  for k in sizes:
    src = jnp.arange(k, dtype=jnp.int32)
    dst = jnp.asarray(np.random.default_rng(k).permutation(pool_blocks)[:k],
                      jnp.int32)
    samples = {(kind, d): [] for kind in kinds for d in ("out", "in")}
    dispatch = {key: [] for key in samples}
    for r in range(repeats + 1):  # interleaved: kinds and directions alternate
      for kind in kinds:
        for d in ("out", "in"):
          t0 = time.perf_counter()
          if d == "out":
            hosts[kind] = kv_offload.copy_to_host(cache, hosts[kind], src, dst)
            t1 = time.perf_counter()
            jax.block_until_ready(hosts[kind])
          else:
            cache = kv_offload.copy_to_device(cache, hosts[kind], dst, src)
            t1 = time.perf_counter()
            jax.block_until_ready(cache)
          t2 = time.perf_counter()
          if r:  # the first round compiles
            samples[(kind, d)].append(t2 - t0)
            dispatch[(kind, d)].append(t1 - t0)
    for (kind, d), ts in samples.items():
      med = statistics.median(ts)
      rows.append(dict(blocks=k, bytes=k * block_bytes, memory_kind=kind,
                       direction=d, median_s=med,
                       dispatch_s=statistics.median(dispatch[(kind, d)]),
                       gb_per_s=k * block_bytes / med / 1e9))
      log(f"swap {d:3s} {kind:12s} {k:5d} blocks ({k * block_bytes / 2**20:.1f}"
          f" MiB): {med * 1e3:.2f} ms, {rows[-1]['gb_per_s']:.2f} GB/s, returns"
          f" in {rows[-1]['dispatch_s'] * 1e6:.0f} us")
  return rows, block_bytes


def main():
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args()
  quick = args.quick
  num_blocks = 2**10 if quick else 2**16
  bs, max_seqs, width = 16, 64 if quick else 1024, 128
  out = {"compact": [], "devices": [str(d) for d in jax.devices()],
         "memory_kinds": [m.kind for m in jax.devices()[0].addressable_memories()]}
  for caching in (False, True):
    state = fragmented(num_blocks, bs, max_seqs, width, caching)
    used = int(state.num_used)
    cached = int(state.num_cached) if caching else 0
    secs, moves = time_compact(state, args.repeats)
    copy_s, bucket, block_bytes = time_cache_copy(num_blocks, bs, moves,
                                                  args.repeats)
    row = dict(num_blocks=num_blocks, prefix_caching=caching, live=used,
               cached=cached, moves=int(moves.num_moves), compact_s=secs,
               copy_pairs=bucket, copy_block_bytes=block_bytes, copy_s=copy_s)
    out["compact"].append(row)
    log(f"compact {num_blocks} blocks, caching={caching}: {used} live, "
        f"{cached} cached, {row['moves']} moves: {secs * 1e3:.2f} ms; copy "
        f"{bucket} pairs of {block_bytes} B: {copy_s * 1e3:.2f} ms")
  sizes = (16, 64) if quick else (64, 256, 1024)
  out["swap"], out["swap_block_bytes"] = swap_bandwidth(
      sizes, args.repeats, 256 if quick else 2048)
  path = common.write_json(args.out, "compaction", out, quick=quick)
  log(f"wrote {path}")


if __name__ == "__main__":
  main()
