"""Sharded paged attention on 8 simulated CPU devices (see tests/conftest.py)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from paged_jax import block_manager as bm
from paged_jax import reference
from paged_jax import sharding as ps
from tests import cases
from tests.pallas_kernels import gpu_lowering

MESHES = [(d, m) for d in (1, 2, 4, 8) for m in (1, 2, 4, 8) if d * m <= 8]
HQ, HKV, D, BS, SEQS = 8, 2, 32, 8, 2

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices: run with "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py)")


def _per_shard_cases(rng, data, ragged, head_dim=D):
  """Each data shard gets its own pool, sequences and (local) block ids."""
  out = []
  for _ in range(data):
    if ragged:
      out.append(cases.make_ragged_case(
          rng, q_lens=[5, 1], kv_lens=[9, 20], num_q_heads=HQ, num_kv_heads=HKV,
          head_dim=head_dim, block_size=BS, max_blocks_per_seq=4, num_tokens=8,
          max_num_seqs=SEQS, extra_blocks=16 - 4))
    else:
      out.append(cases.make_decode_case(
          rng, batch=SEQS, num_q_heads=HQ, num_kv_heads=HKV, head_dim=head_dim,
          block_size=BS, max_blocks_per_seq=4, kv_lens=rng.integers(0, 33, SEQS),
          extra_blocks=5))
  nb = max(c.k_pages.shape[1] for c in out)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, nb - x.shape[1]), (0, 0), (0, 0)),
                          constant_values=jnp.nan)
  return out, pad


def _place_pages(mesh, cs, pad, model):
  spec = NamedSharding(mesh, P(ps.MODEL, ps.DATA))
  k = jnp.concatenate([pad(c.k_pages) for c in cs], axis=1)
  v = jnp.concatenate([pad(c.v_pages) for c in cs], axis=1)
  k = jax.device_put(ps.replicate_kv_heads(k, HKV, model, axis=0), spec)
  v = jax.device_put(ps.replicate_kv_heads(v, HKV, model, axis=0), spec)
  return k, v


@pytest.mark.parametrize("data, model", MESHES)
def test_sharded_decode_equals_single_device(data, model):
  rng = np.random.default_rng(data * 10 + model)
  mesh = ps.make_mesh(data, model)
  cs, pad = _per_shard_cases(rng, data, ragged=False)
  k, v = _place_pages(mesh, cs, pad, model)
  assert k.sharding.is_equivalent_to(NamedSharding(mesh, P(ps.MODEL, ps.DATA)), 4)
  q = jnp.concatenate([c.q for c in cs])
  tables = jnp.concatenate([c.block_tables for c in cs])
  lens = jnp.concatenate([c.kv_lens for c in cs])
  f = jax.jit(lambda *a: ps.sharded_paged_attention(mesh, *a))
  out = f(q, k, v, tables, lens)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(ps.DATA, ps.MODEL)),
                                       3)
  for i, c in enumerate(cs):
    ref = reference.paged_attention_reference(c.q, c.k_pages, c.v_pages,
                                              c.block_tables, c.kv_lens)
    cases.assert_rows_close(out[i * SEQS:(i + 1) * SEQS], ref, jnp.float32)
  hlo = f.lower(q, k, v, tables, lens).compile().as_text()
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in hlo, f"{op} in the compiled sharded attention"


@pytest.mark.parametrize("data, model", [(2, 4), (4, 2), (8, 1), (1, 8)])
def test_sharded_ragged_and_write(data, model):
  rng = np.random.default_rng(1)
  mesh = ps.make_mesh(data, model)
  cs, pad = _per_shard_cases(rng, data, ragged=True)
  k, v = _place_pages(mesh, cs, pad, model)
  q = jnp.concatenate([c.q for c in cs])
  args = [jnp.concatenate([getattr(c, f) for c in cs])
          for f in ("block_tables", "kv_lens", "cu_q_lens", "num_seqs")]
  out = jax.jit(lambda *a: ps.sharded_ragged_paged_attention(mesh, *a))(
      q, k, v, *args)
  for i, c in enumerate(cs):
    ref = reference.ragged_paged_attention_reference(
        c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
        c.num_seqs)
    cases.assert_rows_close(out[i * 8:(i + 1) * 8], ref, jnp.float32)
  # Each data shard writes its own tokens into its own pool (local slots).
  new_k = jnp.ones((data * 2, ps.cache_kv_heads(HKV, model), D))
  slots = jnp.tile(jnp.array([3, -1], jnp.int32), data)
  k2, _ = jax.jit(lambda *a: ps.write_kv_sharded(mesh, *a))(
      k, v, new_k, new_k, slots)
  nb = k.shape[1] // data
  for i in range(data):
    np.testing.assert_array_equal(np.asarray(k2[:, i * nb, 3]), 1.0)


def test_block_states_per_data_shard():
  mesh = ps.make_mesh(4, 2)
  states = ps.init_block_states(mesh, num_blocks_per_shard=8, block_size=4,
                                max_seqs_per_shard=2, max_blocks_per_seq=4)
  assert states.refcounts.shape == (4, 8)
  assert states.refcounts.sharding.is_equivalent_to(
      NamedSharding(mesh, P(ps.DATA)), 2)
  ids = jnp.array([[0, 1]] * 4, jnp.int32)
  n = jnp.array([[5, 9], [1, 1], [16, 17], [0, 3]], jnp.int32)
  step = jax.jit(jax.vmap(bm.reserve), donate_argnums=0)
  states, res = step(states, ids, n)
  assert res.ok.tolist() == [[True, True], [True, True], [True, False],
                             [True, True]]
  for i in range(4):
    bm.check_invariants(jax.tree.map(lambda x, i=i: x[i], states))


def test_mesh_errors():
  with pytest.raises(ValueError, match="a data=4 x model=4 mesh needs 16 "
                     "devices, 8 available"):
    ps.make_mesh(4, 4)
  with pytest.raises(ValueError, match=r"num_kv_heads=3 and the model axis "
                     r"\(2\) must divide one another"):
    ps.cache_kv_heads(3, 2)
  assert ps.cache_kv_heads(2, 8) == 8 and ps.cache_kv_heads(8, 2) == 8


@pytest.mark.parametrize("data, model", [(2, 4), (4, 2), (8, 1)])
def test_create_cache_and_copy_blocks_stay_in_their_shard(data, model):
  mesh = ps.make_mesh(data, model)
  cache = ps.create_cache(mesh, num_layers=2, num_kv_heads=8,
                          num_blocks_per_shard=6, block_size=4, head_dim=16,
                          dtype=jnp.float32)
  assert cache.k_pages.shape == (2, 8, data * 6, 4, 16)
  assert cache.k_pages.sharding.is_equivalent_to(
      NamedSharding(mesh, ps.cache_spec()), 5)
  per_device = ps.per_device_cache_bytes(cache)
  assert len(per_device) == data * model
  assert set(per_device.values()) == {cache.nbytes // (data * model)}
  # Block b of shard i holds the value 100 * i + b everywhere.
  vals = (100 * np.arange(data)[:, None] + np.arange(6)).reshape(-1)
  pages = jnp.broadcast_to(jnp.asarray(vals, jnp.float32)[None, None, :, None, None],
                           cache.k_pages.shape)
  pages = jax.device_put(pages, cache.k_pages.sharding)
  cache = cache.replace(k_pages=pages, v_pages=-pages)
  # Shard i copies local block i % 6 -> 5 (shard 0 also 1 -> 4); -1 pairs skip.
  src = np.full((data, 2), -1, np.int32)
  dst = np.full((data, 2), -1, np.int32)
  src[:, 0], dst[:, 0] = np.arange(data) % 5, 5
  src[0, 1], dst[0, 1] = 1, 4
  out = jax.jit(lambda c, s, d: ps.copy_blocks_sharded(mesh, c, s, d))(
      cache, src, dst)
  want = vals.reshape(data, 6).copy()
  want[:, 5] = 100 * np.arange(data) + np.arange(data) % 5
  want[0, 4] = 1
  got = np.asarray(out.k_pages[1, 3, :, 2, 7]).reshape(data, 6)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(out.v_pages[0, 0, :, 0, 0]),
                                -want.reshape(-1))
  assert out.k_pages.sharding.is_equivalent_to(cache.k_pages.sharding, 5)


def test_create_cache_errors():
  with pytest.raises(ValueError, match=r"num_kv_heads=2 must be a multiple of "
                     r"the model axis \(4\)"):
    ps.create_cache(ps.make_mesh(2, 4), num_layers=1, num_kv_heads=2,
                    num_blocks_per_shard=4, block_size=4, head_dim=16)
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    ps.create_cache(ps.make_mesh(1, 2), num_layers=1, num_kv_heads=2,
                    num_blocks_per_shard=4, block_size=0, head_dim=16)
  # Slots are local to a data shard: each shard's pool must fit int32.
  with pytest.raises(ValueError, match=r"num_blocks \* block_size = 2147483648 "
                     r"must be < 2\*\*31 \(int32 cache slots\), got "
                     r"num_blocks=2097152"):
    ps.create_cache(ps.make_mesh(2, 1), num_layers=1, num_kv_heads=1,
                    num_blocks_per_shard=2**21, block_size=2**10, head_dim=1)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_sharded_attention_runs_every_kernel(impl):
  """The kernels (in interpret mode) under shard_map on a 2 x 2 mesh."""
  data, model = 2, 2
  rng = np.random.default_rng(7)
  mesh = ps.make_mesh(data, model)
  kw = dict(implementation=impl, interpret=True)
  for ragged in (False, True):
    cs, pad = _per_shard_cases(rng, data, ragged=ragged, head_dim=64)
    k, v = _place_pages(mesh, cs, pad, model)
    q = jnp.concatenate([c.q for c in cs])
    if ragged:
      args = [jnp.concatenate([getattr(c, f) for c in cs])
              for f in ("block_tables", "kv_lens", "cu_q_lens", "num_seqs")]
      out = jax.jit(lambda *a: ps.sharded_ragged_paged_attention(mesh, *a, **kw))(
          q, k, v, *args)
      refs = [reference.ragged_paged_attention_reference(
          c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
          c.num_seqs) for c in cs]
    else:
      tables = jnp.concatenate([c.block_tables for c in cs])
      lens = jnp.concatenate([c.kv_lens for c in cs])
      out = jax.jit(lambda *a: ps.sharded_paged_attention(mesh, *a, **kw))(
          q, k, v, tables, lens)
      refs = [reference.paged_attention_reference(
          c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens) for c in cs]
    rows = out.shape[0] // data
    for i, ref in enumerate(refs):
      cases.assert_rows_close(out[i * rows:(i + 1) * rows], ref, jnp.float32)


@pytest.mark.parametrize("target", ["tpu", "cuda"])
def test_sharded_kernels_lower_for_their_targets(target):
  """Under shard_map on a 2 x 4 mesh each device's kernel (local shapes) passes
  Mosaic's / Triton's lowering checks (from CPU; interpret mode does not)."""
  backend = "tpu" if target == "tpu" else "gpu"
  decode = pytest.importorskip(f"pallas_kernels.{backend}.paged_decode")
  ragged = pytest.importorskip(f"pallas_kernels.{backend}.ragged_attention")
  mesh, context = ps.make_mesh(2, 4), contextlib.nullcontext()
  if target == "cuda":
    mesh, context = gpu_lowering.abstract_gpu_mesh(mesh)
  bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
  pages = P(ps.MODEL, ps.DATA, None, None)
  rows = P(ps.DATA, ps.MODEL, None)
  calls = [
      (decode.paged_decode, (rows, pages, pages, P(ps.DATA, None), P(ps.DATA)),
       (bf16(16, 16, 128), bf16(4, 64, 16, 128), bf16(4, 64, 16, 128),
        i32(16, 8), i32(16))),
      (ragged.ragged_paged_attention,
       (rows, pages, pages, P(ps.DATA, None), P(ps.DATA), P(ps.DATA), P(ps.DATA)),
       (bf16(64, 16, 128), bf16(4, 64, 16, 128), bf16(4, 64, 16, 128),
        i32(8, 8), i32(8), i32(10), i32(2))),
  ]
  for fn, in_specs, args in calls:
    f = jax.shard_map(lambda *a, fn=fn: fn(*a, sm_scale=0.1), mesh=mesh,
                      in_specs=in_specs, out_specs=rows, check_vma=False)
    with context:
      text = jax.jit(f).trace(*args).lower(lowering_platforms=(target,)).as_text()
    assert ("tpu_custom_call" if target == "tpu" else "triton") in text


@pytest.mark.parametrize("data, model", [(2, 2)])
def test_quantized_cache_on_a_mesh(data, model):
  """An int8 cache's scales are created, written, copied and attended on the
  mesh sharded like their pages, with the single-device answer."""
  mesh = ps.make_mesh(data, model)
  cache = ps.create_cache(mesh, num_layers=1, num_kv_heads=HKV,
                          num_blocks_per_shard=8, block_size=BS, head_dim=D,
                          dtype="int8")
  assert cache.dtype == jnp.int8 and cache.k_scales.shape == (1, HKV, 16, BS)
  assert cache.k_scales.sharding.is_equivalent_to(
      NamedSharding(mesh, ps.scales_spec()), 4)
  per_device = ps.per_device_cache_bytes(cache)
  assert sum(per_device.values()) == cache.nbytes  # scales counted
  # Every shard writes its own 12 tokens into blocks 0, 1 of its own pool.
  rng = np.random.default_rng(5)
  k = jnp.asarray(rng.standard_normal((data * 12, HKV, D), np.float32))
  slots = jnp.tile(jnp.arange(12, dtype=jnp.int32), data)
  layer = cache.layer(0)
  write = jax.jit(lambda kp, vp, kk, ks, vs, s: ps.write_kv_sharded(
      mesh, kp, vp, kk, kk, s, k_scales=ks, v_scales=vs))
  arrays = write(layer["k_pages"], layer["v_pages"], k, layer["k_scales"],
                 layer["v_scales"], slots)
  cache = cache.set_layer(0, *arrays)
  src = np.array([[1], [1]], np.int32)
  dst = np.array([[2], [2]], np.int32)
  cache = jax.jit(lambda c, s, d: ps.copy_blocks_sharded(mesh, c, s, d))(
      cache, src, dst)
  assert cache.k_scales.sharding.is_equivalent_to(
      NamedSharding(mesh, ps.scales_spec()), 4)
  np.testing.assert_array_equal(np.asarray(cache.k_scales[0, :, 2]),
                                np.asarray(cache.k_scales[0, :, 1]))
  np.testing.assert_array_equal(np.asarray(cache.k_scales[0, :, 10]),
                                np.asarray(cache.k_scales[0, :, 9]))  # shard 1
  q = jnp.asarray(rng.standard_normal((data * SEQS, HQ, D), np.float32))
  tables = jnp.tile(jnp.array([[0, 1, -1, -1], [0, 2, -1, -1]], jnp.int32),
                    (data, 1))
  lens = jnp.tile(jnp.array([12, 10], jnp.int32), data)
  layer = cache.layer(0)
  out = jax.jit(lambda *a: ps.sharded_paged_attention(
      mesh, *a[:5], k_scales=a[5], v_scales=a[6]))(
          q, layer["k_pages"], layer["v_pages"], tables, lens,
          layer["k_scales"], layer["v_scales"])
  nb = 8
  for i in range(data):
    pool = slice(i * nb, (i + 1) * nb)
    ref = reference.paged_attention_reference(
        q[i * SEQS:(i + 1) * SEQS], layer["k_pages"][:, pool],
        layer["v_pages"][:, pool], tables[:SEQS], lens[:SEQS],
        k_scales=layer["k_scales"][:, pool], v_scales=layer["v_scales"][:, pool])
    cases.assert_rows_close(out[i * SEQS:(i + 1) * SEQS], ref, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_layer_write_on_a_mesh_equals_the_one_device_write(dtype):
  """`write_kv_layer_sharded` (each device scatters into its part of the
  stacked pages, in place) writes what `kv_cache.write_kv_layer` writes on
  one device: local slots per data shard, heads over `model`, only the
  layer given, scales too for quantised pages."""
  from paged_jax import kv_cache  # pylint: disable=import-outside-toplevel
  mesh = ps.make_mesh(data=2, model=2)
  layers, heads, blocks, bs, d = 3, 2, 4, 4, 8  # blocks per data shard
  cache = ps.create_cache(mesh, num_layers=layers, num_kv_heads=heads,
                          num_blocks_per_shard=blocks, block_size=bs,
                          head_dim=d, dtype=dtype)
  rng = np.random.default_rng(0)
  t = 6  # token rows per data shard
  k = jnp.asarray(rng.normal(size=(2 * t, heads, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2 * t, heads, d)), jnp.float32)
  local = np.array([0, 5, 9, -1, 15, 3] * 2, np.int32)  # -1: dropped
  # Jitted, as the engine's step calls it (eagerly, each op of the shard_map
  # body compiled on its own: ~100 programs for the quantised pages).
  write = jax.jit(ps.write_kv_layer_sharded, static_argnums=(0, 6))
  got = write(mesh, *cache.arrays()[:2], k, v, local, 1, **_scales(cache))
  # One device: shard i's pool is blocks [i * blocks, (i + 1) * blocks).
  flat = np.where(local >= 0, local + np.repeat([0, blocks * bs], t), -1)
  one = jax.tree.map(lambda a: jax.device_put(np.asarray(a), jax.devices()[0]), cache)
  want = kv_cache.write_kv_layer(*one.arrays()[:2], k, v, jnp.asarray(flat), 1,
                                 **_scales(one))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, ps.cache_spec()), 5)


def _scales(cache):
  return ({} if not cache.quantized
          else dict(k_scales=cache.k_scales, v_scales=cache.v_scales))
