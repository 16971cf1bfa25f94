"""Block-aware admission's per-pool estimate (`window_pool.held_blocks`,
`window_pool.local_admission_room`; the shared pool's `shared_pool.
SharedHost.held` and `admission_room`): the blocks it counts are the ones the
host model of a windowed pool holds after a step's reclamation."""

from __future__ import annotations

import types

import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import window_reclaim
from paged_jax.serving import window_pool
from paged_jax.serving.host_pool import HostPool


@pytest.mark.parametrize("window, bs", [(None, 4), (10, 4), (3, 4), (16, 16), (64, 16)])
def test_held_blocks_is_what_a_pool_holds_after_reclamation(window, bs):
  """One sequence grown by random chunks in a `HostPool` with `window`:
  after each step's reserve and reclaim its row holds `held_blocks` blocks."""
  rng = np.random.default_rng(0)
  pool = HostPool(bm.init(num_blocks=64, block_size=bs, max_seqs=2,
                          max_blocks_per_seq=64, window=window))
  length = 0
  while length < 200:
    q = int(rng.integers(1, 3 * bs))
    seq, num = np.array([0]), np.array([q])
    res = pool.reserve(seq, num)
    assert res.ok.all()
    window_reclaim.reclaim_host(pool, seq, num, res.ok)
    length += q
    held = int(np.sum(pool.tables[0] >= 0))
    assert held == window_pool.held_blocks(window, length, bs), (length, held)


def _seq(tokens: int, cached: int):
  return types.SimpleNamespace(tokens=[0] * tokens, num_cached=cached)


def test_local_room_charges_what_running_sequences_will_hold():
  """Window 10, blocks of 4: a sequence holds at most 3 blocks between steps
  (`held_blocks(10, L, 4)` for L >= 12); a prefill at 8 of 40 tokens will
  hold 3 (now 2), a decode at 30 holds 3 whether or not it crosses."""
  pools = [types.SimpleNamespace(window=10, num_available=20),
           types.SimpleNamespace(window=None, num_available=99)]
  assert window_pool.host_pools(types.SimpleNamespace(pools=pools)) == pools
  room = window_pool.local_admission_room(
      pools[:1], [_seq(40, 8), _seq(31, 30)], rows=2, block_size=4,
      max_tokens_per_step=16)
  # 20 available - (3 - 2) growth - ceil(2 / 4) crossings - (16 / 4 + 1) chunk
  assert room == [20 - 1 - 1 - 5]
  assert window_pool.held_blocks(10, 40, 4) == 3  # what a waiting 40 costs
  assert window_pool.held_blocks(None, 40, 4) == 10


def test_shared_room_counts_every_sub_group_in_the_one_pool():
  """The shared pool (`shared_pool.SharedHost`): a sequence's cost is its
  blocks summed over the sub-groups -- what the host model holds after each
  step of a prompt grown by chunks -- and the room keeps one step's chunk and
  crossings per local sub-group and the decode headroom per global one."""
  from paged_jax.serving import shared_pool  # pylint: disable=import-outside-toplevel
  windows = (10, 10, None)
  host = shared_pool.SharedHost(shared_pool.init(
      60, windows, block_size=4, max_seqs=2, max_blocks_per_seq=32))
  none = np.full(1, -1)
  length = 0
  for q in (7, 16, 1, 9, 1, 1):
    _, res, _ = host.bookkeeping(None, None, none, none, none, none, None,
                                 None, None, np.array([0]), np.array([q]))
    assert res.ok.all()
    length += q
    assert host.held(length) == int(np.sum(host.pool.tables >= 0)), length
  assert host.held(40) == 2 * 3 + 10
  # 60 - 15 held (35 tokens: 9 global, 3 per local) = 45 available; a prefill at 8 of 40 tokens will
  # hold 16 (now 2 * 2 + 2 = 6), a decode at 30 (31 tokens: 3 + 3 + 8 either
  # way): 49 - 10 growth - 2 local * (ceil(2 / 4) + 16 / 4 + 1) - 1 global *
  # ceil(2 * 16 / 4).
  assert host.num_available == 60 - host.held(length) == 45
  room = host.admission_room([_seq(40, 8), _seq(31, 30)], rows=2,
                             max_tokens_per_step=16, headroom_steps=16)
  assert room == 45 - 10 - 2 * 6 - 8
