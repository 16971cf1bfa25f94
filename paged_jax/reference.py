"""Float32 reference attention: the oracle every backend is tested against.

Everything here is deliberately plain NumPy: K/V are gathered into contiguous
form sequence by sequence (Python loops over the batch), upcast to float32 and
attended with an explicit softmax. It runs on the host, is not jittable, and is
never used on a hot path; results are float32 `np.ndarray`s.

Conventions (the same as JAX's `ragged_paged_attention` reference):
  * scores are `q . k * sm_scale`; `sm_scale` defaults to `head_dim ** -0.5`;
  * the soft cap is applied after `sm_scale`: `s = soft_cap * tanh(s / soft_cap)`;
  * a query at position `p` sees key positions `p - sliding_window + 1 .. p`
    (the window counts the query's own token), and never positions `> p`;
  * a sequence with no visible keys (for decode: `kv_len == 0`) gives zeros.

Quantised pages (int8 / float8_e4m3fn, with `k_scales` / `v_scales`) are
dequantised up front by the one rule, `pallas_kernels.quantization.dequantize`,
and then attended exactly as float32 pages.

Malformed traced inputs (the contract of `pallas_kernels.contract`, which
every backend follows; this file states it independently, in plain Python):
  * `kv_len` is clamped to `[0, max_blocks_per_seq * block_size]`;
  * a table entry inside `kv_len` outside `[0, num_blocks)` (`NULL_BLOCK`
    included) contributes no keys: its tokens are invisible, its block unread;
  * ragged: `num_seqs` is clamped to `[0, max_num_seqs]`; sequence `s` is
    served only if `cu_q_lens[0] == 0` and `cu_q_lens[0] <= ... <=
    cu_q_lens[s+1] <= num_tokens`; the first malformed sequence and all after
    it are dropped, and every row no served sequence owns is zero; a query
    at a negative position (`q_len > kv_len`) sees no key and is zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantization


def dense_attention_reference(
    q: jax.Array,  # [q_len, num_q_heads, head_dim]
    k: jax.Array,  # [kv_len, num_kv_heads, head_dim]
    v: jax.Array,  # [kv_len, num_kv_heads, head_dim]
    q_positions: jax.Array,  # i32[q_len]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    key_valid: np.ndarray | None = None,
) -> np.ndarray:
  """Causal attention of `q` over contiguous `k`/`v`, in float32 NumPy.

  Args:
    q: `[q_len, num_q_heads, head_dim]` queries, any float dtype.
    k: `[kv_len, num_kv_heads, head_dim]` keys; key `j` sits at position `j`.
    v: `[kv_len, num_kv_heads, head_dim]` values.
    q_positions: `i32[q_len]` absolute position of each query.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: optional logit soft cap.
    sliding_window: optional window length in tokens (counts the query's own).
    key_valid: optional `bool[kv_len]`; keys marked False are invisible to
      every query (their K/V are never used, NaN or not).

  Returns:
    float32 `[q_len, num_q_heads, head_dim]`; rows with no visible key are 0.
  """
  q = np.asarray(q, np.float32)
  k = np.asarray(k, np.float32)
  v = np.asarray(v, np.float32)
  _, num_q_heads, head_dim = q.shape
  kv_len, num_kv_heads, _ = k.shape
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  group = num_q_heads // num_kv_heads
  k = np.repeat(k, group, axis=1)
  v = np.repeat(v, group, axis=1)
  s = np.einsum("qhd,khd->hqk", q, k) * np.float32(sm_scale)
  if soft_cap is not None:
    s = np.float32(soft_cap) * np.tanh(s / np.float32(soft_cap))
  q_pos = np.asarray(q_positions, np.int64)[None, :, None]
  k_pos = np.arange(kv_len)[None, None, :]
  visible = k_pos <= q_pos
  if sliding_window is not None:
    visible = visible & (k_pos > q_pos - sliding_window)
  if key_valid is not None:
    visible = visible & np.asarray(key_valid, bool)[None, None, :]
  s = np.where(visible, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(visible, np.exp(s - m), 0.0).astype(np.float32)
  l = np.sum(p, axis=-1, keepdims=True)
  v = np.where(visible.any(axis=(0, 1))[:, None, None], v, 0.0)
  o = np.einsum("hqk,khd->qhd", p, v)
  l = np.transpose(l, (1, 0, 2))  # [q_len, heads, 1]
  return np.where(l > 0, o / np.where(l > 0, l, 1.0), 0.0).astype(np.float32)


def gather_sequence_reference(
    pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_table: np.ndarray,  # i32[max_blocks_per_seq]
    kv_len: int,
) -> np.ndarray:
  """Contiguous float32 `[kv_len, num_kv_heads, head_dim]` copy of one sequence.

  Tokens of entries outside `[0, num_blocks)` are zeros (see
  `sequence_keys_reference` for which tokens are valid).
  """
  return sequence_keys_reference(pages, block_table, kv_len)[0]


def sequence_keys_reference(
    pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_table: np.ndarray,  # i32[max_blocks_per_seq]
    kv_len: int,
) -> tuple[np.ndarray, np.ndarray]:
  """One sequence's keys (or values) and which of them are real.

  Returns:
    `(x, valid)`: float32 `[kv_len, num_kv_heads, head_dim]` (zeros where
    invalid) and `bool[kv_len]`, False for tokens whose table entry is not a
    block in `[0, num_blocks)`. Such blocks are never read. `kv_len` must
    already be clamped to the table's capacity.
  """
  num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  n = -(-int(kv_len) // block_size)
  ids = np.asarray(block_table)[:n].astype(np.int64)
  ok = (ids >= 0) & (ids < num_blocks)
  x = np.zeros((num_kv_heads, n, block_size, head_dim), np.float32)
  x[:, ok] = np.asarray(pages[:, ids[ok]], np.float32)
  x = x.reshape(num_kv_heads, n * block_size, head_dim)[:, :kv_len]
  valid = np.repeat(ok, block_size)[:kv_len]
  return np.transpose(x, (1, 0, 2)), valid


def dequantized_pages(pages, scales) -> np.ndarray:
  """float32 NumPy pages: `pages` as they are, or dequantised with `scales`
  (`f32[num_kv_heads, num_blocks, block_size]`) when given."""
  if scales is None:
    return np.asarray(pages, np.float32)
  return np.asarray(quantization.dequantize(jnp.asarray(pages),
                                            jnp.asarray(scales)))


def _clamped_kv_len(kv_len, block_tables, block_size) -> int:
  return min(max(int(kv_len), 0), block_tables.shape[1] * block_size)


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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
  """Float32 decode attention: one query per sequence at position `kv_len - 1`.

  Not jittable (loops over the batch on the host); for tests only. Malformed
  lengths and table entries follow the module's contract. `k_scales` /
  `v_scales` (`f32[num_kv_heads, num_blocks, block_size]`) go with quantised
  pages.

  Returns:
    float32 `[batch, num_q_heads, head_dim]` (NumPy); zeros where `kv_len == 0`.
  """
  block_tables = np.asarray(block_tables)
  kv_lens = np.asarray(kv_lens)
  q = np.asarray(q, np.float32)
  k_pages = dequantized_pages(k_pages, k_scales)
  v_pages = dequantized_pages(v_pages, v_scales)
  outs = []
  block_size = k_pages.shape[2]
  for b in range(q.shape[0]):
    kv_len = _clamped_kv_len(kv_lens[b], block_tables, block_size)
    if kv_len == 0:
      outs.append(np.zeros(q.shape[1:], np.float32))
      continue
    k, ok = sequence_keys_reference(k_pages, block_tables[b], kv_len)
    v, _ = sequence_keys_reference(v_pages, block_tables[b], kv_len)
    o = dense_attention_reference(
        q[b][None], k, v, np.array([kv_len - 1]), sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, key_valid=ok)
    outs.append(o[0])
  return np.stack(outs)


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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
  """Float32 ragged attention: sequence `s` owns rows `cu_q_lens[s]:cu_q_lens[s+1]`.

  Query `i` of sequence `s` sits at position `kv_lens[s] - q_len[s] + i`. Rows
  beyond `cu_q_lens[num_seqs]` (padding) come back as zeros. Malformed
  `num_seqs`, `cu_q_lens`, lengths and table entries follow the module's
  contract. Not jittable.

  Returns:
    float32 `[num_tokens, num_q_heads, head_dim]`.
  """
  block_tables = np.asarray(block_tables)
  kv_lens = np.asarray(kv_lens)
  cu_q_lens = np.asarray(cu_q_lens)
  k_pages = dequantized_pages(k_pages, k_scales)
  v_pages = dequantized_pages(v_pages, v_scales)
  max_num_seqs = block_tables.shape[0]
  n = min(max(int(np.asarray(num_seqs).reshape(-1)[0]), 0), max_num_seqs)
  q = np.asarray(q, np.float32)
  out = np.zeros(q.shape, np.float32)
  block_size = k_pages.shape[2]
  if int(cu_q_lens[0]) != 0:
    n = 0  # no sequence's rows are known
  for s in range(n):
    start, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
    if end < start or end > q.shape[0]:
      break  # this sequence and every later one are dropped
    kv_len = _clamped_kv_len(kv_lens[s], block_tables, block_size)
    if end == start or kv_len == 0:
      continue
    k, ok = sequence_keys_reference(k_pages, block_tables[s], kv_len)
    v, _ = sequence_keys_reference(v_pages, block_tables[s], kv_len)
    pos = np.arange(kv_len - (end - start), kv_len)
    o = dense_attention_reference(
        q[start:end], k, v, pos, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, key_valid=ok)
    out[start:end] = o
  return out
