"""The scheduler's NumPy model of a pool (`host_pool.HostPool`) against the
block manager it models: a hypothesis state machine runs the same random
operations (valid and invalid ids, repeats, negative sizes, forks and
copy-on-write, registration, hits, evictions, ring compaction) on both and
checks after every step that every array of the state, every result and the
fingerprint are exactly equal; trials that are rolled back leave the model
exactly as it was."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_jax import block_manager as bm
from paged_jax.serving import step as step_lib
from paged_jax.serving.host_pool import HostPool

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, WIDTH = 10, 2, 6, 5
N = 4  # rows per call (padded with -1)

_reserve = jax.jit(bm.reserve)
_release = jax.jit(bm.release)
_fork = jax.jit(bm.fork)
_register = jax.jit(bm.register)
_share = jax.jit(bm.share)
_fingerprint = jax.jit(step_lib.state_fingerprint)
_bookkeeping = jax.jit(functools.partial(step_lib.bookkeeping))

ids = st.lists(st.integers(-1, MAX_SEQS), min_size=0, max_size=N)


def _pad(values, fill=-1, n=N):
  out = np.full(n, fill, np.int32)
  values = list(values)[:n]
  out[:len(values)] = values
  return out


def assert_same(pool: HostPool, state: bm.BlockState):
  for name, a, b in zip(
      ("block_tables", "seq_lens", "refcounts", "free_stack", "num_free",
       "cacheable", "lru", "lru_pos", "lru_head", "lru_len", "num_cached"),
      jax.tree.leaves(pool.to_state()), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  np.testing.assert_array_equal(pool.fingerprint(), np.asarray(_fingerprint(state)))


class PoolMachine(RuleBasedStateMachine):
  caching = False

  def __init__(self):
    super().__init__()
    self.state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH,
                         prefix_caching=self.caching)
    self.pool = HostPool(self.state)

  def _live(self):
    return np.flatnonzero(self.pool.lens > 0).tolist()

  @rule(seqs=ids, sizes=st.lists(st.integers(-1, 7), min_size=N, max_size=N),
        undo=st.booleans())
  def reserve_any(self, seqs, sizes, undo):
    self.reserve(seqs, sizes, undo)

  @rule(seqs=st.lists(st.integers(0, MAX_SEQS - 1), max_size=N, unique=True),
        sizes=st.lists(st.integers(0, 4), min_size=N, max_size=N),
        undo=st.booleans())
  def reserve_valid(self, seqs, sizes, undo):
    self.reserve(seqs, sizes, undo)

  def reserve(self, seqs, sizes, undo):
    x, q = _pad(seqs), np.array(sizes, np.int32)
    if undo:  # a refused trial leaves the model as it was
      self.pool.begin()
      self.pool.reserve(x, q)
      self.pool.rollback()
      assert_same(self.pool, self.state)
    self.pool.begin()
    got = self.pool.reserve(x, q)
    self.pool.commit()
    self.state, want = _reserve(self.state, x, q)
    self._same_reservation(got, want)

  def _same_reservation(self, got, want):
    np.testing.assert_array_equal(got.ok, want.ok)
    np.testing.assert_array_equal(got.copy_src, want.copy_src)
    np.testing.assert_array_equal(got.copy_dst, want.copy_dst)
    if self.caching:
      np.testing.assert_array_equal(got.evicted, want.evicted)

  @rule(data=st.data(), repeats=st.integers(1, 4), undo=st.booleans())
  def reserve_steady(self, data, repeats, undo):
    """The scheduler's steady decode steps: the same read-only arrays, one
    token for each of `leading` distinct live slots, again and again (what
    `HostPool.reserve` remembers of them, `SteadyDecode`)."""
    live = self._live()
    if not live:
      return
    seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=N,
                              unique=True))
    x, q = _pad(seqs), _pad([1] * len(seqs), 0)
    x.flags.writeable = q.flags.writeable = False
    for _ in range(repeats):
      if undo:
        self.pool.begin()
        self.pool.reserve(x, q, leading=len(seqs), decode=len(seqs))
        self.pool.rollback()
        assert_same(self.pool, self.state)
      self.pool.begin()
      got = self.pool.reserve(x, q, leading=len(seqs), decode=len(seqs))
      self.pool.commit()
      self.state, want = _reserve(self.state, x, q)
      self._same_reservation(got, want)
      assert_same(self.pool, self.state)

  @rule(data=st.data(), undo=st.booleans())
  def reserve_steady_then_others(self, data, undo):
    """A mixed step of the scheduler: its steady decode rows first (one
    token each, `decode`), often the same slots as the last such call (what
    `SteadyDecode` keeps across the other rules' releases, forks and
    hits), then other distinct slots with any sizes, in new arrays."""
    live = self._live()
    if not live:
      return
    last = [s for s in getattr(self, "steady_rows", []) if s in live]
    if last and data.draw(st.booleans()):
      seqs = last
    else:
      seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=N - 1,
                                unique=True))
    self.steady_rows = seqs
    others = data.draw(st.lists(st.integers(0, MAX_SEQS - 1).filter(
        lambda s: s not in seqs), max_size=N - len(seqs), unique=True))
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=len(others),
                               max_size=len(others)))
    x, q = _pad(seqs + others), _pad([1] * len(seqs) + sizes, 0)
    k = len(seqs) + len(others)
    if undo:
      self.pool.begin()
      self.pool.reserve(x.copy(), q.copy(), leading=k, decode=len(seqs))
      self.pool.rollback()
      assert_same(self.pool, self.state)
    self.pool.begin()
    got = self.pool.reserve(x.copy(), q.copy(), leading=k, decode=len(seqs))
    self.pool.commit()
    self.state, want = _reserve(self.state, x, q)
    self._same_reservation(got, want)
    assert_same(self.pool, self.state)

  @rule(seqs=ids)
  def release(self, seqs):
    x = _pad(seqs)
    got = self.pool.release(x)
    self.state, want = _release(self.state, x)
    np.testing.assert_array_equal(got, want)

  @rule(data=st.data())
  def release_live(self, data):
    live = self._live()
    if live:
      seqs = data.draw(st.lists(st.sampled_from(live), max_size=N, unique=True))
      self.release(seqs)

  @rule(parents=ids, children=ids, data=st.data())
  def fork(self, parents, children, data):
    live = self._live()
    if live and data.draw(st.booleans()):  # mostly valid forks
      free = [s for s in range(MAX_SEQS) if s not in live]
      children = data.draw(st.lists(st.sampled_from(free), max_size=N, unique=True)) if free else []
      parents = [data.draw(st.sampled_from(live)) for _ in children]
    k = min(len(parents), len(children))
    p, c = _pad(parents[:k]), _pad(children[:k])
    got = self.pool.fork(p, c)
    self.state, want = _fork(self.state, p, c)
    np.testing.assert_array_equal(got, want)

  @rule(data=st.data())
  def register(self, data):
    if not self.caching:
      return
    seqs = data.draw(ids)
    cols = data.draw(st.lists(st.integers(-1, WIDTH), min_size=len(seqs),
                              max_size=len(seqs)))
    live = self._live()
    if live and data.draw(st.booleans()):  # every full block of a live seq
      s = data.draw(st.sampled_from(live))
      full = int(self.pool.lens[s]) // BLOCK_SIZE
      seqs, cols = [s] * min(full, N), list(range(min(full, N)))
    x, c = _pad(seqs), _pad(cols, 0)
    # The scheduler's layout (entries first, then padding) takes the short path.
    leading = min(seqs, default=0) >= 0 and data.draw(st.booleans())
    got = self.pool.register(x, c, leading=leading)
    self.state, want = _register(self.state, x, c)
    np.testing.assert_array_equal(got, want)

  @rule(data=st.data())
  def share(self, data):
    if not self.caching:
      return
    cacheable = np.flatnonzero(self.pool.cacheable).tolist()
    free = np.flatnonzero(self.pool.lens == 0).tolist()
    valid = bool(cacheable and free) and data.draw(st.booleans())
    if valid:  # hits: empty slots on distinct cacheable blocks
      seqs = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=2,
                                unique=True))
    else:
      seqs = data.draw(ids)
    rows = np.full((N, WIDTH), -1, np.int32)
    counts = np.ones(N, np.int32)
    for i in range(len(seqs)):
      pick = data.draw(st.lists(st.sampled_from(cacheable or [0, 99]),
                                min_size=1, max_size=3, unique=valid))
      rows[i, :len(pick)] = pick
      counts[i] = (len(pick) if valid else
                   data.draw(st.integers(0, len(pick) + 1)))
    x = _pad(seqs)
    got = self.pool.share(x, rows, counts)
    self.state, want = _share(self.state, x, rows, counts)
    np.testing.assert_array_equal(got, want)

  @invariant()
  def same_state(self):
    assert_same(self.pool, self.state)


class CachingPoolMachine(PoolMachine):
  caching = True


_SETTINGS = hypothesis.settings(max_examples=40, stateful_step_count=50,
                                deadline=None, derandomize=True,
                                suppress_health_check=list(hypothesis.HealthCheck))
TestHostPool = PoolMachine.TestCase
TestHostPool.settings = _SETTINGS
TestCachingHostPool = CachingPoolMachine.TestCase
TestCachingHostPool.settings = _SETTINGS


@pytest.mark.parametrize("caching", [False, True])
def test_bookkeeping_matches_the_device_step(caching):
  """The whole step's bookkeeping (register -> ... -> reserve) on the model
  and on the device give the same state and results; so does the model told
  the scheduler's layout (`packed`: these inputs have it)."""
  rng = np.random.default_rng(0)
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=caching)
  pool = HostPool(state)
  packed = HostPool(state)
  r = N if caching else 0
  for _ in range(30):
    live = np.flatnonzero(pool.lens > 0)
    free = np.flatnonzero(pool.lens == 0)
    reg_s = _pad(rng.choice(live, min(len(live), 2)) if len(live) else [], n=r)
    reg_c = _pad(rng.integers(0, 2, size=min(len(live), 2)), 0, n=r)
    rel = _pad(rng.choice(live, min(len(live), 1)) if len(live) and rng.random() < 0.3
               else [], n=MAX_SEQS)
    k = min(len(live), len(free), 1) if rng.random() < 0.3 else 0
    fp, fc = _pad(rng.choice(live, k) if k else []), _pad(rng.choice(free, k) if k else [])
    share_s = np.full(r, -1, np.int32)
    share_b = np.full((r, WIDTH), -1, np.int32)
    share_c = np.zeros(r, np.int32)
    seq = _pad(rng.choice(MAX_SEQS, 3, replace=False))
    q = _pad(rng.integers(0, 5, 3), 0)
    args = (reg_s, reg_c, rel, fp, fc, _pad([], n=MAX_SEQS), share_s, share_b,
            share_c, seq, q)
    fork_ok, res, cache_ok = pool.bookkeeping(*args)
    got_packed = packed.bookkeeping(*args, packed=3)
    state, want_fork, want_res, want_cache = _bookkeeping(state, *args)
    for got_fork, got_res, got_cache in ((fork_ok, res, cache_ok), got_packed):
      np.testing.assert_array_equal(got_fork, want_fork)
      np.testing.assert_array_equal(got_res.ok, want_res.ok)
      np.testing.assert_array_equal(got_cache, want_cache)
    assert_same(pool, state)
    assert_same(packed, state)


@pytest.mark.parametrize("caching", [False, True])
def test_long_random_run_covers_evictions_copies_and_compaction(caching):
  """Thousands of mostly valid operations on a small pool, compared after
  each; the run must have copied on write, and with caching evicted, hit
  and compacted the ring (checked, so the comparison covers them)."""
  rng = np.random.default_rng(1)
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=caching)
  pool = HostPool(state)
  seen = dict(copies=0, evictions=0, hits=0)
  for _ in range(1500):
    live = np.flatnonzero(pool.lens > 0)
    free = np.flatnonzero(pool.lens == 0)
    op = rng.choice(["reserve", "release", "fork", "register", "share"],
                    p=[0.3, 0.15, 0.1, 0.15, 0.3])
    if op == "reserve":
      x = _pad(rng.choice(MAX_SEQS, rng.integers(1, N + 1), replace=False))
      q = rng.integers(0, 3, N).astype(np.int32)
      if rng.random() < 0.3:  # a refused trial, undone
        pool.begin()
        pool.reserve(x, q)
        pool.rollback()
      got = pool.reserve(x, q)
      state, want = _reserve(state, x, q)
      np.testing.assert_array_equal(got.ok, want.ok)
      np.testing.assert_array_equal(got.copy_dst, want.copy_dst)
      seen["copies"] += int(np.sum(got.copy_src >= 0))
      if caching:
        np.testing.assert_array_equal(got.evicted, want.evicted)
        seen["evictions"] += int(np.sum(got.evicted >= 0))
    elif op == "release" and len(live):
      x = _pad(rng.choice(live, min(len(live), rng.integers(1, 3)), replace=False))
      got = pool.release(x)
      state, want = _release(state, x)
      np.testing.assert_array_equal(got, want)
    elif op == "fork" and len(live) and len(free):
      k = min(len(free), 2)
      p, c = _pad(rng.choice(live, k)), _pad(rng.choice(free, k, replace=False))
      got = pool.fork(p, c)
      state, want = _fork(state, p, c)
      np.testing.assert_array_equal(got, want)
    elif op == "register" and caching and len(live):
      s = int(rng.choice(live))
      full = min(int(pool.lens[s]) // BLOCK_SIZE, N)
      x, c = _pad([s] * full), _pad(range(full), 0)
      got = pool.register(x, c)
      state, want = _register(state, x, c)
      np.testing.assert_array_equal(got, want)
    elif op == "share" and caching and len(free):
      cacheable = np.flatnonzero(pool.cacheable)
      if not len(cacheable):
        continue
      blocks = rng.choice(cacheable, min(len(cacheable), rng.integers(1, 3)),
                          replace=False)
      rows = np.full((N, WIDTH), -1, np.int32)
      rows[0, :len(blocks)] = blocks
      x = _pad([int(rng.choice(free))])
      counts = _pad([len(blocks)], 1)
      got = pool.share(x, rows, counts)
      state, want = _share(state, x, rows, counts)
      np.testing.assert_array_equal(got, want)
      seen["hits"] += int(got.sum())
    assert_same(pool, state)
  assert seen["copies"] > 0, seen
  if caching:
    assert seen["evictions"] > 0 and seen["hits"] > 0, seen


def test_ring_compaction_matches():
  """Hits from the middle of the ring leave tombstones until the ring must be
  compacted; the model compacts exactly as the device does."""
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=True)
  pool = HostPool(state)
  compactions = 0

  def both(op, jitted, *args):
    nonlocal state
    got = getattr(pool, op)(*args)
    state, want = jitted(state, *args)
    np.testing.assert_array_equal(getattr(got, "ok", got), getattr(want, "ok", want))
    assert_same(pool, state)

  both("reserve", _reserve, _pad([0]), _pad([2 * BLOCK_SIZE], 0))
  both("register", _register, _pad([0, 0]), _pad([0, 1], 0))
  both("release", _release, _pad([0]))  # two cached blocks: [b, a]
  _, b = bm.cached_blocks(state)
  rows = np.full((N, WIDTH), -1, np.int32)
  rows[0, 0] = b
  for _ in range(2 * NUM_BLOCKS):
    before = pool.lru_len
    both("share", _share, _pad([1]), rows, _pad([1], 1))  # a tombstone
    both("release", _release, _pad([1]))  # b back at the tail
    compactions += pool.lru_len < before
  assert compactions >= 1
