"""Shared random inputs and comparisons for every attention backend's tests.

Every case is built the same way, whatever the backend:
  * K/V pages in the canonical layout `[num_kv_heads, num_blocks, block_size, head_dim]`;
  * each sequence owns a random, non-contiguous set of physical blocks;
  * unused block-table entries hold `NULL_BLOCK` (-1), which no backend may read;
  * every block the batch does not own, and every slot past `kv_len` inside an
    owned block, is filled with NaN: a stray read turns the output into NaN.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from paged_jax.block_manager import NULL_BLOCK
from pallas_kernels import quantization

# Tolerances per dtype, absolute and relative, for outputs of O(1) magnitude.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    jnp.dtype(jnp.float16): dict(atol=5e-3, rtol=5e-3),
}


# Quantised pages against the float32 reference on the *float* pages they were
# made from (`assert_rows_close(..., quantized_from_float=True)`), N(0, 1)
# K/V, head_dim 64, outputs O(1). int8 rounds each element to within half a
# step, absmax / 254 (absmax of 64 N(0, 1) draws is about 2.5-3.5): V errors
# of at most ~0.014 pass straight into the output (a convex combination of
# V rows), K errors of the same size move each score by <= |q| * 0.014 * 8
# * head_dim ** -0.5 ~ 0.01 (softmax weights by ~1%); measured max 0.011.
# float8_e4m3fn keeps 3 mantissa bits: relative error <= 2 ** -4 per element,
# up to ~0.2 on the largest |v|, averaged over the attended rows; measured max
# 0.09. Both tolerances sit about 2x above what correct kernels measure; a
# wrong scale (K scale applied to V, a scale dropped, a stale token's scale)
# is off by O(1).
QUANTIZED_TOLERANCES = {
    jnp.dtype(jnp.int8): dict(atol=2.5e-2, rtol=0.0),
    jnp.dtype(jnp.float8_e4m3fn): dict(atol=0.2, rtol=0.0),
}


@dataclasses.dataclass
class PagedCase:
  q: jnp.ndarray  # [batch or num_tokens, num_q_heads, head_dim]
  k_pages: jnp.ndarray  # [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages: jnp.ndarray  # [num_kv_heads, num_blocks, block_size, head_dim]
  block_tables: jnp.ndarray  # i32[num_seqs, max_blocks_per_seq]
  kv_lens: jnp.ndarray  # i32[num_seqs]
  cu_q_lens: jnp.ndarray | None = None  # i32[num_seqs + 1] (ragged cases)
  num_seqs: jnp.ndarray | None = None  # i32[1] (ragged cases)
  k_scales: jnp.ndarray | None = None  # f32[num_kv_heads, num_blocks, block_size]
  v_scales: jnp.ndarray | None = None  # (quantised cases)

  def scales(self) -> dict:
    """`{k_scales, v_scales}` for the call (empty for float pages)."""
    if self.k_scales is None:
      return {}
    return dict(k_scales=self.k_scales, v_scales=self.v_scales)


# What an unowned slot of a quantised page holds: int8 cannot be NaN, so the
# values are the extreme -128 (never written by `quantize`) and the slot's
# scale is NaN; a read of either turns the output into NaN or garbage.
INT8_POISON = -128


def quantize_case(case: PagedCase, dtype) -> PagedCase:
  """`case` with its float pages quantised to `dtype` (int8 / fp8) by the
  library's one rule, keeping the poison: every NaN (unowned) slot gets a NaN
  scale, and int8 values -128 there (fp8 values stay NaN)."""
  out = dataclasses.replace(case)
  for name in ("k", "v"):
    pages = getattr(case, f"{name}_pages")
    values, scales = quantization.quantize(pages, dtype)
    poisoned = jnp.isnan(pages).any(axis=-1)  # [kvh, num_blocks, block_size]
    scales = jnp.where(poisoned, jnp.nan, scales)
    if jnp.dtype(dtype) == jnp.int8:
      values = jnp.where(poisoned[..., None], jnp.int8(INT8_POISON), values)
    setattr(out, f"{name}_pages", values)
    setattr(out, f"{name}_scales", scales)
  return out


def ragged_lengths(rng: np.random.Generator, n: int, block_size: int,
                   max_len: int) -> np.ndarray:
  """`n` lengths that always include the edge cases when `n` allows it."""
  edge = [0, 1, block_size - 1, block_size, block_size + 1, max_len]
  edge = [e for e in edge if 0 <= e <= max_len]
  lens = list(rng.permutation(edge))[:n]
  lens += list(rng.integers(0, max_len + 1, size=n - len(lens)))
  return np.asarray(rng.permutation(lens), np.int32)


def make_pages(rng, kv_lens, *, num_kv_heads, head_dim, block_size,
               max_blocks_per_seq, dtype, extra_blocks=3,
               unused_entry=NULL_BLOCK, poison=True):
  """Random pages and non-contiguous block tables for sequences of `kv_lens`."""
  kv_lens = np.asarray(kv_lens, np.int32)
  num_seqs = len(kv_lens)
  need = [-(-int(n) // block_size) for n in kv_lens]
  assert max(need, default=0) <= max_blocks_per_seq, (need, max_blocks_per_seq)
  num_blocks = sum(need) + extra_blocks
  perm = rng.permutation(num_blocks)
  tables = np.full((num_seqs, max_blocks_per_seq), unused_entry, np.int32)
  k = rng.standard_normal((num_kv_heads, num_blocks, block_size, head_dim),
                          np.float32)
  v = rng.standard_normal((num_kv_heads, num_blocks, block_size, head_dim),
                          np.float32)
  owned = np.zeros((num_blocks, block_size), bool)
  pos = 0
  for s, n in enumerate(need):
    tables[s, :n] = perm[pos:pos + n]
    for j in range(n):
      valid = min(block_size, int(kv_lens[s]) - j * block_size)
      owned[perm[pos + j], :valid] = True
    pos += n
  if poison:
    k[:, ~owned] = np.nan
    v[:, ~owned] = np.nan
  return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
          jnp.asarray(kv_lens))


def make_decode_case(rng, *, batch, num_q_heads, num_kv_heads, head_dim,
                     block_size, max_blocks_per_seq, dtype=jnp.float32,
                     kv_lens=None, **kw) -> PagedCase:
  """A decode batch: one query per sequence, ragged `kv_lens`."""
  if kv_lens is None:
    kv_lens = ragged_lengths(rng, batch, block_size,
                             block_size * max_blocks_per_seq)
  k, v, tables, lens = make_pages(
      rng, kv_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
      dtype=dtype, **kw)
  q = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_dim),
                                      np.float32), dtype)
  return PagedCase(q, k, v, tables, lens)


def make_ragged_case(rng, *, q_lens, kv_lens, num_q_heads, num_kv_heads,
                     head_dim, block_size, max_blocks_per_seq, max_num_seqs=None,
                     num_tokens=None, dtype=jnp.float32, **kw) -> PagedCase:
  """A mixed batch: sequence `s` has `q_lens[s]` new tokens, `kv_lens[s]` in all.

  Padding rows of `q` (beyond `sum(q_lens)`) and padding sequences (beyond
  `len(q_lens)`, up to `max_num_seqs`) are NaN / empty.
  """
  q_lens = np.asarray(q_lens, np.int32)
  kv_lens = np.asarray(kv_lens, np.int32)
  assert np.all(q_lens <= kv_lens), (q_lens, kv_lens)
  n = len(q_lens)
  max_num_seqs = max_num_seqs or n
  total = int(q_lens.sum())
  num_tokens = num_tokens or total
  padded_kv = np.zeros(max_num_seqs, np.int32)
  padded_kv[:n] = kv_lens
  k, v, tables, lens = make_pages(
      rng, padded_kv, num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
      dtype=dtype, **kw)
  # Padding sequences own nothing; give them garbage lengths that must be ignored.
  lens = lens.at[n:].set(0)
  cu = np.zeros(max_num_seqs + 1, np.int32)
  cu[1:n + 1] = np.cumsum(q_lens)
  cu[n + 1:] = total
  q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
  q[total:] = np.nan
  return PagedCase(jnp.asarray(q, dtype), k, v, tables, lens,
                   jnp.asarray(cu), jnp.asarray([n], jnp.int32))


def assert_rows_close(out, ref, dtype, *, rows=None):
  """Row-by-row comparison against the float32 reference, with per-dtype
  tolerance: `TOLERANCES` for float dtypes, `QUANTIZED_TOLERANCES` for int8 /
  fp8 (outputs from quantised pages against the reference on the float pages
  they came from)."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  ref = np.asarray(ref, np.float32)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.isfinite(out).all(), "output has NaN/inf: a stray read of poisoned K/V"
  tol = {**TOLERANCES, **QUANTIZED_TOLERANCES}[jnp.dtype(dtype)]
  rows = range(out.shape[0]) if rows is None else rows
  for r in rows:
    np.testing.assert_allclose(out[r], ref[r], err_msg=f"row {r}", **tol)
