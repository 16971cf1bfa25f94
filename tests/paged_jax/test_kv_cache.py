"""KV cache writes, copy-on-write copies and gathers, driven by the block manager."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK


def _rand(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_then_gather_round_trips(dtype):
  rng = np.random.default_rng(0)
  kvh, d, bs = 2, 8, 4
  state = bm.init(num_blocks=16, block_size=bs, max_seqs=3, max_blocks_per_seq=5)
  cache = kv_cache.KVCache.create(2, kvh, 16, bs, d, dtype)
  lens = [7, 0, 13]
  state, res = bm.reserve(state, jnp.array([0, 1, 2]), jnp.array(lens))
  assert res.ok.tolist() == [True, True, True]
  seq = jnp.array(sum(([s] * n for s, n in enumerate(lens)), []) + [-1])
  pos = jnp.array(sum((list(range(n)) for n in lens), []) + [0])
  slots = bm.slot_mapping(state, seq, pos)
  assert slots[-1] == -1  # padding token
  k, v = _rand(rng, (len(seq), kvh, d), dtype), _rand(rng, (len(seq), kvh, d), dtype)
  write = jax.jit(kv_cache.write_kv, donate_argnums=(0, 1))
  kp, vp = write(cache.k_pages[1], cache.v_pages[1], k, v, slots)
  tables, kv_lens = bm.gather_tables(state, jnp.array([0, 1, 2]))
  got = kv_cache.gather_kv(kp, tables, kv_lens, max_len=13)
  assert got.shape == (3, 13, kvh, d)
  start = 0
  for s, n in enumerate(lens):
    np.testing.assert_array_equal(np.asarray(got[s, :n]), np.asarray(k[start:start + n]))
    assert not np.asarray(got[s, n:], np.float32).any()
    ref = reference.gather_sequence_reference(vp, np.asarray(tables[s]), n)
    np.testing.assert_array_equal(ref, np.asarray(v[start:start + n], np.float32))
    start += n


def test_copy_on_write_copies_the_shared_block_in_every_layer():
  rng = np.random.default_rng(1)
  state = bm.init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=3)
  cache = kv_cache.KVCache(_rand(rng, (3, 2, 8, 4, 16)), _rand(rng, (3, 2, 8, 4, 16)))
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([6]))
  state, _ = bm.fork(state, jnp.array([0]), jnp.array([1]))
  state, res = bm.reserve(state, jnp.array([1]), jnp.array([1]))
  src, dst = int(res.copy_src[0]), int(res.copy_dst[0])
  old_k, old_v = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
  copy = jax.jit(kv_cache.copy_blocks, donate_argnums=0)
  new = copy(cache, res.copy_src, res.copy_dst)  # in place: `cache` is donated
  np.testing.assert_array_equal(new.k_pages[:, :, dst], old_k[:, :, src])
  np.testing.assert_array_equal(new.v_pages[:, :, dst], old_v[:, :, src])
  untouched = [b for b in range(8) if b != dst]
  np.testing.assert_array_equal(new.k_pages[:, :, untouched],
                                old_k[:, :, untouched])
  # NULL_BLOCK pairs are skipped.
  same = kv_cache.copy_blocks(new, jnp.array([NULL_BLOCK]), jnp.array([NULL_BLOCK]))
  np.testing.assert_array_equal(same.k_pages, new.k_pages)
  # The child's new token goes to its own copy, never to the shared block.
  slot = bm.slot_mapping(state, jnp.array([1]), jnp.array([6]))
  assert int(slot[0]) // 4 == dst


def test_create_and_errors():
  cache = kv_cache.KVCache.create(2, 4, 10, 16, 64, jnp.bfloat16)
  assert cache.k_pages.shape == (2, 4, 10, 16, 64)
  assert (cache.num_layers, cache.num_blocks, cache.block_size) == (2, 10, 16)
  assert cache.nbytes == 2 * 2 * 4 * 10 * 16 * 64 * 2
  with pytest.raises(ValueError, match="num_blocks must be a positive int, got "
                     "num_blocks=0"):
    kv_cache.KVCache.create(2, 4, 0, 16, 64)
  with pytest.raises(ValueError, match="dtype must be a floating dtype, got int32"):
    kv_cache.KVCache.create(2, 4, 1, 16, 64, jnp.int32)
  pages = cache.k_pages[0]
  with pytest.raises(ValueError, match=r"k and v must be \[T, num_kv_heads, "
                     r"head_dim\]=\(3, 4, 64\)"):
    kv_cache.write_kv(pages, pages, jnp.zeros((3, 4, 32)), jnp.zeros((3, 4, 32)),
                      jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"v_pages.shape=.* must equal"):
    kv_cache.write_kv(pages, pages[:2], jnp.zeros((3, 4, 64)),
                      jnp.zeros((3, 4, 64)), jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"k_pages must be \[num_kv_heads"):
    kv_cache.write_kv(cache.k_pages, cache.k_pages, jnp.zeros((3, 4, 64)),
                      jnp.zeros((3, 4, 64)), jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"max_len must be in \[1, 32\]"):
    kv_cache.gather_kv(pages, jnp.zeros((1, 2), jnp.int32),
                       jnp.zeros((1,), jnp.int32), max_len=33)
  with pytest.raises(ValueError, match="src and dst must be 1-D of equal length"):
    kv_cache.copy_blocks(cache, jnp.zeros((2,), jnp.int32),
                         jnp.zeros((1,), jnp.int32))


def test_reference_is_softmax_attention():
  """The oracle itself, on a case small enough to check by hand."""
  q = np.array([[[1.0, 0.0]]], np.float32)  # one query, one head
  k = np.array([[[1.0, 0.0]], [[0.0, 0.0]], [[2.0, 0.0]]], np.float32)
  v = np.array([[[1.0, 1.0]], [[2.0, 2.0]], [[4.0, 4.0]]], np.float32)
  out = reference.dense_attention_reference(q, k, v, np.array([1]), sm_scale=1.0)
  w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()  # position 2 is in the future
  np.testing.assert_allclose(out[0, 0], w @ v[:2, 0], rtol=1e-6)
  win = reference.dense_attention_reference(q, k, v, np.array([2]), sm_scale=1.0,
                                            sliding_window=1)
  np.testing.assert_allclose(win[0, 0], v[2, 0], rtol=1e-6)
  capped = reference.dense_attention_reference(q, k, v, np.array([2]), sm_scale=1.0,
                                               soft_cap=1.0)
  s = np.tanh([1.0, 0.0, 2.0])
  np.testing.assert_allclose(capped[0, 0], (np.exp(s) / np.exp(s).sum()) @ v[:, 0],
                             rtol=1e-6)
