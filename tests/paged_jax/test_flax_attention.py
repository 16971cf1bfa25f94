"""Paged attention for Flax: step metadata and the NNX module vs dense attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import block_manager as bm
from paged_jax import flax_attention as fa
from paged_jax import kv_cache
from paged_jax import rope
from paged_jax import sharding


reserve = jax.jit(bm.reserve)


def test_step_metadata_layout():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=4, max_blocks_per_seq=4)
  state, _ = reserve(state, np.array([2, -1, -1, -1]), np.array([5, 0, 0, 0]))
  seq_ids, q_lens = np.array([2, 0, 1, -1]), np.array([1, 3, 2, 0])
  state, res = reserve(state, seq_ids, q_lens)
  active = np.array([True, True, False, False])  # pretend seq 1 was refused
  meta = jax.jit(fa.step_metadata, static_argnames="num_tokens")(
      state, seq_ids, q_lens, num_tokens=8, active=active)
  np.testing.assert_array_equal(meta.cu_q_lens, [0, 1, 4, 6, 6])
  np.testing.assert_array_equal(meta.kv_lens, [6, 3, 0, 0])
  np.testing.assert_array_equal(meta.positions, [5, 0, 1, 2, 0, 0, 0, 0])
  np.testing.assert_array_equal(meta.num_seqs, [3])
  tables = np.asarray(state.block_tables)
  assert meta.slots[0] == tables[2, 1] * 4 + 1
  np.testing.assert_array_equal(meta.slots[1:4], tables[0, 0] * 4 + np.arange(3))
  np.testing.assert_array_equal(meta.slots[4:], -1)  # refused and padding rows
  assert (np.asarray(meta.block_tables)[2:] == bm.NULL_BLOCK).all()


def _module(num_heads, num_kv_heads, head_dim, seed=0):
  return fa.PagedAttention(
      32, num_heads, num_kv_heads, head_dim,
      rope=rope.RopeConfig(head_dim, 10000.0, rope.Llama3Scaling(
          original_max_position_embeddings=16)),
      rngs=nnx.Rngs(seed))


# 8-bit caches against the float32 dense oracle: outputs within a share of
# their largest magnitude (the 8-bit error budget of tests/cases.py:
# QUANTIZED_TOLERANCES, for outputs of O(1)); the write quantises, the
# attention dequantises, on both kernels' paths (ragged and decode).
_QUANT_TOL = {"float32": 2e-5, "int8": 2.5e-2, "fp8": 0.1}


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,cache_dtype", [
    (4, 1, 16, "float32"), (8, 2, 64, "float32"), (8, 2, 64, "int8"),
    pytest.param(8, 2, 64, "fp8", marks=pytest.mark.slow),
    pytest.param(4, 4, 32, "float32", marks=pytest.mark.slow)])
def test_chunked_prefill_and_decode_match_dense(num_heads, num_kv_heads, head_dim,
                                                cache_dtype):
  attn = _module(num_heads, num_kv_heads, head_dim)
  rng = np.random.default_rng(0)
  xa = rng.standard_normal((14, 32)).astype(np.float32)
  xb = rng.standard_normal((7, 32)).astype(np.float32)
  graphdef, params = nnx.split(attn)
  dense = jax.jit(lambda p, x: nnx.merge(graphdef, p).dense(x))
  dense_a = np.asarray(dense(params, np.pad(xa, ((0, 2), (0, 0)))[None])[0])
  dense_b = np.asarray(dense(params, np.pad(xb, ((0, 9), (0, 0)))[None])[0])
  state = bm.init(num_blocks=12, block_size=4, max_seqs=3, max_blocks_per_seq=4)
  cache = kv_cache.KVCache.create(num_layers=1, num_kv_heads=num_kv_heads,
                                  num_blocks=12, block_size=4,
                                  head_dim=head_dim, dtype=cache_dtype)
  tol = _QUANT_TOL[cache_dtype]
  close = functools.partial(
      np.testing.assert_allclose, rtol=tol if cache_dtype == "float32" else 0,
      atol=tol * max(1.0, float(np.abs(dense_a).max())))

  @functools.partial(jax.jit, static_argnames=("decode_only",))
  def step(params, state, cache, ids, lens, x, decode_only):
    state, res = bm.reserve(state, ids, lens)
    meta = fa.step_metadata(state, ids, lens, num_tokens=x.shape[0],
                            decode_only=decode_only)
    out, cache = nnx.merge(graphdef, params)(x, meta, cache, 0)
    return out, state, cache, res.ok

  def run(entries, num_tokens, decode_only=False):
    nonlocal state, cache
    ids = np.array([e[0] for e in entries] + [-1] * (3 - len(entries)), np.int32)
    lens = np.array([e[1].shape[0] for e in entries] + [0] * (3 - len(entries)),
                    np.int32)
    x = np.zeros((num_tokens, 32), np.float32)
    x[:lens.sum()] = np.concatenate([e[1] for e in entries])
    out, state, cache, ok = step(params, state, cache, ids, lens, x, decode_only)
    assert np.asarray(ok)[:len(entries)].all()
    return np.asarray(out)

  out = run([(0, xa[:5])], 16)  # chunk 1 of A
  close(out[:5], dense_a[:5])
  out = run([(0, xa[5:11]), (1, xb)], 16)  # chunk 2 of A with all of B
  close(out[:6], dense_a[5:11])
  close(out[6:13], dense_b[:7])
  np.testing.assert_array_equal(out[13:], 0.0)  # padding rows
  for p in range(11, 14):  # decode A, alternating the two kernels
    out = run([(0, xa[p:p + 1])], 3, decode_only=(p % 2 == 0))
    close(out[0], dense_a[p])
  bm.check_invariants(state)
  assert cache.dtype == kv_cache.cache_dtype(cache_dtype)
  assert cache.quantized == (cache_dtype != "float32")


def test_inactive_entries_write_nothing():
  attn = _module(4, 2, 16)
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  cache = kv_cache.KVCache.create(num_layers=1, num_kv_heads=2, num_blocks=4,
                                  block_size=4, head_dim=16, dtype=jnp.float32)
  ids, lens = np.array([0, 1]), np.array([3, 2])
  graphdef, params = nnx.split(attn)

  @jax.jit
  def step(params, state, cache):
    state, _ = bm.reserve(state, ids, lens)
    meta = fa.step_metadata(state, ids, lens, num_tokens=5,
                            active=jnp.array([False, True]))
    model = nnx.merge(graphdef, params)
    out, cache = model(jnp.ones((5, 32)), meta, cache, 0)
    return out, cache, state, model.o_proj(jnp.zeros((3, 64)))

  out, new_cache, state, zero_rows = step(params, state, cache)
  np.testing.assert_array_equal(out[:3], zero_rows)
  block0 = int(state.block_tables[0, 0])
  np.testing.assert_array_equal(new_cache.k_pages[0, :, block0], 0.0)


def test_errors():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  with pytest.raises(ValueError, match="decode_only needs one row per sequence"):
    fa.step_metadata(state, jnp.array([0, 1]), jnp.array([1, 1]), num_tokens=4,
                     decode_only=True)
  with pytest.raises(ValueError, match=r"seq_ids must be a 1-D integer array, "
                     r"got shape \(2, 1\)"):
    fa.step_metadata(state, jnp.zeros((2, 1), jnp.int32), jnp.array([1, 1]), num_tokens=4)
  with pytest.raises(ValueError, match="q_lens shape"):
    fa.step_metadata(state, jnp.array([0, 1]), jnp.array([1]), num_tokens=4)
  with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
    fa.PagedAttention(32, 6, 4, 16, rope=None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="must equal head_dim=16"):
    fa.PagedAttention(32, 4, 4, 16, rope=rope.RopeConfig(32), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("blocks, block_size, match", [
    (4, 8, "the KV cache's block_size=8 must equal the block state's block_size=4"),
    (6, 4, "the KV cache's num_blocks=6 must equal the block state's 4 blocks"),
])
def test_a_cache_of_another_pool_is_refused(blocks, block_size, match):
  """Slots and tables index the pages directly: a cache with another block
  size gave silently wrong attention (error 0.67 against the reference)."""
  attn = _module(4, 2, 16)
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  cache = kv_cache.KVCache.create(num_layers=1, num_kv_heads=2,
                                  num_blocks=blocks, block_size=block_size,
                                  head_dim=16, dtype=jnp.float32)
  ids, lens = np.array([0, 1]), np.array([3, 2])
  state, _ = bm.reserve(state, ids, lens)
  meta = fa.step_metadata(state, ids, lens, num_tokens=5)
  assert (meta.block_size, meta.total_blocks) == (4, 4)
  with pytest.raises(ValueError, match=match):
    attn(jnp.ones((5, 32)), meta, cache, 0)


def test_sharded_metadata_records_the_whole_pool():
  mesh = sharding.make_mesh(data=2, model=1)
  states = sharding.init_block_states(mesh, num_blocks_per_shard=4, block_size=4,
                                      max_seqs_per_shard=2, max_blocks_per_seq=2)
  ids = np.array([[0, 1], [0, 1]])
  meta = fa.sharded_step_metadata(mesh, states, ids, np.zeros((2, 2), np.int32),
                                  num_tokens=2)
  assert (meta.block_size, meta.total_blocks) == (4, 8)
  kv_cache.check_compatible(jnp.zeros((1, 8, 4, 16)), meta)
  x = jnp.zeros((4, 1, 16))
  pages = jnp.zeros((1, 4, 4, 16))  # one shard's pool, not the mesh's
  with pytest.raises(ValueError, match="num_blocks=4 must equal the block "
                     "state's 8 blocks"):
    fa.write_and_attend(x, x, x, pages, pages, meta)


def test_step_metadata_ids_outside_int32_are_padding():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, np.array([0, 1]), np.array([2, 3]))
  ids = np.array([2**32 + 1, 0], np.int64)  # wrapped to slot 1 in int32
  meta = fa.step_metadata(state, ids, np.array([3, 2]), num_tokens=5)
  np.testing.assert_array_equal(meta.kv_lens, [0, 2])
  np.testing.assert_array_equal(meta.slots[:3], -1)
  assert (np.asarray(meta.block_tables)[0] == bm.NULL_BLOCK).all()


def test_step_metadata_hostile_q_lens_keep_the_layout_well_formed():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, np.array([0, 1]), np.array([2, 3]))
  tables = np.asarray(state.block_tables)
  # A huge count wrapped cu_q_lens negative; a negative one made it decrease.
  meta = fa.step_metadata(state, [0, 1], [2**31 - 1, 3], num_tokens=5)
  np.testing.assert_array_equal(meta.cu_q_lens, [0, 5, 8])
  np.testing.assert_array_equal(meta.kv_lens, [0, 3])
  np.testing.assert_array_equal(meta.slots, -1)
  meta = fa.step_metadata(state, [0, 1], [-3, 3], num_tokens=5)
  np.testing.assert_array_equal(meta.cu_q_lens, [0, 0, 3])
  np.testing.assert_array_equal(meta.kv_lens, [0, 3])
  np.testing.assert_array_equal(meta.positions[:3], [0, 1, 2])
  np.testing.assert_array_equal(meta.slots[:3], tables[1, 0] * 4 + np.arange(3))
  # More new tokens than the sequence holds: no write at a negative position.
  meta = fa.step_metadata(state, [0, 1], [4, 1], num_tokens=5)
  np.testing.assert_array_equal(meta.kv_lens, [0, 3])
  np.testing.assert_array_equal(meta.slots, [-1] * 4 + [tables[1, 0] * 4 + 2])
  with pytest.raises(ValueError, match=r"max_seqs_per_step \* num_tokens = "
                     r"2147483648 must be < 2\*\*31 \(int32 cu_q_lens\)"):
    fa.step_metadata(state, [0, 1], [1, 1], num_tokens=2**30)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, "int8"])
@pytest.mark.parametrize("decode_only", [True, False])
def test_write_and_attend_at_a_layer_equals_the_layer_slice(cache_dtype,
                                                            decode_only):
  """`layer=i` on the whole cache (static, or traced under jit) gives the same
  output and the same layer `i` as the one-layer form, and leaves the other
  layers alone."""
  rng = np.random.default_rng(3)
  kvh, heads, d, bs, layers = 2, 4, 16, 4, 3
  state = bm.init(num_blocks=8, block_size=bs, max_seqs=2,
                  max_blocks_per_seq=4)
  ids = jnp.array([0, 1])
  lens = jnp.array([1, 1]) if decode_only else jnp.array([3, 2])
  tokens = 2 if decode_only else 6  # one padding row in the ragged step
  state, _ = reserve(state, ids, lens)
  meta = fa.step_metadata(state, ids, lens, num_tokens=tokens,
                          decode_only=decode_only)
  cache = kv_cache.KVCache.create(num_layers=layers, num_kv_heads=kvh,
                                  num_blocks=8, block_size=bs, head_dim=d,
                                  dtype=cache_dtype)
  rand = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))  # noqa: E731
  q, k, v = rand(tokens, heads, d), rand(tokens, kvh, d), rand(tokens, kvh, d)
  names = ["k_pages", "v_pages"] + (["k_scales", "v_scales"]
                                    if cache.quantized else [])
  one = cache.layer(1)
  want = fa.write_and_attend(q, k, v, one["k_pages"], one["v_pages"], meta,
                             **{n: one[n] for n in names[2:]})
  whole = {n: getattr(cache, n) for n in names}

  def at(layer, arrays):
    return fa.write_and_attend(q, k, v, arrays["k_pages"], arrays["v_pages"],
                               meta, layer=layer,
                               **{n: arrays[n] for n in names[2:]})

  for got in (at(1, whole), jax.jit(at)(jnp.int32(1), whole)):
    assert len(got) == len(want)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    for g, w, old in zip(got[1:], want[1:], cache.arrays()):
      assert g.shape == old.shape
      np.testing.assert_array_equal(np.asarray(g[1], np.float32),
                                    np.asarray(w, np.float32))
      np.testing.assert_array_equal(np.asarray(g[0::2], np.float32),
                                    np.asarray(old[0::2], np.float32))
  with pytest.raises(ValueError, match=r"with layer=0, k_pages must be the "
                     r"whole cache's \[num_layers"):
    fa.write_and_attend(q, k, v, one["k_pages"], one["v_pages"], meta, layer=0,
                        **{n: one[n] for n in names[2:]})
  with pytest.raises(ValueError, match=r"layer must be in \[0, num_layers=3\)"):
    at(3, whole)
