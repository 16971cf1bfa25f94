"""The XLA decode path with a sliding window reads only the blocks inside
each sequence's window: every block wholly before it is NaN-poisoned (and,
in a second case, its table entry replaced by `NULL_BLOCK`), and the output
still matches the float32 reference on the clean pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention
from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK
from tests import cases


def _before_window(tables, kv_lens, block_size, window):
  """`(row, col)` of every owned block whose tokens all lie before the
  window (`(col + 1) * block_size <= kv_len - window`)."""
  out = []
  for b, n in enumerate(np.asarray(kv_lens).tolist()):
    for c in range(max(n - window, 0) // block_size):
      out.append((b, c))
  return out


@pytest.mark.parametrize("window,block_size,null_entries", [
    (5, 4, False), (16, 8, False), (9, 4, True), (1, 8, True)])
def test_decode_skips_blocks_before_the_window(window, block_size, null_entries):
  rng = np.random.default_rng(window * 131 + block_size)
  width = 12
  kv_lens = np.array([0, 1, window, window + 1, block_size * width,
                      block_size * width - 3, 3 * block_size + 2], np.int32)
  c = cases.make_decode_case(rng, batch=len(kv_lens), num_q_heads=4,
                             num_kv_heads=2, head_dim=16, block_size=block_size,
                             max_blocks_per_seq=width, kv_lens=kv_lens)
  ref = reference.paged_attention_reference(
      c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
      sliding_window=window)
  tables = np.asarray(c.block_tables).copy()
  skipped = _before_window(tables, c.kv_lens, block_size, window)
  assert skipped  # the case has blocks before some window
  ids = np.array([tables[b, col] for b, col in skipped])
  k = c.k_pages.at[:, ids].set(jnp.nan)
  v = c.v_pages.at[:, ids].set(jnp.nan)
  if null_entries:
    for b, col in skipped:
      tables[b, col] = NULL_BLOCK
  out = attention.paged_attention(c.q, k, v, jnp.asarray(tables), c.kv_lens,
                                  sliding_window=window, implementation="xla")
  cases.assert_rows_close(out, ref, jnp.float32)
  assert not np.isnan(np.asarray(out)).any()
