"""Hybrid capacity planning (`paged_jax.hybrid_capacity`): the planned
blocks per group are what the grouped manager holds, and the figures add up."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax import block_groups as bg
from paged_jax import capacity
from paged_jax import hybrid_capacity as hc


@pytest.mark.parametrize("window,block_size", [(5, 4), (8, 4), (3, 2)])
def test_planned_blocks_bound_what_the_grouped_manager_holds(window, block_size):
  # Prefill 3 tokens, then decode token by token, reclaiming after each
  # step: the local group never holds more than planned, and reaches it.
  state = bg.init(num_blocks=64, block_size=block_size, max_seqs=1,
                  max_blocks_per_seq=40 // block_size, windows=(None, window))
  reserve, reclaim = jax.jit(bg.reserve), jax.jit(bg.reclaim)
  seq = np.zeros(1, np.int32)
  state, _ = reserve(state, seq, np.array([3], np.int32))
  planned, peak = hc.local_blocks(window, 40, block_size), 0
  for length in range(3, 40):
    state, _ = reclaim(state, seq)
    held = bg.held_blocks(state)[:, 0]
    assert held[0] == hc.local_blocks(None, length, block_size)
    assert held[1] <= hc.local_blocks(window, length, block_size)
    state, res = reserve(state, seq, np.ones(1, np.int32))  # the step's peak
    assert bool(res.ok[0])
    peak = max(peak, int(bg.held_blocks(state)[1, 0]))
  assert peak == planned  # the bound is reached: the plan is tight


def test_plan_adds_up():
  groups = hc.groups_from_windows([4, None, 4, 4, None])
  assert groups == (hc.LayerGroup(3, 4), hc.LayerGroup(2, None))
  p = hc.plan_hybrid(kv_pool_bytes=10**7, groups=groups, num_kv_heads=2,
                     head_dim=64, block_size=4, context=30, kv_dtype="int8")
  token = capacity.kv_head_token_bytes("int8", 64)  # 64 + 4 bytes of scale
  assert p.bytes_per_token == (2 * 3 * 2 * token, 2 * 2 * 2 * token)
  assert p.blocks_per_seq == (2, 8)  # ceil(4 / 4) + 1, ceil(30 / 4)
  assert p.bytes_per_seq == 4 * (2 * p.bytes_per_token[0] + 8 * p.bytes_per_token[1])
  assert p.bytes_per_seq_without_reclamation == 32 * sum(p.bytes_per_token)
  assert p.max_seqs == 10**7 // p.bytes_per_seq
  assert p.max_seqs_without_reclamation == 10**7 // p.bytes_per_seq_without_reclamation
  # Without local layers, reclamation changes nothing: capacity.plan's figure.
  flat = hc.plan_hybrid(kv_pool_bytes=10**7, groups=[hc.LayerGroup(5, None)],
                        num_kv_heads=2, head_dim=64, block_size=4, context=30)
  ref = capacity.plan(kv_pool_bytes=10**7, num_layers=5, num_kv_heads=2,
                      head_dim=64, block_size=4, avg_tokens=30, max_model_len=30)
  assert flat.ratio == 1.0 and flat.max_seqs == ref.max_concurrency_paged


@pytest.mark.parametrize("kwargs,match", [
    (dict(groups=[]), "groups must not be empty"),
    (dict(context=0), "context=0 must be a positive integer"),
    (dict(groups=[hc.LayerGroup(0, None)]), r"groups\[0\].num_layers=0"),
    (dict(kv_pool_bytes=100), "holds no sequence of 30 tokens"),
])
def test_plan_errors(kwargs, match):
  args = dict(kv_pool_bytes=10**7, groups=[hc.LayerGroup(2, 8)], num_kv_heads=2,
              head_dim=64, block_size=4, context=30)
  with pytest.raises(ValueError, match=match):
    hc.plan_hybrid(**{**args, **kwargs})
  with pytest.raises(ValueError, match="window must be None or a positive int"):
    hc.groups_from_windows([0])
