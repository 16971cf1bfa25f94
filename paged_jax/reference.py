"""Float32 reference attention: the oracle every backend is tested against.

Everything here is deliberately plain: K/V are gathered into contiguous form
sequence by sequence (in NumPy-style Python loops over the batch), upcast to
float32 and attended with an explicit softmax. It is slow and never used on a
hot path.

Conventions (the same as JAX's `ragged_paged_attention` reference):
  * scores are `q . k * sm_scale`; `sm_scale` defaults to `head_dim ** -0.5`;
  * the soft cap is applied after `sm_scale`: `s = soft_cap * tanh(s / soft_cap)`;
  * a query at position `p` sees key positions `p - sliding_window + 1 .. p`
    (the window counts the query's own token), and never positions `> p`;
  * a sequence with no visible keys (for decode: `kv_len == 0`) gives zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dense_attention_reference(
    q: jax.Array,  # [q_len, num_q_heads, head_dim]
    k: jax.Array,  # [kv_len, num_kv_heads, head_dim]
    v: jax.Array,  # [kv_len, num_kv_heads, head_dim]
    q_positions: jax.Array,  # i32[q_len]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
  """Causal attention of `q` over contiguous `k`/`v`, in float32.

  Args:
    q: `[q_len, num_q_heads, head_dim]` queries, any float dtype.
    k: `[kv_len, num_kv_heads, head_dim]` keys; key `j` sits at position `j`.
    v: `[kv_len, num_kv_heads, head_dim]` values.
    q_positions: `i32[q_len]` absolute position of each query.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: optional logit soft cap.
    sliding_window: optional window length in tokens (counts the query's own).

  Returns:
    float32 `[q_len, num_q_heads, head_dim]`; rows with no visible key are 0.
  """
  q = jnp.asarray(q, jnp.float32)
  k = jnp.asarray(k, jnp.float32)
  v = jnp.asarray(v, jnp.float32)
  _, num_q_heads, head_dim = q.shape
  kv_len, num_kv_heads, _ = k.shape
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  group = num_q_heads // num_kv_heads
  k = jnp.repeat(k, group, axis=1)
  v = jnp.repeat(v, group, axis=1)
  s = jnp.einsum("qhd,khd->hqk", q, k, precision="highest") * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  q_pos = jnp.asarray(q_positions, jnp.int32)[None, :, None]
  k_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
  visible = k_pos <= q_pos
  if sliding_window is not None:
    visible = visible & (k_pos > q_pos - sliding_window)
  s = jnp.where(visible, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(visible, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("hqk,khd->qhd", p, v, precision="highest")
  l = jnp.transpose(l, (1, 0, 2))  # [q_len, heads, 1]
  return jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)


def gather_sequence_reference(
    pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_table: np.ndarray,  # i32[max_blocks_per_seq]
    kv_len: int,
) -> jax.Array:
  """Contiguous `[kv_len, num_kv_heads, head_dim]` copy of one sequence."""
  block_size = pages.shape[2]
  n = -(-int(kv_len) // block_size)
  ids = np.asarray(block_table)[:n]
  x = pages[:, ids]  # [kvh, n, bs, hd]
  x = x.reshape(pages.shape[0], n * block_size, pages.shape[3])[:, :kv_len]
  return jnp.transpose(x, (1, 0, 2))


def paged_attention_reference(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # i32[batch]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
  """Float32 decode attention: one query per sequence at position `kv_len - 1`.

  Not jittable (loops over the batch on the host); for tests only.

  Returns:
    float32 `[batch, num_q_heads, head_dim]`; zeros where `kv_len == 0`.
  """
  block_tables = np.asarray(block_tables)
  kv_lens = np.asarray(kv_lens)
  outs = []
  for b in range(q.shape[0]):
    kv_len = int(kv_lens[b])
    if kv_len == 0:
      outs.append(jnp.zeros(q.shape[1:], jnp.float32))
      continue
    k = gather_sequence_reference(k_pages, block_tables[b], kv_len)
    v = gather_sequence_reference(v_pages, block_tables[b], kv_len)
    o = dense_attention_reference(
        q[b][None], k, v, jnp.array([kv_len - 1]), sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window)
    outs.append(o[0])
  return jnp.stack(outs)


def ragged_paged_attention_reference(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[max_num_seqs, max_blocks_per_seq]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
  """Float32 ragged attention: sequence `s` owns rows `cu_q_lens[s]:cu_q_lens[s+1]`.

  Query `i` of sequence `s` sits at position `kv_lens[s] - q_len[s] + i`. Rows
  beyond `cu_q_lens[num_seqs]` (padding) come back as zeros. Not jittable.

  Returns:
    float32 `[num_tokens, num_q_heads, head_dim]`.
  """
  block_tables = np.asarray(block_tables)
  kv_lens = np.asarray(kv_lens)
  cu_q_lens = np.asarray(cu_q_lens)
  n = int(np.asarray(num_seqs).reshape(-1)[0])
  out = jnp.zeros(q.shape, jnp.float32)
  for s in range(n):
    start, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
    kv_len = int(kv_lens[s])
    if end == start or kv_len == 0:
      continue
    k = gather_sequence_reference(k_pages, block_tables[s], kv_len)
    v = gather_sequence_reference(v_pages, block_tables[s], kv_len)
    pos = jnp.arange(kv_len - (end - start), kv_len)
    o = dense_attention_reference(
        q[start:end], k, v, pos, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window)
    out = out.at[start:end].set(o)
  return out
