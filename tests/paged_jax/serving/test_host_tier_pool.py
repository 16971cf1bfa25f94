"""The scheduler's NumPy model of the host tier (`host_tier_pool.HostTierPool`,
with `host_pool.HostPool` for the device pool) against `host_tier` and
`block_manager`: a hypothesis state machine runs the same random operations
(swap-outs and swap-ins of live, empty, swapped and out-of-range slots,
repeats, a host pool too small, forks so that shared blocks are swapped,
prefix caching so that swap-ins evict cached blocks, drops, trials rolled
back) on both and checks after every step that both pools' arrays, the
results and the fingerprints are exactly equal and every invariant holds.
Then the whole step's bookkeeping with swaps (`swap_step.bookkeeping`)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_jax import block_manager as bm
from paged_jax import host_tier
from paged_jax import kv_offload
from paged_jax.kv_cache import KVCache
from paged_jax.serving import swap_step
from paged_jax.serving.host_pool import HostPool
from paged_jax.serving.host_tier_pool import HostTierPool

NUM_BLOCKS, NUM_HOST, BLOCK_SIZE, MAX_SEQS, WIDTH = 8, 6, 2, 5, 4
N = 3  # rows per call (padded with -1)

_reserve = jax.jit(bm.reserve)
_release = jax.jit(bm.release)
_fork = jax.jit(bm.fork)
_register = jax.jit(bm.register)
_swap_out = jax.jit(host_tier.swap_out)
_swap_in = jax.jit(host_tier.swap_in)
_drop = jax.jit(host_tier.drop)
_tier_fp = jax.jit(swap_step.tier_fingerprint)
_bookkeeping = jax.jit(swap_step.bookkeeping)

ids = st.lists(st.integers(-1, MAX_SEQS), min_size=0, max_size=N)


def _pad(values, fill=-1, n=N):
  out = np.full(n, fill, np.int32)
  values = list(values)[:n]
  out[:len(values)] = values
  return out


def assert_same(pool, tiers, state, tier):
  for a, b in zip(jax.tree.leaves(pool.to_state()), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for name, a, b in zip(("tables", "seq_lens", "free_stack", "num_free"),
                        jax.tree.leaves(tiers.to_tier()), jax.tree.leaves(tier)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  np.testing.assert_array_equal(tiers.fingerprint(), np.asarray(_tier_fp(tier)))


def assert_swap(got, want):
  np.testing.assert_array_equal(got.ok, want.ok)
  np.testing.assert_array_equal(got.src, want.src)
  np.testing.assert_array_equal(got.dst, want.dst)
  if want.evicted is None:
    assert got.evicted is None
  else:
    np.testing.assert_array_equal(got.evicted, want.evicted)


class TierMachine(RuleBasedStateMachine):
  caching = False

  def __init__(self):
    super().__init__()
    self.state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH,
                         prefix_caching=self.caching)
    self.tier = host_tier.init(self.state, num_host_blocks=NUM_HOST)
    self.pool, self.tiers = HostPool(self.state), HostTierPool(self.tier)

  def _live(self):
    return np.flatnonzero(self.pool.lens > 0).tolist()

  def _pick(self, data, choices):
    if choices and data.draw(st.booleans()):  # mostly meaningful ids
      return data.draw(st.lists(st.sampled_from(choices), max_size=N, unique=True))
    return data.draw(ids)

  @rule(seqs=st.lists(st.integers(0, MAX_SEQS - 1), max_size=N, unique=True),
        sizes=st.lists(st.integers(0, 4), min_size=N, max_size=N))
  def reserve(self, seqs, sizes):
    x, q = _pad(seqs), np.array(sizes, np.int32)
    x = np.where(self.tiers.lens[np.maximum(x, 0)] > 0, -1, x)  # slot kept
    got = self.pool.reserve(x, q)
    self.state, want = _reserve(self.state, x, q)
    np.testing.assert_array_equal(got.ok, want.ok)

  @rule(data=st.data())
  def release(self, data):
    x = _pad(self._pick(data, self._live()))
    np.testing.assert_array_equal(self.pool.release(x),
                                  _release(self.state, x)[1])
    self.state = _release(self.state, x)[0]

  @rule(data=st.data())
  def fork(self, data):
    live = self._live()
    free = [s for s in range(MAX_SEQS)
            if s not in live and self.tiers.lens[s] == 0]
    if live and free:
      c = data.draw(st.sampled_from(free))
      p, c = _pad([data.draw(st.sampled_from(live))]), _pad([c])
      got = self.pool.fork(p, c)
      self.state, want = _fork(self.state, p, c)
      np.testing.assert_array_equal(got, want)

  @rule(data=st.data())
  def register(self, data):
    live = self._live()
    if self.caching and live:
      s = data.draw(st.sampled_from(live))
      full = min(int(self.pool.lens[s]) // BLOCK_SIZE, N)
      x, c = _pad([s] * full), _pad(range(full), 0)
      got = self.pool.register(x, c)
      self.state, want = _register(self.state, x, c)
      np.testing.assert_array_equal(got, want)

  def _trial(self, op, x):
    """A trial rolled back leaves both models as they were."""
    self.pool.begin()
    self.tiers.begin()
    op(self.pool, x)
    self.tiers.rollback()
    self.pool.rollback()
    assert_same(self.pool, self.tiers, self.state, self.tier)

  @rule(data=st.data(), undo=st.booleans())
  def swap_out(self, data, undo):
    x = _pad(self._pick(data, self._live()))
    if undo:
      self._trial(self.tiers.swap_out, x)
    got = self.tiers.swap_out(self.pool, x)
    self.state, self.tier, want = _swap_out(self.state, self.tier, x)
    assert_swap(got, want)

  @rule(data=st.data(), undo=st.booleans())
  def swap_in(self, data, undo):
    x = _pad(self._pick(data, self.tiers.swapped.tolist()))
    if undo:
      self._trial(self.tiers.swap_in, x)
    got = self.tiers.swap_in(self.pool, x)
    self.state, self.tier, want = _swap_in(self.state, self.tier, x)
    assert_swap(got, want)

  @rule(data=st.data())
  def drop(self, data):
    x = _pad(self._pick(data, self.tiers.swapped.tolist()))
    got = self.tiers.drop(x)
    self.tier, want = _drop(self.tier, x)
    np.testing.assert_array_equal(got, want)

  @invariant()
  def same_state(self):
    assert_same(self.pool, self.tiers, self.state, self.tier)
    host_tier.check_invariants(self.tier, self.state)


class CachingTierMachine(TierMachine):
  caching = True


_SETTINGS = hypothesis.settings(max_examples=25, stateful_step_count=30,
                                deadline=None, derandomize=True,
                                suppress_health_check=list(hypothesis.HealthCheck))
TestHostTierPool = TierMachine.TestCase
TestHostTierPool.settings = _SETTINGS
TestCachingHostTierPool = CachingTierMachine.TestCase
TestCachingHostTierPool.settings = _SETTINGS


@pytest.mark.parametrize("caching", [False, True])
def test_bookkeeping_with_swaps_matches_the_device(caching):
  """`swap_step.bookkeeping` (register -> release -> drop -> swap_out ->
  fork -> release -> share -> swap_in -> reserve) and the models'
  `bookkeeping` give the same states and results, steps without swaps
  included."""
  rng = np.random.default_rng(0)
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=caching)
  tier = host_tier.init(state, num_host_blocks=NUM_HOST)
  pool, tiers = HostPool(state), HostTierPool(tier)
  r = N if caching else 0
  moved = dropped = 0
  for _ in range(40):
    live = np.flatnonzero(pool.lens > 0)
    out_ids = _pad(rng.choice(live, min(len(live), 1)) if len(live)
                   and rng.random() < 0.4 else [])
    back = tiers.swapped
    in_ids = _pad(rng.choice(back, 1) if len(back) and rng.random() < 0.5 else [])
    gone = [s for s in back if s not in in_ids]
    drop_ids = _pad(rng.choice(gone, 1) if gone and rng.random() < 0.3 else [])
    empty = [s for s in range(MAX_SEQS) if pool.lens[s] == 0
             and tiers.lens[s] == 0 and s not in in_ids]
    seqs = _pad(rng.choice(empty, min(len(empty), 1)).tolist()
                + [s for s in live if s not in out_ids][:N - 1])
    args = (_pad(live[:r], n=r), _pad([0] * min(len(live), r), 0, n=r),
            _pad([], n=MAX_SEQS), _pad([]), _pad([]), _pad([], n=MAX_SEQS),
            _pad([], n=r), np.full((r, WIDTH), -1, np.int32),
            np.ones(r, np.int32), seqs,
            rng.integers(1, 4, size=N).astype(np.int32), out_ids, in_ids, drop_ids)
    fork_ok, res, cache_ok, got_out, got_back = tiers.bookkeeping(pool, *args)
    state, tier, want_fork, want_res, want_cache, want_out, want_back = (
        _bookkeeping(state, tier, *args))
    np.testing.assert_array_equal(fork_ok, want_fork)
    np.testing.assert_array_equal(res.ok, want_res.ok)
    np.testing.assert_array_equal(cache_ok, want_cache)
    assert_swap(got_out, want_out)
    assert_swap(got_back, want_back)
    moved += int(np.sum(want_out.ok)) + int(np.sum(want_back.ok))
    dropped += int(np.sum(drop_ids >= 0))
    assert_same(pool, tiers, state, tier)
    host_tier.check_invariants(tier, state)
  assert moved >= 4 and dropped >= 1  # the run did swap both ways, and drop


def test_copies_round_trip_through_a_step_that_reuses_the_blocks():
  """A sequence swapped out in one step and back in a later one gets its
  K/V back exactly, although a second sequence swapped out and another
  swapped in by the same step took its freed device blocks (copies
  dispatched with the host model's pairs before the step; the blocks left
  free are NaN-poisoned, as a reused block would be)."""
  layers, heads, dim = 2, 2, 4
  rng = np.random.default_rng(1)
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH)
  tier = host_tier.init(state, num_host_blocks=NUM_HOST)
  pool, tiers = HostPool(state), HostTierPool(tier)
  shape = (layers, heads, NUM_BLOCKS, BLOCK_SIZE, dim)
  cache = KVCache(jnp.asarray(rng.standard_normal(shape), jnp.float32),
                  jnp.asarray(rng.standard_normal(shape), jnp.float32))
  host = kv_offload.host_cache(cache, NUM_HOST)

  def bookkeeping(out_ids=(), in_ids=(), seqs=(), q=()):
    args = (_pad([], n=0), _pad([], n=0), _pad([], n=MAX_SEQS), _pad([]),
            _pad([]), _pad([], n=MAX_SEQS), _pad([], n=0),
            np.zeros((0, WIDTH), np.int32), np.ones(0, np.int32), _pad(seqs),
            _pad(q, 0), _pad(out_ids), _pad(in_ids))
    nonlocal state, tier, cache, host
    *_, out, back = tiers.bookkeeping(pool, *args)
    cache, host, _ = swap_step.dispatch_copies(cache, host, out, back)
    state, tier, *_ = _bookkeeping(state, tier, *args)
    assert_same(pool, tiers, state, tier)
    return out, back

  def k_of(s, n):
    return np.asarray(cache.k_pages)[:, :, np.asarray(state.block_tables[s, :n])]

  bookkeeping(seqs=[0, 1], q=[5, 3])  # 3 + 2 of the 8 blocks
  keep = {0: k_of(0, 3), 1: k_of(1, 2)}
  out, _ = bookkeeping(out_ids=[0])
  assert out.ok[0]
  # Every free device block is NaN from here: what comes back is the host's.
  free = np.asarray(pool.stack[:pool.num_free])
  poisoned = np.asarray(cache.k_pages).copy()
  poisoned[:, :, free] = np.nan
  cache = cache.replace(k_pages=jnp.asarray(poisoned))
  # 1 swaps out, 0 swaps in, 2 grows: one step, the freed blocks reused.
  out, back = bookkeeping(out_ids=[1], in_ids=[0], seqs=[2], q=[6])
  assert out.ok[0] and back.ok[0]
  assert set(back.dst[0, :3].tolist()) & set(out.src[0, :2].tolist())
  np.testing.assert_array_equal(k_of(0, 3), keep[0])
  _, back = bookkeeping(in_ids=[1])
  assert back.ok[0]
  np.testing.assert_array_equal(k_of(1, 2), keep[1])
  host_tier.check_invariants(tier, state)
