"""Prefix caching in the engine: the same greedy tokens with and without it.

Every engine here has the small pool (`SMALL_POOL` blocks of 4 tokens), so
the workload preempts and evicts; with caching on, after every step the host
index names exactly the mirror's cacheable blocks, the mirror equals the
device state, and every block no sequence holds and no cache entry keeps is
refilled with NaN (a sequence that read a block it does not own would turn
its logits to NaN and its greedy tokens to garbage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import prefix_cache
from paged_jax.serving.engine import EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests.examples.conftest import (SMALL_POOL, assert_mirror_is_the_device_state,
                                     make_engine)

BS = 4
# Two step shapes (the largest decode and mixed buckets of `SIZES`): each
# compiles once, and this file's engines share them.
TWO_SHAPES = dict(num_blocks=SMALL_POOL, min_bucket=16, admission_headroom_steps=0)


def _poison_unowned_blocks(engine):
  """Refills every empty block (refcount 0, not cached) with NaN."""
  state = jax.device_get(engine.block_state)
  cached = np.zeros(state.num_blocks, bool)
  cached[bm.cached_blocks(state)] = True
  empty = np.flatnonzero((np.asarray(state.refcounts) == 0) & ~cached)
  mask = np.zeros(state.num_blocks, bool)
  mask[empty] = True
  runner = engine._runner  # pylint: disable=protected-access
  runner.cache = _poison(runner.cache, mask)


@jax.jit
def _poison(cache, mask):
  """`cache` with the blocks where `mask` (bool[num_blocks]) is set all NaN."""
  nan = lambda p: jnp.where(mask[None, None, :, None, None], jnp.nan, p)
  return cache.replace(k_pages=nan(cache.k_pages), v_pages=nan(cache.v_pages))


def _run(engine, requests, *, checked: bool) -> dict:
  """Serves `requests`; with `checked`, checks the index, the mirror and
  poisons unowned blocks after every step."""
  for r in requests:
    assert engine.add_request(r) is None, r
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
    if checked:
      for pool in engine._pools:  # pylint: disable=protected-access
        pool.check_prefix_index()
      assert_mirror_is_the_device_state(engine)
      _poison_unowned_blocks(engine)
  engine.flush()
  for o in engine._take_outputs():  # pylint: disable=protected-access
    outs[o.request_id] = o
  return outs


def _tokens(outs) -> dict:
  return {k: [c.token_ids for c in o.completions] for k, o in outs.items()}


def _phases(seed=0):
  """A shared system prompt, then distinct prompts that evict it, then the
  system prompt again (recomputed and cached again), then exact repeats
  (whole prompt cached), all with concurrent load on the small pool."""
  rng = np.random.default_rng(seed)
  system = rng.integers(3, 512, size=13).tolist()
  tail = lambda k: rng.integers(3, 512, size=k).tolist()
  greedy = lambda n: SamplingParams(max_new_tokens=n)
  shared = [Request(f"a{i}", system + tail(2 + i), greedy(6)) for i in range(5)]
  other = [Request(f"b{i}", tail(18), greedy(8)) for i in range(5)]
  again = [Request(f"c{i}", system + tail(3), greedy(5)) for i in range(3)]
  repeat = [Request(f"d{i}", list(shared[0].prompt), greedy(6)) for i in range(3)]
  return [shared, other, again, repeat]


def test_greedy_tokens_are_identical_with_caching_on_and_off(model):
  phases = _phases()
  off = make_engine(model, **TWO_SHAPES)
  expected = {}
  for reqs in phases:
    expected.update(_tokens(_run(off, reqs, checked=False)))
  on = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True)
  got, outs = {}, {}
  evicted_after = []
  for reqs in phases:
    o = _run(on, reqs, checked=True)
    outs.update(o)
    got.update(_tokens(o))
    evicted_after.append(on.stats.prefix_blocks_evicted)
  assert got == expected
  st = on.stats
  assert st.preemptions > 0  # the small pool preempted with caching on
  assert evicted_after[1] > evicted_after[0]  # "other" evicted cached blocks
  assert st.prefix_hit_tokens > 0 and st.prefix_tokens_saved >= st.prefix_hit_tokens
  # The repeats' whole prompt was cached: all blocks before the last token.
  full = prefix_cache.max_hit_blocks(len(phases[3][0].prompt), BS) * BS
  assert [outs[f"d{i}"].num_cached_tokens for i in range(3)][1:] == [full, full]
  assert st.computed_tokens < off.stats.computed_tokens
  # Every block accounted for: nothing live, the rest cached or empty.
  state = jax.device_get(on.block_state)
  bm.check_invariants(state)
  assert int(state.num_used) == 0
  assert int(state.num_free) + int(state.num_cached) == SMALL_POOL
  assert on.usage()["blocks_cached"] == int(state.num_cached) > 0


def test_hits_salts_and_statistics(model):
  engine = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True)
  prompt = list(range(10, 27))  # 17 tokens: 4 full blocks before the last
  greedy = SamplingParams(max_new_tokens=3)
  first = _run(engine, [Request("x", prompt, greedy)], checked=True)["x"]
  assert first.num_cached_tokens == 0
  later = [_run(engine, [Request(f"y{i}", prompt, greedy)], checked=True)[f"y{i}"]
           for i in range(2)]
  # Temperature 0 in float32: the first request and later identical ones
  # (served from the cache) give the same tokens.
  assert [o.completions for o in later] == [first.completions] * 2
  assert [o.num_cached_tokens for o in later] == [16, 16]
  salted = _run(engine, [Request("z", prompt, greedy, cache_salt="tenant-2")],
                checked=True)["z"]
  assert salted.num_cached_tokens == 0 and salted.completions == first.completions
  st = engine.stats
  assert (st.prefix_queried_tokens, st.prefix_hit_tokens) == (4 * 17, 32)
  assert st.prefix_cache_hit_rate == pytest.approx(32 / 68)
  assert st.prefix_tokens_saved == 32
  # "x" cached 4 full blocks (its 5th holds the last prompt token and the
  # first outputs); "z" 4 more under its own salt (its blocks do not share).
  assert st.prefix_blocks_registered >= 8
  assert len(engine._pools[0].prefix_index) == st.prefix_blocks_registered - (  # pylint: disable=protected-access
      st.prefix_blocks_evicted)


def test_hits_on_blocks_registered_in_the_same_step(model):
  """A prompt admitted in the step that registers another sequence's blocks
  (computed the step before, not yet in the index) hits them."""
  prompt = list(range(10, 27))  # 17 tokens: 4 full blocks before the last
  greedy = SamplingParams(max_new_tokens=3)
  engine = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True)
  engine.add_request(Request("a", prompt, greedy))
  engine.step()  # "a"'s first 16 tokens: 4 full blocks, registered next step
  engine.add_request(Request("b", prompt, greedy))
  outs = {o.request_id: o for o in engine.run_until_done()}
  assert outs["b"].num_cached_tokens == 16
  assert outs["b"].completions == outs["a"].completions
  for pool in engine._pools:  # pylint: disable=protected-access
    pool.check_prefix_index()
  assert_mirror_is_the_device_state(engine)


def test_caching_off_has_no_prefix_inputs_and_no_statistics(model):
  engine = make_engine(model, **TWO_SHAPES)
  x, _ = engine._pools[0]._build([], engine.buckets[0])  # pylint: disable=protected-access
  assert x.register_seqs.shape == (0,) and x.share_blocks.shape[0] == 0
  assert not engine.block_state.prefix_caching
  _run(engine, [Request("x", list(range(10, 27)), SamplingParams(max_new_tokens=2)),
                Request("y", list(range(10, 27)), SamplingParams(max_new_tokens=2))],
       checked=False)
  st = engine.stats
  assert (st.prefix_queried_tokens, st.prefix_hit_tokens, st.prefix_blocks_registered,
          engine.usage()["blocks_cached"]) == (0, 0, 0, 0)
  assert engine._pools[0].prefix_index is None  # pylint: disable=protected-access


def test_a_salt_that_is_not_str_or_bytes_is_rejected(model):
  engine = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True)
  out = engine.add_request(Request("s", [5, 6, 7], cache_salt=7))
  assert out.rejected == "cache_salt must be a str or bytes, got 7"


def test_enable_prefix_caching_must_be_a_bool():
  with pytest.raises(ValueError, match="enable_prefix_caching must be a bool, got 1"):
    EngineConfig(num_blocks=8, enable_prefix_caching=1)


def test_registration_looks_only_at_rows_that_completed_a_block(model):
  """Each full block is hashed once (`seq.hashes` keeps them), and a step
  looks for blocks to register only in the sequences that completed one in
  the step before: a row that completed none is not looked at, even one
  whose registration count was reset behind the engine's back (the old
  per-step scan over every running row found it)."""
  engine = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True,
                       async_scheduling=False)
  pool = engine._pools[0]  # pylint: disable=protected-access
  chained, looked = [], []
  chain, collect = pool.prefix_index.chain, pool._collect_registrations  # pylint: disable=protected-access
  pool.prefix_index.chain = lambda *a: chained.append(1) or chain(*a)
  pool._collect_registrations = lambda s: looked.append(s.num_cached) or collect(s)  # pylint: disable=protected-access
  prompt = list(range(10, 16))  # 6 tokens: 1 full block, then 1 per 4 outputs
  engine.add_request(Request("a", prompt, SamplingParams(max_new_tokens=12,
                                                         eos_token_ids=(-1,))))
  engine.step()  # the prompt: 6 tokens computed, block 0 full
  seq = pool._running[0]  # pylint: disable=protected-access
  engine.step()  # registers block 0; computes token 7
  assert looked == [6] and seq.num_registered == 1
  seq.num_registered = 0  # not due: no block completed in the last step
  engine.step()  # computes token 8, completing block 1
  assert looked == [6]
  seq.num_registered = 1
  engine.step()  # registers block 1
  assert looked == [6, 8]
  engine.run_until_done()
  # 17 computed tokens (6 + 11 outputs): 4 full blocks, each hashed once
  # (the admission lookup's hash of block 0 included).
  assert engine.stats.prefix_blocks_registered == 4
  assert len(chained) == 4
  pool.check_prefix_index()
  assert_mirror_is_the_device_state(engine)
