"""The float32 reference, batched so that a test pays one compile, not hundreds.

`paged_jax.reference.paged_attention_reference` loops over sequences on the
host and runs every op eagerly at a new shape per `kv_len`: on a shared
2-core machine that is 5-15 s per call. Here the same oracle
(`dense_attention_reference`) runs once, vmapped over sequences padded to a
common length; the padding is made inert exactly as the reference does it
(padded keys are zeros and invisible: they sit past the query's position).
`test_batched_reference_is_the_reference` proves the two agree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.reference import dense_attention_reference


def _gather_padded(pages, block_tables, kv_lens):
  """`[batch, max_len, num_kv_heads, head_dim]` contiguous K or V, zero-padded."""
  pages = np.asarray(jnp.asarray(pages, jnp.float32))
  block_tables = np.asarray(block_tables)
  kv_lens = np.asarray(kv_lens)
  num_kv_heads, _, block_size, head_dim = pages.shape
  max_len = max(int(kv_lens.max(initial=0)), 1)
  out = np.zeros((len(kv_lens), max_len, num_kv_heads, head_dim), np.float32)
  for b, n in enumerate(kv_lens):
    n = int(n)
    ids = block_tables[b, :-(-n // block_size)]
    x = pages[:, ids].reshape(num_kv_heads, -1, head_dim)[:, :n]
    out[b, :n] = np.transpose(x, (1, 0, 2))
  return out


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "soft_cap", "sliding_window"))
def _batched_dense(q, k, v, q_positions, *, sm_scale, soft_cap, sliding_window):
  f = functools.partial(dense_attention_reference, sm_scale=sm_scale,
                        soft_cap=soft_cap, sliding_window=sliding_window)
  return jax.vmap(f)(q, k, v, q_positions)


def paged_decode_reference(q, k_pages, v_pages, block_tables, kv_lens, *,
                           sm_scale=None, soft_cap=None, sliding_window=None):
  """Same result as `paged_attention_reference` (float32), one compile."""
  k = _gather_padded(k_pages, block_tables, kv_lens)
  v = _gather_padded(v_pages, block_tables, kv_lens)
  pos = np.asarray(kv_lens, np.int32)[:, None] - 1  # -1: sees nothing
  return _batched_dense(jnp.asarray(q)[:, None], k, v, pos, sm_scale=sm_scale,
                        soft_cap=soft_cap, sliding_window=sliding_window)[:, 0]


def ragged_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                     num_seqs, *, sm_scale=None, soft_cap=None,
                     sliding_window=None):
  """Same result as `ragged_paged_attention_reference` (float32), one compile."""
  cu = np.asarray(cu_q_lens)
  n = int(np.asarray(num_seqs).reshape(-1)[0])
  kv_lens = np.asarray(kv_lens)[:n]
  q_lens = cu[1:n + 1] - cu[:n]
  out = np.zeros(q.shape, np.float32)
  if n == 0 or q_lens.sum() == 0:
    return jnp.asarray(out)
  max_q = int(q_lens.max())
  q_np = np.asarray(jnp.asarray(q, jnp.float32))
  qs = np.zeros((n, max_q) + q.shape[1:], np.float32)
  pos = np.full((n, max_q), -1, np.int32)  # padding rows see nothing
  for s in range(n):
    ql = int(q_lens[s])
    qs[s, :ql] = q_np[cu[s]:cu[s] + ql]
    pos[s, :ql] = np.arange(kv_lens[s] - ql, kv_lens[s])
  k = _gather_padded(k_pages, np.asarray(block_tables)[:n], kv_lens)
  v = _gather_padded(v_pages, np.asarray(block_tables)[:n], kv_lens)
  o = np.asarray(_batched_dense(qs, k, v, pos, sm_scale=sm_scale,
                                soft_cap=soft_cap,
                                sliding_window=sliding_window))
  for s in range(n):
    ql = int(q_lens[s])
    if kv_lens[s] > 0:
      out[cu[s]:cu[s] + ql] = o[s, :ql]
  return jnp.asarray(out)
