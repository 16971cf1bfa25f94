"""Helpers shared by the TPU paged-attention kernels (not public API)."""

from __future__ import annotations

import functools
import inspect

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels import contract
from pallas_kernels import quantization

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Default scoped-VMEM limit of Mosaic kernels (v4/v5e; v6e allows more).
DEFAULT_VMEM_LIMIT_BYTES = 16 * 1024 * 1024
# Scalar-prefetched operands live in SMEM (1 MiB per core on v4 and later).
SMEM_BUDGET_BYTES = 512 * 1024

ANY = getattr(pl, "ANY", None) or pltpu.MemorySpace.HBM
SQUEEZED = getattr(pl, "squeezed", None)


def sublane_tile(dtype) -> int:
  """Rows of one (sublane, 128) VMEM tile of `dtype`: 8 f32, 16 bf16."""
  return 8 * (4 // jnp.dtype(dtype).itemsize)


def compute_dtype(q_dtype, kv_dtype):
  """Matmul input dtype: the shared dtype, else float32; for 8-bit pages,
  `q_dtype` (every int8 and float8_e4m3fn value is exact in bfloat16)."""
  if quantization.is_quantized(kv_dtype):
    return q_dtype
  return kv_dtype if jnp.dtype(q_dtype) == jnp.dtype(kv_dtype) else jnp.float32


def load_values(ref, compute_dtype):
  """A K/V buffer slot as `compute_dtype`; 8-bit values go through float32
  (Mosaic converts int8 / fp8 to float32, not to every dtype)."""
  x = ref[...]
  if quantization.is_quantized(x.dtype):
    x = x.astype(jnp.float32)
  return x.astype(compute_dtype)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def interpret_params(interpret):
  """`True` -> TPU interpret mode, races detected, uninitialised memory NaN."""
  if interpret is True:
    wanted = dict(detect_races=True, uninitialized_memory="nan")
    accepted = inspect.signature(pltpu.InterpretParams).parameters
    return pltpu.InterpretParams(
        **{k: v for k, v in wanted.items() if k in accepted})
  return interpret


def matmul_precision(compute_dtype):
  """HIGHEST for float32 matmuls (Mosaic's default would round to bf16)."""
  return (lax.Precision.HIGHEST
          if jnp.dtype(compute_dtype) == jnp.float32 else None)


def scores(q, k, *, sm_scale, soft_cap, precision, k_scales=None):
  """f32[rows, tokens] scores `q @ k.T * sm_scale`, soft-capped if asked.

  `k_scales` (f32[1, tokens], 8-bit pages) multiply the scores of the K
  values (`quantization.scale_scores`) before `sm_scale` and the cap.
  """
  s = lax.dot_general(
      q, k, (((1,), (1,)), ((), ())), precision=precision,
      preferred_element_type=jnp.float32)
  s = quantization.scale_scores(s, k_scales) * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  return s


def online_softmax_block(m_ref, l_ref, acc_ref, s, visible, load_v, *,
                         compute_dtype, precision, load_v_scales=None):
  """Folds one compute block into the running float32 online softmax.

  Args:
    m_ref, l_ref: f32[rows, 1] running max and denominator (VMEM).
    acc_ref: f32[rows, head_dim] running numerator (VMEM).
    s: f32[rows, tokens] scores; entries not `visible` may be garbage.
    visible: bool[rows, tokens].
    load_v: `() -> f32[tokens, head_dim]`, the block's values with every
      row no query sees zeroed (0 * NaN is NaN); called after the running max
      and denominator are updated, so the V copy overlaps that work.
    load_v_scales: None (float pages), or `() -> f32[1, tokens]`, the V
      scales (0 where no token is), called after `load_v`: they multiply the
      probabilities of the weighted sum, not the denominator
      (`quantization.scale_probs`).
  """
  s = jnp.where(visible, s, DEFAULT_MASK_VALUE)
  m_prev = m_ref[...]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
  alpha = jnp.exp(m_prev - m_next)
  l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
  m_ref[...] = m_next
  v = load_v()
  if load_v_scales is not None:
    p = quantization.scale_probs(p, load_v_scales())
  pv = lax.dot_general(
      p.astype(compute_dtype), v.astype(compute_dtype),
      (((1,), (0,)), ((), ())), precision=precision,
      preferred_element_type=jnp.float32)  # [rows, head_dim]
  acc_ref[...] = alpha * acc_ref[...] + pv


class PageCopies:
  """Async copies of a sequence's K/V pages, one compute block at a time,
  into the two slots of a VMEM double buffer (both TPU kernels use it).

  A run of pages is given by `row` (the offset of the sequence's row in the
  flat SMEM block table), `page_lo` / `page_end` (the pages to walk) and the
  KV `head`. Page `page_lo + block * pages_per_block + j` of compute `block`
  lands in rows `j * block_size ..` of the slot. A page is copied only if it
  is below `page_end` and its table entry is a block in `[0, num_blocks)`
  (`pallas_kernels.contract.valid_block`): other entries are never read.

  8-bit pages come with `scales = (k_scales_hbm, v_scales_hbm, ks_buf,
  vs_buf)`: each page's scale row (`f32[block_size]` of one KV head and
  block) is copied beside the page, on the same semaphore, into row `j` of
  the slot (`f32[2, pages_per_block, block_size]`), and waited for with it.
  """

  def __init__(self, tables_ref, k_hbm_ref, v_hbm_ref, k_buf, v_buf, sems, *,
               block_size, max_blocks_per_seq, scales=None):
    self.tables_ref = tables_ref  # i32[rows * max_blocks_per_seq] (SMEM)
    self.hbm = (k_hbm_ref, v_hbm_ref)  # [num_kv_heads, num_blocks, bs, d]
    self.bufs = (k_buf, v_buf)  # [2, pages_per_block * block_size, d]
    self.sems = sems  # DMA [2 (k, v), 2 (slot)]
    self.block_size = block_size
    self.max_blocks_per_seq = max_blocks_per_seq
    self.pages_per_block = k_buf.shape[1] // block_size
    self.num_blocks = k_hbm_ref.shape[1]
    if scales is None:
      self.scales_hbm = self.scale_bufs = None
    else:
      # f32[num_kv_heads, num_blocks, block_size] (HBM) and
      # f32[2, pages_per_block, block_size] (VMEM), K then V.
      self.scales_hbm, self.scale_bufs = scales[:2], scales[2:]

  def block_id(self, row, page):
    """The table entry of `page` (clamped into the sequence's row)."""
    return self.tables_ref[row + jnp.minimum(page, self.max_blocks_per_seq - 1)]

  def pages(self, row, page_lo, page_end, block):
    """`[(page, copied)]` for the pages of compute `block`."""
    out = []
    for j in range(self.pages_per_block):
      page = page_lo + block * self.pages_per_block + j
      copied = (page < page_end) & contract.valid_block(
          self.block_id(row, page), self.num_blocks)
      out.append((page, copied))
    return out

  def pages_ok(self, row, page_lo, page_end, block):
    """Per page of `block`, whether its tokens may be used (copied, or past
    `page_end` where the caller's position mask hides them), and whether all
    may: False marks a page inside the run whose entry is not a block."""
    flags = [copied | (page >= page_end)
             for page, copied in self.pages(row, page_lo, page_end, block)]
    return flags, functools.reduce(lambda a, b: a & b, flags)

  def _copies(self, kv, head, row, page, j, slot):
    """The copies of one page of K (kv=0) or V (kv=1): values, then scales."""
    block_id = self.block_id(row, page)
    out = [pltpu.make_async_copy(
        self.hbm[kv].at[head, block_id],
        self.bufs[kv].at[slot, pl.ds(j * self.block_size, self.block_size)],
        self.sems.at[kv, slot])]
    if self.scales_hbm is not None:
      out.append(pltpu.make_async_copy(
          self.scales_hbm[kv].at[head, pl.ds(block_id, 1)],  # f32[1, bs]
          self.scale_bufs[kv].at[slot, pl.ds(j, 1)],
          self.sems.at[kv, slot]))
    return out

  def start(self, head, row, page_lo, page_end, block, slot):
    """Starts the K and V copies of compute `block` into `slot`."""
    for j, (page, copied) in enumerate(self.pages(row, page_lo, page_end,
                                                  block)):
      @pl.when(copied)
      def _(page=page, j=j):
        for kv in (0, 1):
          for copy in self._copies(kv, head, row, page, j, slot):
            copy.start()

  def wait(self, kv, head, row, page_lo, page_end, block, slot):
    """Waits for the K (kv=0) or V (kv=1) copies of compute `block`."""
    for j, (page, copied) in enumerate(self.pages(row, page_lo, page_end,
                                                  block)):
      @pl.when(copied)
      def _(page=page, j=j):
        for copy in self._copies(kv, head, row, page, j, slot):
          copy.wait()

  def scale_row(self, kv, slot, block_start, end, pages_ok):
    """The K (kv=0) or V (kv=1) scales of the block in `slot` as
    `f32[1, tokens]`, laid along the scores' lanes (`scales_along_lanes`);
    0 for positions `>= end` and for pages not `pages_ok` (None: all ok)."""
    scales = self.scale_bufs[kv][slot]  # f32[pages_per_block, block_size]
    shape = scales.shape
    page = lax.broadcasted_iota(jnp.int32, shape, 0)
    pos = (block_start + page * self.block_size
           + lax.broadcasted_iota(jnp.int32, shape, 1))
    valid = pos < end
    if pages_ok is not None:
      for j, flag in enumerate(pages_ok):
        valid &= (page != j) | flag
    return scales_along_lanes(scales, valid)


def scales_along_lanes(scales, valid):
  """`f32[1, pages * block_size]` with `scales[j, t]` at lane
  `j * block_size + t`, where the scores of that token are.

  Args:
    scales: f32[pages, block_size], one page's scale row per sublane (the
      layout its copy lands in).
    valid: bool[pages, block_size]; other entries (garbage, NaN in interpret
      mode) are 0 in the result.

  A page's row is narrower than a 128-lane vreg for block sizes below 128,
  and moving it to lane offset `j * block_size` is a relayout Mosaic may not
  lower; the MXU does it instead: `scales @ spread`, with the 0/1 matrix
  `spread[t, c] = (c == j * block_size + t for some j)`, puts row `j` at
  every page's lanes, and keeping page `j`'s lanes of row `j` sums to the
  row. One nonzero term per output and HIGHEST precision make it exact.
  Invalid entries are zeroed first: a NaN would spread over its whole row.
  """
  scales = jnp.where(valid, scales, 0.0)
  pages, block_size = scales.shape
  if pages == 1:
    return scales
  tokens = pages * block_size
  spread_shape = (block_size, tokens)
  offset = (lax.broadcasted_iota(jnp.int32, spread_shape, 1)
            - lax.broadcasted_iota(jnp.int32, spread_shape, 0))
  spread = functools.reduce(lambda a, b: a | b,
                            [offset == j * block_size for j in range(pages)])
  spread = spread.astype(jnp.float32)
  rows = lax.dot_general(
      scales, spread, (((1,), (0,)), ((), ())),
      precision=lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32)  # [pages, tokens]
  shape = (pages, tokens)
  lo = lax.broadcasted_iota(jnp.int32, shape, 0) * block_size
  lane = lax.broadcasted_iota(jnp.int32, shape, 1)
  own = (lane >= lo) & (lane < lo + block_size)
  return jnp.sum(jnp.where(own, rows, 0.0), axis=0, keepdims=True)


def page_token_mask(shape, axis, block_size, pages_ok):
  """bool[shape]: False for the tokens (along `axis`) of page `j` of a
  compute block where the scalar `pages_ok[j]` is False.

  Only built on the rare path where a compute block holds a table entry that
  is not a block (see `pallas_kernels.contract`).
  """
  tok = lax.broadcasted_iota(jnp.int32, shape, axis)
  ok = jnp.ones(shape, jnp.int32)
  for j, flag in enumerate(pages_ok):
    in_page = (tok >= j * block_size) & (tok < (j + 1) * block_size)
    ok = jnp.where(in_page, flag.astype(jnp.int32), ok)
  return ok == 1


def dtype_and_tiling_limitation(q, k_pages) -> str | None:
  """Why Mosaic cannot serve these dtypes / head_dim / block_size, or None.

  Pages are float32, bfloat16, or 8-bit (`quantization.QUANTIZED_DTYPES`,
  with scales); queries float32 or bfloat16. A page is copied to row
  `j * block_size` of a VMEM buffer, so `block_size` must fill whole sublane
  tiles of the page dtype: 8 rows for float32, 16 for bfloat16, 32 for int8
  and float8_e4m3fn.
  """
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    return f"q dtype {jnp.dtype(q.dtype)} is not float32 or bfloat16"
  if not (jnp.dtype(k_pages.dtype) in SUPPORTED_DTYPES
          or quantization.is_quantized(k_pages.dtype)):
    return (f"k_pages dtype {jnp.dtype(k_pages.dtype)} is not float32, "
            f"bfloat16, int8 or float8_e4m3fn")
  head_dim = q.shape[2]
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"{head_dim=} is not one of {SUPPORTED_HEAD_DIMS}"
  block_size = k_pages.shape[2]
  tile = sublane_tile(k_pages.dtype)
  if block_size % tile:
    return (f"{block_size=} must be a multiple of {tile} for"
            f" {jnp.dtype(k_pages.dtype)} pages (VMEM sublane tiling)")
  return None


def scale_vmem_bytes(kv_dtype, pages_per_block: int, block_size: int) -> int:
  """VMEM of the scale copies and their lane layout (0 for float pages):
  K and V double buffers `f32[2, pages, block_size]` (tiles of (8, 128)),
  and `scales_along_lanes`' `spread` and `[pages, tokens]` temporaries."""
  if not quantization.is_quantized(kv_dtype):
    return 0
  pages, lanes = round_up(pages_per_block, 8), round_up(block_size, 128)
  tokens = round_up(pages_per_block * block_size, 128)
  return 4 * (2 * 2 * pages * lanes
              + 2 * (round_up(block_size, 8) + 2 * pages) * tokens)


def memory_limitation(smem_bytes: int, vmem_bytes: int,
                      vmem_limit_bytes: int | None) -> str | None:
  """Why the scalar-prefetch or VMEM footprint does not fit, or None."""
  if smem_bytes > SMEM_BUDGET_BYTES:
    return (f"scalar-prefetched tables take {smem_bytes} bytes of SMEM, more"
            f" than the {SMEM_BUDGET_BYTES} budgeted")
  vmem_limit = vmem_limit_bytes or DEFAULT_VMEM_LIMIT_BYTES
  if vmem_bytes > vmem_limit:
    return (f"buffers need about {vmem_bytes} bytes of VMEM, more than"
            f" {vmem_limit=}; use smaller blocks")
  return None
