"""Preemption by swap in the engine (`EngineConfig.preemption_mode="swap"`):
the same greedy outputs as recompute and as a pool that never preempts, every
block back in both pools, the host models equal to the device, each step
shape traced once, and the flags' errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import host_tier
from paged_jax.serving.engine import EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.speculative import SpeculativeConfig
from tests.examples.conftest import (SMALL_POOL, assert_mirror_is_the_device_state,
                                     make_engine, random_requests, serve)


def tokens(outputs: dict) -> dict:
  return {k: [(c.token_ids, c.finish_reason) for c in o.completions]
          for k, o in outputs.items()}


def test_swap_gives_the_outputs_of_recompute_and_of_a_big_pool(model):
  requests = random_requests(1, 8, prompt=(8, 24), new=(8, 16))
  big = make_engine(model)
  recompute = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  swap = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0,
                     preemption_mode="swap", swap_space_blocks=16,
                     check_traces=True)  # each shape traced once
  want = serve(big, requests)
  assert tokens(serve(recompute, requests)) == tokens(want)
  got = serve(swap, requests)
  assert tokens(got) == tokens(want)
  st = swap.stats
  assert st.swapped_out > 0 and st.swapped_in == st.swapped_out
  assert st.swap_blocks_out == st.swap_blocks_in > 0
  assert st.recomputed_tokens < recompute.stats.recomputed_tokens
  # Every block is back in both pools, and the host models are the device's.
  runner, (pool,) = swap._runner, swap._pools  # pylint: disable=protected-access
  bm.check_invariants(swap.block_state)
  host_tier.check_invariants(runner.tier, swap.block_state)
  assert int(swap.block_state.num_free) == SMALL_POOL
  assert int(runner.tier.num_free) == 16
  assert_mirror_is_the_device_state(swap)
  for a, b in zip(jax.tree.leaves(pool._pool.tier.to_tier()),  # pylint: disable=protected-access
                  jax.tree.leaves(runner.tier)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not swap.has_unfinished()


def test_abort_of_a_swapped_request_drops_it(model):
  requests = random_requests(2, 8, prompt=(8, 24), new=(12, 16))
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0,
                       preemption_mode="swap", swap_space_blocks=16)
  for r in requests:
    assert engine.add_request(r) is None
  (pool,) = engine._pools  # pylint: disable=protected-access
  aborted = None
  for _ in range(200):
    engine.step()
    if pool._swapped:  # pylint: disable=protected-access
      aborted = pool._swapped[0].group.request.request_id  # pylint: disable=protected-access
      assert engine.abort_request(aborted)
      break
  assert aborted is not None, "no sequence was swapped out"
  outs = {o.request_id: o for o in engine.run_until_done()}
  engine.flush()
  assert outs[aborted].completions[0].finish_reason == "abort"
  runner = engine._runner  # pylint: disable=protected-access
  host_tier.check_invariants(runner.tier, engine.block_state)
  assert int(runner.tier.num_free) == 16
  assert int(engine.block_state.num_free) == SMALL_POOL


@pytest.mark.parametrize("kw, match", [
    (dict(preemption_mode="swapp"), "preemption_mode must be one of"),
    (dict(preemption_mode="swap"), "needs swap_space_blocks >= 1, got 0"),
    (dict(swap_space_blocks=-1), "swap_space_blocks must be an int >= 0, got -1"),
    (dict(preemption_mode="swap", swap_space_blocks=4, enable_prefix_caching=True),
     "does not support enable_prefix_caching"),
    (dict(preemption_mode="swap", swap_space_blocks=4, num_scheduler_steps=2),
     "needs num_scheduler_steps=1"),
    (dict(preemption_mode="swap", swap_space_blocks=4,
          speculative_config=SpeculativeConfig(num_speculative_tokens=2)),
     "does not support speculative_config"),
])
def test_swap_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig(num_blocks=8, **kw)


@pytest.mark.parametrize("argv, match", [
    (["--preemption-mode", "swap"],
     "--preemption-mode 'swap' needs --swap-space-blocks >= 1, got 0"),
    (["--preemption-mode", "swap", "--swap-space-blocks", "8",
      "--enable-prefix-caching"], "does not support --enable-prefix-caching"),
    (["--swap-space-blocks", "-3"], "--swap-space-blocks must be an int >= 0, got -3"),
])
def test_swap_flags_errors(argv, match, capsys):
  from paged_jax.entrypoints import generate  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    generate.parse_and_check(argv)
  assert match in capsys.readouterr().err


@pytest.mark.parametrize("params, async_scheduling", [
    (SamplingParams(beam_width=2, max_new_tokens=10), True),
    (SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=14), True),
    (SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=14), False),
], ids=["beam", "n2", "n2-sync"])
def test_groups_under_swap_preemption(model, params, async_scheduling):
  """Beam groups are recomputed, sampling groups swapped; outputs as a big
  pool's, with and without asynchronous scheduling."""
  requests = [Request("old", list(range(100, 120)), SamplingParams(max_new_tokens=16)),
              Request("group", list(range(50, 59)), params)]
  big = make_engine(model, max_beam_width=2)
  small = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0,
                      max_beam_width=2, preemption_mode="swap", swap_space_blocks=16,
                      async_scheduling=async_scheduling)
  want, got = serve(big, requests), serve(small, requests)
  assert got["group"].preemptions > 0
  assert tokens(got) == tokens(want)
  if params.beam_width > 1:
    assert small.stats.swapped_out == 0
  else:
    assert small.stats.swapped_out > 0
  assert int(small.block_state.num_free) == SMALL_POOL
  assert int(small._runner.tier.num_free) == 16  # pylint: disable=protected-access
  assert not small.has_unfinished()


def test_stats_and_usage_count_the_copies_dispatched(model, monkeypatch):
  """`EngineStats.offload_bytes_*` equal the real pairs handed to the copy
  programs times one block's bytes; `usage()` reports the tier while
  sequences are out, and 0 when idle or without a tier."""
  from paged_jax import kv_offload  # pylint: disable=import-outside-toplevel
  seen = {"out": 0, "in": 0}

  def counting(name, fn):
    def wrapped(cache, host, src, dst):
      src, dst = np.asarray(src), np.asarray(dst)
      seen[name] += int(np.sum((src >= 0) & (dst >= 0)))
      return fn(cache, host, src, dst)
    return wrapped

  monkeypatch.setattr(kv_offload, "copy_to_host",
                      counting("out", kv_offload.copy_to_host))
  monkeypatch.setattr(kv_offload, "copy_to_device",
                      counting("in", kv_offload.copy_to_device))
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0,
                       preemption_mode="swap", swap_space_blocks=16)
  usages = []
  for r in random_requests(1, 8, prompt=(8, 24), new=(8, 16)):
    assert engine.add_request(r) is None
  engine.run_until_done(on_step=lambda e, _: usages.append(e.usage()))
  engine.flush()
  st, cache = engine.stats, engine.cache
  c = model.config
  per_block = (2 * c.num_layers * c.num_kv_heads * cache.block_size * c.head_dim
               * cache.dtype.itemsize)
  assert cache.bytes_per_block == per_block
  assert seen["out"] == st.swap_blocks_out > 0 and seen["in"] == st.swap_blocks_in
  assert st.offload_bytes_to_host == seen["out"] * per_block
  assert st.offload_bytes_to_device == seen["in"] * per_block
  out = [u for u in usages if u["swapped"]]
  assert out, "no step saw a sequence swapped out"
  assert all(0 < u["host_blocks_used"] <= u["host_blocks_total"] == 16 for u in out)
  assert engine.usage()["host_blocks_used"] == engine.usage()["swapped"] == 0
  off = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  serve(off, random_requests(1, 4, prompt=(8, 24), new=(8, 16)))
  assert {k: off.usage()[k] for k in ("host_blocks_used", "host_blocks_total",
                                      "swapped")} == dict.fromkeys(
      ("host_blocks_used", "host_blocks_total", "swapped"), 0)
  assert off.stats.offload_bytes_to_host == off.stats.offload_bytes_to_device == 0
