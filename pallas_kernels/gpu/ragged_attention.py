"""Ragged paged attention for GPUs (prefill, chunked prefill and decode mixed).

Pallas on the Triton lowering. The batch is ragged: sequence `s` owns query
rows `cu_q_lens[s]:cu_q_lens[s+1]` of `q` and `kv_lens[s]` tokens of paged K/V;
its `i`-th query sits at position `kv_lens[s] - q_len[s] + i` and attends
causally (and within `sliding_window`). Only `num_seqs[0]` sequences are live,
so one compiled kernel serves every batch mix of the same padded sizes.

Triton has no scalar prefetch and no dynamic grid, so the grid is static:
`num_tokens // block_q + max_num_seqs` query tiles times `num_kv_heads`.
Sequence `s` owns tiles `[cu_q_lens[s] // block_q + s, cu_q_lens[s+1] //
block_q + s + 1)`, enough for `cdiv(q_len[s], block_q)` tiles (the scheme of
vLLM's unified Triton attention); a program finds its sequence with one
vectorised comparison over `cu_q_lens` and idles if it has none. A tile packs
`block_q` query tokens times the GQA group (padded to a power of two) into
`block_q * group` rows against one KV head, and walks only the KV compute
blocks that some row of the tile can see: blocks wholly above the causal
diagonal or wholly outside the sliding window are skipped, and pages past the
visible range (or table entries that are not blocks) are never loaded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels import contract
from pallas_kernels import quantization
from pallas_kernels.gpu import _common

MIN_DOT_DIM = _common.MIN_DOT_DIM
MAX_ROWS = 256


@dataclasses.dataclass(frozen=True)
class RaggedAttentionConfig:
  """Tuning knobs of the GPU ragged paged-attention kernel (static, hashable).

  Attributes:
    block_q: query tokens per tile; the tile has `block_q * group` rows
      (group = q heads per KV head, padded to a power of two), which must be a
      power of two in [16, 256].
    pages_per_compute_block: pages per inner-loop step;
      `pages_per_compute_block * block_size` must be a power of two >= 16.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
  """
  block_q: int = 16
  pages_per_compute_block: int = 4
  num_warps: int = 4
  num_stages: int = 2


def _group_pad(num_q_heads: int, num_kv_heads: int) -> int:
  return _common.next_pow2(num_q_heads // num_kv_heads)


def default_config(q, k_pages, block_tables, *,
                   num_sms: int | None = None) -> RaggedAttentionConfig:
  """Picks a config from the shapes (arrays or `jax.ShapeDtypeStruct`s).

  Heuristic: 64 rows per tile (`block_q = 64 // group`, at least 1, so 16
  tokens at GQA 4) and K tiles of about 16 KiB (64 tokens for bf16 at
  head_dim 128), like the decode kernel; 4 warps, 2 stages. `num_sms` is
  accepted for symmetry with the decode kernel and unused: the grid is fixed
  by the token count.
  """
  del num_sms
  _, num_q_heads, _ = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group_pad = _group_pad(num_q_heads, num_kv_heads)
  block_q = max(1, 64 // group_pad)
  block_k = _common.default_block_k(q, k_pages, block_tables.shape[1])
  return RaggedAttentionConfig(
      block_q=block_q, pages_per_compute_block=max(1, block_k // block_size),
      num_warps=4, num_stages=2)


def unsupported_reason(q, k_pages, block_tables, *, soft_cap=None,
                       sliding_window=None, config=None) -> str | None:
  """Why this kernel cannot serve these inputs, or None if it can.

  Accepts arrays or `jax.ShapeDtypeStruct`s; looks only at shapes and dtypes.
  """
  error = contract.attention_input_error(
      q, k_pages, block_tables, ragged=True, soft_cap=soft_cap,
      sliding_window=sliding_window)
  if error is not None:
    return f"invalid inputs: {error}"
  return _limitation(q, k_pages, block_tables, config)


def _limitation(q, k_pages, block_tables, config) -> str | None:
  """Why this (well-formed) input cannot be served by the kernel, or None."""
  reason = _common.limitation(q, k_pages, block_tables)
  if reason is not None:
    return reason
  if config is None:
    config = default_config(q, k_pages, block_tables)
  num_q_heads = q.shape[1]
  num_kv_heads, _, block_size, _ = k_pages.shape
  rows = config.block_q * _group_pad(num_q_heads, num_kv_heads)
  if not _common.is_pow2(config.block_q):
    return f"config.block_q={config.block_q} must be a power of two"
  if not MIN_DOT_DIM <= rows <= MAX_ROWS:
    return (f"config.block_q * padded group = {rows} rows must be in"
            f" [{MIN_DOT_DIM}, {MAX_ROWS}] (Triton tile rules)")
  return _common.tile_limitation(block_size, config)


def _ragged_kernel(
    q_ref,  # [num_tokens, num_kv_heads, group, head_dim]
    k_ref,  # [num_blocks * block_size, head_dim]  (one KV head)
    v_ref,  # [num_blocks * block_size, head_dim]
    table_ref,  # i32[max_num_seqs, max_blocks_per_seq]
    kv_lens_ref,  # i32[max_num_seqs]
    cu_ref,  # i32[seqs_pad]: cu_q_lens padded to a power of two
    num_seqs_ref,  # i32[1]
    *refs,  # quantised pages: ks_ref, vs_ref f32[num_blocks * block_size];
    # then o_ref [num_tokens + 1, num_kv_heads, group_pad, head_dim]
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_size: int,
    pages_per_compute_block: int,
    block_q: int,
):
  ks_ref, vs_ref, o_ref = refs if quantized else (None, None) + refs
  num_tokens, _, group, head_dim = q_ref.shape
  num_blocks = k_ref.shape[0] // block_size
  group_pad = o_ref.shape[2]
  max_blocks_per_seq = table_ref.shape[1]
  seqs_pad = cu_ref.shape[0]
  block_k = pages_per_compute_block * block_size
  rows = block_q * group_pad
  tile, head = pl.program_id(0), pl.program_id(1)

  # Which sequence owns this tile: the last live s with first_tile[s] <= tile.
  num_seqs = num_seqs_ref[0]
  seq_ids = lax.iota(jnp.int32, seqs_pad)
  first_tiles = lax.div(cu_ref[...], block_q) + seq_ids  # i32[seqs_pad]
  owns = (first_tiles <= tile) & (seq_ids < num_seqs)
  seq = jnp.maximum(jnp.sum(owns.astype(jnp.int32)) - 1, 0)
  q_start = cu_ref[seq]
  q_len = cu_ref[seq + 1] - q_start
  local = tile - (lax.div(q_start, block_q) + seq)
  active = (num_seqs > 0) & (local * block_q < q_len)

  @pl.when(active)
  def _():
    kv_len = kv_lens_ref[seq]  # clamped to the table's capacity by the caller
    r = lax.iota(jnp.int32, rows)
    t = lax.div(r, group_pad)  # token within the tile
    h = lax.rem(r, group_pad)  # head within the group
    tok = q_start + local * block_q + t  # i32[rows]
    row_ok = (tok < q_start + q_len) & (h < group)
    q_pos = kv_len - q_len + (tok - q_start)  # i32[rows]
    cols = lax.iota(jnp.int32, head_dim)[None, :]
    row_mask = jnp.broadcast_to(row_ok[:, None], (rows, head_dim))
    q_idx = (jnp.where(row_ok, tok, 0)[:, None], head,
             jnp.minimum(h, group - 1)[:, None], cols)
    q = plgpu.load(q_ref.at[q_idx], mask=row_mask, other=0)
    compute_dtype = _common.compute_dtype(q.dtype, k_ref.dtype)
    q = q.astype(compute_dtype)
    precision = (lax.Precision.HIGHEST if compute_dtype == jnp.float32
                 else None)

    # Keys any row of the tile can see: [lo, hi).
    last_tok = jnp.minimum(q_start + (local + 1) * block_q, q_start + q_len) - 1
    hi = kv_len - q_len + (last_tok - q_start) + 1
    lo = jnp.int32(0)
    if sliding_window is not None:
      first_pos = kv_len - q_len + local * block_q
      lo = jnp.maximum(first_pos - sliding_window + 1, 0)

    def body(i, carry):
      o, m, l = carry
      k_pos = i * block_k + lax.iota(jnp.int32, block_k)  # i32[block_k]
      in_range = (k_pos >= lo) & (k_pos < hi)
      slots = jnp.minimum(lax.div(k_pos, block_size), max_blocks_per_seq - 1)
      pages = plgpu.load(table_ref.at[seq, slots], mask=in_range, other=0)
      # A table entry that is not a block contributes no tokens, unread.
      in_range &= contract.valid_block(pages, num_blocks)
      pages = jnp.where(in_range, pages, 0)  # never a bad id in an address
      kv_rows = pages * block_size + lax.rem(k_pos, block_size)
      kv_idx = (kv_rows[:, None], lax.iota(jnp.int32, head_dim)[None, :])
      kv_mask = jnp.broadcast_to(in_range[:, None], (block_k, head_dim))

      k = plgpu.load(k_ref.at[kv_idx], mask=kv_mask,
                     other=_common.zero(k_ref.dtype))
      ks = vs = None
      if quantized:  # unread tokens' scales load as 0 (never NaN)
        ks = plgpu.load(ks_ref.at[kv_rows], mask=in_range, other=0.0)[None, :]
        vs = plgpu.load(vs_ref.at[kv_rows], mask=in_range, other=0.0)
      s = quantization.scale_scores(
          plgpu.dot(q, k.astype(compute_dtype), trans_b=True,
                    precision=precision), ks) * sm_scale  # f32[rows, block_k]
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      visible = in_range[None, :] & (k_pos[None, :] <= q_pos[:, None])
      if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
      s = jnp.where(visible, s, -jnp.inf)
      v = plgpu.load(v_ref.at[kv_idx], mask=kv_mask,
                     other=_common.zero(v_ref.dtype))
      return _common.online_softmax_step(o, m, l, s, v,
                                         compute_dtype=compute_dtype,
                                         precision=precision, v_scales=vs)

    o = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    o, m, l = lax.fori_loop(lax.div(lo, block_k), pl.cdiv(hi, block_k), body,
                            (o, m, l))
    o = _common.normalise(o, l)
    # Rows that are not ours go to the spare row `num_tokens` (never written:
    # the store is masked), so no valid row shares an address with them.
    o_idx = (jnp.where(row_ok, tok, num_tokens)[:, None], head, h[:, None],
             cols)
    plgpu.store(o_ref.at[o_idx], o.astype(o_ref.dtype), mask=row_mask)


def _ragged_call(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                 num_seqs, k_scales, v_scales, *, sm_scale, soft_cap, sliding_window,
                 config: RaggedAttentionConfig, interpret: bool):
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  max_num_seqs = block_tables.shape[0]
  group = num_q_heads // num_kv_heads
  group_pad = _group_pad(num_q_heads, num_kv_heads)
  block_q = config.block_q
  num_tiles = num_tokens // block_q + max_num_seqs

  q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  k_rows = k_pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)
  v_rows = v_pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)
  seqs_pad = _common.next_pow2(max_num_seqs + 1)
  cu = jnp.pad(cu_q_lens, (0, seqs_pad - (max_num_seqs + 1)), mode="edge")

  def whole(x):
    return pl.BlockSpec(x.shape, lambda i, h: (0,) * len(x.shape))

  rows_spec = pl.BlockSpec((None, num_blocks * block_size, head_dim),
                           lambda i, h: (h, 0, 0))
  out_shape = jax.ShapeDtypeStruct(
      (num_tokens + 1, num_kv_heads, group_pad, head_dim), q.dtype)
  quantized = k_scales is not None
  scales, scale_specs = (), []
  if quantized:  # one scale per token row: [num_kv_heads, num_blocks * bs]
    scales = tuple(x.reshape(num_kv_heads, num_blocks * block_size)
                   for x in (k_scales, v_scales))
    scale_specs = [pl.BlockSpec((None, num_blocks * block_size),
                                lambda i, h: (h, 0))] * 2
  kernel = functools.partial(
      _ragged_kernel, quantized=quantized, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, block_size=block_size,
      pages_per_compute_block=config.pages_per_compute_block, block_q=block_q)
  o = pl.pallas_call(
      kernel,
      grid=(num_tiles, num_kv_heads),
      in_specs=[whole(q4), rows_spec, rows_spec, whole(block_tables),
                whole(kv_lens), whole(cu), whole(num_seqs)] + scale_specs,
      out_specs=pl.BlockSpec(out_shape.shape, lambda i, h: (0, 0, 0, 0)),
      out_shape=out_shape,
      compiler_params=_common.CompilerParams(num_warps=config.num_warps,
                                      num_stages=config.num_stages),
      interpret=interpret,
      name=(f"ragged_attention_bq{block_q}xg{group_pad}"
            f"_bk{config.pages_per_compute_block}x{block_size}"
            f"{'_' + jnp.dtype(k_pages.dtype).name if quantized else ''}"),
  )(q4, k_rows, v_rows, block_tables, kv_lens, cu, num_seqs, *scales)
  o = o[:num_tokens, :, :group].reshape(num_tokens, num_q_heads, head_dim)
  # Rows past the last live sequence were never written.
  live = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
  return jnp.where(live[:, None, None], o, 0).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "soft_cap", "sliding_window", "config",
                     "interpret"])
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
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
) -> jax.Array:
  """Causal attention of a ragged batch over a paged KV cache (GPU).

  Args:
    q: `[num_tokens, num_q_heads, head_dim]`; sequence `s` owns rows
      `cu_q_lens[s]:cu_q_lens[s+1]`, rows past `cu_q_lens[num_seqs[0]]` are
      padding.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` keys, holding
      every sequence's tokens, the new ones included.
    v_pages: values, same shape and dtype as `k_pages`.
    block_tables: `i32[max_num_seqs, max_blocks_per_seq]`; entries past a
      sequence's last block are never read (may hold -1); an entry inside it
      that is not a block in `[0, num_blocks)` contributes no tokens, unread.
    kv_lens: `i32[max_num_seqs]` tokens per sequence, new ones included,
      clamped to `[0, max_blocks_per_seq * block_size]`.
    cu_q_lens: `i32[max_num_seqs + 1]` cumulative query lengths; sequences
      from the first malformed one on are dropped (`pallas_kernels.contract`).
    num_seqs: `i32[1]` live sequences (the rest are ignored), clamped to
      `[0, max_num_seqs]`.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: if set, scores become `soft_cap * tanh(s / soft_cap)`.
    sliding_window: if set, a query at position `p` sees keys
      `p - sliding_window + 1 .. p`.
    config: tuning knobs; `default_config(...)` when None.
    interpret: run in Pallas interpret mode (CPU tests).
    k_scales, v_scales: int8 / float8_e4m3fn pages' per-token scales, as in
      `paged_decode` (dequantised inside the kernel).

  Returns:
    `[num_tokens, num_q_heads, head_dim]` in `q.dtype`; padding rows are 0.

  Raises:
    ValueError: if shapes or dtypes disagree or the kernel cannot serve them.

  Example:
    >>> q = jnp.ones((5, 8, 128), jnp.bfloat16)  # a 4-token prefill + a decode
    >>> k = jnp.ones((2, 16, 16, 128), jnp.bfloat16)
    >>> tables = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    >>> out = ragged_paged_attention(
    ...     q, k, k, tables, jnp.array([4, 30], jnp.int32),
    ...     jnp.array([0, 4, 5], jnp.int32), jnp.array([2], jnp.int32),
    ...     interpret=True)
    >>> out.shape
    (5, 8, 128)
  """
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      cu_q_lens=cu_q_lens, num_seqs=num_seqs, ragged=True, soft_cap=soft_cap,
      sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)
  reason = _limitation(q, k_pages, block_tables, config)
  if reason is not None:
    raise ValueError(
        f"ragged_paged_attention (GPU) cannot serve these inputs: {reason}")
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  if config is None:
    config = default_config(q, k_pages, block_tables)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kv_lens = contract.clamp_kv_lens(kv_lens, block_tables.shape[1],
                                   k_pages.shape[2])
  cu_q_lens, num_seqs = contract.sanitize_ragged_metadata(
      cu_q_lens, num_seqs, q.shape[0])
  return _ragged_call(
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
      k_scales, v_scales, sm_scale=float(sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      config=config, interpret=interpret)
