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
  """Matmul input dtype: the shared dtype, else float32."""
  return kv_dtype if jnp.dtype(q_dtype) == jnp.dtype(kv_dtype) else jnp.float32


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


def scores(q, k, *, sm_scale, soft_cap, precision):
  """f32[rows, tokens] scores `q @ k.T * sm_scale`, soft-capped if asked."""
  s = lax.dot_general(
      q, k, (((1,), (1,)), ((), ())), precision=precision,
      preferred_element_type=jnp.float32)
  s = s * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  return s


def online_softmax_block(m_ref, l_ref, acc_ref, s, visible, load_v, *,
                         compute_dtype, precision):
  """Folds one compute block into the running float32 online softmax.

  Args:
    m_ref, l_ref: f32[rows, 1] running max and denominator (VMEM).
    acc_ref: f32[rows, head_dim] running numerator (VMEM).
    s: f32[rows, tokens] scores; entries not `visible` may be garbage.
    visible: bool[rows, tokens].
    load_v: `() -> f32[tokens, head_dim]`, the block's values with every
      row no query sees zeroed (0 * NaN is NaN); called after the running max
      and denominator are updated, so the V copy overlaps that work.
  """
  s = jnp.where(visible, s, DEFAULT_MASK_VALUE)
  m_prev = m_ref[...]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
  alpha = jnp.exp(m_prev - m_next)
  l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
  m_ref[...] = m_next
  v = load_v()
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
  """

  def __init__(self, tables_ref, k_hbm_ref, v_hbm_ref, k_buf, v_buf, sems, *,
               block_size, max_blocks_per_seq):
    self.tables_ref = tables_ref  # i32[rows * max_blocks_per_seq] (SMEM)
    self.hbm = (k_hbm_ref, v_hbm_ref)  # [num_kv_heads, num_blocks, bs, d]
    self.bufs = (k_buf, v_buf)  # [2, pages_per_block * block_size, d]
    self.sems = sems  # DMA [2 (k, v), 2 (slot)]
    self.block_size = block_size
    self.max_blocks_per_seq = max_blocks_per_seq
    self.pages_per_block = k_buf.shape[1] // block_size
    self.num_blocks = k_hbm_ref.shape[1]

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

  def _copy(self, kv, head, row, page, j, slot):
    buf = self.bufs[kv]
    return pltpu.make_async_copy(
        self.hbm[kv].at[head, self.block_id(row, page)],
        buf.at[slot, pl.ds(j * self.block_size, self.block_size)],
        self.sems.at[kv, slot])

  def start(self, head, row, page_lo, page_end, block, slot):
    """Starts the K and V copies of compute `block` into `slot`."""
    for j, (page, copied) in enumerate(self.pages(row, page_lo, page_end,
                                                  block)):
      @pl.when(copied)
      def _(page=page, j=j):
        self._copy(0, head, row, page, j, slot).start()
        self._copy(1, head, row, page, j, slot).start()

  def wait(self, kv, head, row, page_lo, page_end, block, slot):
    """Waits for the K (kv=0) or V (kv=1) copies of compute `block`."""
    for j, (page, copied) in enumerate(self.pages(row, page_lo, page_end,
                                                  block)):
      pl.when(copied)(functools.partial(
          lambda page, j: self._copy(kv, head, row, page, j, slot).wait(),
          page, j))


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
  """Why Mosaic cannot serve these dtypes / head_dim / block_size, or None."""
  if quantization.is_quantized(k_pages.dtype):
    # The per-token scales would need a [tokens] row per page copied next to
    # the pages and laid along the scores' lanes; not written (or measured on
    # a TPU) yet. Refused here, never cast.
    return (f"{jnp.dtype(k_pages.dtype)} pages (with per-token scales) are "
            "not implemented in the TPU kernels yet; implementation='xla' "
            "serves them on TPU")
  for name, dtype in (("q", q.dtype), ("k_pages", k_pages.dtype)):
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
      return f"{name} dtype {jnp.dtype(dtype)} is not float32 or bfloat16"
  head_dim = q.shape[2]
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"{head_dim=} is not one of {SUPPORTED_HEAD_DIMS}"
  block_size = k_pages.shape[2]
  tile = sublane_tile(k_pages.dtype)
  if block_size % tile:
    return (f"{block_size=} must be a multiple of {tile} for"
            f" {jnp.dtype(k_pages.dtype)} pages (VMEM sublane tiling)")
  return None


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
