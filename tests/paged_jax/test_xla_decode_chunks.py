"""The XLA decode path's chunked walk (`pages_per_step` table columns a step).

The shared contract tests use tiny shapes, where the default walk is one
step; here the step is forced to 1-3 columns (widths they do not divide), so
both passes (scores, then values) cross chunk boundaries: ragged lengths,
random non-contiguous tables, NaN in every block and slot the batch does not
own, invalid table entries inside a sequence's length, quantised pages with
poisoned scales, a sliding window, a soft cap, compared row by row with the
float32 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import reference
from paged_jax import xla_attention
from paged_jax.block_manager import NULL_BLOCK
from tests import cases

# (pages_per_step, block_size, width, dtype, soft_cap, window, kv dtype)
CHUNK_CONFIGS = [
    (1, 4, 7, jnp.float32, None, None, None),
    (2, 8, 5, jnp.float32, 20.0, None, None),
    (3, 4, 8, jnp.bfloat16, None, None, None),
    (2, 4, 9, jnp.float32, None, 11, None),
    (1, 8, 6, jnp.float32, 5.0, 3, None),
    (3, 4, 7, jnp.float32, None, None, jnp.int8),
    (2, 8, 5, jnp.float32, None, 13, jnp.float8_e4m3fn),
    # Steps of 128 tokens and more, as the default takes.
    (4, 32, 9, jnp.float32, 10.0, None, None),
    (2, 64, 5, jnp.bfloat16, None, 150, None),
    (4, 32, 7, jnp.float32, None, 70, jnp.int8),
]


def _run(c, pps, **kw):
  return xla_attention.paged_decode_xla(
      c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
      sm_scale=c.q.shape[-1]**-0.5, pages_per_step=pps, **kw, **c.scales())


@pytest.mark.parametrize("config", CHUNK_CONFIGS, ids=str)
def test_chunked_walk_matches_reference(config):
  pps, bs, width, dtype, cap, window, kv_dtype = config
  rng = np.random.default_rng(pps * 1000 + bs * 10 + width)
  c = cases.make_decode_case(rng, batch=7, num_q_heads=8, num_kv_heads=2,
                             head_dim=32, block_size=bs,
                             max_blocks_per_seq=width, dtype=dtype)
  if kv_dtype is not None:
    c = cases.quantize_case(c, kv_dtype)
  kw = dict(soft_cap=cap, sliding_window=window)
  out = _run(c, pps, **kw)
  assert out.shape == c.q.shape and out.dtype == c.q.dtype
  ref = reference.paged_attention_reference(
      c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, **kw,
      **c.scales())
  cases.assert_rows_close(out, ref, kv_dtype or dtype)
  # The walk's split does not change the result beyond rounding.
  whole = _run(c, width, **kw)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(whole, np.float32), rtol=2e-5,
                             atol=2e-6 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("window", [None, 6])
def test_invalid_entries_inside_a_length_contribute_nothing(window):
  """NULL_BLOCK and out-of-range ids in the middle of a sequence's table (a
  malformed table, served by the contract) are skipped in every chunk; the
  blocks they would have named are NaN, and so is block 0, which the gather
  reads in their place."""
  rng = np.random.default_rng(7)
  bs, width = 4, 9
  kv_lens = np.array([bs * width, bs * width - 1, 2 * bs + 1, 0, 5 * bs],
                     np.int32)
  c = cases.make_decode_case(rng, batch=len(kv_lens), num_q_heads=4,
                             num_kv_heads=2, head_dim=16, block_size=bs,
                             max_blocks_per_seq=width, kv_lens=kv_lens)
  tables = np.asarray(c.block_tables).copy()
  num_blocks = c.k_pages.shape[1]
  holes = [(0, 1), (0, 7), (1, 4), (2, 2), (4, 0)]
  for n, (row, col) in enumerate(holes):
    tables[row, col] = NULL_BLOCK if n % 2 else num_blocks + 5
  ref = reference.paged_attention_reference(
      c.q, c.k_pages, c.v_pages, jnp.asarray(tables), c.kv_lens,
      sliding_window=window)
  named = tables[tables >= 0]
  named = named[named < num_blocks]
  unnamed = np.setdiff1d(np.arange(num_blocks), named)
  poison = np.concatenate([unnamed, [0]]) if 0 not in named else unnamed
  k = c.k_pages.at[:, poison].set(jnp.nan)
  v = c.v_pages.at[:, poison].set(jnp.nan)
  for pps in (1, 2, 4):
    out = xla_attention.paged_decode_xla(
        c.q, k, v, jnp.asarray(tables), c.kv_lens, sm_scale=16**-0.5,
        sliding_window=window, pages_per_step=pps)
    cases.assert_rows_close(out, ref, jnp.float32)


def test_default_walk_takes_several_steps_on_long_tables():
  """The default step is about 512 KiB of gathered K, 128-512 tokens: a long
  table walks in several steps, a short one in one."""
  assert xla_attention.default_pages_per_step(16, 512, 1 * 2 * 128 * 4) == 32
  assert xla_attention.default_pages_per_step(16, 8, 1 * 2 * 128 * 4) == 8
  assert xla_attention.default_pages_per_step(16, 512, 8 * 2 * 128 * 4) == 8
  assert xla_attention.default_pages_per_step(16, 512, 64 * 8 * 128 * 4) == 8
  assert xla_attention.default_pages_per_step(256, 512, 64 * 8 * 128 * 4) == 1
  assert xla_attention.default_pages_per_step(16, 512) == 16


@pytest.mark.parametrize("pps,block_size", [(2, 4), (2, 64)])
def test_gathers_land_in_the_dot_layout(pps, block_size):
  """The compiled walk gathers (head, block) pages straight into
  `[kv_heads, batch, tokens, head_dim]`: no transpose or copy of a gathered
  chunk sits between the gather and the dots, and the scores are stored
  token-major (`f32[kv_heads, batch, walk, group]`)."""
  rng = np.random.default_rng(0)
  c = cases.make_decode_case(rng, batch=3, num_q_heads=4, num_kv_heads=2,
                             head_dim=16, block_size=block_size,
                             max_blocks_per_seq=6)
  f = jax.jit(lambda *a: xla_attention.paged_decode_xla(
      *a, sm_scale=0.25, pages_per_step=pps))
  hlo = f.lower(c.q, c.k_pages, c.v_pages, c.block_tables,
                c.kv_lens).compile().as_text()
  gathers = [line for line in hlo.splitlines()
             if " gather(" in line and "= f32[" in line]
  assert len(gathers) == 2, gathers  # K once, V once
  assert all(f"slice_sizes={{1,1,{block_size},16}}" in g for g in gathers), gathers
  assert " transpose(" not in "\n".join(
      line for line in hlo.splitlines() if "gather" in line)
  scores = f"f32[2,3,{6 * block_size},2]{{3,2,1,0}} dynamic-update-slice("
  assert scores in hlo
