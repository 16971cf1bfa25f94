"""The shared pool of a hybrid model (`paged_jax.serving.shared_pool`): the
sub-group layout, the joint grant (a refused entry leaves every sub-group
untouched) and the host model (`SharedHost`) equal to the device's
transitions after every step of a random run with refusals, releases and
forks, the pool's invariants holding throughout."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import window_reclaim
from paged_jax.models.llama import pooled as pooled_model
from paged_jax.serving import shared_pool

W = 10  # window


@pytest.mark.parametrize("windows, want", [
    ((W,) * 5 + (None,), (1, (W,) * 5 + (None,), (0, 1, 2, 3, 4, 5), (0,) * 6)),
    ((W, None, W, None), (2, (W, None), (0, 1, 0, 1), (0, 0, 1, 1))),
    ((W, W, None, W, W, None), (2, (W, W, None), (0, 0, 2, 1, 1, 2),
                                (0, 1, 0, 0, 1, 1))),
])
def test_sub_groups_split_each_group_into_runs_of_g_layers(windows, want):
  assert pooled_model.sub_groups(windows) == want


def test_expand_names_each_slot_in_every_sub_group():
  got = shared_pool.expand(np.array([2, -1, 0, 5]), 3, 4)
  assert got.tolist() == [2, 6, 10, -1, -1, -1, 0, 4, 8, -1, -1, -1]


def _args(n, **kw):
  """A step's bookkeeping inputs (the attributes `_bookkeeping` reads), all
  padding but `kw`."""
  pad = lambda: np.full(n, -1, np.int32)  # noqa: E731
  x = dict(release_early=pad(), fork_parents=pad(), fork_children=pad(),
           release_late=pad(), seq_ids=pad(), q_lens=np.zeros(n, np.int32))
  x.update({k: np.asarray(v, np.int32) for k, v in kw.items()})
  return x


@jax.jit
def _device(shared, x, num_tokens):
  """`device_step`'s block transitions: bookkeeping, then reclamation."""
  del num_tokens
  x = types.SimpleNamespace(**x)
  shared, fork_ok, ok, res = shared_pool._bookkeeping(shared, x)  # pylint: disable=protected-access
  ids, q, live = shared_pool._reclaim_args(shared, x.seq_ids, x.q_lens, ok)  # pylint: disable=protected-access
  shared = shared.replace(state=window_reclaim.reclaim(
      shared.state, ids, q, live, max_new_tokens=16))
  return shared, fork_ok, ok, res.copy_src, res.copy_dst


def _host(host, x):
  return host.bookkeeping(None, None, x["release_early"], x["fork_parents"],
                          x["fork_children"], x["release_late"], None, None,
                          None, x["seq_ids"], x["q_lens"])


def _same(host, shared):
  for a, b in zip(jax.tree.leaves(host.to_state()), jax.tree.leaves(shared)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert host.fingerprint().tolist() == np.asarray(
      shared_pool.step_lib.state_fingerprint(shared.state)).tolist()


def _rows(shared, slot):
  """Slot `slot`'s table rows and lengths in every sub-group."""
  t, lens = np.asarray(shared.state.block_tables), np.asarray(shared.state.seq_lens)
  idx = [k * shared.max_seqs + slot for k in range(shared.num_sub_groups)]
  return t[idx].copy(), lens[idx].copy()


def test_a_refused_entry_is_untouched_in_every_sub_group():
  """Slot 0 (16 tokens) holds 7 of 14 blocks (4 global, 3 local: one
  reclaimed). Slot 1 asks for 16 tokens: 4 blocks per sub-group, 8 in all,
  7 free -- refused, though each sub-group alone would fit; slot 2 after it asks for 4 tokens (2 blocks)
  and is served (in order, as `block_manager.reserve`)."""
  shared = shared_pool.init(14, (W, None), block_size=4, max_seqs=3,
                            max_blocks_per_seq=8)
  host = shared_pool.SharedHost(shared)
  x = _args(3, seq_ids=[0, -1, -1], q_lens=[8, 0, 0])
  shared, _, ok, _, _ = _device(shared, x, 16)
  assert _host(host, x)[1].ok.tolist() == np.asarray(ok).tolist() == [True, False, False]
  shared, _, _, _, _ = _device(shared, _args(3, seq_ids=[0], q_lens=[8]), 16)
  _host(host, _args(3, seq_ids=[0], q_lens=[8]))
  _same(host, shared)
  assert int(shared.state.num_free) == 7
  before = _rows(shared, 1)
  x = _args(3, seq_ids=[1, 2, -1], q_lens=[16, 4, 0])
  shared, _, ok, _, _ = _device(shared, x, 16)
  _, res, _ = _host(host, x)
  assert np.asarray(ok).tolist() == res.ok.tolist() == [False, True, False]
  after = _rows(shared, 1)
  np.testing.assert_array_equal(before[0], after[0])
  np.testing.assert_array_equal(before[1], after[1])
  assert (after[0] == bm.NULL_BLOCK).all() and (after[1] == 0).all()
  assert _rows(shared, 2)[1].tolist() == [4, 4]  # served in both sub-groups
  _same(host, shared)
  bm.check_invariants(shared.state)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_host_model_is_the_device_after_every_step(seed):
  """A random run on a small pool (refusals, copy-on-write after forks,
  reclamation): after every step the host model equals the device state,
  an entry is granted in every sub-group or none (a refused one keeps its
  rows), every sub-group holds a sequence at one length, a local
  sub-group at most its window's blocks, and the pool's invariants hold;
  releasing everything gives every block back."""
  rng = np.random.default_rng(seed)
  B, ms, bs = 4, 6, 4
  shared = shared_pool.init(40, (W, W, None), block_size=bs, max_seqs=ms,
                            max_blocks_per_seq=12)
  host = shared_pool.SharedHost(shared)
  live: set[int] = set()
  refused = copies = 0
  for _ in range(40):
    lens = np.asarray(shared.seq_lens)
    free = [s for s in range(ms) if s not in live]
    release = [s for s in live if rng.random() < 0.15][:B]
    kw = {}
    if release:
      kw["release_early"] = release + [-1] * (B - len(release))
    for s in release:
      live.discard(s)
    grow = [s for s in live if rng.random() < 0.8]
    forks = []
    if grow and free and rng.random() < 0.3:  # a child of a growing parent
      forks = [(int(rng.choice(grow)), free.pop())]
      kw["fork_parents"] = [forks[0][0]] + [-1] * (B - 1)
      kw["fork_children"] = [forks[0][1]] + [-1] * (B - 1)
      grow.append(forks[0][1])
    while free and rng.random() < 0.5:
      grow.append(free.pop())
    grow = grow[:B]
    kw["seq_ids"] = grow + [-1] * (B - len(grow))
    kw["q_lens"] = [int(rng.integers(1, 13)) for _ in grow] + [0] * (B - len(grow))
    x = _args(B, **kw)
    snap = {s: _rows(shared, s) for s in grow}
    shared, fork_ok, ok, src, _ = _device(shared, x, 16)
    h_fork, res, _ = _host(host, x)
    ok = np.asarray(ok)
    assert ok.tolist() == res.ok.tolist()
    assert np.asarray(fork_ok)[:len(forks)].all() and h_fork[:len(forks)].all()
    for p, c in forks:
      live.add(c)
    copies += int(np.sum(np.asarray(src) >= 0))
    for i, s in enumerate(grow):
      if ok[i]:
        live.add(s)
      elif s in live and s not in dict(forks).values():
        refused += 1
        t, l = _rows(shared, s)
        np.testing.assert_array_equal(t, snap[s][0])
        np.testing.assert_array_equal(l, snap[s][1])
    _same(host, shared)
    bm.check_invariants(shared.state)
    lens = np.asarray(shared.state.seq_lens).reshape(3, ms)
    assert (lens == lens[0]).all()
    for k in (0, 1):
      held = np.sum(np.asarray(shared.view(k).block_tables) >= 0, axis=1)
      assert held.max() <= -(-W // bs) + 1
  assert refused and copies  # the run did refuse and copy
  x = _args(ms, release_early=sorted(live) + [-1] * (ms - len(live)))
  shared, *_ = _device(shared, x, 16)
  _host(host, x)
  _same(host, shared)
  assert int(shared.state.num_free) == shared.num_blocks


def _host_packed(host, x, packed, decode):
  """`_host` with the scheduler's layout promise (`packed` leading entries,
  the first `decode` of one token)."""
  return host.bookkeeping(None, None, x["release_early"], x["fork_parents"],
                          x["fork_children"], x["release_late"], None, None,
                          None, x["seq_ids"], x["q_lens"], packed=packed,
                          decode=decode)


def test_the_steady_decode_path_is_the_device_after_every_step():
  """The scheduler's layout promise (`packed`, `decode`) on the shared pool:
  runs of steady decode steps (the same slots, one token each, the same
  read-only inputs sent again, as `packing.SteadyInputs`) broken by
  admissions, prompt chunks, releases and forks, on a pool small enough to
  refuse (the shapes of the test above, so `_device` compiles nothing new). The host model takes its fast paths (the joint grant without
  `joint_ok`, `HostPool._steady_step` across block boundaries and
  reclamation) and still equals the device after every step."""
  rng = np.random.default_rng(3)
  B, ms, bs = 4, 6, 4
  shared = shared_pool.init(40, (W, W, None), block_size=bs, max_seqs=ms,
                            max_blocks_per_seq=12)  # (the shapes above: compiled once)
  host = shared_pool.SharedHost(shared)
  pool = host.pool
  fast = {"steady": 0, "joint": 0}
  step, joint = pool._steady_step, shared_pool.joint_ok  # pylint: disable=protected-access
  pool._steady_step = lambda *a: bool(fast.__setitem__("steady", fast["steady"] + 1)) or step(*a)  # pylint: disable=protected-access
  live: list[int] = []
  steady_x = None
  refused = 0
  try:
    shared_pool.joint_ok = lambda *a: bool(fast.__setitem__("joint", fast["joint"] + 1)) or joint(*a)
    for i in range(60):
      if steady_x is not None and rng.random() < 0.8:
        x, packed, decode = steady_x
        assert x["seq_ids"][:packed].tolist() == live[:packed]
      else:
        steady_x = None
        free = [s for s in range(ms) if s not in live]
        kw = {}
        release = [s for s in live if rng.random() < 0.2][:1]
        if release:
          kw["release_early"] = release + [-1] * (B - 1)
          live = [s for s in live if s not in release]
        if live and free and rng.random() < 0.2:  # a child of a running parent
          kw["fork_parents"] = [live[0]] + [-1] * (B - 1)
          kw["fork_children"] = [free[0]] + [-1] * (B - 1)
          live.append(free.pop(0))
        grow = live[:B]
        new = [s for s in free if rng.random() < 0.4][:B - len(grow)]
        q = [1] * len(grow) + [int(rng.integers(1, 13)) for _ in new]
        kw["seq_ids"] = grow + new + [-1] * (B - len(grow) - len(new))
        kw["q_lens"] = q + [0] * (B - len(q))
        x, packed, decode = _args(B, **kw), len(grow) + len(new), len(grow)
        if not new and "release_early" not in kw and "fork_parents" not in kw and grow:
          for v in x.values():
            v.flags.writeable = False
          steady_x = (x, packed, decode)  # sent again while the rows stay the same
      shared, _, ok, _, _ = _device(shared, x, 16)
      _, res, _ = _host_packed(host, x, packed, decode)
      ok = np.asarray(ok)
      assert ok.tolist() == res.ok.tolist()
      ids = np.asarray(x["seq_ids"])
      for j in range(packed):
        if not ok[j]:
          refused += 1
          steady_x = None
          if ids[j] in live:  # the scheduler would preempt it
            x2 = _args(B, release_early=[ids[j]] + [-1] * (B - 1))
            shared, *_ = _device(shared, x2, 16)
            _host(host, x2)
            live.remove(int(ids[j]))
        elif ids[j] not in live:
          live.append(int(ids[j]))
      _same(host, shared)
      bm.check_invariants(shared.state)
  finally:
    shared_pool.joint_ok = joint
  assert fast["steady"] >= 10 and refused  # the fast paths ran; the pool refused
  assert fast["joint"] < 60  # the joint grant skipped `joint_ok` in most steps


def test_the_fast_joint_grant_counts_a_copy_of_a_shared_last_block():
  """`SharedHost._joint_ok`'s shortcut (everything granted when the pool
  holds the entries' new blocks) must not apply when an entry grows into a
  partial last block that a fork shares: that copy needs a block too. With
  fewer free blocks than the copies, it refuses as `joint_ok` does (host
  only: no device program)."""
  B, bs = 4, 4
  host = shared_pool.SharedHost(shared_pool.init(40, (W, W, None), block_size=bs,
                                                 max_seqs=6, max_blocks_per_seq=12))
  _host(host, _args(B, seq_ids=[0, -1, -1, -1], q_lens=[2, 0, 0, 0]))
  _host(host, _args(B, fork_parents=[0, -1, -1, -1], fork_children=[1, -1, -1, -1]))
  p = host.pool
  p.num_free = host.num_sub - 1  # one block short of a copy in every sub-group
  seq_ids, q_lens = np.array([0, 1, -1, -1]), np.array([1, 1, 0, 0])
  ids, q, _, _ = host._expanded(seq_ids, q_lens)  # pylint: disable=protected-access
  want = shared_pool.joint_ok(shared_pool._HostView(p), ids, q, host.num_sub)  # pylint: disable=protected-access
  got = host._joint_ok(seq_ids, q_lens, ids, q, packed=2)  # pylint: disable=protected-access
  assert not want[0]  # the copies do not fit
  assert got.tolist() == want.tolist()
