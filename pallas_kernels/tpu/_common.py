"""Helpers shared by the TPU paged-attention kernels (not public API)."""

from __future__ import annotations

import inspect

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

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


def check_attention_inputs(q, k_pages, block_tables, *, soft_cap,
                           sliding_window, v_pages=None, num_seqs=None):
  """Raises ValueError for malformed q/pages/tables (static checks only).

  `num_seqs` is the expected `block_tables.shape[0]`, default `q.shape[0]`.
  """
  if len(q.shape) != 3:
    raise ValueError(
        f"q must be [tokens, num_q_heads, head_dim], got {q.shape=}")
  if len(k_pages.shape) != 4:
    raise ValueError(
        "k_pages must be [num_kv_heads, num_blocks, block_size, head_dim],"
        f" got {k_pages.shape=}")
  _, num_q_heads, head_dim = q.shape
  num_kv_heads, _, _, kv_head_dim = k_pages.shape
  if v_pages is not None and (v_pages.shape != k_pages.shape
                              or v_pages.dtype != k_pages.dtype):
    raise ValueError(
        f"v_pages must match k_pages: expected {k_pages.shape}"
        f" {k_pages.dtype}, got {v_pages.shape} {v_pages.dtype}")
  if kv_head_dim != head_dim:
    raise ValueError(f"q {head_dim=} must equal k_pages head_dim={kv_head_dim}")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
  num_seqs = q.shape[0] if num_seqs is None else num_seqs
  if len(block_tables.shape) != 2 or block_tables.shape[0] != num_seqs:
    raise ValueError(
        f"block_tables must be i32[{num_seqs=}, max_blocks_per_seq], got"
        f" {block_tables.shape=}")
  if block_tables.dtype != jnp.int32:
    raise ValueError(f"block_tables must be int32, got {block_tables.dtype=}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"{soft_cap=} must be positive")
  if sliding_window is not None and not sliding_window >= 1:
    raise ValueError(f"{sliding_window=} must be at least 1")


def check_i32_vector(name, x, length):
  if x.shape != (length,) or x.dtype != jnp.int32:
    raise ValueError(
        f"{name} must be i32[{length}], got {x.dtype}{list(x.shape)}")


def dtype_and_tiling_limitation(q, k_pages) -> str | None:
  """Why Mosaic cannot serve these dtypes / head_dim / block_size, or None."""
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
