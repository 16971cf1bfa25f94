"""Shared helpers of the TPU-kernel tests (interpret mode on CPU).

* `FAR_BLOCK`: a block-table entry far outside any page pool. Tests put it in
  every entry a kernel must not read; the TPU interpreter raises on a copy of
  such a page, so a passing test proves the entry was never touched (-1
  itself would wrap around in the interpreter's NumPy-style indexing).
* `races_found()`: whether the interpreter's race detector fired.
* Batched oracles: the shared float32 oracle (`dense_attention_reference` on
  each gathered sequence), vmapped over sequences with zero-padded keys, so
  it compiles once per shape instead of once per distinct length (the eager
  per-length loop of `paged_jax.reference` dominated the tests' run time).
  Padding keys sit after every query's position, so the causal mask hides
  them; padding queries get position -1 and see nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.reference import dense_attention_reference

FAR_BLOCK = 2**30


def races_found() -> bool | None:
  """Whether the TPU interpreter's race detector fired (None: not exposed)."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  except ImportError:
    return None
  races = getattr(ipc, "races", None)
  return None if races is None else bool(races.races_found)


def _padded_sequences(pages, block_tables, kv_lens):
  """`[num_seqs, max_len, num_kv_heads, head_dim]` float32, zero-padded."""
  pages = np.asarray(jnp.asarray(pages, jnp.float32))
  num_kv_heads, _, block_size, head_dim = pages.shape
  tables, lens = np.asarray(block_tables), np.asarray(kv_lens)
  out = np.zeros((len(lens), tables.shape[1] * block_size, num_kv_heads,
                  head_dim), np.float32)
  for s, kv_len in enumerate(lens):
    ids = tables[s, :-(-int(kv_len) // block_size)]
    seq = pages[:, ids].reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
    out[s, :kv_len] = seq.transpose(1, 0, 2)
  return out


@functools.lru_cache(maxsize=None)
def _vmapped_dense(sm_scale, soft_cap, sliding_window):
  return jax.jit(jax.vmap(functools.partial(
      dense_attention_reference, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window)))


def batched_decode_reference(q, k_pages, v_pages, block_tables, kv_lens, *,
                             sm_scale=None, soft_cap=None,
                             sliding_window=None):
  """`paged_attention_reference`, batched (float32)."""
  k = _padded_sequences(k_pages, block_tables, kv_lens)
  v = _padded_sequences(v_pages, block_tables, kv_lens)
  pos = np.asarray(kv_lens, np.int32)[:, None] - 1
  f = _vmapped_dense(sm_scale, soft_cap, sliding_window)
  return f(jnp.asarray(q, jnp.float32)[:, None], k, v, pos)[:, 0]


def batched_ragged_reference(q, k_pages, v_pages, block_tables, kv_lens,
                             cu_q_lens, num_seqs, *, sm_scale=None,
                             soft_cap=None, sliding_window=None):
  """`ragged_paged_attention_reference`, batched (float32)."""
  num_tokens = q.shape[0]
  cu, lens = np.asarray(cu_q_lens), np.asarray(kv_lens)
  n = int(np.asarray(num_seqs).reshape(-1)[0])
  q = np.asarray(jnp.asarray(q, jnp.float32))
  max_num_seqs = len(lens)
  q_pad = np.zeros((max_num_seqs, num_tokens) + q.shape[1:], np.float32)
  pos = np.full((max_num_seqs, num_tokens), -1, np.int32)
  for s in range(n):
    q_len = cu[s + 1] - cu[s]
    q_pad[s, :q_len] = q[cu[s]:cu[s + 1]]
    pos[s, :q_len] = lens[s] - q_len + np.arange(q_len)
  live_lens = np.where(np.arange(max_num_seqs) < n, lens, 0)
  k = _padded_sequences(k_pages, block_tables, live_lens)
  v = _padded_sequences(v_pages, block_tables, live_lens)
  o = np.asarray(_vmapped_dense(sm_scale, soft_cap, sliding_window)(
      q_pad, k, v, pos))
  out = np.zeros(q.shape, np.float32)
  for s in range(n):
    out[cu[s]:cu[s + 1]] = o[s, :cu[s + 1] - cu[s]]
  return out
