"""Sliding-window block reclamation in the engine
(`EngineConfig.sliding_window_reclamation`, `paged_jax.window_reclaim`; for
hybrid models one pool per window, `window_pool.py`): Mistral- and
Gemma-3-shaped models whose window slides inside the test give the greedy
outputs of an engine that keeps every block, with every reclaimed and free
block NaN-poisoned after every step, the host model equal to the device
state at every step, each sequence holding at most `ceil(w / bs) + 1`
blocks in every local pool, every block back at the end, each step shape traced once; and the
switch's refusals and fallbacks."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.models.llama import model as model_lib
from paged_jax.serving import reclamation
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.speculative import SpeculativeConfig
from tests.examples.conftest import (assert_mirror_is_the_device_state,
                                     random_requests)
from paged_jax.serving import pooled_step
from paged_jax.serving import shared_pool
from paged_jax.serving import prefix as prefix_lib
from tests.examples.test_prefix_engine import _poison, _poison_unowned_blocks

WINDOW, BS = 10, 4
# Two step shapes (decode 4, mixed 16): each compiles once per engine kind.
SIZES = dict(block_size=BS, max_batch=4, max_tokens_per_step=16,
             max_model_len=96, min_bucket=16, bucket_midpoints=False)
MAX_HELD = -(-WINDOW // BS) + 1


@pytest.fixture(scope="module")
def mistral():
  return model_lib.init_model(model_lib.LlamaConfig.tiny(sliding_window=WINDOW),
                              seed=3)


@pytest.fixture(scope="module")
def gemma3():
  types = ("sliding_attention",) * 5 + ("full_attention",)
  return model_lib.init_model(model_lib.LlamaConfig.tiny(
      num_layers=6, sliding_window=WINDOW, layer_types=types), seed=4)


def _engine(model, num_blocks, **kw) -> Engine:
  return Engine(model, EngineConfig(num_blocks=num_blocks, **{**SIZES, **kw}))


def _requests(seed=0, count=8):
  return random_requests(seed, count, prompt=(30, 61), new=(6, 20))


def _states(engine) -> list:
  """The engine's block states: one, one per pool, or the shared pool's."""
  state = engine.block_state
  if isinstance(state, shared_pool.SharedState):
    return [state.state]
  return list(state.states) if isinstance(state, pooled_step.PooledState) else [state]


def _views(engine) -> list:
  """Per local pool or local sub-group its `BlockState` (its rows)."""
  state = engine.block_state
  if isinstance(state, shared_pool.SharedState):
    return [state.view(k) for k, w in enumerate(state.windows) if w is not None]
  return [s for s in _states(engine) if s.window is not None]


def _held(engine) -> np.ndarray:
  """Blocks each sequence slot holds in each local pool or sub-group
  (reclaimed entries excluded), `[local pools, max_seqs]`."""
  out = []
  for state in _views(engine):
    tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
    inside = np.arange(tables.shape[1])[None, :] < -(-lens // BS)[:, None]
    out.append(np.sum(inside & (tables >= 0), axis=1))
  return np.stack(out)


def _poison_free_blocks(engine):
  """Every block no sequence holds, in every pool, all NaN."""
  if not isinstance(engine.block_state, (pooled_step.PooledState,
                                         shared_pool.SharedState)):
    _poison_unowned_blocks(engine)
    return
  runner = engine._runner  # pylint: disable=protected-access
  if isinstance(engine.block_state, shared_pool.SharedState):
    runner.cache = _poison(runner.cache, np.asarray(engine.block_state.state.refcounts) == 0)
    return
  runner.cache = tuple(_poison(c, np.asarray(s.refcounts) == 0)
                       for c, s in zip(runner.cache, engine.block_state.states))


def _run(engine, requests, *, checked: bool) -> dict:
  """Serves `requests`; with `checked`, after every step: the host model is
  the device state, each sequence holds at most `MAX_HELD` blocks, the
  state's invariants hold, and every block nobody holds is NaN."""
  for r in requests:
    assert engine.add_request(r) is None, r
  outs, peak = {}, 0
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
    pending = engine._pending  # pylint: disable=protected-access
    if checked and pending is not None and pending.multi is not None:
      # a K-step dispatch: the host replays its loop when it resolves it
      engine._resolve_pending()  # pylint: disable=protected-access
      for o in engine._take_outputs():  # pylint: disable=protected-access
        outs[o.request_id] = o
    if checked:
      assert_mirror_is_the_device_state(engine)
      for state in _states(engine):
        bm.check_invariants(state)
      held = _held(engine)
      peak = max(peak, int(held.max()))
      assert held.max() <= MAX_HELD, held
      _poison_free_blocks(engine)
  engine.flush()
  for o in engine._take_outputs():  # pylint: disable=protected-access
    outs[o.request_id] = o
  if checked:
    assert peak >= 2  # the sequences did hold blocks
  return {k: [(c.token_ids, c.finish_reason) for c in o.completions]
          for k, o in outs.items()}


def _all_free(engine) -> bool:
  return all(int(s.num_free) == s.num_blocks for s in _states(engine))


@pytest.mark.parametrize("kind, async_scheduling", [
    ("mistral", False), ("gemma3", True),  # one synchronous, one asynchronous
    pytest.param("mistral", True, marks=pytest.mark.slow),  # the suite's time
    pytest.param("gemma3", False, marks=pytest.mark.slow)])
def test_reclamation_gives_the_outputs_of_keeping_every_block(
    request, kind, async_scheduling):
  model = request.getfixturevalue(kind)
  requests = _requests()
  keep = _engine(model, 256, sliding_window_reclamation=False)
  assert not keep.reclamation.on
  want = _run(keep, requests, checked=False)
  # 8 sequences of up to 80 tokens would need 160 blocks without
  # reclamation; with it, ~4 each in a local pool or sub-group (Gemma 3:
  # one pool of 240 one-layer blocks shared by its six layers).
  pool = 24 if kind == "mistral" else 40
  small = _engine(model, pool, check_traces=True,
                  admission_headroom_steps=0, async_scheduling=async_scheduling)
  if kind == "mistral":
    assert small.reclamation.window == WINDOW
  else:
    assert small.reclamation.pools == (WINDOW, None)
    assert small.reclamation.layout == "shared"
    # Same KV bytes: 40 blocks x 6 layers = one pool of 240 blocks of 1 layer.
    assert small.block_state.num_blocks == 240
    assert small.cache.num_layers == 1
  assert _run(small, requests, checked=True) == want
  if kind == "gemma3":  # a pool per window: the same outputs
    # The layout prefix caching picks, in the pool of
    # test_prefix_caching_with_reclamation[gemma3-20] (its step programs,
    # where a pool per window of its own compiled two more): it preempts.
    per_window = _engine(model, 20, enable_prefix_caching=True,
                         admission_headroom_steps=0)
    assert isinstance(per_window.block_state, pooled_step.PooledState)
    assert _run(per_window, requests, checked=False) == want
    assert per_window.stats.preemptions > 0
  assert small.stats.preemptions == 0
  assert small.stats.running.peak == 4  # max_batch: the pool was no limit
  assert _all_free(small)  # every block back in every pool
  assert_mirror_is_the_device_state(small)
  # Block-aware admission (the default admission_headroom_steps) charges a
  # windowed pool what its sequences hold there, which stops growing at their
  # window (`window_pool.local_admission_room`), not a global pool's growth:
  # the same pools admit max_batch at once, with no preemption. (Charged the
  # global rule, Mistral's 24-block pool held the batch at 3; Gemma 3's
  # 26-block local pool did in some asynchronous runs, by timing.)
  admit = _engine(model, pool, async_scheduling=async_scheduling)
  assert admit.config.admission_headroom_steps == 16  # the default
  assert _run(admit, requests, checked=True) == want
  assert admit.stats.running.peak == 4
  assert admit.stats.preemptions == 0
  assert _all_free(admit)
  assert_mirror_is_the_device_state(admit)
  # Without reclamation the same memory preempts (and gives the same
  # outputs): the comparison that test_without_reclamation_the_same_pool_preempts
  # (-m slow) makes for Mistral in a pool of 40.
  off = _engine(model, pool, admission_headroom_steps=0,
                sliding_window_reclamation=False)
  assert _run(off, requests, checked=False) == want
  assert off.stats.preemptions > 0


@pytest.mark.slow  # (its own step programs; the 5:1 model runs G = 1 above)
def test_shared_pool_with_sub_groups_of_two_layers():
  """Gemma 2's alternating pattern over 4 layers: sub-groups of G = 2 layers
  (a cache of 2 layers, read at a traced layer index), checked every step;
  the outputs of keeping every block."""
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(
      num_layers=4, sliding_window=WINDOW,
      layer_types=("sliding_attention", "full_attention") * 2), seed=5)
  requests = _requests()
  want = _run(_engine(model, 256, sliding_window_reclamation=False), requests,
              checked=False)
  on = _engine(model, 40, admission_headroom_steps=0)
  assert on.block_state.windows == (WINDOW, None) and on.cache.num_layers == 2
  assert on.block_state.num_blocks == 80  # 40 blocks x 4 layers / 2
  assert _run(on, requests, checked=True) == want
  assert _all_free(on)


# The hybrid under preemption is also test_prefix_caching_with_reclamation
# [gemma3-20]'s case (checked every step, preemptions asserted): its run
# here is slow only, for the suite's time.
@pytest.mark.parametrize("kind, num_blocks", [
    ("mistral", 12), pytest.param("gemma3", 20, marks=pytest.mark.slow)])
def test_reclamation_under_preemption(request, kind, num_blocks):
  """Pools too small even with reclamation: preemptions (recompute) and
  the same outputs."""
  model = request.getfixturevalue(kind)
  requests = _requests(seed=1)
  want = _run(_engine(model, 256, sliding_window_reclamation=False), requests,
              checked=False)
  tight = _engine(model, num_blocks, admission_headroom_steps=0)
  assert _run(tight, requests, checked=True) == want
  assert tight.stats.preemptions > 0
  assert _all_free(tight)


# test_reclamation_gives_the_outputs_of_keeping_every_block makes the same
# comparison for both models in their reclaiming pools (4 step programs fewer).
@pytest.mark.slow
def test_without_reclamation_the_same_pool_preempts(mistral):
  """The comparison: the same small pool keeping every block preempts (and
  still gives the same outputs)."""
  requests = _requests()
  on = _engine(mistral, 40, admission_headroom_steps=0)
  off = _engine(mistral, 40, admission_headroom_steps=0,
                sliding_window_reclamation=False)
  assert _run(on, requests, checked=False) == _run(off, requests, checked=False)
  assert on.stats.preemptions == 0 < off.stats.preemptions


def test_beams_and_samples_fork_reclaimed_tables(mistral):
  """Forks (n > 1, beams) copy a table with a reclaimed prefix; outputs
  equal the engine keeping every block."""
  rng = np.random.default_rng(5)
  params = [SamplingParams(max_new_tokens=14, n=2, temperature=0.8, seed=7)] * 3 + [
      SamplingParams(max_new_tokens=14, beam_width=2)] * 2
  reqs = [Request(i, rng.integers(3, 512, size=int(rng.integers(30, 50))).tolist(), p)
          for i, p in enumerate(params)]
  kw = dict(max_beam_width=2)
  want = _run(_engine(mistral, 256, sliding_window_reclamation=False, **kw),
              reqs, checked=False)
  # The reclamation test's pool (its step programs: the beam width changes
  # none of them).
  on = _engine(mistral, 24, **kw)
  assert _run(on, reqs, checked=True) == want
  assert int(on.block_state.num_free) == 24


# ------------------------------------------------------------ the switch


def test_auto_is_off_without_windows_and_on_with_them(model, gemma3, mistral,
                                                     caplog):
  assert _engine(model, 64).reclamation == reclamation.Reclamation(
      None, "the model has no sliding-window layers")
  assert _engine(model, 64).block_state.window is None
  with caplog.at_level(logging.INFO, logger="paged_jax.serving"):
    assert _engine(mistral, 64).block_state.window == WINDOW
    hybrid = _engine(gemma3, 64)
  assert hybrid.reclamation.pools == (WINDOW, None)
  assert hybrid.block_state.windows == (WINDOW,) * 5 + (None,)  # sub-groups
  assert ("sliding-window reclamation on (one KV pool shared by the layer "
          "groups (10, None))" in caplog.text)
  # A pool that cannot hold one sequence: auto falls back, True refuses.
  why = (r"num_blocks=8 gives the shared pool 48 blocks of 1 layers, less than "
         r"one sequence of max_model_len=96 tokens needs in its 6 sub-groups \(64\)")
  with caplog.at_level(logging.INFO, logger="paged_jax.serving"):
    fallback = _engine(gemma3, 8)
  assert not fallback.reclamation.on
  assert re.search(why, fallback.reclamation.reason)
  assert re.search("sliding-window reclamation off: " + why, caplog.text)
  with pytest.raises(ValueError, match=why):
    _engine(gemma3, 8, sliding_window_reclamation=True)


def test_prefix_caching_keeps_a_pool_per_window_and_says_why(gemma3, caplog):
  """`window_pool.layout`, the one rule: the shared pool unless prefix
  caching (its hits are anchored on a global pool with links into each
  window's); the reason in the decision and its log line."""
  with caplog.at_level(logging.INFO, logger="paged_jax.serving"):
    cached = _engine(gemma3, 64, enable_prefix_caching=True)
  assert isinstance(cached.block_state, pooled_step.PooledState)
  assert cached.reclamation.layout.startswith("prefix caching")
  assert ("sliding-window reclamation on (a KV pool per window: (10, None); "
          "prefix caching: hits are anchored" in caplog.text)
  assert isinstance(_engine(gemma3, 64).block_state, shared_pool.SharedState)


def _shared_prefix_requests(seed=2, count=10):
  """Prompts of a 37-token common prefix (9 blocks, the window of 10 slides
  inside it) and a distinct tail; greedy."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(3, 512, size=37).tolist()
  return [Request(i, prefix + rng.integers(3, 512, size=int(rng.integers(3, 20))).tolist(),
                  SamplingParams(max_new_tokens=int(rng.integers(4, 14))))
          for i in range(count)]


def _poison_empty_blocks(engine):
  """Every block on a pool's free stack (reclaimed or released, not cached)
  all NaN: a hit or a step reading one shows in the tokens."""
  runner = engine._runner  # pylint: disable=protected-access
  empty = [np.isin(np.arange(s.num_blocks), np.asarray(s.free_stack)[:int(s.num_free)])
           for s in _states(engine)]
  if isinstance(engine.block_state, pooled_step.PooledState):
    runner.cache = tuple(_poison(c, e) for c, e in zip(runner.cache, empty))
  else:
    runner.cache = _poison(runner.cache, empty[0])


@pytest.mark.parametrize("kind, num_blocks", [
    pytest.param("gemma3", 40, marks=pytest.mark.slow),  # the suite's time
    ("gemma3", 20), ("mistral", 16)])
def test_prefix_caching_with_reclamation(request, monkeypatch, kind, num_blocks):
  """Prefix caching with reclamation, on a hybrid model (a pool per window,
  hits anchored on the global pool) and on one whose every layer has the
  window (one pool: a hit needs only its last window cached): hits occur,
  the greedy tokens are those with neither (every empty block NaN after
  every step), the host model (links included) and the index match the
  device at every step, and every block of every pool ends free or cached.
  The pools are too small to keep every sequence: preemptions and
  evictions. On one pool, some hits are longer than the cached chain from
  the first block: their blocks before the last window were evicted."""
  model = request.getfixturevalue(kind)
  beyond = []  # one pool: hits longer than the chain from column 0
  window_hit = prefix_lib.PrefixCaching._window_hit  # pylint: disable=protected-access

  def spy(self, hashes):
    blocks = window_hit(self, hashes)
    beyond.append(len(blocks) > len(self._index.lookup(hashes)))  # pylint: disable=protected-access
    return blocks

  monkeypatch.setattr(prefix_lib.PrefixCaching, "_window_hit", spy)
  requests = _shared_prefix_requests()
  want = _run(_engine(model, 256, sliding_window_reclamation=False), requests,
              checked=False)
  engine = _engine(model, num_blocks, enable_prefix_caching=True,
                   admission_headroom_steps=0)
  if kind == "gemma3":
    assert engine.reclamation.pools == (WINDOW, None)
  else:
    assert engine.block_state.window == WINDOW
  assert engine.block_state.prefix_caching
  for r in requests:
    assert engine.add_request(r) is None
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
    assert_mirror_is_the_device_state(engine)
    for p in engine._pools:  # pylint: disable=protected-access
      p.check_prefix_index()
    for state in _states(engine):
      bm.check_invariants(state)
    # A step's newly full blocks are kept one step longer (registered first).
    assert _held(engine).max() <= MAX_HELD + SIZES["max_tokens_per_step"] // BS + 1
    _poison_empty_blocks(engine)
  got = {k: [(c.token_ids, c.finish_reason) for c in o.completions]
         for k, o in outs.items()}
  assert got == want
  st = engine.stats
  assert st.prefix_hit_tokens > 0, st
  for state in _states(engine):  # every block back: free or cached
    assert int(state.num_free) + int(state.num_cached) == state.num_blocks
    assert int(np.sum(np.asarray(state.refcounts))) == 0
  if num_blocks <= 20:
    assert st.preemptions > 0 and st.prefix_blocks_evicted > 0, st
  assert any(beyond) == (kind == "mistral"), beyond


def test_prefix_caching_on_one_pool_with_a_window_under_a_block():
  """A window shorter than a block (3 tokens, blocks of 4), so a 16-token
  chunk defers more columns (kept for registration, `reclaim_stop`) than a
  4-row decode step makes invisible: the decode step's reclamation must reach
  back to them, as the host's does (the fingerprints compared at every step).
  One long prompt twice, the second after the first finished: the second
  hits, greedy tokens equal to caching and reclamation off."""
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(sliding_window=3), seed=5)
  rng = np.random.default_rng(7)
  prompt = rng.integers(3, 512, size=61).tolist()
  reqs = [Request(i, prompt, SamplingParams(max_new_tokens=6)) for i in range(2)]
  want, got = [], []
  for out, kw in ((want, dict(sliding_window_reclamation=False)),
                  (got, dict(enable_prefix_caching=True))):
    engine = _engine(model, 64, **kw)
    for r in reqs:
      assert engine.add_request(r) is None
      while engine.has_unfinished():
        for o in engine.step():
          out.append(o.completions[0].token_ids)
        assert_mirror_is_the_device_state(engine)
  assert engine.block_state.window == 3 and engine.block_state.prefix_caching
  assert engine.stats.prefix_hit_tokens > 0, engine.stats
  assert got == want


def test_prefix_caching_over_windows_needs_a_global_pool():
  """Pools of windows with no global one have no pool to anchor hits on."""
  with pytest.raises(ValueError, match=r"needs a global pool .* got windows=\(10,\)"):
    pooled_step.init([8], [WINDOW], block_size=BS, max_seqs=2,
                     max_blocks_per_seq=4, prefix_caching=True)
  assert reclamation.caching_conflict(
      EngineConfig(num_blocks=8, enable_prefix_caching=True), (10, 20))
  assert reclamation.caching_conflict(
      EngineConfig(num_blocks=8, enable_prefix_caching=True), None) is None


@pytest.mark.parametrize("kw, field", [
    (dict(kv_offloading_size=0.01, enable_prefix_caching=True),
     "kv_offloading_size=0.01"),
    (dict(preemption_mode="swap", swap_space_blocks=8), "preemption_mode='swap'"),
    (dict(speculative_config=SpeculativeConfig(num_speculative_tokens=2)),
     "speculative_config"),
])
def test_unsupported_features_turn_it_off_or_refuse(gemma3, caplog, kw, field):
  with caplog.at_level(logging.INFO, logger="paged_jax.serving"):
    engine = _engine(gemma3, 64, **kw)
  assert not engine.reclamation.on
  assert not isinstance(engine.block_state, pooled_step.PooledState)
  assert field in engine.reclamation.reason
  assert f"sliding-window reclamation off: {field}" in caplog.text
  with pytest.raises(ValueError, match=rf"sliding_window_reclamation=True: .*{field}"):
    EngineConfig(num_blocks=64, sliding_window_reclamation=True, **kw)


def test_multistep_reclaims_in_its_loop_on_one_pool(gemma3, mistral, caplog):
  """Multi-step decode (K = 4) on one windowed pool reclaims after each of
  its loop's iterations: greedy tokens equal a single-step engine keeping
  every block, the host model equals the device after every dispatch, every
  sequence holds at most `MAX_HELD` blocks, freed blocks NaN, and K-step
  dispatches ran. On a hybrid model (a pool per window) reclamation is off
  (auto) or refused (True)."""
  requests = _requests(seed=3)
  # The reference is the pool of 256 that the module's other references
  # use (its steps compiled once); its size changes no token.
  want = _run(_engine(mistral, 256, sliding_window_reclamation=False), requests,
              checked=False)
  # The reclamation test's pool: only the K-step program is this test's own.
  engine = _engine(mistral, 24, num_scheduler_steps=4)
  assert engine.block_state.window == WINDOW
  assert _run(engine, requests, checked=True) == want
  assert engine.stats.multistep_tokens > 0, engine.stats
  assert _all_free(engine)
  field = "num_scheduler_steps=4 (multi-step decode) is not supported with it"
  with caplog.at_level(logging.INFO, logger="paged_jax.serving"):
    hybrid = _engine(gemma3, 64, num_scheduler_steps=4)
  assert not hybrid.reclamation.on and field in hybrid.reclamation.reason
  with pytest.raises(ValueError, match=re.escape(f"sliding_window_reclamation=True: {field}")):
    _engine(gemma3, 64, num_scheduler_steps=4, sliding_window_reclamation=True)


def test_explicit_true_refuses_a_model_or_mesh_it_cannot_serve(model, mistral):
  with pytest.raises(ValueError, match="sliding_window_reclamation=True: the "
                     "model has no sliding-window layers"):
    _engine(model, 64, sliding_window_reclamation=True)
  config = EngineConfig(num_blocks=64, sliding_window_reclamation=True)
  with pytest.raises(ValueError, match="a device mesh is not supported"):
    reclamation.decide(config, mistral.config, mesh=object())
  auto = EngineConfig(num_blocks=64)
  assert reclamation.decide(auto, mistral.config, mesh=object()).window is None


@pytest.mark.parametrize("bad", ["yes", 1, 0])
def test_the_field_must_be_none_or_a_bool(bad):
  with pytest.raises(ValueError, match=r"sliding_window_reclamation must be "
                     rf"None \(auto\) or a bool, got {bad!r}"):
    EngineConfig(num_blocks=8, sliding_window_reclamation=bad)


def test_resizing_the_pool_is_refused_by_name_with_reclamation(mistral):
  engine = _engine(mistral, 24)
  assert engine.reclamation.on
  with pytest.raises(ValueError, match="sliding-window block reclamation"):
    engine.resize_kv_cache(128)
