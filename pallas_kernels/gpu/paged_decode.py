"""Paged decode attention for GPUs: Pallas on the Triton lowering.

Flash-decoding over a paged KV cache. One program handles one (sequence,
KV head, k-split): it loads the query heads of that KV head's GQA group as one
`[block_h, head_dim]` tile (the group padded to the 16 rows a Triton `dot`
needs, by a masked load: q is never padded or copied outside) and walks its
share of the sequence's visible tokens in compute blocks of
`pages_per_compute_block * block_size` tokens, with an online softmax in
float32. It stores only its group's rows (masked), straight into the
`[batch, num_q_heads, head_dim]` output. Splitting the KV sequence across
programs (k-splits) keeps the GPU busy when `batch * num_kv_heads` is small;
the per-split partial results `(o, m, l)`, again only for the real rows, are
merged with a log-sum-exp by one XLA reduction after the call (a reduction
across programs, which one Pallas call cannot do).

Paging: a compute block's table entries are read as one contiguous vector a
block ahead, through the loop carry, so the K/V addresses of a block never
wait on a table load and Triton's software pipeliner keeps the next block's
copies in flight during this block's matmuls (see `default_config`). Each token
finds its physical row as `page * block_size + token % block_size` and K/V rows
are gathered with masked loads. A token is loaded only if it is visible
(`< kv_len`, and inside the sliding window) and its table entry names a block
in `[0, num_blocks)`: pages past `kv_len` and table entries that are not blocks
(`NULL_BLOCK` = -1 included, see `pallas_kernels.contract`) are never
dereferenced, and each split walks only the visible range of its own
sequence, so short sequences and sliding windows cost what they read.

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
  pages_per_compute_block: int = 2
  num_warps: int = 4
  num_stages: int = 3


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


# The launch knobs, from the kernel's resource use when compiled for sm_90a
# (H200: 132 multiprocessors, 64K registers and 228 KiB of shared memory each).
# `benchmarks/triton_resources.py` lowers the kernel on a CPU and compiles its
# Triton IR with the `triton` package (3.9); at the shape (batch 64 x
# 4096 tokens, 32/8 heads, head_dim 128, bf16, block 16: 512 programs, one
# wave needs 4 per multiprocessor) it reported, per (K tile, warps, stages):
#   32 tokens, 4 warps, 3 stages:  96 registers, 37 KiB, 5 per SM, 0.78 waves
#   32 tokens, 4 warps, 4 stages:  96 registers, 53 KiB, 4 per SM, 0.97 waves
#   64 tokens, 4 warps, 2 stages: 106 registers, 38 KiB, 4 per SM, 0.97 waves
#   64 tokens, 4 warps, 3 stages: 136 registers, 70 KiB, 3 per SM, 1.29 waves
# At 2 stages the PTX waits for every copy (`cp.async.wait_group 0`) before
# each block's compute; from 3 stages it keeps the next block's K and V
# copies in flight (`cp.async.wait_group 2`) - possible only because the page
# ids arrive a block ahead. So: a K tile of 8 KiB (32 tokens at bf16 x 128),
# 4 warps, 3 stages: one wave with a program to spare per SM for whatever
# XLA's own Triton adds, and two blocks of K/V (32 KiB) in flight per
# program. UNTESTED ON A GPU: no timing has confirmed it yet;
# `benchmarks/gpu_decode.py` sweeps stages 2-5 and tiles of 16-64 tokens
# around it.
DEFAULT_TILE_BYTES = 8 * 1024
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


def default_config(q, k_pages, block_tables, *,
                   num_sms: int | None = None) -> PagedDecodeConfig:
  """Picks a config from the shapes (arrays or `jax.ShapeDtypeStruct`s).

  Heuristic (the numbers behind it are in the comment above):
    * compute block (`block_k` tokens) sized so one K tile is about 8 KiB:
      32 tokens for bf16 at head_dim 128, clamped to [16, 128] tokens, to the
      table's capacity and to at least one page;
    * k-splits: `batch * num_kv_heads` programs rarely fill the GPU in decode,
      so split each sequence until there are about two programs per
      multiprocessor (`num_sms`, queried from the device when on GPU, else
      132), a power of two, at most 64, and never more splits than the table
      has compute blocks;
    * 4 warps, 3 stages (the next block's K/V in flight during this one's
      compute).

  Args:
    q: `[batch, num_q_heads, head_dim]` queries.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` keys.
    block_tables: `i32[batch, max_blocks_per_seq]`.
    num_sms: multiprocessor count; queried from the device if None.

  Returns:
    A `PagedDecodeConfig`.
  """
  batch = q.shape[0]
  num_kv_heads, _, block_size, _ = k_pages.shape
  max_blocks_per_seq = block_tables.shape[1]
  if num_sms is None:
    num_sms = _device_num_sms()
  block_k = _common.default_block_k(q, k_pages, max_blocks_per_seq,
                                    tile_bytes=DEFAULT_TILE_BYTES)
  pages_per_compute_block = max(1, block_k // block_size)
  num_compute_blocks = pl.cdiv(max_blocks_per_seq, pages_per_compute_block)
  programs = max(batch * num_kv_heads, 1)
  k_splits = _common.next_pow2(pl.cdiv(2 * num_sms, programs))
  k_splits = max(1, min(k_splits, 64,
                        _common.next_pow2(num_compute_blocks) // 2 or 1))
  return PagedDecodeConfig(
      k_splits=k_splits, pages_per_compute_block=pages_per_compute_block,
      num_warps=DEFAULT_NUM_WARPS, num_stages=DEFAULT_NUM_STAGES)


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
    q_ref,  # [num_q_heads, head_dim]  (this sequence's queries)
    k_ref,  # [num_blocks * block_size, head_dim]  (one KV head)
    v_ref,  # [num_blocks * block_size, head_dim]
    table_ref,  # i32[max_blocks_per_seq]
    kv_len_ref,  # i32[]
    *refs,  # quantised pages: ks_ref, vs_ref f32[num_blocks * block_size];
    # then o_ref [num_q_heads, head_dim]: normalised (one split) or this
    # split's f32 partial, and (several splits only) m_ref, l_ref
    # f32[num_q_heads]; each program writes only its GQA group's rows
    quantized: bool,
    group: int,
    block_h: int,
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
  head_dim = q_ref.shape[1]
  max_blocks_per_seq = table_ref.shape[0]
  num_blocks = k_ref.shape[0] // block_size
  ppcb = pages_per_compute_block
  block_k = ppcb * block_size
  split = pl.program_id(2)

  # This KV head's query heads, padded to `block_h` rows with masked loads
  # and stores (no padded copy of q, no slice of the output outside).
  row = lax.iota(jnp.int32, block_h)
  heads = pl.program_id(1) * group + row  # i32[block_h]
  real = row < group  # bool[block_h]
  head_idx = (heads[:, None], lax.iota(jnp.int32, head_dim)[None, :])
  head_mask = jnp.broadcast_to(real[:, None], (block_h, head_dim))

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

  q = plgpu.load(q_ref.at[head_idx], mask=head_mask,
                 other=_common.zero(q_ref.dtype))
  compute_dtype = _common.compute_dtype(q.dtype, k_ref.dtype)
  q = q.astype(compute_dtype)
  precision = (lax.Precision.HIGHEST if compute_dtype == jnp.float32
               else None)

  def table_entries(i):
    """i32[ppcb]: compute block i's table entries, one contiguous read
    (entries past the table read as -1: not a block)."""
    slots = i * ppcb + lax.iota(jnp.int32, ppcb)
    return plgpu.load(table_ref.at[slots], mask=slots < max_blocks_per_seq,
                      other=-1)

  def body(i, carry):
    o, m, l, pages = carry  # pages: i32[ppcb], compute block i's entries
    # The next block's entries, a block ahead: the K/V addresses of block i
    # never wait on a table load, so the pipeliner can overlap them.
    next_pages = table_entries(i + 1)
    tokens = i * block_k + lax.iota(jnp.int32, block_k)  # i32[block_k]
    page_of_token = jnp.broadcast_to(
        pages[:, None], (ppcb, block_size)).reshape(block_k)
    # A table entry that is not a block contributes no tokens, unread.
    visible = ((tokens >= lo) & (tokens < hi)
               & contract.valid_block(page_of_token, num_blocks))
    page_of_token = jnp.where(visible, page_of_token, 0)  # no bad address
    rows = page_of_token * block_size + lax.rem(tokens, block_size)
    # Gather [block_k, head_dim] with two broadcast integer indices (interpret
    # mode cannot mix an integer-array index with a slice).
    idx = (rows[:, None], lax.iota(jnp.int32, head_dim)[None, :])
    row_mask = jnp.broadcast_to(visible[:, None], (block_k, head_dim))

    k = plgpu.load(k_ref.at[idx], mask=row_mask,
                   other=_common.zero(k_ref.dtype))
    v = plgpu.load(v_ref.at[idx], mask=row_mask,
                   other=_common.zero(v_ref.dtype))
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
    o, m, l = _common.online_softmax_step(o, m, l, s, v,
                                          compute_dtype=compute_dtype,
                                          precision=precision, v_scales=vs)
    return o, m, l, next_pages

  o = jnp.zeros((block_h, head_dim), jnp.float32)
  # A finite start keeps `exp(m - m_next)` a number when a row sees nothing.
  m = jnp.full((block_h,), jnp.finfo(jnp.float32).min, jnp.float32)
  l = jnp.zeros((block_h,), jnp.float32)
  o, m, l, _ = lax.fori_loop(start, end, body,
                             (o, m, l, table_entries(start)))

  if ml_refs:
    m_ref, l_ref = ml_refs
    plgpu.store(o_ref.at[head_idx], o, mask=head_mask)
    plgpu.store(m_ref.at[heads], m, mask=real)
    plgpu.store(l_ref.at[heads], l, mask=real)
  else:
    plgpu.store(o_ref.at[head_idx], _common.normalise(o, l).astype(o_ref.dtype),
                mask=head_mask)


def _paged_decode_call(q, k_pages, v_pages, block_tables, kv_lens, k_scales,
                       v_scales, *, sm_scale, soft_cap, sliding_window,
                       config: PagedDecodeConfig, interpret: bool):
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  max_blocks_per_seq = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  block_h = _block_h(num_q_heads, num_kv_heads)
  k_splits = config.k_splits
  # One row per token: [num_kv_heads, num_blocks * block_size, head_dim].
  k_rows = k_pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)
  v_rows = v_pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)

  quantized = k_scales is not None
  kernel = functools.partial(
      _paged_decode_kernel, quantized=quantized, group=group, block_h=block_h,
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
      block_size=block_size,
      pages_per_compute_block=config.pages_per_compute_block,
      k_splits=k_splits)
  rows_spec = pl.BlockSpec((None, num_blocks * block_size, head_dim),
                           lambda b, h, s: (h, 0, 0))
  # Every program of sequence b sees all its query heads and picks (masked)
  # its group's rows: the block is the whole last two dims, any head count.
  heads_spec = pl.BlockSpec((None, num_q_heads, head_dim),
                            lambda b, h, s: (b, 0, 0))
  in_specs = [
      heads_spec,  # q
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
    out_shape = jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), q.dtype)
    out_specs = heads_spec
  else:  # per split: f32 partial outputs, running max and sum, real rows only
    ml = jax.ShapeDtypeStruct((k_splits, batch, num_q_heads), jnp.float32)
    out_shape = [
        jax.ShapeDtypeStruct((k_splits, batch, num_q_heads, head_dim),
                             jnp.float32), ml, ml]
    ml_spec = pl.BlockSpec((None, None, num_q_heads),
                           lambda b, h, s: (s, b, 0))
    out_specs = [
        pl.BlockSpec((None, None, num_q_heads, head_dim),
                     lambda b, h, s: (s, b, 0, 0)), ml_spec, ml_spec]

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
    return out
  # The log-sum-exp merge of the splits is a reduction across programs: one
  # fused XLA reduction over [k_splits, batch, num_q_heads(, head_dim)].
  o, m, l = out
  m_max = m.max(axis=0)
  # JAX's decode_attention needs this barrier against NaNs after XLA fusion
  # (b/389925439); it costs nothing measurable here.
  m_max = lax.optimization_barrier(m_max)
  w = jnp.exp(m - m_max[None])
  l_sum = (w * l).sum(axis=0)
  o = (w[..., None] * o).sum(axis=0)
  o = jnp.where(l_sum[..., None] > 0,
                o / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)
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
