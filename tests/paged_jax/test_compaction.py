"""Compaction and resize: random fragmentations, NaN in every block moved away
from, the same K/V and attention after."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import compaction
from paged_jax import prefix_cache
from paged_jax.kv_cache import KVCache, copy_blocks, gather_kv
from paged_jax.xla_attention import paged_decode_xla

NUM_BLOCKS, BS, MAX_SEQS, WIDTH, HEADS, DIM = 24, 4, 8, 4, 2, 8

_ops = {name: jax.jit(getattr(bm, name)) for name in
        ("reserve", "release", "fork", "register")}
_compact = jax.jit(compaction.compact)
_copy = jax.jit(copy_blocks)


def _ids(values):
  return jnp.asarray(np.asarray(values, np.int32).reshape(-1))


seq = st.integers(0, MAX_SEQS - 1)
op = st.one_of(
    st.tuples(st.just("reserve"), seq, st.integers(1, 16)),
    st.tuples(st.just("reserve"), seq, st.integers(1, 16)),
    st.tuples(st.just("release"), seq, st.just(0)),
    st.tuples(st.just("fork"), seq, seq),
    st.tuples(st.just("register"), seq, st.integers(0, WIDTH - 1)))


def _slots(ids, values=None):
  """`ids` (and their `values`) padded to `MAX_SEQS` entries with id -1 (an
  entry that fails and changes nothing), so that each op compiles one batch
  shape, not one per example's batch size."""
  pad = MAX_SEQS - len(ids)
  out = (_ids(np.pad(np.asarray(ids, np.int32), (0, pad), constant_values=-1)),)
  if values is not None:
    out += (_ids(np.pad(np.asarray(values, np.int32), (0, pad))),)
  return out


def _fragment(lengths, ops, dropped, prefix_caching):
  """A pool filled by `lengths`, then `ops`, then the slots in `dropped`
  released: holes wherever they fall."""
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BS, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=prefix_caching)
  state, _ = _ops["reserve"](state, *_slots(range(len(lengths)), lengths))
  if prefix_caching:  # some full blocks registered before the releases
    for col in range(2):
      state, _ = _ops["register"](state, _ids(range(MAX_SEQS)),
                                  _ids([col] * MAX_SEQS))
  for name, a, b in ops:
    if name == "register" and not prefix_caching:
      continue
    args = (_ids([a]),) if name == "release" else (_ids([a]), _ids([b]))
    state, _ = _ops[name](state, *args)
  state, _ = _ops["release"](state, *_slots(np.nonzero(dropped)[0]))
  return state


def _poison(cache: KVCache, blocks) -> KVCache:
  blocks = np.asarray(blocks, np.int64)
  blocks = blocks[blocks >= 0]
  def bad(x):
    y = np.array(x)
    y[:, :, blocks] = np.nan
    return jnp.asarray(y)
  return cache.replace(k_pages=bad(cache.k_pages), v_pages=bad(cache.v_pages))


def _read(cache, state, q):
  """Every slot's K/V (contiguous) and its attention output."""
  tables, lens = bm.gather_tables(state, _ids(range(MAX_SEQS)))
  kv = [np.asarray(gather_kv(p[0], tables, lens, WIDTH * BS))
        for p in (cache.k_pages, cache.v_pages)]
  out = paged_decode_xla(q, cache.k_pages[0], cache.v_pages[0], tables, lens,
                         sm_scale=DIM**-0.5)
  return kv, np.asarray(out)


def _kv_np(cache, state):
  """Every slot's blocks' K and V, read on the host (any pool size)."""
  tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
  k, v = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
  return [(k[:, :, row[:-(-n // BS)]], v[:, :, row[:-(-n // BS)]])
          for row, n in zip(tables, lens)]


def _same(a, b):
  for (ka, va), (kb, vb) in zip(a, b):
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(va, vb)


def _cached_contents(cache, state, blocks):
  return np.asarray(cache.k_pages[:, :, np.asarray(blocks, np.int64)])


_FRAGMENTATIONS = dict(
    lengths=st.lists(st.integers(0, WIDTH * BS), min_size=MAX_SEQS // 2,
                     max_size=MAX_SEQS),
    ops=st.lists(op, max_size=8),
    dropped=st.lists(st.booleans(), min_size=MAX_SEQS, max_size=MAX_SEQS),
    prefix_caching=st.booleans())


def _settings(examples):
  return hypothesis.settings(max_examples=examples, deadline=None,
                             derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))


@_settings(12)
@hypothesis.given(**_FRAGMENTATIONS)
def test_compact_keeps_every_sequence_and_cached_block(**kw):
  _check_compaction(**kw)


@pytest.mark.slow
@_settings(400)
@hypothesis.given(**_FRAGMENTATIONS)
def test_compact_keeps_every_sequence_and_cached_block_long(**kw):
  _check_compaction(**kw)


def _check_compaction(lengths, ops, dropped, prefix_caching):
  state = _fragment(lengths, ops, dropped, prefix_caching)
  rng = np.random.default_rng(len(ops))
  shape = (1, HEADS, NUM_BLOCKS, BS, DIM)
  cache = KVCache(jnp.asarray(rng.standard_normal(shape), jnp.float32),
                  jnp.asarray(rng.standard_normal(shape), jnp.float32))
  q = jnp.asarray(rng.standard_normal((MAX_SEQS, 2 * HEADS, DIM)), jnp.float32)
  kv, out = _read(cache, state, q)
  kv_np = _kv_np(cache, state)
  cached = bm.cached_blocks(state)
  cached_kv = _cached_contents(cache, state, cached)
  index = prefix_cache.PrefixIndex(BS)
  if prefix_caching:  # every cacheable block indexed under some hash
    for b in np.nonzero(np.asarray(state.cacheable))[0].tolist():
      assert index.insert(b.to_bytes(4, "little"), b)

  new, moves = _compact(state)
  bm.check_invariants(new)
  k = int(state.num_used) + (int(state.num_cached) if prefix_caching else 0)
  m = int(moves.num_moves)
  src, dst = np.asarray(moves.src), np.asarray(moves.dst)
  assert np.all(src[:m] >= k) and np.all((dst[:m] >= 0) & (dst[:m] < k))
  assert np.all(src[m:] == -1) and np.all(dst[m:] == -1)
  refs = np.asarray(new.refcounts)
  assert np.all(refs[k:] == 0) and int(new.num_free) == NUM_BLOCKS - k
  assert np.asarray(new.seq_lens).tolist() == np.asarray(state.seq_lens).tolist()
  cache = _copy(cache, moves.src, moves.dst)
  cache = _poison(cache, np.concatenate([src[:m], np.arange(k, NUM_BLOCKS)]))
  kv2, out2 = _read(cache, new, q)
  for a, b in zip(kv2, kv):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(out2, out)
  new_ids = np.asarray(moves.new_ids)
  assert bm.cached_blocks(new) == [int(new_ids[b]) for b in cached]
  np.testing.assert_array_equal(
      _cached_contents(cache, new, bm.cached_blocks(new)), cached_kv)
  if prefix_caching:
    index.relabel(new_ids)
    prefix_cache.check_consistent(index, new)

  # Shrink to exactly what is kept, then past it, then grow.
  small, res = compaction.resize(new, max(k, 1))
  assert res.ok and res.evicted.size == 0
  bm.check_invariants(small)
  cache = compaction.resize_cache(cache, max(k, 1))
  _same(_kv_np(cache, small), kv_np)
  if k > 1:
    _check_shrink_past_kept(small, k - 1)
  big, res = compaction.resize(small, NUM_BLOCKS + 3)
  assert res.ok
  bm.check_invariants(big)
  used = int(big.num_used)
  assert int(big.num_available) == NUM_BLOCKS + 3 - used
  cache = compaction.resize_cache(cache, NUM_BLOCKS + 3)
  _same(_kv_np(cache, big), kv_np)


def _check_shrink_past_kept(state, m):
  """Block `m` (the last kept one) is live: refused, state unchanged; or
  cached: evicted."""
  live = int(state.refcounts[m]) > 0
  out, res = compaction.resize(state, m)
  if live:
    assert not res.ok and out is state
  else:
    assert res.ok and res.evicted.tolist() == [m]
    bm.check_invariants(out)
    assert m not in bm.cached_blocks(out)


def test_grow_hands_out_the_new_blocks_after_the_free_ones():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=8)
  state, _ = bm.reserve(state, _ids([0]), _ids([8]))  # blocks 0, 1
  state, res = compaction.resize(state, 6)
  assert res.ok and int(state.num_free) == 4
  state, r = bm.reserve(state, _ids([1]), _ids([16]))
  assert bool(r.ok[0])
  assert np.asarray(state.block_tables[1, :4]).tolist() == [2, 3, 4, 5]
  bm.check_invariants(state)


def test_compact_an_empty_and_a_full_pool_moves_nothing():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=4)
  new, moves = compaction.compact(state)
  assert int(moves.num_moves) == 0 and int(new.num_free) == 4
  state, _ = bm.reserve(state, _ids([0]), _ids([16]))
  new, moves = compaction.compact(state)
  assert int(moves.num_moves) == 0
  assert np.asarray(new.block_tables).tolist() == np.asarray(
      state.block_tables).tolist()


def test_resize_errors():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=4)
  with pytest.raises(ValueError, match="new_num_blocks must be a positive"):
    compaction.resize(state, 0)
  with pytest.raises(ValueError, match="cache slots"):
    compaction.resize(state, 2**30)
  cache = KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=4,
                         block_size=4, head_dim=8)
  with pytest.raises(ValueError, match="new_num_blocks must be a positive"):
    compaction.resize_cache(cache, -1)
  index = prefix_cache.PrefixIndex(4)
  index.insert(b"x", 3)
  with pytest.raises(ValueError, match="have no new id"):
    index.relabel(np.array([0, 1, 2, -1]))


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("m", [6, 24])
def test_a_resized_state_can_be_donated(prefix_caching, m):
  """Every leaf of `resize`'s state is its own buffer, so a step that
  donates the state (the serving engine's) takes it (run eagerly, two
  leaves were one array: "donate the same buffer twice")."""
  state = bm.init(num_blocks=12, block_size=4, max_seqs=2, max_blocks_per_seq=4,
                  prefix_caching=prefix_caching)
  state, _ = bm.reserve(state, jnp.array([0, 1]), jnp.array([9, 5]))
  state, _ = compaction.compact(state)
  state, res = compaction.resize(state, m)
  assert res.ok
  leaves = jax.tree.leaves(state)
  ptrs = [a.unsafe_buffer_pointer() for a in leaves]
  assert len(set(ptrs)) == len(ptrs)
  jax.block_until_ready(jax.jit(lambda s: s, donate_argnums=0)(state))
