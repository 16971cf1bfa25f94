"""Copies between the device cache and host memory: a swap round trip is exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import host_tier as ht
from paged_jax import kv_offload
from paged_jax.kv_cache import KVCache, gather_kv
from paged_jax.xla_attention import paged_decode_xla

LAYERS, HEADS, Q_HEADS, BS, DIM, BLOCKS, HOST_BLOCKS = 2, 2, 4, 4, 8, 16, 10


def _ids(values):
  return jnp.asarray(np.asarray(values, np.int32).reshape(-1))


def _random_cache(rng, dtype):
  cache = KVCache.create(num_layers=LAYERS, num_kv_heads=HEADS,
                         num_blocks=BLOCKS, block_size=BS, head_dim=DIM,
                         dtype=dtype)
  shape = cache.k_pages.shape
  if cache.quantized:
    pages = lambda: jnp.asarray(rng.integers(-100, 100, shape), jnp.float32
                                ).astype(cache.dtype)
    scales = lambda: jnp.asarray(rng.uniform(0.01, 0.1, shape[:-1]), jnp.float32)
    return KVCache(pages(), pages(), scales(), scales())
  pages = lambda: jnp.asarray(rng.standard_normal(shape), dtype)
  return KVCache(pages(), pages())


def _poison(cache: KVCache, blocks, sharding=None) -> KVCache:
  """NaN in `blocks` of every array (int8 pages: -128, and NaN scales)."""
  blocks = np.asarray(blocks, np.int64)
  blocks = blocks[blocks >= 0]
  out = {}
  for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
    x = getattr(cache, name)
    if x is None:
      continue
    bad = -128 if jnp.issubdtype(x.dtype, jnp.integer) else np.nan
    y = np.array(jax.device_get(x).astype(np.float32))
    y[:, :, blocks] = bad
    out[name] = jax.device_put(jnp.asarray(y).astype(x.dtype),
                               sharding or x.sharding)
  return cache.replace(**out)


def _attend(cache, tables, lens, q):
  outs = []
  for layer in range(LAYERS):
    a = cache.layer(layer)
    outs.append(paged_decode_xla(q, a["k_pages"], a["v_pages"], tables, lens,
                                 sm_scale=DIM**-0.5, k_scales=a["k_scales"],
                                 v_scales=a["v_scales"]))
  return np.stack([np.asarray(o.astype(jnp.float32)) for o in outs])


def _contents(cache, tables, lens):
  out = []
  for layer in range(LAYERS):
    a = cache.layer(layer)
    for pages, scales in ((a["k_pages"], a["k_scales"]),
                          (a["v_pages"], a["v_scales"])):
      x = gather_kv(pages, tables, lens, BS * tables.shape[1], scales=scales)
      out.append(np.asarray(x.astype(jnp.float32)))
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_swap_round_trip_is_bit_identical(dtype):
  rng = np.random.default_rng(7)
  cache = _random_cache(rng, dtype)
  state = bm.init(num_blocks=BLOCKS, block_size=BS, max_seqs=5,
                  max_blocks_per_seq=4)
  state, _ = bm.reserve(state, _ids([0, 1, 2]), _ids([5, 11, 4]))
  state, _ = bm.fork(state, _ids([1]), _ids([3]))  # 3 shares 1's blocks
  seqs = _ids([0, 1, 3])
  q = jnp.asarray(rng.standard_normal((3, Q_HEADS, DIM)), jnp.float32)
  q = q.astype(cache.dtype if not cache.quantized else jnp.float32)
  tables, lens = bm.gather_tables(state, seqs)
  old_tables = np.asarray(tables)
  want = _attend(cache, tables, lens, q)
  want_kv = _contents(cache, tables, lens)

  tier = ht.init(state, num_host_blocks=HOST_BLOCKS)
  host = kv_offload.host_cache(cache, HOST_BLOCKS)
  host = _poison(host, np.arange(HOST_BLOCKS))  # unlisted host blocks: NaN
  assert host.k_pages.sharding.memory_kind == kv_offload.host_memory_kind()
  state, tier, out = ht.swap_out(state, tier, seqs)
  assert np.asarray(out.ok).all()
  src, dst, count = ht.pack_pairs(out.src, out.dst)
  assert int(count) == 2 + 3 + 3  # 3's shared blocks are copied too
  host = kv_offload.copy_to_host(cache, host, src, dst)
  assert host.k_pages.sharding.memory_kind == kv_offload.host_memory_kind()
  # Every device block moved away from is poisoned, and reused by another
  # sequence, so the swap-in must land elsewhere.
  moved = np.asarray(out.src).reshape(-1)
  cache = _poison(cache, moved)
  state, _ = bm.reserve(state, _ids([4]), _ids([BS * 4]))
  cache = _poison(cache, np.asarray(state.block_tables[4]))
  state, tier, back = ht.swap_in(state, tier, seqs)
  assert np.asarray(back.ok).all()
  src, dst, count = ht.pack_pairs(back.src, back.dst)
  cache = kv_offload.copy_to_device(cache, host, src[:8], dst[:8])
  ht.check_invariants(tier, state)
  tables, lens = bm.gather_tables(state, seqs)
  assert (np.asarray(tables) != old_tables).sum() >= 6  # mostly new blocks
  got = _attend(cache, tables, lens, q)
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(got, want)
  for g, w in zip(_contents(cache, tables, lens), want_kv):
    np.testing.assert_array_equal(g, w)


def test_memory_kinds_and_errors():
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  kind = kv_offload.host_memory_kind()
  assert kind == ("pinned_host" if "pinned_host" in kinds else
                  "unpinned_host" if "unpinned_host" in kinds else "device")
  cache = KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=4,
                         block_size=4, head_dim=8, dtype=jnp.float32)
  dev = kv_offload.host_cache(cache, 3, memory_kind="device")
  assert dev.num_blocks == 3 and dev.k_pages.sharding.memory_kind == (
      jax.devices()[0].default_memory().kind)
  with pytest.raises(ValueError, match="memory_kind must be one of"):
    kv_offload.host_cache(cache, 3, memory_kind="disk")
  other = KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=4,
                         block_size=4, head_dim=16, dtype=jnp.float32)
  with pytest.raises(ValueError, match="must match the device cache"):
    kv_offload.copy_to_host(cache, other, _ids([0]), _ids([0]))
  with pytest.raises(ValueError, match="src and dst must be 1-D of equal"):
    kv_offload.copy_to_device(cache, dev, _ids([0]), _ids([0, 1]))


@pytest.mark.parametrize("kind", [kv_offload.host_memory_kind(), "device"])
def test_copies_through_a_fresh_host_cache(kind):
  rng = np.random.default_rng(3)
  cache = _random_cache(rng, "float32")
  want = np.asarray(cache.k_pages[:, :, [3, 5]])
  host = kv_offload.host_cache(cache, 4, memory_kind=kind)
  host = kv_offload.copy_to_host(cache, host, _ids([3, 5, -1]), _ids([1, 0, 2]))
  np.testing.assert_array_equal(np.asarray(host.k_pages)[:, :, [1, 0]], want)
  assert not np.asarray(host.k_pages)[:, :, 2].any()  # the NULL pair: skipped
  cache = kv_offload.copy_to_device(cache, host, _ids([1, 0]), _ids([0, 9]))
  np.testing.assert_array_equal(np.asarray(cache.k_pages[:, :, 0]), want[:, :, 0])
