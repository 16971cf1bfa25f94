"""Paged decode attention for TPU (Mosaic Pallas).

One query token per sequence attends over that sequence's K/V pages. Layout:

  q:            [batch, num_q_heads, head_dim]
  k/v pages:    [num_kv_heads, num_blocks, block_size, head_dim]   (stay in HBM)
  block_tables: i32[batch, max_blocks_per_seq]   (-1 = unused, never read)
  kv_lens:      i32[batch]
  k/v scales:   f32[num_kv_heads, num_blocks, block_size]   (8-bit pages only)

The grid is `(batch,)`, marked parallel: every grid step owns one sequence and
is self-contained (no state crosses grid steps, so megacore chips may split
the batch). Inside a step the sequence's KV heads are walked one after the
other, and each head's pages in compute blocks of `pages_per_compute_block`
pages. The query heads that share a KV head (the GQA group) are computed
together, so each page is read from HBM once. The (head, block) pairs form one
flat pipeline: the next pair's pages are copied HBM -> VMEM (one async copy
per page, into the other half of a double buffer) while the current pair is
computed, so only the first copy of each sequence is exposed. Pages past
`kv_len`, pages wholly before the sliding window, and table entries that are
not blocks (`pallas_kernels.contract`) are never copied; the softmax is an
online softmax in float32. A compute block with such an entry takes a slower
path that masks that page's tokens; a well-formed block pays one scalar test
per page.

Block tables and lengths are scalar-prefetched into SMEM.

8-bit pages (int8 / float8_e4m3fn, `pallas_kernels.quantization`): each
page's scale row is copied beside it (same table entry, same semaphore) and
laid along the scores' lanes (`_common.scales_along_lanes`); the K scales
multiply the scores and the V scales the probabilities of the weighted sum.
The values are converted in VMEM, one compute block at a time, to the query
dtype (exact: every 8-bit value is a bfloat16); the cache is never cast.
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

# Tokens per compute block that `default_config` aims for.
TARGET_TOKENS_PER_COMPUTE_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class PagedDecodeConfig:
  """Tuning knobs of the TPU paged-decode kernel (hashable, static).

  Attributes:
    pages_per_compute_block: pages copied and attended per step of the inner
      loop; two such blocks of K and of V live in VMEM at once.
    vmem_limit_bytes: scoped-VMEM limit passed to Mosaic; `None` keeps the
      compiler default (assumed `DEFAULT_VMEM_LIMIT_BYTES` when checking fit).
  """
  pages_per_compute_block: int = 8
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    pages_per_compute_block = self.pages_per_compute_block
    vmem_limit_bytes = self.vmem_limit_bytes
    if pages_per_compute_block < 1:
      raise ValueError(f"{pages_per_compute_block=} must be at least 1")
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
      raise ValueError(f"{vmem_limit_bytes=} must be positive")


def _q_kernel_layout(q_shape, q_dtype, num_kv_heads):
  """Shape and dtype in which q (and the output) cross the kernel boundary.

  A GQA group that fills whole 8-row sublane tiles goes as
  `[batch, num_kv_heads, num_groups, head_dim]` in `q.dtype`. A smaller group
  goes as float32 `[batch, num_kv_heads, num_groups, 1, head_dim]`: one
  `(1, 128)`-tiled row per head, the layout JAX's own paged-attention kernel
  uses for small groups.
  """
  batch, num_q_heads, head_dim = q_shape
  num_groups = num_q_heads // num_kv_heads
  if num_groups % 8 == 0:
    return (batch, num_kv_heads, num_groups, head_dim), q_dtype
  return (batch, num_kv_heads, num_groups, 1, head_dim), jnp.float32


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------


def _paged_decode_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[batch]
    block_tables_ref,  # i32[batch * max_blocks_per_seq]
    # Inputs.
    q_ref,  # [num_kv_heads, num_groups, head_dim] queries of one sequence
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
  """One grid step: every KV head of sequence `b`, one compute block at a time.

  The (kv head, compute block) pairs of the sequence form one flat pipeline:
  the copies of pair `t + 1` (possibly the next head's first block) are in
  flight while pair `t` is computed.

  `refs`, in order (the `[..]` ones only when `quantized`):
    [k_scales_hbm_ref, v_scales_hbm_ref]  f32[num_kv_heads, num_blocks,
                                          block_size] (HBM)
    o_ref    [num_kv_heads, num_groups, head_dim]  (output)
    k_buf    [2, pages_per_compute_block * block_size, head_dim] (VMEM)
    v_buf    [2, pages_per_compute_block * block_size, head_dim] (VMEM)
    [ks_buf, vs_buf]  f32[2, pages_per_compute_block, block_size] (VMEM)
    sems     DMA semaphores [2 (k, v), 2 (buffer slot)]
    m_ref    f32[num_groups, 1] running max
    l_ref    f32[num_groups, 1] running denominator
    acc_ref  f32[num_groups, head_dim] running numerator
  """
  if quantized:
    (k_scales_hbm_ref, v_scales_hbm_ref, o_ref, k_buf, v_buf, ks_buf, vs_buf,
     sems, m_ref, l_ref, acc_ref) = refs
    scales = (k_scales_hbm_ref, v_scales_hbm_ref, ks_buf, vs_buf)
  else:
    o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    scales = None
  b = pl.program_id(0)
  _, tokens_per_block, head_dim = k_buf.shape
  pages_per_block = tokens_per_block // block_size
  num_kv_heads, num_groups, _ = q_ref.shape

  kv_len = kv_lens_ref[b]
  num_pages = jnp.minimum(pl.cdiv(kv_len, block_size), max_blocks_per_seq)
  if sliding_window is None:
    window_start = jnp.int32(0)
  else:
    window_start = jnp.maximum(kv_len - sliding_window, 0)
  # Pages wholly before the window are skipped. (lax.div: `//` on traced ints
  # lowers through `sign`, which needs a TPU to be present at lowering time.)
  first_page = lax.div(window_start, block_size)
  num_blocks = jnp.maximum(pl.cdiv(num_pages - first_page, pages_per_block), 0)
  num_steps = num_kv_heads * num_blocks  # flat (kv head, block) pipeline

  copies = _common.PageCopies(
      block_tables_ref, k_pages_hbm_ref, v_pages_hbm_ref, k_buf, v_buf, sems,
      block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
      scales=scales)
  row = b * max_blocks_per_seq
  run = (row, first_page, num_pages)  # this sequence's pages to walk

  def start(h, block, slot):
    copies.start(h, *run, block, slot)

  def wait(kv, h, block, slot):
    copies.wait(kv, h, *run, block, slot)

  # Heads are written as they finish; kv_len == 0 leaves these zeros.
  o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(num_steps > 0)
  def _():
    start(0, 0, 0)

  precision = _common.matmul_precision(compute_dtype)

  def compute(h, i, slot, pages_ok):
    """Folds compute block `i` of head `h` into the running softmax.
    `pages_ok` (scalars per page, or None when all are fine) masks the tokens
    of pages whose table entry is not a block (never copied)."""
    block_start = (first_page + i * pages_per_block) * block_size
    wait(0, h, i, slot)
    q = q_ref[h].astype(compute_dtype)  # [num_groups, head_dim]
    # [tokens_per_block, head_dim]
    k = _common.load_values(k_buf.at[slot], compute_dtype)
    k_scales = v_scales = None  # f32[1, tokens_per_block] (8-bit pages)
    if quantized:
      k_scales = copies.scale_row(0, slot, block_start, kv_len, pages_ok)
      v_scales = lambda: copies.scale_row(1, slot, block_start, kv_len,
                                          pages_ok)
    s = _common.scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap,
                       precision=precision, k_scales=k_scales)
    # s: f32[num_groups, tokens_per_block]
    # Slots past kv_len (and of pages not copied) hold garbage: mask with where.
    shape = (num_groups, tokens_per_block)
    pos = block_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = (pos < kv_len) & (pos >= window_start)
    if pages_ok is not None:
      visible &= _common.page_token_mask(shape, 1, block_size, pages_ok)

    def load_v():
      wait(1, h, i, slot)
      v_shape = (tokens_per_block, head_dim)
      keep = block_start + lax.broadcasted_iota(jnp.int32, v_shape, 0) < kv_len
      if pages_ok is not None:
        keep &= _common.page_token_mask(v_shape, 0, block_size, pages_ok)
      return jnp.where(keep, v_buf[slot].astype(jnp.float32), 0.0)

    _common.online_softmax_block(m_ref, l_ref, acc_ref, s, visible, load_v,
                                 compute_dtype=compute_dtype,
                                 precision=precision, load_v_scales=v_scales)

  def body(t, carry):
    h, i = carry  # kv head, compute block of step t
    slot = lax.rem(t, 2)
    last_block = i + 1 == num_blocks
    next_h = jnp.where(last_block, h + 1, h)
    next_i = jnp.where(last_block, 0, i + 1)

    @pl.when(t + 1 < num_steps)
    def _():
      start(next_h, next_i, 1 - slot)

    @pl.when(i == 0)
    def _():
      m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
      l_ref[...] = jnp.zeros_like(l_ref)
      acc_ref[...] = jnp.zeros_like(acc_ref)

    # A page inside kv_len whose entry is not a block contributes no tokens:
    # the common case pays one scalar test per page for it.
    pages_ok, all_ok = copies.pages_ok(*run, i)
    pl.when(all_ok)(lambda: compute(h, i, slot, None))
    pl.when(~all_ok)(lambda: compute(h, i, slot, pages_ok))

    @pl.when(last_block)
    def _():
      # Every processed block holds a visible key unless its pages are not
      # blocks; then l == 0 and the head's output is zero.
      l = l_ref[...]
      o_ref[h] = jnp.where(l > 0.0, acc_ref[...] / jnp.where(l > 0.0, l, 1.0),
                           0.0).astype(o_ref.dtype)

    return next_h, next_i

  lax.fori_loop(0, num_steps, body, (jnp.int32(0), jnp.int32(0)))


# ----------------------------------------------------------------------------
# pallas_call builder
# ----------------------------------------------------------------------------


def _build_paged_decode(
    q_shape, q_dtype, k_shape, kv_dtype, max_blocks_per_seq, *, sm_scale,
    soft_cap, sliding_window, config: PagedDecodeConfig, interpret):
  """Returns `f(kv_lens, tables_flat, q_kernel, k_pages, v_pages[, k_scales,
  v_scales]) -> out` (the scales for 8-bit pages)."""
  batch, num_q_heads, head_dim = q_shape
  num_kv_heads, _, block_size, _ = k_shape
  num_groups = num_q_heads // num_kv_heads
  pages_per_block = config.pages_per_compute_block

  q_shape_kernel, q_dtype_kernel = _q_kernel_layout(q_shape, q_dtype,
                                                    num_kv_heads)
  if len(q_shape_kernel) == 4:  # [batch, num_kv_heads, num_groups, head_dim]
    block = (_common.SQUEEZED, num_kv_heads, num_groups, head_dim)
  else:  # [batch, num_kv_heads, num_groups, 1, head_dim]
    block = (_common.SQUEEZED, num_kv_heads, num_groups, _common.SQUEEZED,
             head_dim)
  q_spec = pl.BlockSpec(block, lambda b, *_: (b,) + (0,) * (len(block) - 1))

  kv_buf = pltpu.VMEM((2, pages_per_block * block_size, head_dim), kv_dtype)
  quantized = quantization.is_quantized(kv_dtype)
  scale_specs, scale_bufs = [], []
  if quantized:
    scale_specs = [pl.BlockSpec(memory_space=_common.ANY)] * 2
    scale_bufs = [pltpu.VMEM((2, pages_per_block, block_size),
                             jnp.float32)] * 2
  kernel = functools.partial(
      _paged_decode_kernel,
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
          num_scalar_prefetch=2,
          grid=(batch,),
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
              pltpu.VMEM((num_groups, 1), jnp.float32),
              pltpu.VMEM((num_groups, 1), jnp.float32),
              pltpu.VMEM((num_groups, head_dim), jnp.float32),
          ],
      ),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",),
          vmem_limit_bytes=config.vmem_limit_bytes,
      ),
      out_shape=jax.ShapeDtypeStruct(q_shape_kernel, q_dtype_kernel),
      interpret=_common.interpret_params(interpret),
      name=f"paged_decode_ppcb{pages_per_block}",
  )


# ----------------------------------------------------------------------------
# Checks and configuration
# ----------------------------------------------------------------------------


def _limitation(q, k_pages, block_tables, config) -> str | None:
  """Why this (well-formed) input cannot be served by the kernel, or None."""
  reason = _common.dtype_and_tiling_limitation(q, k_pages)
  if reason is not None:
    return reason
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  num_groups = num_q_heads // num_kv_heads
  lanes = _common.round_up(head_dim, 128)
  # q and out blocks (double-buffered, float32 at most; a small group's rows
  # may each be padded to a full 8-row tile), the accumulator, K/V buffers.
  q_rows = num_q_heads if num_groups % 8 == 0 else 8 * num_q_heads
  vmem = 4 * lanes * (2 * 2 * q_rows + num_groups + 16)
  vmem += (2 * 2 * config.pages_per_compute_block * block_size * lanes *
           jnp.dtype(k_pages.dtype).itemsize)
  vmem += _common.scale_vmem_bytes(k_pages.dtype, config.pages_per_compute_block,
                                   block_size)
  smem = 4 * (batch * block_tables.shape[1] + batch)
  return _common.memory_limitation(smem, vmem, config.vmem_limit_bytes)


def default_config(q, k_pages, block_tables) -> PagedDecodeConfig:
  """A config chosen from shapes: ~512 tokens per compute block.

  Args:
    q: `[batch, num_q_heads, head_dim]` array or `jax.ShapeDtypeStruct`.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    block_tables: `i32[batch, max_blocks_per_seq]`.
  """
  del q
  block_size = k_pages.shape[2]
  max_blocks_per_seq = block_tables.shape[1]
  pages = max(1, TARGET_TOKENS_PER_COMPUTE_BLOCK // block_size)
  return PagedDecodeConfig(
      pages_per_compute_block=max(1, min(pages, max_blocks_per_seq)))


def unsupported_reason(q, k_pages, block_tables, *, soft_cap=None,
                       sliding_window=None, config=None) -> str | None:
  """None if `paged_decode` can serve these inputs, else a readable reason.

  Only `.shape` and `.dtype` are used: arrays or `jax.ShapeDtypeStruct` work.

  Args:
    q: `[batch, num_q_heads, head_dim]` queries.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` pages:
      float32 / bfloat16, or int8 / float8_e4m3fn (their scales are not
      needed here; `block_size` must then be a multiple of 32).
    block_tables: `i32[batch, max_blocks_per_seq]`.
    soft_cap: optional logit soft cap.
    sliding_window: optional window in tokens.
    config: a `PagedDecodeConfig`, default `default_config(...)`.
  """
  error = contract.attention_input_error(
      q, k_pages, block_tables, soft_cap=soft_cap,
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
    interpret: bool | Any = False,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_blocks, block_size]
    v_scales: jax.Array | None = None,
) -> jax.Array:
  """Decode attention of one query per sequence over its paged K/V (TPU).

  The query of sequence `b` sits at position `kv_lens[b] - 1` and sees keys
  `max(0, kv_lens[b] - sliding_window) .. kv_lens[b] - 1`.

  Args:
    q: `[batch, num_q_heads, head_dim]`, float32 or bfloat16.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`, float32,
      bfloat16, or int8 / float8_e4m3fn with `k_scales`; `num_q_heads` must
      be a multiple of `num_kv_heads`. `block_size` must be a multiple of 8
      (float32), 16 (bfloat16) or 32 (8-bit) pages.
    v_pages: same shape and dtype as `k_pages`.
    block_tables: `i32[batch, max_blocks_per_seq]`; entry `i` is the physical
      block of tokens `i * block_size ..`. Entries past
      `cdiv(kv_lens[b], block_size)` (e.g. -1) are never read; an entry inside
      it that is not a block in `[0, num_blocks)` is never read and
      contributes no tokens.
    kv_lens: `i32[batch]`, clamped to `[0, max_blocks_per_seq * block_size]`.
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
    `[batch, num_q_heads, head_dim]` in `q.dtype`; rows with `kv_lens == 0`
    are zeros.

  Raises:
    ValueError: malformed shapes/dtypes, or inputs the kernel cannot serve
      (see `unsupported_reason`).

  Example (TPU interpret mode, runs on CPU):
    >>> q = jnp.ones((2, 8, 128), jnp.bfloat16)      # 8 query heads
    >>> k_pages = jnp.ones((2, 4, 16, 128), jnp.bfloat16)  # 2 KV heads
    >>> v_pages = k_pages
    >>> block_tables = jnp.array([[3, 0], [1, -1]], jnp.int32)
    >>> kv_lens = jnp.array([20, 5], jnp.int32)
    >>> paged_decode(q, k_pages, v_pages, block_tables, kv_lens,
    ...              interpret=True).shape
    (2, 8, 128)
  """
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
      v_scales=v_scales)
  config = config or default_config(q, k_pages, block_tables)
  reason = _limitation(q, k_pages, block_tables, config)
  if reason is not None:
    raise ValueError(f"paged_decode (TPU) cannot serve these inputs: {reason}")
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  head_dim = q.shape[2]
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  call = _build_paged_decode(
      q.shape, q.dtype, k_pages.shape, k_pages.dtype, block_tables.shape[1],
      sm_scale=float(sm_scale), soft_cap=soft_cap,
      sliding_window=sliding_window, config=config, interpret=interpret)
  q_shape_kernel, q_dtype_kernel = _q_kernel_layout(q.shape, q.dtype,
                                                    k_pages.shape[0])
  q_kernel = q.astype(q_dtype_kernel).reshape(q_shape_kernel)
  kv_lens = contract.clamp_kv_lens(kv_lens, block_tables.shape[1],
                                   k_pages.shape[2])
  scales = () if k_scales is None else (k_scales, v_scales)
  out = _map_when_vmapped(call)(kv_lens, block_tables.reshape(-1), q_kernel,
                                k_pages, v_pages, *scales)
  return out.reshape(q.shape).astype(q.dtype)


def _map_when_vmapped(call):
  """`call`, batched under `jax.vmap` by a `lax.map` over the vmapped axis.

  A `pallas_call` with scalar-prefetch operands has no batching rule, so a
  vmapped call (e.g. over layers) runs the kernel once per element instead;
  unbatched operands (the pages, typically) are closed over, not broadcast.
  """

  @jax.custom_batching.custom_vmap
  def run(*args):
    return call(*args)

  @run.def_vmap
  def _(axis_size, in_batched, *args):
    del axis_size

    def one(xs):
      it = iter(xs)
      return run(*[next(it) if b else a for a, b in zip(args, in_batched)])

    batched = [a for a, b in zip(args, in_batched) if b]
    return jax.lax.map(one, batched), True

  return run
