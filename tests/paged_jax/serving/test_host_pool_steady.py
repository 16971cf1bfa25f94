"""The host pool's steady decode path (`host_reserve.SteadyDecode`): the
scheduler's steady rows reserved without a scan, across block boundaries and
other operations, against the block manager (the helpers and sizes of
`test_host_pool`)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.serving.host_pool import HostPool
from tests.paged_jax.serving.test_host_pool import (MAX_SEQS, WIDTH, _fork, _pad,
                                                    _register, _release, _reserve,
                                                    _share, assert_same)


@pytest.mark.parametrize("caching", [False, True])
def test_steady_decode_reservations_add_one_token_within_the_last_blocks(caching):
  """Read-only one-token reservations of the same slots, repeated: those
  within every slot's last block take `HostPool._steady_step` (no block, no
  copy: only the lengths grow), the others the general path; the state
  equals the block manager's after each, and a fork (a shared last block
  must be copied) is taken into account."""
  bs = 4
  state = bm.init(num_blocks=16, block_size=bs, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=caching)
  pool = HostPool(state)
  fast = []
  step = pool._steady_step  # pylint: disable=protected-access
  pool._steady_step = lambda *a: fast.append(1) or step(*a)  # pylint: disable=protected-access
  x, q = _pad([0, 1]), _pad([1, 1], 0)
  x.flags.writeable = q.flags.writeable = False
  start = _pad([0, 1])
  pool.reserve(start, _pad([1, 3], 0))
  state, _ = _reserve(state, start, _pad([1, 3], 0))
  for i in range(10):
    if i == 5:  # slot 1's partial last block becomes shared
      pool.fork(_pad([1]), _pad([2]))
      state, _ = _fork(state, _pad([1]), _pad([2]))
    got = pool.reserve(x, q, leading=2, decode=2)
    state, want = _reserve(state, x, q)
    np.testing.assert_array_equal(got.ok, want.ok)
    np.testing.assert_array_equal(got.copy_src, want.copy_src)
    np.testing.assert_array_equal(got.copy_dst, want.copy_dst)
    assert_same(pool, state)
  assert 3 <= len(fast) < 10


@pytest.mark.parametrize("caching", [False, True])
def test_steady_decode_reservations_cross_block_boundaries_without_a_scan(caching):
  """Steady one-token reservations of slots at staggered lengths (one of
  them crosses a block boundary at most steps): each step whose crossing
  entries the free stack can serve takes `HostPool._steady_step`, not the
  general path (`_reserve`), and the pool equals the block manager's after
  every step, results included; once the free stack runs short (with
  caching: a cached block to evict) the general path evicts or refuses."""
  bs = 4
  state = bm.init(num_blocks=8, block_size=bs, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=caching)
  pool = HostPool(state)

  def both(op, jitted, *args):
    nonlocal state
    got = getattr(pool, op)(*args)
    state, want = jitted(state, *args)
    np.testing.assert_array_equal(getattr(got, "ok", got), getattr(want, "ok", want))

  both("reserve", _reserve, _pad([0, 1, 2]), _pad([1, 2, 3], 0))
  if caching:  # two cached blocks (slot 3's, registered, then released)
    both("reserve", _reserve, _pad([3]), _pad([2 * bs], 0))
    both("register", _register, _pad([3, 3]), _pad([0, 1], 0))
    both("release", _release, _pad([3]))
    assert pool.num_cached == 2
  general = []
  scan = pool._reserve  # pylint: disable=protected-access
  pool._reserve = lambda *a: general.append(1) or scan(*a)  # pylint: disable=protected-access
  x, q = _pad([0, 1, 2]), _pad([1, 1, 1], 0)
  x.flags.writeable = q.flags.writeable = False
  fast = evicted = 0
  steady = False  # whether the last step granted every entry (on any path)
  for _ in range(16):
    crossing = int(np.count_nonzero(pool.lens[:3] % bs == 0))
    served = crossing <= pool.num_free
    before = len(general)
    got = pool.reserve(x, q, leading=3, decode=3)
    state, want = _reserve(state, x, q)
    np.testing.assert_array_equal(got.ok, want.ok)
    np.testing.assert_array_equal(got.copy_src, want.copy_src)
    np.testing.assert_array_equal(got.copy_dst, want.copy_dst)
    if caching:
      np.testing.assert_array_equal(got.evicted, want.evicted)
      evicted += int((np.asarray(want.evicted) >= 0).sum())
    assert_same(pool, state)
    if steady and served:
      assert len(general) == before, "a steady step took the general path"
      fast += crossing > 0
    steady = bool(np.asarray(want.ok)[:3].all())
  assert fast >= 2  # crossings served without the scan
  assert not np.asarray(want.ok)[:3].all()  # the pool ran out: the general path refused
  if caching:
    assert evicted > 0


@pytest.mark.parametrize("caching", [False, True])
def test_steady_rows_kept_across_other_operations_match_the_block_manager(caching):
  """The scheduler's mixed steps: the same steady decode rows first (one
  token each, `decode`), other entries after them, in new arrays every
  step, between random releases, forks, general reservations (of steady
  slots too), registrations and hits. `HostPool` keeps its `SteadyDecode`
  across what leaves the rows steady and forgets it at what does not; the
  pool equals the block manager's after every operation, results included,
  and the steady path served many steps, crossings among them."""
  rng = np.random.default_rng(0)
  bs, num_blocks, max_seqs, width = 2, 40, 8, 16
  state = bm.init(num_blocks=num_blocks, block_size=bs, max_seqs=max_seqs,
                  max_blocks_per_seq=width, prefix_caching=caching)
  pool = HostPool(state)
  served = []
  step = pool._steady_step  # pylint: disable=protected-access

  def counted(steady):
    crossing = steady.bounds[steady.step % bs] < steady.bounds[steady.step % bs + 1]
    ok = step(steady)
    served.append((ok, crossing))
    return ok
  pool._steady_step = counted  # pylint: disable=protected-access

  def both(op, jitted, *args, **kw):
    nonlocal state
    got = getattr(pool, op)(*args, **kw)
    state, want = jitted(state, *args)
    for name in ("ok", "copy_src", "copy_dst") + (("evicted",) if caching and op == "reserve" else ()):
      np.testing.assert_array_equal(getattr(got, name, got), getattr(want, name, want),
                                    err_msg=f"{op} {name}")
    assert_same(pool, state)
    return got

  n = 4
  steady: list[int] = []
  for _ in range(500):
    live = np.flatnonzero(pool.lens > 0).tolist()
    free = [s for s in range(max_seqs) if s not in live]
    steady = [s for s in steady if s in live]
    if live and (not steady or rng.random() < 0.1):  # (new rows: the pool must see it)
      steady = rng.choice(live, min(len(live), int(rng.integers(1, 3))), replace=False).tolist()
    # Another operation's slot: a steady one half the time (then the rows
    # must be forgotten, or for a fork their shared last block copied).
    some = int(rng.choice(steady if steady and rng.random() < 0.5 else live or [0]))
    op = rng.random()
    if op < 0.45 and steady:  # a mixed step (the scheduler's layout)
      others = [s for s in rng.permutation(max_seqs).tolist() if s not in steady]
      others = others[:int(rng.integers(0, n - len(steady) + 1))]
      x = _pad(steady + others, n=n)
      q = _pad([1] * len(steady) + rng.integers(0, 4, len(others)).tolist(), 0, n=n)
      got = both("reserve", _reserve, x, q, leading=len(steady) + len(others),
                 decode=len(steady))
      if not got.ok[:len(steady)].all():
        steady = []
    elif op < 0.55:  # any reservation
      both("reserve", _reserve, _pad([some], n=n), _pad([int(rng.integers(0, 4))], 0, n=n))
    elif op < 0.7 and live:  # a release
      both("release", _release, _pad([some], n=n))
    elif op < 0.82 and live and free:  # a fork
      both("fork", _fork, _pad([some], n=n), _pad([free[0]], n=n))
    elif op < 0.9 and caching and live:  # a registration, then a hit
      full = int(pool.lens[some]) // bs
      if full:
        both("register", _register, _pad([some], n=n), _pad([int(rng.integers(0, full))], 0, n=n))
      cached = np.flatnonzero(pool.cacheable).tolist()
      if cached and free:
        rows = np.full((n, width), -1, np.int32)
        rows[0, 0] = cached[0]
        both("share", _share, _pad([free[0]], n=n), rows, _pad([1], 1, n=n))
    elif free:  # a new sequence
      both("reserve", _reserve, _pad([free[0]], n=n), _pad([int(rng.integers(1, 5))], 0, n=n))
  fast = [crossing for ok, crossing in served if ok]
  assert len(fast) >= 50 and sum(fast) >= 20, (len(fast), sum(fast))
