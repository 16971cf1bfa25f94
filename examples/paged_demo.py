"""A tour of paged-jax in one jitted loop: allocate, fork, write, attend, release.

Run: `python examples/paged_demo.py`. It decodes random K/V for a few
sequences of different lengths through the block manager and the paged cache,
checks every step against the float32 reference, and prints what it did.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import paged_jax as pj
from paged_jax import block_manager as bm
from paged_jax import kv_cache


@functools.partial(jax.jit, donate_argnums=(0, 1))
def decode_step(state, cache, seq_ids, q, k, v):
  """One token for each of `seq_ids`: reserve, copy-on-write, write, attend."""
  state, res = bm.reserve(state, seq_ids, jnp.ones_like(seq_ids))
  cache = kv_cache.copy_blocks(cache, res.copy_src, res.copy_dst)
  tables, lens = bm.gather_tables(state, seq_ids)
  slots = bm.slot_mapping(state, seq_ids, lens - 1)
  kp, vp = kv_cache.write_kv(cache.k_pages[0], cache.v_pages[0], k, v, slots)
  cache = cache.replace(k_pages=cache.k_pages.at[0].set(kp),
                        v_pages=cache.v_pages.at[0].set(vp))
  out = pj.paged_attention(q, kp, vp, tables, lens)
  return state, cache, out, res.ok


def main():
  rng = np.random.default_rng(0)
  heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
  state = bm.init(num_blocks=64, block_size=block_size, max_seqs=8,
                  max_blocks_per_seq=16)
  cache = kv_cache.KVCache.create(num_layers=1, num_kv_heads=kv_heads,
                                  num_blocks=64, block_size=block_size,
                                  head_dim=head_dim, dtype=jnp.float32)
  seq_ids = jnp.arange(4, dtype=jnp.int32)
  budgets = np.array([5, 40, 90, 17])  # tokens each sequence will generate
  worst = 0.0
  for step in range(int(budgets.max())):
    live = budgets > step
    ids = jnp.where(jnp.asarray(live), seq_ids, -1)  # -1: an idle batch slot
    q = jnp.asarray(rng.standard_normal((4, heads, head_dim), np.float32))
    k = jnp.asarray(rng.standard_normal((4, kv_heads, head_dim), np.float32))
    v = jnp.asarray(rng.standard_normal((4, kv_heads, head_dim), np.float32))
    state, cache, out, ok = decode_step(state, cache, ids, q, k, v)
    tables, lens = bm.gather_tables(state, ids)
    ref = pj.reference.paged_attention_reference(
        q, cache.k_pages[0], cache.v_pages[0], tables, lens)
    worst = max(worst, float(np.max(np.abs(np.asarray(out)[live] - ref[live]))))
    if step == 20:
      state, forked = bm.fork(state, jnp.array([2]), jnp.array([5]))
      print(f"step {step}: forked sequence 2 into slot 5 (ok={bool(forked[0])}),"
            f" {bm.usage(state)['blocks_used']} blocks in use, shared")
    done = np.nonzero(budgets == step + 1)[0]
    if len(done):
      state, _ = bm.release(state, jnp.asarray(done, jnp.int32))
      print(f"step {step}: sequences {done.tolist()} finished, blocks released; "
            f"usage {bm.usage(state)}")
  bm.check_invariants(state)
  state, _ = bm.release(state, jnp.array([5]))
  bm.check_invariants(state)
  print(f"decoded {int(budgets.sum())} tokens in {int(budgets.max())} jitted "
        f"steps; max |paged - reference| = {worst:.2e}; "
        f"blocks free at the end: {int(state.num_free)}/{state.num_blocks}")


if __name__ == "__main__":
  main()
