"""Paged decode attention for GPUs: Pallas on the Triton lowering.

Flash-decoding over a paged KV cache. One program handles one (sequence,
KV head, k-split): it holds the query heads of that KV head's GQA group as one
`[block_h, head_dim]` tile (the group padded to the 16 rows a Triton `dot`
needs) and walks its share of the sequence's visible tokens in compute blocks of
`pages_per_compute_block * block_size` tokens, with an online softmax in
float32. Splitting the KV sequence across programs (k-splits) keeps the GPU busy
when `batch * num_kv_heads` is small; the per-split partial results `(o, m, l)`
are merged with a log-sum-exp outside the kernel.

Paging: each token of a compute block finds its physical row through the block
table (`page * block_size + token % block_size`) and K/V rows are gathered with
masked loads. A token is loaded only if it is visible (`< kv_len`, and inside
the sliding window) and its table entry names a block in `[0, num_blocks)`:
pages past `kv_len` and table entries that are not blocks (`NULL_BLOCK` = -1
included, see `pallas_kernels.contract`) are never dereferenced, and each split walks only the visible range of its own sequence,
so short sequences and sliding windows cost what they read.

The Triton backend is selected explicitly through `CompilerParams` (recent JAX
lowers GPU Pallas with Mosaic GPU by default). Layout as everywhere in
paged-jax: K/V pages `[num_kv_heads, num_blocks, block_size, head_dim]`,
`block_tables` i32[batch, max_blocks_per_seq], `kv_lens` i32[batch].
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

DEFAULT_NUM_SMS = 132  # an H100/H200, when no GPU is attached
MIN_DOT_DIM = _common.MIN_DOT_DIM


@dataclasses.dataclass(frozen=True)
class PagedDecodeConfig:
  """Tuning knobs of the GPU paged-decode kernel (static, hashable).

  Attributes:
    k_splits: programs per (sequence, KV head); each takes an equal share of
      the sequence's visible compute blocks.
    pages_per_compute_block: pages per inner-loop step;
      `pages_per_compute_block * block_size` (the tile's token count, `block_k`)
      must be a power of two and at least 16.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages for the inner loop.
  """
  k_splits: int = 1
  pages_per_compute_block: int = 4
  num_warps: int = 4
  num_stages: int = 2


def _block_h(num_q_heads: int, num_kv_heads: int) -> int:
  """Rows of the query tile: the GQA group padded to a Triton dot's minimum."""
  return max(MIN_DOT_DIM, _common.next_pow2(num_q_heads // num_kv_heads))


def _device_num_sms() -> int:
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return DEFAULT_NUM_SMS
  if device.platform != "gpu":
    return DEFAULT_NUM_SMS
  return int(getattr(device, "core_count", 0) or DEFAULT_NUM_SMS)


def default_config(q, k_pages, block_tables, *,
                   num_sms: int | None = None) -> PagedDecodeConfig:
  """Picks a config from the shapes (arrays or `jax.ShapeDtypeStruct`s).

  Heuristic:
    * compute block (`block_k` tokens) sized so one K tile is about 16 KiB:
      64 tokens for bf16 at head_dim 128, clamped to [16, 128] tokens, to the
      table's capacity and to at least one page;
    * k-splits: `batch * num_kv_heads` programs rarely fill the GPU in decode,
      so split each sequence until there are about two programs per
      multiprocessor (`num_sms`, queried from the device when on GPU, else
      132), a power of two, at most 64, and never more splits than the table
      has compute blocks;
    * 4 warps, 2 stages (the tiles are small: 16 query rows).

  Args:
    q: `[batch, num_q_heads, head_dim]` queries.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` keys.
    block_tables: `i32[batch, max_blocks_per_seq]`.
    num_sms: multiprocessor count; queried from the device if None.

  Returns:
    A `PagedDecodeConfig`.
  """
  batch, _, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  max_blocks_per_seq = block_tables.shape[1]
  if num_sms is None:
    num_sms = _device_num_sms()
  block_k = _common.default_block_k(q, k_pages, max_blocks_per_seq)
  pages_per_compute_block = max(1, block_k // block_size)
  num_compute_blocks = pl.cdiv(max_blocks_per_seq, pages_per_compute_block)
  programs = max(batch * num_kv_heads, 1)
  k_splits = _common.next_pow2(pl.cdiv(2 * num_sms, programs))
  k_splits = max(1, min(k_splits, 64,
                        _common.next_pow2(num_compute_blocks) // 2 or 1))
  return PagedDecodeConfig(
      k_splits=k_splits, pages_per_compute_block=pages_per_compute_block,
      num_warps=4, num_stages=2)


def unsupported_reason(q, k_pages, block_tables, *, soft_cap=None,
                       sliding_window=None, config=None) -> str | None:
  """Why this kernel cannot serve these inputs, or None if it can.

  Accepts arrays or `jax.ShapeDtypeStruct`s; looks only at shapes and dtypes.
  """
  error = contract.attention_input_error(
      q, k_pages, block_tables, soft_cap=soft_cap,
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
    config = default_config(q, k_pages, block_tables, num_sms=DEFAULT_NUM_SMS)
  if config.k_splits < 1:
    return f"config.k_splits={config.k_splits} must be at least 1"
  return _common.tile_limitation(k_pages.shape[2], config)


def _paged_decode_kernel(
    q_ref,  # [block_h, head_dim]
    k_ref,  # [num_blocks * block_size, head_dim]  (one KV head)
    v_ref,  # [num_blocks * block_size, head_dim]
    table_ref,  # i32[max_blocks_per_seq]
    kv_len_ref,  # i32[]
    *refs,  # quantised pages: ks_ref, vs_ref f32[num_blocks * block_size];
    # then o_ref [block_h, head_dim]: normalised (one split) or f32 partial,
    # and (several splits only) m_ref, l_ref f32[block_h]
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_size: int,
    pages_per_compute_block: int,
    k_splits: int,
):
  scale_refs, (o_ref, *ml_refs) = (refs[:2], refs[2:]) if quantized else (
      (None, None), refs)
  ks_ref, vs_ref = scale_refs
  block_h, head_dim = q_ref.shape
  max_blocks_per_seq = table_ref.shape[0]
  num_blocks = k_ref.shape[0] // block_size
  block_k = pages_per_compute_block * block_size
  split = pl.program_id(2)

  # Visible tokens are [lo, hi); this split owns compute blocks [start, end).
  hi = kv_len_ref[()]  # clamped to the table's capacity by the caller
  lo = jnp.int32(0)
  if sliding_window is not None:
    lo = jnp.maximum(hi - sliding_window, 0)
  first = lax.div(lo, block_k)
  num_compute_blocks = jnp.maximum(pl.cdiv(hi, block_k) - first, 0)
  per_split = pl.cdiv(num_compute_blocks, k_splits)
  start = first + split * per_split
  end = jnp.minimum(start + per_split, first + num_compute_blocks)

  q = q_ref[...]
  compute_dtype = _common.compute_dtype(q.dtype, k_ref.dtype)
  q = q.astype(compute_dtype)
  precision = (lax.Precision.HIGHEST if compute_dtype == jnp.float32
               else None)

  def body(i, carry):
    o, m, l = carry
    tokens = i * block_k + lax.iota(jnp.int32, block_k)  # i32[block_k]
    in_range = (tokens >= lo) & (tokens < hi)  # bool[block_k]
    slots = jnp.minimum(lax.div(tokens, block_size), max_blocks_per_seq - 1)
    pages = plgpu.load(table_ref.at[slots], mask=in_range, other=0)
    # A table entry that is not a block contributes no tokens, unread.
    visible = in_range & contract.valid_block(pages, num_blocks)
    pages = jnp.where(visible, pages, 0)  # never a bad id in an address
    rows = pages * block_size + lax.rem(tokens, block_size)  # i32[block_k]
    # Gather [block_k, head_dim] with two broadcast integer indices (interpret
    # mode cannot mix an integer-array index with a slice).
    idx = (rows[:, None], lax.iota(jnp.int32, head_dim)[None, :])
    row_mask = jnp.broadcast_to(visible[:, None], (block_k, head_dim))

    k = plgpu.load(k_ref.at[idx], mask=row_mask,
                   other=_common.zero(k_ref.dtype))
    ks = vs = None
    if quantized:  # invisible tokens' scales load as 0 (never NaN)
      ks = plgpu.load(ks_ref.at[rows], mask=visible, other=0.0)[None, :]
      vs = plgpu.load(vs_ref.at[rows], mask=visible, other=0.0)
    s = quantization.scale_scores(
        plgpu.dot(q, k.astype(compute_dtype), trans_b=True,
                  precision=precision), ks) * sm_scale  # f32[block_h, block_k]
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible[None, :], s, -jnp.inf)
    v = plgpu.load(v_ref.at[idx], mask=row_mask,
                   other=_common.zero(v_ref.dtype))
    return _common.online_softmax_step(o, m, l, s, v,
                                       compute_dtype=compute_dtype,
                                       precision=precision, v_scales=vs)

  o = jnp.zeros((block_h, head_dim), jnp.float32)
  # A finite start keeps `exp(m - m_next)` a number when a row sees nothing.
  m = jnp.full((block_h,), jnp.finfo(jnp.float32).min, jnp.float32)
  l = jnp.zeros((block_h,), jnp.float32)
  o, m, l = lax.fori_loop(start, end, body, (o, m, l))

  if ml_refs:
    m_ref, l_ref = ml_refs
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l
  else:
    o_ref[...] = _common.normalise(o, l).astype(o_ref.dtype)


def _paged_decode_call(q, k_pages, v_pages, block_tables, kv_lens, k_scales,
                       v_scales, *, sm_scale, soft_cap, sliding_window,
                       config: PagedDecodeConfig, interpret: bool):
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  max_blocks_per_seq = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  block_h = _block_h(num_q_heads, num_kv_heads)
  k_splits = config.k_splits

  q = q.reshape(batch, num_kv_heads, group, head_dim)
  if block_h != group:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
  # One row per token: [num_kv_heads, num_blocks * block_size, head_dim].
  k_rows = k_pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)
  v_rows = v_pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)

  quantized = k_scales is not None
  kernel = functools.partial(
      _paged_decode_kernel, quantized=quantized, sm_scale=sm_scale,
      soft_cap=soft_cap,
      sliding_window=sliding_window, block_size=block_size,
      pages_per_compute_block=config.pages_per_compute_block,
      k_splits=k_splits)
  rows_spec = pl.BlockSpec((None, num_blocks * block_size, head_dim),
                           lambda b, h, s: (h, 0, 0))
  in_specs = [
      pl.BlockSpec((None, None, block_h, head_dim),
                   lambda b, h, s: (b, h, 0, 0)),  # q
      rows_spec,  # k
      rows_spec,  # v
      pl.BlockSpec((None, max_blocks_per_seq), lambda b, h, s: (b, 0)),  # table
      pl.BlockSpec((None,), lambda b, h, s: (b,)),  # kv_len
  ]
  scales = ()
  if quantized:  # one scale per token row: [num_kv_heads, num_blocks * bs]
    scales = tuple(x.reshape(num_kv_heads, num_blocks * block_size)
                   for x in (k_scales, v_scales))
    in_specs += [pl.BlockSpec((None, num_blocks * block_size),
                              lambda b, h, s: (h, 0))] * 2
  if k_splits == 1:
    out_shape = jax.ShapeDtypeStruct((batch, num_kv_heads, block_h, head_dim),
                                     q.dtype)
    out_specs = pl.BlockSpec((None, None, block_h, head_dim),
                             lambda b, h, s: (b, h, 0, 0))
  else:
    ml = jax.ShapeDtypeStruct((k_splits, batch, num_kv_heads, block_h),
                              jnp.float32)
    out_shape = [
        jax.ShapeDtypeStruct((k_splits, batch, num_kv_heads, block_h, head_dim),
                             jnp.float32), ml, ml]
    ml_spec = pl.BlockSpec((None, None, None, block_h),
                           lambda b, h, s: (s, b, h, 0))
    out_specs = [
        pl.BlockSpec((None, None, None, block_h, head_dim),
                     lambda b, h, s: (s, b, h, 0, 0)), ml_spec, ml_spec]

  out = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, k_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_common.CompilerParams(num_warps=config.num_warps,
                                      num_stages=config.num_stages),
      interpret=interpret,
      name=(f"paged_decode_bh{block_h}_bk{config.pages_per_compute_block}"
            f"x{block_size}_ks{k_splits}"
            f"{'_' + jnp.dtype(k_pages.dtype).name if quantized else ''}"),
  )(q, k_rows, v_rows, block_tables, kv_lens, *scales)

  if k_splits == 1:
    o = out
  else:
    o, m, l = out  # [k_splits, batch, num_kv_heads, block_h(, head_dim)]
    m_max = m.max(axis=0)
    # JAX's decode_attention needs this barrier against NaNs after XLA fusion
    # (b/389925439); it costs nothing measurable here.
    m_max = lax.optimization_barrier(m_max)
    w = jnp.exp(m - m_max[None])
    l_sum = (w * l).sum(axis=0)
    o = (w[..., None] * o).sum(axis=0)
    o = jnp.where(l_sum[..., None] > 0,
                  o / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)
  o = o[:, :, :group].reshape(batch, num_q_heads, head_dim)
  return o.astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "soft_cap", "sliding_window", "config",
                     "interpret"])
def paged_decode(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # i32[batch]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    config: PagedDecodeConfig | None = None,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
) -> jax.Array:
  """Decode attention over a paged KV cache (GPU, Pallas/Triton).

  Sequence `b`'s single query sits at position `kv_lens[b] - 1` and attends to
  its first `kv_lens[b]` tokens, found through `block_tables[b]`.

  Args:
    q: `[batch, num_q_heads, head_dim]` queries (float32, bfloat16, float16).
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` keys: float,
      or int8 / float8_e4m3fn (the latter on sm_89+) with `k_scales`.
    v_pages: values, same shape and dtype as `k_pages`.
    block_tables: `i32[batch, max_blocks_per_seq]`: logical block `i` of
      sequence `b` is physical block `block_tables[b, i]`; entries past the
      sequence's last block are never read (may hold -1); an entry inside it
      that is not a block in `[0, num_blocks)` is never read and contributes
      no tokens.
    kv_lens: `i32[batch]` tokens per sequence (0 gives a zero output),
      clamped to `[0, max_blocks_per_seq * block_size]`.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: if set, scores become `soft_cap * tanh(s / soft_cap)` (after
      `sm_scale`).
    sliding_window: if set, the query sees only its last `sliding_window`
      tokens (its own included).
    config: tuning knobs; `default_config(...)` when None.
    interpret: run the kernel in Pallas interpret mode (CPU tests).
    k_scales, v_scales: quantised pages' per-token scales (see
      `pallas_kernels.quantization`); the K scales multiply the scores, the V
      scales the probabilities, inside the kernel.

  Returns:
    `[batch, num_q_heads, head_dim]` in `q.dtype`.

  Raises:
    ValueError: if shapes or dtypes disagree (`pallas_kernels.contract`) or
      the kernel cannot serve them (see `unsupported_reason`).

  Example:
    >>> q = jnp.ones((2, 8, 128), jnp.bfloat16)
    >>> k = jnp.ones((2, 16, 16, 128), jnp.bfloat16)
    >>> tables = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    >>> out = paged_decode(q, k, k, tables, jnp.array([5, 100], jnp.int32),
    ...                    interpret=True)
    >>> out.shape
    (2, 8, 128)
  """
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
      v_scales=v_scales)
  reason = _limitation(q, k_pages, block_tables, config)
  if reason is not None:
    raise ValueError(f"paged_decode (GPU) cannot serve these inputs: {reason}")
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  if config is None:
    config = default_config(q, k_pages, block_tables)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kv_lens = contract.clamp_kv_lens(kv_lens, block_tables.shape[1],
                                   k_pages.shape[2])
  return _paged_decode_call(
      q, k_pages, v_pages, block_tables, kv_lens, k_scales, v_scales,
      sm_scale=float(sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      config=config, interpret=interpret)
