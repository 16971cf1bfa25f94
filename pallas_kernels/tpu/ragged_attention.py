"""Ragged paged attention for TPU (Mosaic Pallas): chunked prefill + decode.

The new tokens of all sequences are packed into one query array:

  q:            [num_tokens, num_q_heads, head_dim]
  k/v pages:    [num_kv_heads, num_blocks, block_size, head_dim]   (stay in HBM)
  block_tables: i32[max_num_seqs, max_blocks_per_seq]   (-1 = unused, never read)
  kv_lens:      i32[max_num_seqs]     tokens in the cache, new ones included
  cu_q_lens:    i32[max_num_seqs + 1] sequence s owns rows cu[s]:cu[s+1]
  num_seqs:     i32[1]                live sequences (dynamic: no retrace)
  k/v scales:   f32[num_kv_heads, num_blocks, block_size]   (8-bit pages only)

Query `i` of sequence `s` sits at position `kv_lens[s] - q_len[s] + i` and
attends causally (and within `sliding_window`). Rows past
`cu_q_lens[num_seqs]` come back as zeros.

The grid is `(num_kv_heads, num_query_blocks)`, both parallel: a grid step
owns `queries_per_block` consecutive rows of q for one KV head, i.e. the rows
of every query head of that KV head (the GQA group), stacked into one
`[num_groups * queries_per_block, head_dim]` matrix so each page is read once.
A query block may hold rows of several sequences (the range of sequences per
block is computed outside the kernel and scalar-prefetched). For each of them
the kernel walks only the KV pages that some row of the block can see: pages
wholly above the causal diagonal or before the sliding window are never
copied. The (sequence, KV compute block) pairs form one flat pipeline of
async copies into a double buffer, so the next pair's pages arrive while the
current pair is computed. Rows of other sequences are masked out of each
pair's scores; the online softmax is in float32.

8-bit pages (int8 / float8_e4m3fn) are read as in the decode kernel
(`paged_decode`): each page's scale row is copied beside it and laid along
the scores' lanes; K scales multiply the scores, V scales the probabilities
of the weighted sum; values are converted in VMEM, a compute block at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels import contract
from pallas_kernels import quantization
from pallas_kernels.tpu import _common

# Rows (query tokens x GQA group) and KV tokens per step `default_config`
# aims for.
TARGET_ROWS_PER_BLOCK = 128
TARGET_TOKENS_PER_COMPUTE_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class RaggedAttentionConfig:
  """Tuning knobs of the TPU ragged paged-attention kernel (hashable, static).

  Attributes:
    queries_per_block: query tokens per grid step (a power of two, at least 8;
      at least 16 for bfloat16 queries). The step's matrix has
      `queries_per_block * num_q_heads // num_kv_heads` rows.
    pages_per_compute_block: KV pages copied and attended per inner step; two
      such blocks of K and of V live in VMEM at once.
    vmem_limit_bytes: scoped-VMEM limit passed to Mosaic; `None` keeps the
      compiler default.
  """
  queries_per_block: int = 32
  pages_per_compute_block: int = 4
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    queries_per_block = self.queries_per_block
    pages_per_compute_block = self.pages_per_compute_block
    vmem_limit_bytes = self.vmem_limit_bytes
    if queries_per_block < 8 or queries_per_block & (queries_per_block - 1):
      raise ValueError(
          f"{queries_per_block=} must be a power of two, at least 8")
    if pages_per_compute_block < 1:
      raise ValueError(f"{pages_per_compute_block=} must be at least 1")
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
      raise ValueError(f"{vmem_limit_bytes=} must be positive")


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------


def _ragged_attention_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[max_num_seqs]
    block_tables_ref,  # i32[max_num_seqs * max_blocks_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    first_seq_ref,  # i32[num_query_blocks] first sequence with rows in block
    last_seq_ref,  # i32[num_query_blocks] last one (< first: empty block)
    # Inputs.
    q_ref,  # [num_groups, queries_per_block, head_dim] one KV head's queries
    k_pages_hbm_ref,  # [num_kv_heads, num_blocks, block_size, head_dim] (HBM)
    v_pages_hbm_ref,  # [num_kv_heads, num_blocks, block_size, head_dim] (HBM)
    *refs,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_size: int,
    max_blocks_per_seq: int,
    compute_dtype: Any,
    quantized: bool,
):
  """One grid step: KV head `h`, query block `qb`.

  `refs`, in order (the `[..]` ones only when `quantized`):
    [k_scales_hbm_ref, v_scales_hbm_ref]  f32[num_kv_heads, num_blocks,
                                          block_size] (HBM)
    o_ref    [num_groups, queries_per_block, head_dim]  (output)
    k_buf    [2, pages_per_compute_block * block_size, head_dim] (VMEM)
    v_buf    [2, pages_per_compute_block * block_size, head_dim] (VMEM)
    [ks_buf, vs_buf]  f32[2, pages_per_compute_block, block_size] (VMEM)
    sems     DMA semaphores [2 (k, v), 2 (buffer slot)]
    m_ref    f32[num_groups * queries_per_block, 1] running max
    l_ref    f32[num_groups * queries_per_block, 1] running denominator
    acc_ref  f32[num_groups * queries_per_block, head_dim] numerator
  """
  if quantized:
    (k_scales_hbm_ref, v_scales_hbm_ref, o_ref, k_buf, v_buf, ks_buf, vs_buf,
     sems, m_ref, l_ref, acc_ref) = refs
    scales = (k_scales_hbm_ref, v_scales_hbm_ref, ks_buf, vs_buf)
  else:
    o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    scales = None
  h, qb = pl.program_id(0), pl.program_id(1)
  num_groups, queries_per_block, head_dim = q_ref.shape
  rows = num_groups * queries_per_block
  _, tokens_per_block, _ = k_buf.shape
  pages_per_block = tokens_per_block // block_size
  max_num_seqs = kv_lens_ref.shape[0]
  row_start = qb * queries_per_block  # first row of q in this block
  row_end = row_start + queries_per_block

  def seq_info(s):
    """Rows of sequence `s` in this block and the pages they can see."""
    s = jnp.minimum(s, max_num_seqs - 1)  # callers only use s <= last_seq
    q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
    kv_len = kv_lens_ref[s]
    lo, hi = jnp.maximum(row_start, q_start), jnp.minimum(row_end, q_end)
    pos_offset = kv_len - q_end  # row r sits at position r + pos_offset
    key_hi = hi - 1 + pos_offset  # last key the block's rows see (causal)
    if sliding_window is None:
      key_lo = jnp.int32(0)
    else:
      key_lo = jnp.maximum(lo + pos_offset - sliding_window + 1, 0)
    page_lo = lax.div(key_lo, block_size)  # (`//` needs a TPU to lower)
    has_rows = (lo < hi) & (key_hi >= 0)
    page_end = jnp.where(
        has_rows,
        jnp.minimum(lax.div(key_hi, block_size) + 1, max_blocks_per_seq),
        page_lo)
    num_blocks = jnp.maximum(pl.cdiv(page_end - page_lo, pages_per_block), 1)
    return dict(s=s, q_start=q_start, q_end=q_end, kv_len=kv_len,
                pos_offset=pos_offset, page_lo=page_lo, page_end=page_end,
                num_blocks=num_blocks, has_rows=has_rows)

  copies = _common.PageCopies(
      block_tables_ref, k_pages_hbm_ref, v_pages_hbm_ref, k_buf, v_buf, sems,
      block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
      scales=scales)

  def run(info):  # the sequence's pages this block's rows can see
    return info["s"] * max_blocks_per_seq, info["page_lo"], info["page_end"]

  def start(info, block, slot):
    copies.start(h, *run(info), block, slot)

  def wait(kv, info, block, slot):
    copies.wait(kv, h, *run(info), block, slot)

  m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
  l_ref[...] = jnp.zeros_like(l_ref)
  acc_ref[...] = jnp.zeros_like(acc_ref)

  first_seq, last_seq = first_seq_ref[qb], last_seq_ref[qb]

  @pl.when(first_seq <= last_seq)
  def _():
    start(seq_info(first_seq), 0, 0)

  precision = _common.matmul_precision(compute_dtype)
  # Row r of the stacked matrix is query head r // queries_per_block of the
  # group, token row_start + r % queries_per_block (a power of two).
  row_ids = row_start + lax.bitwise_and(
      lax.broadcasted_iota(jnp.int32, (rows, tokens_per_block), 0),
      queries_per_block - 1)

  def compute(info, block, slot, pages_ok):
    """Folds `block` of a sequence into the running softmax. `pages_ok`
    (scalars per page, or None when all are fine) masks the tokens of pages
    whose table entry is not a block (never copied)."""
    block_start = (info["page_lo"] + block * pages_per_block) * block_size
    wait(0, info, block, slot)
    q = q_ref[...].astype(compute_dtype).reshape(rows, head_dim)
    # [tokens_per_block, head_dim]
    k = _common.load_values(k_buf.at[slot], compute_dtype)
    # Rows of K/V not copied or past kv_len hold garbage.
    copied_end = jnp.minimum(info["kv_len"], info["page_end"] * block_size)
    k_scales = v_scales = None  # f32[1, tokens_per_block] (8-bit pages)
    if quantized:
      k_scales = copies.scale_row(0, slot, block_start, copied_end, pages_ok)
      v_scales = lambda: copies.scale_row(1, slot, block_start, copied_end,
                                          pages_ok)
    s = _common.scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision, k_scales=k_scales)
    # s: f32[rows, tokens_per_block]
    q_pos = row_ids + info["pos_offset"]
    shape = (rows, tokens_per_block)
    k_pos = block_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    # Other sequences' rows, future keys and garbage slots are all masked.
    visible = ((row_ids >= info["q_start"]) & (row_ids < info["q_end"])
               & (k_pos <= q_pos))
    if sliding_window is not None:
      visible &= k_pos > q_pos - sliding_window
    if pages_ok is not None:
      visible &= _common.page_token_mask(shape, 1, block_size, pages_ok)

    def load_v():
      wait(1, info, block, slot)
      v_shape = (tokens_per_block, head_dim)
      v_rows = block_start + lax.broadcasted_iota(jnp.int32, v_shape, 0)
      keep = v_rows < copied_end  # the other rows are zeroed
      if pages_ok is not None:
        keep &= _common.page_token_mask(v_shape, 0, block_size, pages_ok)
      return jnp.where(keep, v_buf[slot].astype(jnp.float32), 0.0)

    _common.online_softmax_block(m_ref, l_ref, acc_ref, s, visible, load_v,
                                 compute_dtype=compute_dtype,
                                 precision=precision, load_v_scales=v_scales)

  def compute_checked(info, block, slot):
    # A page whose table entry is not a block contributes no tokens: the
    # common case pays one scalar test per page for it.
    pages_ok, all_ok = copies.pages_ok(*run(info), block)
    pl.when(all_ok)(lambda: compute(info, block, slot, None))
    pl.when(~all_ok)(lambda: compute(info, block, slot, pages_ok))

  def body(carry):
    s, block, t = carry  # sequence, its KV compute block, pipeline step
    info = seq_info(s)
    slot = lax.rem(t, 2)
    last_block = block + 1 >= info["num_blocks"]
    next_s = jnp.where(last_block, s + 1, s)
    next_block = jnp.where(last_block, 0, block + 1)

    @pl.when(next_s <= last_seq)
    def _():
      start(seq_info(next_s), next_block, 1 - slot)

    pl.when(info["has_rows"])(lambda: compute_checked(info, block, slot))
    return next_s, next_block, t + 1

  lax.while_loop(lambda carry: carry[0] <= last_seq, body,
                 (first_seq, jnp.int32(0), jnp.int32(0)))

  l = l_ref[...]
  out = jnp.where(l > 0.0, acc_ref[...] / jnp.where(l > 0.0, l, 1.0), 0.0)
  o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


# ----------------------------------------------------------------------------
# pallas_call builder
# ----------------------------------------------------------------------------


def _build_ragged_attention(
    q_kernel_shape, q_dtype, k_shape, kv_dtype, max_blocks_per_seq, *,
    sm_scale, soft_cap, sliding_window, config: RaggedAttentionConfig,
    interpret):
  """`f(kv_lens, tables_flat, cu_q_lens, first, last, q_kernel, k, v[,
  k_scales, v_scales]) -> out` (the scales for 8-bit pages).

  `q_kernel` is `[num_kv_heads, num_groups, padded_tokens, head_dim]`.
  """
  num_kv_heads, num_groups, padded_tokens, head_dim = q_kernel_shape
  _, _, block_size, _ = k_shape
  queries_per_block = config.queries_per_block
  rows = num_groups * queries_per_block
  tokens_per_block = config.pages_per_compute_block * block_size

  q_spec = pl.BlockSpec(
      (_common.SQUEEZED, num_groups, queries_per_block, head_dim),
      lambda h, qb, *_: (h, 0, qb, 0))
  kv_buf = pltpu.VMEM((2, tokens_per_block, head_dim), kv_dtype)
  quantized = quantization.is_quantized(kv_dtype)
  scale_specs, scale_bufs = [], []
  if quantized:
    scale_specs = [pl.BlockSpec(memory_space=_common.ANY)] * 2
    scale_bufs = [pltpu.VMEM((2, config.pages_per_compute_block, block_size),
                             jnp.float32)] * 2
  kernel = functools.partial(
      _ragged_attention_kernel,
      sm_scale=sm_scale,
      soft_cap=soft_cap,
      sliding_window=sliding_window,
      block_size=block_size,
      max_blocks_per_seq=max_blocks_per_seq,
      compute_dtype=_common.compute_dtype(q_dtype, kv_dtype),
      quantized=quantized,
  )
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=5,
          grid=(num_kv_heads, padded_tokens // queries_per_block),
          in_specs=[
              q_spec,
              pl.BlockSpec(memory_space=_common.ANY),
              pl.BlockSpec(memory_space=_common.ANY),
              *scale_specs,
          ],
          out_specs=q_spec,
          scratch_shapes=[
              kv_buf,
              kv_buf,
              *scale_bufs,
              pltpu.SemaphoreType.DMA((2, 2)),
              pltpu.VMEM((rows, 1), jnp.float32),
              pltpu.VMEM((rows, 1), jnp.float32),
              pltpu.VMEM((rows, head_dim), jnp.float32),
          ],
      ),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel"),
          vmem_limit_bytes=config.vmem_limit_bytes,
      ),
      out_shape=jax.ShapeDtypeStruct(q_kernel_shape, q_dtype),
      interpret=_common.interpret_params(interpret),
      name=(f"ragged_paged_attention_q{queries_per_block}"
            f"_ppcb{config.pages_per_compute_block}"),
  )


def _sequence_range_per_block(cu_q_lens, num_seqs, num_tokens,
                              queries_per_block, num_query_blocks):
  """First and last live sequence with rows in each query block.

  Returns `i32[num_query_blocks]` pairs; an empty block gets `last < first`.
  """
  max_num_seqs = cu_q_lens.shape[0] - 1
  n = num_seqs[0]
  live = jnp.arange(max_num_seqs) < n
  total = jnp.minimum(cu_q_lens[n], num_tokens)
  starts = jnp.arange(num_query_blocks, dtype=jnp.int32) * queries_per_block
  last_rows = jnp.minimum(starts + queries_per_block, total) - 1
  ends = cu_q_lens[1:]

  def seq_of(r):  # sequence owning row r: live sequences ending at or before r
    return jnp.sum(live & (ends[None, :] <= r[:, None]), axis=1,
                   dtype=jnp.int32)

  first = seq_of(starts)
  last = jnp.where(starts < total, seq_of(last_rows), first - 1)
  return first, last


# ----------------------------------------------------------------------------
# Checks and configuration
# ----------------------------------------------------------------------------


def _limitation(q, k_pages, block_tables, config) -> str | None:
  """Why this (well-formed) input cannot be served by the kernel, or None."""
  reason = _common.dtype_and_tiling_limitation(q, k_pages)
  if reason is not None:
    return reason
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  queries_per_block = config.queries_per_block
  tile = _common.sublane_tile(q.dtype)
  if queries_per_block % tile:
    return (f"{queries_per_block=} must be a multiple of {tile} for"
            f" {jnp.dtype(q.dtype)} queries (VMEM sublane tiling)")
  rows = num_q_heads // num_kv_heads * queries_per_block
  tokens = config.pages_per_compute_block * block_size
  lanes = _common.round_up(head_dim, 128)
  itemsize = jnp.dtype(k_pages.dtype).itemsize
  vmem = (2 * 2 * rows * lanes * jnp.dtype(q.dtype).itemsize  # q, out
          + rows * (lanes + 2 * 128) * 4  # acc, m, l
          + 2 * 2 * tokens * lanes * itemsize  # K/V double buffers
          + 3 * rows * _common.round_up(tokens, 128) * 4  # score temporaries
          + _common.scale_vmem_bytes(k_pages.dtype,
                                     config.pages_per_compute_block,
                                     block_size))
  max_num_seqs, max_blocks_per_seq = block_tables.shape
  num_query_blocks = -(-num_tokens // queries_per_block)
  smem = 4 * (max_num_seqs * (max_blocks_per_seq + 2) + 1 +
              2 * num_query_blocks)
  return _common.memory_limitation(smem, vmem, config.vmem_limit_bytes)


def default_config(q, k_pages, block_tables) -> RaggedAttentionConfig:
  """A config chosen from shapes: ~128 rows x ~256 KV tokens per step.

  Args:
    q: `[num_tokens, num_q_heads, head_dim]` array or `jax.ShapeDtypeStruct`.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    block_tables: `i32[max_num_seqs, max_blocks_per_seq]`.
  """
  num_tokens, num_q_heads, _ = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  num_groups = max(1, num_q_heads // max(num_kv_heads, 1))
  queries = 16
  while (queries * 2 * num_groups <= TARGET_ROWS_PER_BLOCK
         and queries < num_tokens):
    queries *= 2
  pages = max(1, TARGET_TOKENS_PER_COMPUTE_BLOCK // block_size)
  return RaggedAttentionConfig(
      queries_per_block=queries,
      pages_per_compute_block=max(1, min(pages, block_tables.shape[1])))


def unsupported_reason(q, k_pages, block_tables, *, soft_cap=None,
                       sliding_window=None, config=None) -> str | None:
  """None if `ragged_paged_attention` can serve these inputs, else a reason.

  Only `.shape` and `.dtype` are used: arrays or `jax.ShapeDtypeStruct` work.

  Args:
    q: `[num_tokens, num_q_heads, head_dim]` queries.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` pages:
      float32 / bfloat16, or int8 / float8_e4m3fn (their scales are not
      needed here; `block_size` must then be a multiple of 32).
    block_tables: `i32[max_num_seqs, max_blocks_per_seq]`.
    soft_cap: optional logit soft cap.
    sliding_window: optional window in tokens.
    config: a `RaggedAttentionConfig`, default `default_config(...)`.
  """
  error = contract.attention_input_error(
      q, k_pages, block_tables, ragged=True, soft_cap=soft_cap,
      sliding_window=sliding_window)
  if error is not None:
    return f"invalid inputs: {error}"
  config = config or default_config(q, k_pages, block_tables)
  return _limitation(q, k_pages, block_tables, config)


# ----------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "config",
                     "interpret"))
def ragged_paged_attention(
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
    config: RaggedAttentionConfig | None = None,
    interpret: bool | Any = False,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array | None = None,
) -> jax.Array:
  """Causal attention of a ragged batch of new tokens over paged K/V (TPU).

  Sequence `s < num_seqs[0]` owns rows `cu_q_lens[s]:cu_q_lens[s+1]` of `q`;
  its query `i` sits at position `kv_lens[s] - q_len + i` and sees keys
  `max(0, p - sliding_window + 1) .. p`. Decode tokens are sequences with one
  row; prefill chunks (with or without a cached prefix) have more.

  Args:
    q: `[num_tokens, num_q_heads, head_dim]`, float32 or bfloat16.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`, float32,
      bfloat16, or int8 / float8_e4m3fn with `k_scales`; `num_q_heads` must
      be a multiple of `num_kv_heads`. `block_size` must be a multiple of 8
      (float32), 16 (bfloat16) or 32 (8-bit) pages.
    v_pages: same shape and dtype as `k_pages`.
    block_tables: `i32[max_num_seqs, max_blocks_per_seq]`; only the entries
      of pages some query can see are read (-1 elsewhere is fine); an entry
      there that is not a block in `[0, num_blocks)` contributes no tokens.
    kv_lens: `i32[max_num_seqs]`, with `q_len <= kv_len` for live sequences;
      clamped to `[0, max_blocks_per_seq * block_size]`.
    cu_q_lens: `i32[max_num_seqs + 1]`, non-decreasing from 0, with
      `cu_q_lens[num_seqs] <= num_tokens`; sequences from the first that
      breaks this on are dropped (zeros), see `pallas_kernels.contract`.
    num_seqs: `i32[1]`, the number of live sequences, clamped to
      `[0, max_num_seqs]`.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: optional `s -> soft_cap * tanh(s / soft_cap)` after `sm_scale`.
    sliding_window: optional window in tokens (counting the query's own).
    config: tuning knobs, default `default_config(q, k_pages, block_tables)`.
    interpret: `False` to compile for TPU; `True` for TPU interpret mode with
      race detection on and uninitialised memory filled with NaN; or a
      `pltpu.InterpretParams`.
    k_scales, v_scales: `f32[num_kv_heads, num_blocks, block_size]`, the
      per-token scales of int8 / float8_e4m3fn pages (`x ~= values *
      scales[..., None]`, `pallas_kernels.quantization`); None for float
      pages. Copied page by page with the values, never read elsewhere.

  Returns:
    `[num_tokens, num_q_heads, head_dim]` in `q.dtype`; padding rows (past
    `cu_q_lens[num_seqs]`) are zeros.

  Raises:
    ValueError: malformed shapes/dtypes, or inputs the kernel cannot serve
      (see `unsupported_reason`).

  Example (TPU interpret mode, runs on CPU): a 3-token prefill chunk after a
  2-token cached prefix, then one decode token, padded to 8 rows.
    >>> q = jnp.ones((8, 4, 128), jnp.float32)
    >>> k_pages = jnp.ones((1, 4, 8, 128), jnp.float32)
    >>> v_pages = k_pages
    >>> block_tables = jnp.array([[2, -1], [0, 1]], jnp.int32)
    >>> kv_lens = jnp.array([5, 12], jnp.int32)
    >>> cu_q_lens = jnp.array([0, 3, 4], jnp.int32)
    >>> out = ragged_paged_attention(
    ...     q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
    ...     jnp.array([2], jnp.int32), interpret=True)
    >>> out.shape, float(out[4:].max())
    ((8, 4, 128), 0.0)
  """
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      cu_q_lens=cu_q_lens, num_seqs=num_seqs, ragged=True, soft_cap=soft_cap,
      sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)
  config = config or default_config(q, k_pages, block_tables)
  reason = _limitation(q, k_pages, block_tables, config)
  if reason is not None:
    raise ValueError(
        f"ragged_paged_attention (TPU) cannot serve these inputs: {reason}")
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  num_groups = num_q_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  queries_per_block = config.queries_per_block
  padded_tokens = _common.round_up(num_tokens, queries_per_block)
  num_query_blocks = padded_tokens // queries_per_block

  # [padded_tokens, num_q_heads, d] -> [num_kv_heads, num_groups, tokens, d]
  q_kernel = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
  q_kernel = q_kernel.reshape(padded_tokens, num_kv_heads, num_groups,
                              head_dim).transpose(1, 2, 0, 3)
  kv_lens = contract.clamp_kv_lens(kv_lens, block_tables.shape[1],
                                   k_pages.shape[2])
  cu_q_lens, num_seqs = contract.sanitize_ragged_metadata(
      cu_q_lens, num_seqs, num_tokens)
  first_seq, last_seq = _sequence_range_per_block(
      cu_q_lens, num_seqs, num_tokens, queries_per_block, num_query_blocks)
  call = _build_ragged_attention(
      q_kernel.shape, q.dtype, k_pages.shape, k_pages.dtype,
      block_tables.shape[1], sm_scale=float(sm_scale), soft_cap=soft_cap,
      sliding_window=sliding_window, config=config, interpret=interpret)
  scales = () if k_scales is None else (k_scales, v_scales)
  out = call(kv_lens, block_tables.reshape(-1), cu_q_lens, first_seq,
             last_seq, q_kernel, k_pages, v_pages, *scales)
  out = out.transpose(2, 0, 1, 3).reshape(padded_tokens, num_q_heads,
                                          head_dim)
  return out[:num_tokens]
