"""Block manager for speculative decoding: lookahead (`reserve(1 + k)`) and
rollback (`truncate`), model-based against the plain Python models of
`test_block_manager` and `test_prefix_block_manager` (forks, copy-on-write
and prefix caching in the mix), plus the rollback safety tests."""

from __future__ import annotations

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import rule

from paged_jax import attention
from paged_jax import block_manager as bm
from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK
from tests.paged_jax import test_block_manager as plain
from tests.paged_jax import test_prefix_block_manager as cached

_reserve = jax.jit(bm.reserve)
_release = jax.jit(bm.release)
_fork = jax.jit(bm.fork)
_register = jax.jit(bm.register)
_truncate = jax.jit(bm.truncate)
_i32 = cached._i32


def _cdiv(a, b):
  return -(-a // b)


# --- The models: `truncate` added to the plain Python ones. ---


class PlainModel(plain.PyModel):

  def truncate(self, sid, new_len, seen):
    if (not 0 <= sid < plain.MAX_SEQS or sid in seen or self.lens[sid] == 0
        or not 0 <= new_len <= self.lens[sid]):
      return False
    keep = _cdiv(new_len, plain.BLOCK_SIZE)
    for b in self.rows[sid][keep:]:
      self.refs[b] -= 1
    self.rows[sid] = self.rows[sid][:keep]
    self.lens[sid] = new_len
    return True


class CacheModel(cached.CacheModel):

  def truncate(self, sid, new_len, seen):
    bs = cached.BLOCK_SIZE
    if (not 0 <= sid < cached.MAX_SEQS or sid in seen or self.lens[sid] == 0
        or not 0 <= new_len <= self.lens[sid]):
      return False
    keep = _cdiv(new_len, bs)
    row = self.rows[sid]
    if new_len % bs and row[keep - 1] in self.cacheable:
      return False  # registered content would become a partial block
    for b in reversed(row[keep:]):  # released last block first, as `release`
      self.refs[b] -= 1
      if self.refs[b] == 0:
        (self.lru.append if b in self.cacheable else self.free.add)(b)
    self.rows[sid] = row[:keep]
    self.lens[sid] = new_len
    return True


class _SpecRules:
  """`truncate` and `speculate` rules shared by both machines (mixed into
  each module's machine; `self.model` has `truncate`)."""

  MAX_SEQS = SEQ_ID = NEW_LEN = None  # set by the subclasses

  @staticmethod
  def _ids(values):
    return _i32(values)

  def _apply_truncate(self, reqs):
    self.state, ok = _truncate(self.state, self._ids([r[0] for r in reqs]),
                               self._ids([r[1] for r in reqs]))
    seen, want = set(), []
    for sid, new_len in reqs:
      want.append(self.model.truncate(sid, new_len, seen))
      seen.add(sid)
    assert np.asarray(ok).tolist() == want, (reqs, ok, want)

  @rule(data=st.data())
  def truncate(self, data):
    """Live sequences to a length they have, mostly; sometimes anything."""
    live = [s for s in range(self.MAX_SEQS) if self.model.lens[s]] or [0]
    reqs = []
    for _ in range(data.draw(st.integers(0, 3))):
      sid = data.draw(st.one_of(st.sampled_from(live), st.sampled_from(live),
                                self.SEQ_ID))
      length = self.model.lens[sid] if 0 <= sid < self.MAX_SEQS else 0
      reqs.append((sid, data.draw(st.one_of(
          st.integers(0, length), st.integers(0, length), self.NEW_LEN))))
    self._apply_truncate(reqs)

  @rule(data=st.data())
  def speculate(self, data):
    """A verification step: live sequences reserve `1 + k` slots, then roll
    back to `1 + a` of them (`a <= k` drafts accepted). When every lookahead
    fits, the result has what `reserve(1 + a)` would have given."""
    live = [s for s in range(self.MAX_SEQS) if self.model.lens[s]]
    if not live:
      return
    sids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3,
                              unique=True))
    ks = [data.draw(st.integers(0, 4)) for _ in sids]
    accepted = [data.draw(st.integers(0, k)) for k in ks]
    old = [self.model.lens[s] for s in sids]
    before = self.state
    self.state, res = _reserve(self.state, _i32(sids), _i32([1 + k for k in ks]))
    self._check_reserve(list(zip(sids, [1 + k for k in ks])), res)
    oks = np.asarray(res.ok).tolist()
    self._apply_truncate([(s, n + 1 + a) for s, n, a, ok in zip(sids, old, accepted,
                                                          oks) if ok])
    if all(oks):
      alt, alt_res = _reserve(before, _i32(sids), _i32([1 + a for a in accepted]))
      assert alt_res.ok.tolist() == oks
      assert alt_res.copy_src.tolist() == res.copy_src.tolist()
      np.testing.assert_array_equal(alt.seq_lens, self.state.seq_lens)
      np.testing.assert_array_equal(np.sum(alt.block_tables >= 0, axis=1),
                                    np.sum(self.state.block_tables >= 0, axis=1))
      assert int(alt.num_available) == int(self.state.num_available)
      assert int(alt.num_used) == int(self.state.num_used)


class PlainSpecMachine(_SpecRules, plain.BlockManagerMachine):
  MAX_SEQS, SEQ_ID = plain.MAX_SEQS, plain.seq_id
  NEW_LEN = plain.count  # int32 / int64 extremes included
  _ids = staticmethod(plain._host)  # converted as an eager call converts them

  def __init__(self):
    super().__init__()
    self.model = PlainModel()

  def _check_reserve(self, reqs, res):
    tables = np.asarray(self.state.block_tables)
    seen = set()
    for i, (sid, n) in enumerate(reqs):
      ok, pair = self.model.reserve(sid, n, tables[sid], seen)
      seen.add(sid)
      assert bool(res.ok[i]) == ok, (reqs, i, res.ok)
      got = (int(res.copy_src[i]), int(res.copy_dst[i]))
      assert got == (pair or (NULL_BLOCK, NULL_BLOCK)), (reqs, i, got, pair)


class CacheSpecMachine(_SpecRules, cached.PrefixCacheMachine):
  MAX_SEQS, SEQ_ID = cached.MAX_SEQS, cached.seq_id
  NEW_LEN = st.integers(-2, cached.WIDTH * cached.BLOCK_SIZE + 2)

  def __init__(self):
    super().__init__()
    self.model = CacheModel()

  def _check_reserve(self, reqs, res):
    tables = np.asarray(self.state.block_tables)
    evicted = np.asarray(res.evicted)
    seen = set()
    for i, (sid, n) in enumerate(reqs):
      ok, pair, ev = self.model.reserve(sid, n, tables[sid], seen)
      seen.add(sid)
      assert bool(res.ok[i]) == ok, (reqs, i, res.ok)
      got = (int(res.copy_src[i]), int(res.copy_dst[i]))
      assert got == (pair or (NULL_BLOCK, NULL_BLOCK)), (reqs, i, got, pair)
      assert evicted[i][evicted[i] >= 0].tolist() == ev, (evicted[i], ev)


_SETTINGS = dict(stateful_step_count=30, deadline=None, derandomize=True,
                 suppress_health_check=list(hypothesis.HealthCheck))
TestPlainSpecModel = PlainSpecMachine.TestCase
TestPlainSpecModel.settings = hypothesis.settings(max_examples=25, **_SETTINGS)
TestCacheSpecModel = CacheSpecMachine.TestCase
TestCacheSpecModel.settings = hypothesis.settings(max_examples=25, **_SETTINGS)


# --- Examples. ---


def _plain_pool(num_blocks=8, block_size=4, max_seqs=3, width=4):
  return bm.init(num_blocks=num_blocks, block_size=block_size,
                 max_seqs=max_seqs, max_blocks_per_seq=width)


def test_lookahead_then_rollback_returns_the_rejected_blocks():
  state = _plain_pool()
  state, _ = _reserve(state, _i32([0]), _i32([6]))  # 2 blocks
  state, res = _reserve(state, _i32([0]), _i32([1 + 4]))  # lookahead k = 4
  assert res.ok.tolist() == [True] and int(state.num_free) == 5
  row = np.asarray(state.block_tables[0]).tolist()
  state, ok = _truncate(state, _i32([0]), _i32([6 + 1 + 1]))  # 1 accepted
  assert ok.tolist() == [True] and int(state.seq_lens[0]) == 8
  assert state.block_tables[0].tolist() == row[:2] + [NULL_BLOCK] * 2
  assert int(state.num_free) == 6
  bm.check_invariants(state)
  # Same length: a no-op that succeeds; to 0: the slot is empty again.
  before = state
  state, ok = _truncate(state, _i32([0]), _i32([8]))
  assert ok.tolist() == [True]
  chex.assert_trees_all_equal(before, state)
  state, ok = _truncate(state, _i32([0]), _i32([0]))
  assert ok.tolist() == [True] and int(state.num_free) == 8
  assert bm.usage(state)["live_seqs"] == 0
  bm.check_invariants(state)


def test_bad_truncations_are_refused_and_change_nothing():
  state = _plain_pool()
  state, _ = _reserve(state, _i32([0, 1]), _i32([6, 3]))
  before = state
  i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
  for ids, lens in [([0], [7]),            # above the current length
                    ([0], [-1]),           # below 0
                    ([2], [0]),            # an empty slot
                    ([3, -1], [0, 0]),     # out of range
                    (i64(2**32), i64(1)),  # int64 ids that would wrap to 0
                    (i64(0), i64(2**32 + 1))]:
    state, ok = bm.truncate(state, ids, lens)
    assert not any(ok.tolist()), (ids, lens)
    chex.assert_trees_all_equal(before, state)
  # A slot listed twice is served once.
  state, ok = _truncate(state, _i32([0, 0]), _i32([5, 1]))
  assert ok.tolist() == [True, False] and state.seq_lens.tolist() == [5, 3, 0]
  bm.check_invariants(state)


def test_rollback_below_a_fork_point_keeps_copy_on_write():
  """A fork shares two full blocks; the child's lookahead is rolled back
  below the fork point, into the shared second block. That block stays the
  parent's too (never freed), stays read-only, and the child's next write
  copies it first."""
  state = _plain_pool()
  state, _ = _reserve(state, _i32([0]), _i32([8]))
  shared = np.asarray(state.block_tables[0, :2]).tolist()
  state, _ = _fork(state, _i32([0]), _i32([1]))
  state, res = _reserve(state, _i32([1]), _i32([1 + 3]))  # a new block
  assert res.copy_src.tolist() == [NULL_BLOCK]
  state, ok = _truncate(state, _i32([1]), _i32([6]))
  assert ok.tolist() == [True]
  assert state.block_tables[1, :2].tolist() == shared
  assert np.asarray(state.refcounts)[shared].tolist() == [2, 2]
  assert bm.slot_mapping(state, _i32([1]), _i32([5])).tolist() == [-1]
  bm.check_invariants(state)
  state, res = _reserve(state, _i32([1]), _i32([1]))
  assert res.ok.tolist() == [True] and int(res.copy_src[0]) == shared[1]
  dst = int(res.copy_dst[0])
  assert dst not in shared and int(state.block_tables[1, 1]) == dst
  assert state.block_tables[0, :2].tolist() == shared  # parent untouched
  assert bm.slot_mapping(state, _i32([1]), _i32([6])).tolist() == [dst * 4 + 2]
  bm.check_invariants(state)


def test_siblings_rolling_back_a_shared_block_free_it_once():
  state = _plain_pool()
  state, _ = _reserve(state, _i32([0]), _i32([10]))  # 3 blocks
  state, _ = _fork(state, _i32([0]), _i32([1]))
  state, ok = _truncate(state, _i32([0, 1]), _i32([4, 5]))
  assert ok.tolist() == [True, True]
  assert int(state.num_free) == 6  # the third block: once, by both
  first = int(state.block_tables[0, 0])
  state, ok = _truncate(state, _i32([1]), _i32([0]))  # the sibling ends
  assert ok.tolist() == [True] and int(state.num_free) == 7
  assert state.block_tables[0].tolist() == [first] + [NULL_BLOCK] * 3
  assert int(state.refcounts[first]) == 1
  bm.check_invariants(state)


def test_rollback_never_frees_a_shared_block_nan_poisoned():
  """Sequences with forks and prefix-cache hits speculate and roll back;
  then every empty block of the pool is filled with NaN. Every live sequence
  still attends to exactly its own K/V (finite, equal to the reference): no
  block a sequence holds was freed by someone else's rollback."""
  rng = np.random.default_rng(0)
  kvh, qh, d, bs, n = 2, 4, 16, 4, 16
  state = bm.init(num_blocks=n, block_size=bs, max_seqs=6,
                  max_blocks_per_seq=5, prefix_caching=True)
  k = jnp.asarray(rng.standard_normal((kvh, n, bs, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((kvh, n, bs, d)), jnp.float32)
  state, a = cached._cached_seq(state, 0, 9)  # 2 registered blocks + 1
  state, ok = _fork(state, _i32([0, 0]), _i32([1, 2]))
  state, hit = bm.share(state, _i32([3]), jnp.array([a + [-1] * 3]), _i32([2]))
  assert ok.tolist() == [True, True] and hit.tolist() == [True]
  ids = _i32([0, 1, 2, 3])
  state, res = _reserve(state, ids, _i32([1 + 4, 1 + 2, 1 + 6, 1 + 3]))
  assert res.ok.tolist() == [True] * 4
  state, ok = _truncate(state, ids, _i32([10, 10, 9 + 1 + 0, 8 + 1 + 3]))
  assert ok.tolist() == [True] * 4
  state, ok = _truncate(state, _i32([2]), _i32([3]))  # below the fork point
  assert ok.tolist() == [False]  # would cut registered content
  state, ok = _truncate(state, _i32([2]), _i32([8]))
  assert ok.tolist() == [True]
  bm.check_invariants(state)
  free = np.asarray(state.free_stack)[:int(state.num_free)]
  assert len(free) > 0
  k = k.at[:, free].set(jnp.nan)
  v = v.at[:, free].set(jnp.nan)
  tables, lens = bm.gather_tables(state, ids)
  q = jnp.asarray(rng.standard_normal((4, qh, d)), jnp.float32)
  got = attention.paged_attention(q, k, v, tables, lens)
  want = reference.paged_attention_reference(q, k, v, tables, lens)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_truncate_and_the_prefix_cache():
  """Registered blocks dropped by a rollback are cached, not emptied; a
  rollback into registered content is refused; blocks past a rolled-back
  length cannot be registered."""
  state = cached._pool(num_blocks=8, block_size=2, max_seqs=3, width=4)
  state, a = cached._cached_seq(state, 0, 4)  # 2 registered blocks
  before = state
  state, ok = _truncate(state, _i32([0]), _i32([3]))  # inside a[1]
  assert ok.tolist() == [False]
  chex.assert_trees_all_equal(before, state)
  state, ok = _truncate(state, _i32([0]), _i32([2]))  # a[1] dropped whole
  assert ok.tolist() == [True] and bm.cached_blocks(state) == [a[1]]
  state, ok = bm.share(state, _i32([1]), jnp.array([a + [-1, -1]]), _i32([2]))
  assert ok.tolist() == [True]  # a hit on it still works
  bm.check_invariants(state)
  # A lookahead, then a rollback: only verified full blocks register.
  state, _ = _reserve(state, _i32([1]), _i32([1 + 3]))  # 4 verified, 1 + 3
  state, ok = _truncate(state, _i32([1]), _i32([4 + 1 + 0]))
  state, ok = _register(state, _i32([1, 1]), _i32([2, 3]))
  assert ok.tolist() == [False, False]
  bm.check_invariants(state)


def test_inside_the_lookahead_window_register_cannot_tell_drafts():
  """Why the protocol says truncate before register: between `reserve(1 +
  k)` and `truncate`, the draft slots count in `seq_lens`, and `register`
  accepts a block that they fill. Truncating before the next register (the
  same device step) keeps draft tokens out of the cache."""
  state = cached._pool(num_blocks=8, block_size=2, max_seqs=2, width=4)
  state, _ = _reserve(state, _i32([0]), _i32([2]))
  state, _ = _reserve(state, _i32([0]), _i32([1 + 3]))  # block 2 holds drafts
  _, ok = _register(state, _i32([0]), _i32([2]))
  assert ok.tolist() == [True]  # the window: the caller's protocol decides
  state, _ = _truncate(state, _i32([0]), _i32([2 + 1]))  # none accepted
  _, ok = _register(state, _i32([0]), _i32([2]))
  assert ok.tolist() == [False]


@pytest.mark.parametrize("caching", [False, True])
def test_a_speculative_step_compiles_once(caching):
  chex.clear_trace_counter()  # one count per parametrisation

  @chex.assert_max_traces(n=1)
  def step(state, ids, k, accepted, done):
    old = state.seq_lens[ids]
    state, res = bm.reserve(state, ids, 1 + k)
    state, ok = bm.truncate(state, ids, jnp.where(res.ok, old + 1 + accepted,
                                                  old))
    state, released = bm.release(state, done)
    return state, (res.ok, ok, released)

  step = jax.jit(step, donate_argnums=0)
  state = bm.init(num_blocks=32, block_size=4, max_seqs=8,
                  max_blocks_per_seq=6, prefix_caching=caching)
  rng = np.random.default_rng(0)
  for _ in range(60):
    ids = rng.permutation(8)[:4]
    k = rng.integers(0, 5, 4)
    args = [ids, k, rng.integers(0, k + 1), rng.integers(0, 16, 1)]
    state, _ = step(state, *[jnp.asarray(x, jnp.int32) for x in args])
  bm.check_invariants(state)


def test_truncate_never_scans_the_pool():
  n = 1009
  for caching in (False, True):
    state = bm.init(num_blocks=n, block_size=4, max_seqs=6,
                    max_blocks_per_seq=5, prefix_caching=caching)
    ids = jnp.zeros(3, jnp.int32)
    jaxpr = jax.make_jaxpr(bm.truncate)(state, ids, ids).jaxpr
    assert not cached._pool_wide_ops(jaxpr, (n, 2 * n), True), caching


def test_truncate_on_stacked_data_shards():
  one = _plain_pool()
  states = jax.tree.map(lambda x: jnp.stack([x, x]), one)
  col = lambda *v: jnp.array(v, jnp.int32)[:, None]  # noqa: E731
  states, _ = jax.vmap(bm.reserve)(states, col(0, 0), col(9, 5))
  states, ok = jax.vmap(bm.truncate)(states, col(0, 0), col(4, 5))
  assert ok.tolist() == [[True], [True]]
  assert states.seq_lens[:, 0].tolist() == [4, 5]
  assert states.num_free.tolist() == [7, 6]
  bm.check_invariants(states)


@pytest.mark.parametrize("jit", [False, True])
def test_truncate_accepts_an_empty_batch(jit):
  state = _plain_pool()
  state, _ = _reserve(state, _i32([0]), _i32([5]))
  none = jnp.zeros((0,), jnp.int32)
  after, ok = (jax.jit(bm.truncate) if jit else bm.truncate)(state, none, none)
  assert ok.shape == (0,)
  chex.assert_trees_all_equal(state, after)


def test_truncate_argument_errors():
  state = _plain_pool()
  with pytest.raises(ValueError, match=r"seq_ids and new_lens must have the "
                     r"same shape, got seq_ids.shape=\(2,\) and "
                     r"new_lens.shape=\(1,\)"):
    bm.truncate(state, jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match=r"new_lens must be a 1-D integer "
                     r"array, got shape \(1, 1\)"):
    bm.truncate(state, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="new_lens must have an integer dtype, "
                     "got float32"):
    bm.truncate(state, jnp.zeros((1,), jnp.int32), jnp.zeros((1,)))
