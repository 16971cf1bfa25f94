"""The XLA attention path: what CPU users get, and the fallback everywhere.

Scores, softmax and the weighted sum are computed in float32 (the gathered
pages are upcast; CPU XLA has no bf16 x bf16 -> f32 dot). Neither path
materialises a gathered copy of the whole cache: both walk the block tables a
few pages at a time (`pages_per_step`) and gather only those pages. Decode
gathers (head, block) pairs straight into the layout its dots read
(`[kv_heads, batch, tokens, head_dim]`, no transpose) and makes two passes
(scores and their max, then the values), so no chunk is rescaled; the ragged
path folds each chunk into a float32 online softmax. Each loop stops after the longest
sequence's last block (a `fori_loop` with a traced trip count). With a
sliding window, decode walks each sequence from its own first block inside
the window (a per-row gather of table columns), so its work is O(window)
whatever the context; blocks wholly before the window are never read.

On CPU a gathered chunk costs about what a copy of it does, and a dense
einsum over contiguous K/V reads each byte once: the paged path pays the
gathers on top of the arithmetic. `benchmarks/xla_decode.py` measures the
gap (RESULTS.md, section "XLA paths").

Masking uses `where` throughout, so stale or NaN contents past `kv_len`
never reach the output. Malformed traced inputs follow the contract of
`pallas_kernels.contract` (as every backend does): `kv_lens` are clamped to
the table's capacity, a table entry outside `[0, num_blocks)` (`NULL_BLOCK`
included) contributes no tokens (the gather reads block 0 in its place, and
that read is masked out), and a ragged batch serves only its well-formed
leading sequences.

Quantised pages (int8 / float8_e4m3fn with `k_scales` / `v_scales`) are read
as they are stored (a quarter of float32's bytes per gathered page) and
dequantised inside the loop: the K scales multiply the scores and the V
scales the probabilities (`pallas_kernels.quantization`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import contract
from pallas_kernels import quantization


def _cdiv(a, b):
  return (a + b - 1) // b


def default_pages_per_step(block_size: int, max_blocks_per_seq: int,
                           bytes_per_token: int = 0) -> int:
  """Pages gathered per loop step.

  About 512 KiB of gathered K per step, given `bytes_per_token` = rows
  gathered per token x head_dim x 4, but 128-512 tokens whatever the batch
  (measured on CPU: shorter steps pay per-step costs, longer ones spill the
  cache); without `bytes_per_token`, about 256 tokens. At least one page, at
  most the whole table.
  """
  tokens = (1 << 19) // bytes_per_token if bytes_per_token else 256
  tokens = min(512, max(128, tokens))
  return max(1, min(max_blocks_per_seq, tokens // block_size))


def _online_softmax_step(carry, s, v, valid):
  """One online-softmax update.

  s: f32[..., t] scores; v: [..., t, head_dim] (broadcastable); valid: bool[..., t].
  carry: (m f32[...], l f32[...], acc f32[..., head_dim]).
  """
  m, l, acc = carry
  s = jnp.where(valid, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p = jnp.where(valid, jnp.exp(s - m_safe[..., None]), 0.0)
  alpha = jnp.exp(m - m_safe)  # m == -inf -> 0
  l = l * alpha + jnp.sum(p, axis=-1)
  acc = acc * alpha[..., None] + v(p)
  return m_new, l, acc


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap",
                                             "sliding_window", "pages_per_step"))
def paged_decode_xla(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # i32[batch]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_step: int | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
) -> jax.Array:
  """Decode attention through block tables in plain XLA.

  Two passes over the walked blocks, `pages_per_step` table columns a step
  (default `default_pages_per_step`), each a `fori_loop` that stops after the
  longest walk's last block:

  1. gather K (`k_pages[head, block]`, straight into `[kv_heads, batch,
     tokens, head_dim]`), score it against the queries, mask the scores
     (`where` to -inf: positions past `kv_len`, outside the window, in
     invalid table entries) and store them (`f32[kv_heads, batch, walk,
     group]`, `group / head_dim` of the K bytes) beside a running max;
  2. gather V with its invalid rows selected to 0 in the same fusion (a
     poisoned row would make `0 * NaN`), exponentiate the stored scores
     against the final max and accumulate the weighted sum.

  Scores never need rescaling (the max is known before any exponential), and
  K and V are each gathered once, a step's chunk at a time.

  Arguments as `paged_jax.attention.paged_attention`, with `sm_scale`
  resolved. Returns `[batch, num_q_heads, head_dim]` in `q.dtype`.
  """
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  width = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  pps = pages_per_step or default_pages_per_step(
      block_size, width, batch * num_kv_heads * head_dim * 4)
  steps = _cdiv(width, pps)
  tokens = pps * block_size
  kv_lens = contract.clamp_kv_lens(kv_lens.astype(jnp.int32), width, block_size)
  tables_ok = contract.valid_block(block_tables, num_blocks)
  tables = jnp.where(tables_ok, block_tables, 0)
  # The walked table columns, ids and ids_ok [b, walk * pps]: a column past
  # the table's end (a shorter walk, or the padding) is invalid, read as
  # block 0 and masked.
  if sliding_window is None:
    first_col = jnp.zeros_like(kv_lens)
    walk = steps
    pad = ((0, 0), (0, walk * pps - width))
    ids, ids_ok = jnp.pad(tables, pad), jnp.pad(tables_ok, pad)
  else:
    # Each sequence walks from its own first block inside the window: at most
    # `window + block_size - 1` tokens, whatever kv_len; blocks wholly before
    # the window are never read.
    first_col = jnp.maximum(kv_lens - sliding_window, 0) // block_size  # [b]
    walk = min(steps, _cdiv(sliding_window + block_size - 1, tokens))
    cols = first_col[:, None] + jnp.arange(walk * pps, dtype=jnp.int32)[None]
    inside = cols < width
    cols = jnp.minimum(cols, width - 1)
    ids = jnp.take_along_axis(tables, cols, axis=1)
    ids_ok = jnp.take_along_axis(tables_ok, cols, axis=1) & inside
  pos = (first_col * block_size)[:, None] + jnp.arange(
      walk * tokens, dtype=jnp.int32)[None, :]  # [b, walk * tokens]
  valid = (pos < kv_lens[:, None]) & jnp.repeat(ids_ok, block_size, axis=1)
  if sliding_window is not None:
    valid &= pos >= kv_lens[:, None] - sliding_window
  # KV-head-major throughout ([kv_heads, batch, ...], the pages' own order):
  # the gathers index (head, block) pairs, so each page lands where the dots
  # read it, with no transpose. Scores are token-major, [kv_heads, b, t,
  # group] (K the dots' left operand): YNNPACK's dot is faster with the long
  # side as rows (about 2x at batch 8 against `hbgd,hbtd->hbgt`).
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None, None]
  qg = jnp.swapaxes(q.reshape(batch, num_kv_heads, group, head_dim), 0, 1)
  qg = qg.astype(jnp.float32)  # [kv_heads, b, group, head_dim]

  def chunk(i):
    step_ids = jax.lax.dynamic_slice_in_dim(ids, i * pps, pps, axis=1)[None]
    step_ok = jax.lax.dynamic_slice_in_dim(valid, i * tokens, tokens, axis=1)
    return step_ids, step_ok[None, :, :, None]  # [1, b, pps], [1, b, t, 1]

  def gather(pages, step_ids):  # -> f32[kv_heads, b, t, head_dim]
    return pages[heads, step_ids].reshape(
        num_kv_heads, batch, tokens, head_dim).astype(jnp.float32)

  def gather_scales(scales, step_ids):  # -> f32[kv_heads, b, t, 1]
    return scales[heads, step_ids].reshape(num_kv_heads, batch, tokens, 1)

  def scores_body(i, carry):
    scores, m = carry
    step_ids, ok = chunk(i)
    s = jnp.einsum("hbtd,hbgd->hbtg", gather(k_pages, step_ids), qg)
    if k_scales is not None:
      s = quantization.scale_scores(s, gather_scales(k_scales, step_ids))
    s = s * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(ok, s, -jnp.inf)
    scores = jax.lax.dynamic_update_slice_in_dim(scores, s, i * tokens, axis=2)
    return scores, jnp.maximum(m, jnp.max(s, axis=2))

  def values_body(i, carry):
    l, acc = carry
    step_ids, ok = chunk(i)
    s = jax.lax.dynamic_slice_in_dim(scores, i * tokens, tokens, axis=2)
    p = jnp.exp(s - m_safe[:, :, None, :])  # masked scores are -inf: p = 0
    l = l + jnp.sum(p, axis=2)
    if v_scales is not None:  # 0 * NaN is NaN: poisoned scales are selected out
      p = p * jnp.where(ok, gather_scales(v_scales, step_ids), 0.0)
    v = jnp.where(ok, gather(v_pages, step_ids), 0.0)
    return l, acc + jnp.einsum("hbtg,hbtd->hbgd", p, v)

  hi = _cdiv(jnp.max(kv_lens - first_col * block_size, initial=0), tokens)
  stats = (num_kv_heads, batch, group)
  scores, m = jax.lax.fori_loop(
      0, hi, scores_body,
      (jnp.zeros((num_kv_heads, batch, walk * tokens, group), jnp.float32),
       jnp.full(stats, -jnp.inf, jnp.float32)))
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  l, acc = jax.lax.fori_loop(
      0, hi, values_body,
      (jnp.zeros(stats, jnp.float32),
       jnp.zeros(stats + (head_dim,), jnp.float32)))
  out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None],
                  0.0)
  out = jnp.swapaxes(out, 0, 1)  # [batch, kv_heads, group, head_dim]
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def default_q_tile(num_tokens: int, max_num_seqs: int) -> int:
  """Query rows per tile: the mean rows per sequence slot, as a power of two
  in [8, 64] (decode-heavy batches get small tiles, prefill larger ones), and
  at most `num_tokens`."""
  mean = max(1, num_tokens // max(1, max_num_seqs))
  tile = 1 << (mean - 1).bit_length()
  return max(1, min(num_tokens, max(8, min(64, tile))))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap",
                                             "sliding_window", "pages_per_step",
                                             "q_tile"))
def ragged_paged_attention_xla(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[max_num_seqs, max_blocks_per_seq]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_step: int | None = None,
    q_tile: int | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
) -> jax.Array:
  """Ragged (prefill / mixed) attention through block tables in plain XLA.

  Walks sequences (`fori_loop` to `num_seqs`), each sequence's queries in tiles
  of `q_tile` rows, and for each tile only the KV pages at or below its last
  query's position (and inside the sliding window): blocks above the causal
  diagonal are skipped, not masked. Each tile reads its sequence's pages once.

  Arguments as `paged_jax.attention.ragged_paged_attention`, with `sm_scale`
  resolved. Returns `[num_tokens, num_q_heads, head_dim]` in `q.dtype`; rows
  no sequence owns are zeros.
  """
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  width = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  # Small KV steps (about 128 tokens) keep the causal skip fine-grained.
  pps = pages_per_step or max(1, min(width, 128 // block_size))
  tq = q_tile or default_q_tile(num_tokens, block_tables.shape[0])
  steps = _cdiv(width, pps)
  tables = jnp.pad(block_tables, ((0, 0), (0, steps * pps - width)),
                   constant_values=-1)
  tables_ok = contract.valid_block(tables, num_blocks)
  tables = jnp.where(tables_ok, tables, 0)
  kv_lens = contract.clamp_kv_lens(kv_lens, width, block_size)
  cu_q_lens, num_seqs = contract.sanitize_ragged_metadata(
      cu_q_lens, num_seqs, num_tokens)
  tokens = pps * block_size
  offs = jnp.arange(tokens, dtype=jnp.int32)
  rows = jnp.arange(tq, dtype=jnp.int32)
  # Pad so a tile starting at any row stays in bounds (dynamic_slice would
  # otherwise shift it).
  qp = jnp.pad(q, ((0, tq), (0, 0), (0, 0)))
  qp = qp.reshape(num_tokens + tq, num_kv_heads, group, head_dim)
  qp = qp.astype(jnp.float32)
  out = jnp.zeros((num_tokens + tq, num_kv_heads, group, head_dim), q.dtype)
  n = num_seqs[0]

  def tile(s, start, q_end, kv_len, q_len, out):
    qt = jax.lax.dynamic_slice_in_dim(qp, start, tq, axis=0)  # [tq, h, g, d]
    row = start + rows
    live = row < q_end
    qpos = kv_len - q_len + (row - (q_end - q_len))  # [tq]
    table, table_ok = tables[s], tables_ok[s]

    def body(i, carry):
      ids = jax.lax.dynamic_slice_in_dim(table, i * pps, pps)
      ids_ok = jax.lax.dynamic_slice_in_dim(table_ok, i * pps, pps)
      k = k_pages[:, ids].reshape(num_kv_heads, tokens, head_dim)
      v = v_pages[:, ids].reshape(num_kv_heads, tokens, head_dim)
      k, v = k.astype(jnp.float32), v.astype(jnp.float32)
      pos = i * tokens + offs
      valid = (pos[None, :] <= qpos[:, None]) & live[:, None]
      valid &= (pos < kv_len)[None, :] & jnp.repeat(ids_ok, block_size)[None, :]
      if sliding_window is not None:
        valid &= pos[None, :] > qpos[:, None] - sliding_window
      vmask = valid[:, None, None, :]  # [tq, 1, 1, t]
      any_valid = jnp.any(valid, axis=0)  # [t]
      ks = vs = None
      if k_scales is not None:
        ks = k_scales[:, ids].reshape(num_kv_heads, 1, tokens)
        vs = jnp.where(any_valid, v_scales[:, ids].reshape(num_kv_heads, 1,
                                                           tokens), 0.0)
      s_ = quantization.scale_scores(
          jnp.einsum("qhgd,htd->qhgt", qt, k,
                     preferred_element_type=jnp.float32), ks) * sm_scale
      if soft_cap is not None:
        s_ = soft_cap * jnp.tanh(s_ / soft_cap)
      v = jnp.where(any_valid[None, :, None], v, 0)

      def pv(p):
        return jnp.einsum("qhgt,htd->qhgd", quantization.scale_probs(p, vs), v,
                          preferred_element_type=jnp.float32)

      return _online_softmax_step(carry, s_, pv, vmask)

    init = (jnp.full((tq, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((tq, num_kv_heads, group), jnp.float32),
            jnp.zeros((tq, num_kv_heads, group, head_dim), jnp.float32))
    last_pos = jnp.max(jnp.where(live, qpos, -1))
    hi = _cdiv(jnp.minimum(last_pos + 1, kv_len), tokens)
    lo = 0
    if sliding_window is not None:
      first_pos = jnp.min(jnp.where(live, qpos, 2**30))
      lo = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0) // tokens,
                       hi)
    _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    o = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None],
                  0.0).astype(out.dtype)
    old = jax.lax.dynamic_slice_in_dim(out, start, tq, axis=0)
    o = jnp.where(live[:, None, None, None], o, old)
    return jax.lax.dynamic_update_slice_in_dim(out, o, start, axis=0)

  def seq_body(s, out):
    q_start, q_end = cu_q_lens[s], cu_q_lens[s + 1]
    q_len = q_end - q_start
    kv_len = kv_lens[s]

    def tile_body(j, out):
      return tile(s, q_start + j * tq, q_end, kv_len, q_len, out)

    return jax.lax.fori_loop(0, _cdiv(jnp.maximum(q_len, 0), tq), tile_body, out)

  out = jax.lax.fori_loop(0, n, seq_body, out)
  return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
