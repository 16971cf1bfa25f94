"""`paged_jax.window_reclaim`: the device reclamation against a plain-Python
model of what each sequence must keep, the host model (`HostPool`) equal to
the device state after every step, the invariants, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import window_reclaim
from paged_jax.serving import step as step_lib
from paged_jax.serving.host_pool import HostPool

BS, SEQS, WIDTH = 4, 6, 16


@jax.jit
def _device_step(state, release, parents, children, seq_ids, q_lens):
  """`step.bookkeeping` then `reclaim`, as `step.device_step` runs them."""
  empty = jnp.zeros((0,), jnp.int32)
  state, fork_ok, res, _ = step_lib.bookkeeping(
      state, empty, empty, release, parents, children, jnp.full_like(release, -1),
      empty, jnp.zeros((0, WIDTH), jnp.int32), empty, seq_ids, q_lens)
  state = window_reclaim.reclaim(state, seq_ids, q_lens, res.ok,
                                 max_new_tokens=12)
  return state, fork_ok, res.ok


def _assert_equal(pool: HostPool, state: bm.BlockState):
  for a, b in zip(jax.tree.leaves(pool.to_state()), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(pool.fingerprint(),
                                np.asarray(step_lib.state_fingerprint(state)))


@pytest.mark.parametrize("window, num_blocks, seed", [
    (1, 40, 0), (5, 24, 1), (8, 20, 2), (13, 30, 3), (9, 12, 4)])
def test_device_and_host_reclaim_alike_and_keep_the_window(window, num_blocks, seed):
  rng = np.random.default_rng(seed)
  state = bm.init(num_blocks=num_blocks, block_size=BS, max_seqs=SEQS,
                  max_blocks_per_seq=WIDTH, window=window)
  pool = HostPool(state)
  reclaimed_any = False
  for _ in range(25):
    lens = np.asarray(state.seq_lens)
    live = np.flatnonzero(lens > 0)
    release = np.full(SEQS, -1, np.int32)
    if live.size and rng.random() < 0.2:
      release[0] = rng.choice(live)
    parents = np.full(2, -1, np.int32)
    children = np.full(2, -1, np.int32)
    empty = np.flatnonzero(lens == 0)
    if live.size and empty.size and rng.random() < 0.3:
      parents[0], children[0] = rng.choice(live), rng.choice(empty)
    k = int(rng.integers(1, SEQS + 1))
    seq_ids = np.full(SEQS, -1, np.int32)
    seq_ids[:k] = rng.permutation(SEQS)[:k]
    q_lens = rng.integers(1, 13, size=SEQS).astype(np.int32)
    args = (release, parents, children, seq_ids, q_lens)
    fork_ok, res, _ = pool.bookkeeping(
        np.zeros(0, np.int32), np.zeros(0, np.int32), release, parents, children,
        np.full(SEQS, -1, np.int32), np.zeros(0, np.int32),
        np.zeros((0, WIDTH), np.int32), np.zeros(0, np.int32), seq_ids, q_lens)
    state, dev_fork_ok, ok = _device_step(state, *map(jnp.asarray, args))
    np.testing.assert_array_equal(res.ok, np.asarray(ok))
    np.testing.assert_array_equal(fork_ok, np.asarray(dev_fork_ok))
    _assert_equal(pool, state)
    bm.check_invariants(state)
    # The plain rule: each live sequence of L tokens holds exactly the
    # columns covering positions max(L - w + 1, 0) .. L - 1.
    tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
    for s in np.flatnonzero(lens > 0):
      first = max(int(lens[s]) - window + 1, 0) // BS
      held = np.flatnonzero(tables[s] >= 0)
      np.testing.assert_array_equal(held, np.arange(first, -(-int(lens[s]) // BS)))
      assert held.size <= -(-window // BS) + 1
      reclaimed_any |= first > 0
  assert reclaimed_any
  state, _ = bm.release(state, jnp.arange(SEQS))
  assert int(state.num_free) == num_blocks  # every block back


@jax.jit
def _caching_step(state, reg_seqs, reg_cols, release, share_seqs, share_blocks,
                  share_counts, seq_ids, q_lens):
  """`step.bookkeeping` with registrations and hits, then `reclaim`."""
  none = jnp.full((2,), -1, jnp.int32)
  state, _, res, cache_ok = step_lib.bookkeeping(
      state, reg_seqs, reg_cols, release, none, none, jnp.full_like(release, -1),
      share_seqs, share_blocks, share_counts, seq_ids, q_lens)
  state = window_reclaim.reclaim(state, seq_ids, q_lens, res.ok,
                                 max_new_tokens=12, deferred_columns=12 // BS + 1)
  return state, res.ok, cache_ok


@pytest.mark.parametrize("window, num_blocks, seed", [(9, 14, 6)])
def test_reclaimed_registered_blocks_are_cached_alike(window, num_blocks, seed):
  """With prefix caching, a registered block that slides out is cached (in
  the ring, in release order), an unregistered one emptied, a step's newly
  full blocks kept one step longer (`reclaim_stop`), on the device and in
  the host model alike; a registration of a reclaimed column is refused.
  A hit shares only the blocks of its last window (`window_reclaim.share`):
  the entries before it are ignored (here random, or -1 as the host sends
  them) and the table starts `NULL_BLOCK` there. Every block ends free or
  cached."""
  rng = np.random.default_rng(seed)
  state = bm.init(num_blocks=num_blocks, block_size=BS, max_seqs=SEQS,
                  max_blocks_per_seq=WIDTH, window=window, prefix_caching=True)
  pool = HostPool(state)
  cached_any = shared_any = False
  for _ in range(25):
    tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
    live = np.flatnonzero(lens > 0)
    reg_seqs = np.full(4, -1, np.int32)
    reg_cols = np.zeros(4, np.int32)
    full = [(s, c) for s in live for c in range(int(lens[s]) // BS) if tables[s, c] >= 0]
    for i, j in enumerate(rng.permutation(len(full))[:4]):
      reg_seqs[i], reg_cols[i] = full[j]
    release = np.full(SEQS, -1, np.int32)
    if live.size and rng.random() < 0.2:
      release[0] = rng.choice(live)
    k = int(rng.integers(1, SEQS + 1))
    seq_ids = np.full(SEQS, -1, np.int32)
    seq_ids[:k] = rng.permutation(SEQS)[:k]
    q_lens = rng.integers(1, 13, size=SEQS).astype(np.int32)
    none = np.full(2, -1, np.int32)
    share_seqs, share_counts = none.copy(), np.zeros(2, np.int32)
    share_blocks = rng.integers(-1, num_blocks, size=(2, WIDTH)).astype(np.int32)
    cacheable = np.flatnonzero(np.asarray(state.cacheable))
    empty = np.flatnonzero(lens == 0)
    if empty.size and cacheable.size and rng.random() < 0.5:
      n = int(rng.integers(1, 6))
      skip = int(bm.reclaimable_columns(window, n * BS, BS))
      if n - skip <= cacheable.size:
        share_seqs[0], share_counts[0] = rng.choice(empty), n
        share_blocks[0, skip:n] = rng.permutation(cacheable)[:n - skip]
        if rng.random() < 0.5:
          share_blocks[0, :skip] = -1
    _, res, cache_ok = pool.bookkeeping(
        reg_seqs, reg_cols, release, none, none, np.full(SEQS, -1, np.int32),
        share_seqs, share_blocks, share_counts, seq_ids, q_lens)
    state, ok, dev_cache_ok = _caching_step(state, *map(jnp.asarray, (
        reg_seqs, reg_cols, release, share_seqs, share_blocks, share_counts,
        seq_ids, q_lens)))
    np.testing.assert_array_equal(res.ok, np.asarray(ok))
    np.testing.assert_array_equal(cache_ok, np.asarray(dev_cache_ok))
    _assert_equal(pool, state)
    bm.check_invariants(state)
    if share_seqs[0] >= 0 and dev_cache_ok[4] and share_seqs[0] not in seq_ids:
      # the hit was taken (and the slot did not grow in the step)
      shared_any = True
      row = np.asarray(state.block_tables)[share_seqs[0]]
      skip = int(bm.reclaimable_columns(window, share_counts[0] * BS, BS))
      np.testing.assert_array_equal(row[skip:share_counts[0]],
                                    share_blocks[0, skip:share_counts[0]])
      assert np.all(row[:skip] == bm.NULL_BLOCK)
      taken = share_blocks[0, skip:share_counts[0]]
      assert np.all(np.asarray(state.refcounts)[taken] >= 1)
    cached_any |= int(state.num_cached) > 0 and bool(np.any(np.asarray(state.refcounts) > 0))
  assert cached_any  # blocks were cached while sequences still ran
  assert shared_any
  tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
  slid = np.flatnonzero((tables[:, 0] < 0) & (lens > 0))
  assert slid.size  # a live sequence whose first column was reclaimed
  _, reg_ok = bm.register(state, jnp.array([slid[0]]), jnp.array([0]))
  assert not bool(reg_ok[0])  # a reclaimed column cannot be registered
  state, _ = bm.release(state, jnp.arange(SEQS))
  assert int(state.num_free) + int(state.num_cached) == num_blocks


@jax.jit
def _reserve_held(state, n):
  """Slot 0 grows by `n`: the state, `ok` and the blocks held within the
  step (before `reclaim`)."""
  state, res = bm.reserve(state, jnp.array([0]), n)
  return state, res.ok, state.num_blocks - state.num_free


# Two programs, not one: the reservation compiles per window (6), only the
# reclamation per (window, q) (24): the test took half the time (JAX 0.12).
_reclaim = jax.jit(window_reclaim.reclaim, static_argnames="max_new_tokens")


def _grow(state, n, *, q):
  """Slot 0 grows by `n`: the blocks held within the step, then reclaimed."""
  state, ok, held = _reserve_held(state, n)
  return _reclaim(state, jnp.array([0]), n, ok, max_new_tokens=q), held


def test_blocks_needed_bounds_a_sequence_alone():
  """A lone sequence growing by up to `q` tokens a step never holds more
  than `blocks_needed` (the scheduler's per-request admission bound)."""
  rng = np.random.default_rng(0)
  for window in (1, 3, 4, 7, 10, 17):
    for q in (1, 4, 6, 16):
      bound = window_reclaim.blocks_needed(60, BS, window, q)
      state = bm.init(num_blocks=64, block_size=BS, max_seqs=1,
                      max_blocks_per_seq=WIDTH, window=window)
      length = 0
      while length < 60:
        n = min(int(rng.integers(1, q + 1)), 60 - length)
        state, held = _grow(state, jnp.array([n]), q=q)
        assert int(held) <= bound, (window, q, length, n)
        length += n
  assert window_reclaim.blocks_needed(60, BS, None, 16) == 15


def test_errors():
  with pytest.raises(ValueError, match="window must be a positive int, got window=0"):
    bm.init(num_blocks=4, block_size=4, max_seqs=1, max_blocks_per_seq=2, window=0)
  state = bm.init(num_blocks=4, block_size=4, max_seqs=1, max_blocks_per_seq=2)
  with pytest.raises(ValueError, match="reclaim needs a state with a window"):
    window_reclaim.reclaim(state, jnp.array([0]), jnp.array([1]),
                           jnp.array([True]), max_new_tokens=1)


def test_check_invariants_refuses_a_visible_block_reclaimed():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=1, max_blocks_per_seq=4,
                  window=6)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([10]))  # 3 blocks
  bm.check_invariants(state)
  # At length 10 a query at 10 sees 5..10: column 1 (4..7) is still visible.
  bad = state.replace(block_tables=state.block_tables.at[0, :2].set(-1),
                      refcounts=state.refcounts.at[:2].set(0))
  with pytest.raises(AssertionError, match="2 leading NULL_BLOCK columns, but "
                     "only 1 are invisible"):
    bm.check_invariants(bad)
