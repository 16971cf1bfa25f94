"""KV cache writes, copy-on-write copies and gathers, driven by the block manager."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK
from pallas_kernels import quantization


def _rand(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_then_gather_round_trips(dtype):
  rng = np.random.default_rng(0)
  kvh, d, bs = 2, 8, 4
  state = bm.init(num_blocks=16, block_size=bs, max_seqs=3,
                  max_blocks_per_seq=5)
  cache = kv_cache.KVCache.create(num_layers=2, num_kv_heads=kvh, num_blocks=16,
                                  block_size=bs, head_dim=d, dtype=dtype)
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
  cache = kv_cache.KVCache.create(num_layers=2, num_kv_heads=4, num_blocks=10,
                                  block_size=16, head_dim=64,
                                  dtype=jnp.bfloat16)
  assert cache.k_pages.shape == (2, 4, 10, 16, 64)
  assert (cache.num_layers, cache.num_blocks, cache.block_size) == (2, 10, 16)
  assert cache.nbytes == 2 * 2 * 4 * 10 * 16 * 64 * 2
  with pytest.raises(ValueError, match="num_blocks must be a positive int, got "
                     "num_blocks=0"):
    kv_cache.KVCache.create(num_layers=2, num_kv_heads=4, num_blocks=0,
                            block_size=16, head_dim=64)
  with pytest.raises(ValueError, match="dtype must be a floating dtype or int8, got int32"):
    kv_cache.KVCache.create(num_layers=2, num_kv_heads=4, num_blocks=1,
                            block_size=16, head_dim=64, dtype=jnp.int32)
  pages = cache.k_pages[0]
  with pytest.raises(ValueError, match=r"k and v must be \[T, num_kv_heads, "
                     r"head_dim\]=\(3, 4, 64\)"):
    kv_cache.write_kv(pages, pages, jnp.zeros((3, 4, 32)), jnp.zeros((3, 4, 32)),
                      jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"v_pages \(bfloat16\[2, 10, 16, 64\]\) must match k_pages "
                     r"\(bfloat16\[4, 10, 16, 64\]\)"):
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


def _numbered_cache(num_blocks=8):
  """One layer, one head, block `b` filled with the value `b`."""
  pages = jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.float32)[
      None, None, :, None, None], (1, 1, num_blocks, 2, 1))
  return kv_cache.KVCache(pages, pages + 100)


def test_copy_blocks_skips_pairs_with_an_id_outside_the_pool():
  cache = _numbered_cache()
  copy = jax.jit(kv_cache.copy_blocks)
  # Each pair has one bad id: a clamp copied block 7 into 0, and a wrapped
  # negative index wrote block 6; every pair must be skipped.
  src = jnp.array([8, 2**30, 1, 1, -2, 3, NULL_BLOCK])
  dst = jnp.array([0, 0, -2, 8, 0, 2**30, 5])
  for c in (copy(cache, src, dst), kv_cache.copy_blocks(cache, src, dst)):
    np.testing.assert_array_equal(c.k_pages, cache.k_pages)
    np.testing.assert_array_equal(c.v_pages, cache.v_pages)
  # int64 ids outside int32 are out of range too, not truncated to 1 -> 0.
  c = kv_cache.copy_blocks(cache, np.array([2**32 + 1], np.int64), [0])
  np.testing.assert_array_equal(c.k_pages, cache.k_pages)
  c = kv_cache.copy_blocks(cache, np.array([1], np.int64), [0])  # a good pair
  assert float(c.k_pages[0, 0, 0, 0, 0]) == 1.0


def test_gather_kv_never_reads_a_block_outside_the_pool():
  cache = _numbered_cache(4)
  tables = jnp.array([[NULL_BLOCK, 1], [4, 2], [2**30, 3], [-2, 0]])
  got = kv_cache.gather_kv(cache.k_pages[0], tables, jnp.array([4, 4, 4, 4]),
                           max_len=4)
  # Entries inside kv_len that are NULL_BLOCK or outside [0, 4) give zeros.
  np.testing.assert_array_equal(got[:, :, 0, 0], [[0, 0, 1, 1], [0, 0, 2, 2],
                                                  [0, 0, 3, 3], [0, 0, 0, 0]])


def test_write_kv_checks_slots():
  pages = jnp.zeros((1, 2, 4, 1))
  one = jnp.ones((1, 1, 1))
  with pytest.raises(ValueError, match="slots must have an integer dtype, got float32"):
    kv_cache.write_kv(pages, pages, one, one, jnp.array([1.0]))
  kp, _ = kv_cache.write_kv(pages, pages, one, one, np.array([2**32 + 5], np.int64))
  assert not np.asarray(kp).any()  # out of int32: dropped, not slot 5
  kp, _ = kv_cache.write_kv(pages, pages, one, one, [5])
  assert float(kp[0, 1, 1, 0]) == 1.0
  # A pool whose flat slots do not fit int32 is refused (checked on shapes).
  big = jax.ShapeDtypeStruct((1, 2**20, 2**11, 1), jnp.float32)
  with pytest.raises(ValueError, match=r"num_blocks \* block_size = 2147483648 "
                     r"must be < 2\*\*31 \(int32 cache slots\)"):
    jax.eval_shape(kv_cache.write_kv, big, big, one, one, jnp.array([0]))


@pytest.mark.parametrize("sizes, match", [
    (dict(num_layers=True), "num_layers must be a positive int, got True"),
    (dict(head_dim=0), "head_dim must be a positive int, got head_dim=0"),
    (dict(num_blocks=2**21, block_size=2**10),
     r"num_blocks \* block_size = 2147483648 must be < 2\*\*31 \(int32 cache slots\)"),
])
def test_cache_shape_errors(sizes, match):
  args = dict(num_layers=2, num_kv_heads=4, num_blocks=10, block_size=16,
              head_dim=64)
  args.update(sizes)
  with pytest.raises(ValueError, match=match):
    kv_cache.cache_shape(**args, dtype=jnp.float32)


def test_cache_shape_takes_numpy_ints_like_block_manager_init():
  shape = kv_cache.cache_shape(num_layers=np.int64(2), num_kv_heads=4,
                               num_blocks=np.int32(10), block_size=16,
                               head_dim=64, dtype=jnp.float32)
  assert shape == (2, 4, 10, 16, 64) and all(type(d) is int for d in shape)


def test_check_compatible():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  kv_cache.check_compatible(_numbered_cache(8).replace(
      k_pages=jnp.zeros((1, 1, 8, 4, 1)), v_pages=jnp.zeros((1, 1, 8, 4, 1))), state)
  kv_cache.check_compatible(jnp.zeros((1, 8, 4, 1)), state)  # one layer's pages
  with pytest.raises(ValueError, match=r"the KV cache's block_size=2 must equal "
                     r"the block state's block_size=4"):
    kv_cache.check_compatible(_numbered_cache(8), state)
  with pytest.raises(ValueError, match=r"the KV cache's num_blocks=6 must equal "
                     r"the block state's 8 blocks"):
    kv_cache.check_compatible(jnp.zeros((1, 6, 4, 1)), state)
  # Data shards' states stacked on a leading axis: their pools add up.
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), state)
  kv_cache.check_compatible(jnp.zeros((1, 16, 4, 1)), stacked)
  with pytest.raises(ValueError, match=r"num_blocks=8 must equal the block "
                     r"state's 16 blocks"):
    kv_cache.check_compatible(jnp.zeros((1, 8, 4, 1)), stacked)


def test_sizes_are_keyword_only_where_orders_differ():
  """`init(num_blocks, block_size, ...)` and `create(num_layers, num_kv_heads,
  num_blocks, block_size, ...)` put the same sizes at other positions."""
  from paged_jax import sharding
  for fn in (bm.init, kv_cache.KVCache.create, kv_cache.cache_shape,
             sharding.create_cache, sharding.init_block_states):
    params = inspect.signature(fn).parameters.values()
    sizes = [p for p in params if p.name not in ("mesh", "cls")]
    assert all(p.kind is p.KEYWORD_ONLY for p in sizes), fn.__qualname__
  with pytest.raises(TypeError):
    bm.init(4, 4, 3, 2)


def test_empty_batches_change_nothing():
  cache = _numbered_cache(4)
  none = jnp.zeros((0,), jnp.int32)
  pages = cache.k_pages[0]
  kp, vp = kv_cache.write_kv(pages, pages, jnp.zeros((0, 1, 1)),
                             jnp.zeros((0, 1, 1)), none)
  np.testing.assert_array_equal(kp, pages)
  same = kv_cache.copy_blocks(cache, none, none)
  np.testing.assert_array_equal(same.k_pages, cache.k_pages)
  got = kv_cache.gather_kv(pages, jnp.zeros((0, 2), jnp.int32), none, max_len=4)
  assert got.shape == (0, 4, 1, 1)


# ----------------------------------------------------------------------------
# Quantised caches: int8 / fp8 pages with per-token, per-KV-head scales.


@pytest.mark.parametrize("name, dtype", [("int8", jnp.int8),
                                         ("fp8", jnp.float8_e4m3fn)])
def test_quantized_write_copy_gather_round_trip(name, dtype):
  """One jitted, donated write quantises and scatters values and scales;
  copy-on-write and gather carry the scales; the result is within half a
  quantisation step of what was written (relative to each row's absmax)."""
  rng = np.random.default_rng(2)
  kvh, d, bs = 2, 16, 4
  cache = kv_cache.KVCache.create(num_layers=2, num_kv_heads=kvh,
                                  num_blocks=8, block_size=bs, head_dim=d,
                                  dtype=name)
  assert cache.dtype == jnp.dtype(dtype) and cache.quantized
  assert cache.k_scales.shape == (2, kvh, 8, bs)
  assert cache.k_scales.dtype == jnp.float32
  # Bytes per token read from the arrays: 2 layers x (K, V) x kvh x (d + 4).
  assert cache.bytes_per_token == 2 * 2 * kvh * (d + 4)
  k = _rand(rng, (5, kvh, d)) * jnp.array([1.0, 100.0])[None, :, None]
  v = _rand(rng, (5, kvh, d))
  slots = jnp.array([0, 1, 5, 6, -1])  # block 0: 2 tokens, block 1: 2, padding
  write = jax.jit(kv_cache.write_kv, donate_argnums=(0, 1))
  cache = cache.set_layer(1, *write(**cache.layer(1), k=k, v=v, slots=slots))
  cache = jax.jit(kv_cache.copy_blocks, donate_argnums=0)(
      cache, jnp.array([1]), jnp.array([3]))  # block 1 -> 3, every layer
  tables = jnp.array([[0, 3]], jnp.int32)
  got = kv_cache.gather_kv(cache.k_pages[1], tables, jnp.array([7]), 7,
                           scales=cache.k_scales[1])
  assert got.dtype == jnp.float32
  step = np.abs(np.asarray(k)).max(-1) / quantization.max_value(dtype)
  rel = 0.5 if name == "int8" else 2.0**-4 * quantization.max_value(dtype)
  # Tokens 0, 1 in block 0 (positions 0, 1); tokens 2, 3 at slots 5, 6 of
  # block 1, copied to block 3 (positions 5, 6).
  for rows, pos in ((slice(0, 2), slice(0, 2)), (slice(2, 4), slice(5, 7))):
    err = np.abs(np.asarray(got[0, pos]) - np.asarray(k)[rows])
    assert (err <= rel * step[rows][..., None] + 1e-7).all(), err.max()
  assert not np.asarray(got[0, 2:5]).any()  # never written: zero pages, scales
  assert cache.k_scales[1, 1, 3, 1] > cache.k_scales[1, 0, 3, 1] * 10  # per head
  # The untouched layer is still all zeros, scales too.
  assert not np.asarray(cache.k_scales[0]).any()


def test_quantized_cache_checks_and_errors():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=1, max_blocks_per_seq=2)
  cache = kv_cache.KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=4,
                                  block_size=4, head_dim=8, dtype="int8")
  kv_cache.check_compatible(cache, state)
  with pytest.raises(ValueError, match=r"the KV cache's int8 pages need "
                     r"v_scales f32\[1, 4, 4\], got None"):
    kv_cache.check_compatible(cache.replace(v_scales=None), state)
  with pytest.raises(ValueError, match=r"the KV cache's k_scales must be None "
                     r"for float32 pages"):
    kv_cache.check_compatible(
        kv_cache.KVCache(cache.k_pages.astype(jnp.float32),
                         cache.v_pages.astype(jnp.float32), cache.k_scales),
        state)
  with pytest.raises(ValueError, match=r"k_scales must have num_layers=1 "
                     r"layers, got shape \(2, 1, 4, 4\)"):
    kv_cache.check_compatible(
        cache.replace(k_scales=jnp.zeros((2, 1, 4, 4))), state)
  k = jnp.ones((1, 1, 8))
  with pytest.raises(ValueError, match=r"int8 pages need k_scales f32\[1, 4, "
                     r"4\], got None"):
    kv_cache.write_kv(cache.k_pages[0], cache.v_pages[0], k, k, jnp.array([0]))
  with pytest.raises(ValueError, match=r"scales must be f32\[1, 4, 4\]"):
    kv_cache.gather_kv(cache.k_pages[0], jnp.zeros((1, 2), jnp.int32),
                       jnp.array([1]), 1, scales=jnp.zeros((1, 4)))
  with pytest.raises(ValueError, match=r"cache dtype must be one of \['auto', "
                     r"'float32'.*, got 'int4'"):
    kv_cache.cache_dtype("int4")
  with pytest.raises(ValueError, match="cache dtype 'auto' needs the model's "
                     "dtype"):
    kv_cache.cache_dtype("auto")
  assert kv_cache.cache_dtype("fp8") == jnp.float8_e4m3fn
  assert kv_cache.cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16


def test_float_cache_has_no_scale_leaves():
  cache = kv_cache.KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=2,
                                  block_size=4, head_dim=8)
  assert cache.k_scales is None and len(jax.tree.leaves(cache)) == 2
  assert cache.bytes_per_token == 2 * 8 * 2  # bf16 K and V, no scales


def test_quantize_rule():
  x = jnp.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e4, -1e-3, 3.0]])
  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    values, scales = quantization.quantize(x, dtype)
    assert values.dtype == dtype and scales.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(scales) * quantization.max_value(dtype),
                               [2.0, 0.0, 1e4], rtol=1e-6)
    back = np.asarray(quantization.dequantize(values, scales))
    assert np.isfinite(back).all() and not back[1].any()
    np.testing.assert_allclose(back[:, 0], [1.0, 0.0, 1e4], rtol=2**-4)
  with pytest.raises(ValueError, match=r"dtype must be one of \['int8', "
                     r"'float8_e4m3fn'\], got float32"):
    quantization.quantize(x, jnp.float32)


# -1 and 24 (past the pool) are dropped; one token (a 1-row decode step) is
# written through a padded second slot.
@pytest.mark.parametrize("slots", [(0, 7, 23, -1, 24), (7,), (-1,)])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8", "fp8"])
def test_write_kv_layer_equals_write_kv_on_the_layer(name, slots):
  """`write_kv_layer` at a static or a traced layer (jitted, donated) changes
  exactly what `write_kv` on that layer's slice does, and nothing else; a
  traced layer outside the cache writes nothing."""
  rng = np.random.default_rng(7)
  kvh, d, bs, layers = 2, 8, 4, 3
  cache = kv_cache.KVCache.create(num_layers=layers, num_kv_heads=kvh,
                                  num_blocks=6, block_size=bs, head_dim=d,
                                  dtype=name)
  # Non-zero pages and scales, so that a write into the wrong place shows.
  cache = cache.replace(**{n: _rand(rng, getattr(cache, n).shape).astype(
      getattr(cache, n).dtype) for n in ("k_pages", "v_pages", "k_scales",
                                          "v_scales")
                           if getattr(cache, n) is not None})
  k, v = (_rand(rng, (len(slots), kvh, d)) for _ in "kv")
  slots = jnp.array(slots)
  scales = dict(k_scales=cache.k_scales, v_scales=cache.v_scales) if (
      cache.quantized) else {}
  copy = lambda: [jnp.array(a) for a in cache.arrays()]  # noqa: E731
  write_layer = jax.jit(kv_cache.write_kv_layer, donate_argnums=(0, 1))
  for layer in (1, jnp.int32(2)):
    i = int(layer)
    one = cache.layer(i)
    want = kv_cache.write_kv(one["k_pages"], one["v_pages"], k, v, slots,
                             **{n: one[n] for n in scales})
    args = copy()
    got = (kv_cache.write_kv_layer(*args[:2], k, v, slots, layer,
                                   **dict(zip(scales, args[2:])))
           if isinstance(layer, int) else
           write_layer(*args[:2], k, v, slots, layer,
                       **dict(zip(scales, args[2:]))))
    assert len(got) == len(cache.arrays())
    for g, w, old in zip(got, want, cache.arrays()):
      assert g.shape == old.shape and g.dtype == old.dtype
      np.testing.assert_array_equal(np.asarray(g[i], np.float32),
                                    np.asarray(w, np.float32))
      others = np.array([j for j in range(layers) if j != i])
      np.testing.assert_array_equal(np.asarray(g[others], np.float32),
                                    np.asarray(old[others], np.float32))
  args = copy()
  got = write_layer(*args[:2], k, v, slots, jnp.int32(layers),
                    **dict(zip(scales, args[2:])))
  for g, old in zip(got, cache.arrays()):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(old, np.float32))


def test_write_kv_layer_errors():
  cache = kv_cache.KVCache.create(num_layers=2, num_kv_heads=1, num_blocks=2,
                                  block_size=4, head_dim=8, dtype="int8")
  one = jnp.zeros((1, 1, 8))
  scales = dict(k_scales=cache.k_scales, v_scales=cache.v_scales)
  args = (cache.k_pages, cache.v_pages, one, one, jnp.array([0]))
  with pytest.raises(ValueError, match=r"layer must be in \[0, num_layers=2\)"):
    kv_cache.write_kv_layer(*args, 2, **scales)
  with pytest.raises(ValueError, match="integer scalar"):
    kv_cache.write_kv_layer(*args, jnp.array([0]), **scales)
  with pytest.raises(ValueError, match="integer scalar"):
    kv_cache.write_kv_layer(*args, True, **scales)
  with pytest.raises(ValueError, match=r"must be \[num_layers, num_kv_heads"):
    kv_cache.write_kv_layer(cache.k_pages[0], cache.v_pages[0], one, one,
                            jnp.array([0]), 0, **scales)
  with pytest.raises(ValueError, match="leading axes"):
    kv_cache.write_kv_layer(*args, 0, k_scales=cache.k_scales[:1],
                            v_scales=cache.v_scales)
  with pytest.raises(ValueError, match="int8 pages need k_scales"):
    kv_cache.write_kv_layer(*args, 0)
  with pytest.raises(ValueError, match=r"k and v must be \[T, num_kv_heads"):
    kv_cache.write_kv_layer(*args[:2], one, one, jnp.array([0, 1]), 0,
                            **scales)
