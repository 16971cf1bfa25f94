"""Speculative decoding with prefix caching (n-gram and draft model): greedy
outputs are those of the same engine with speculation off, on prompts that
share a passage and on follow-ups that extend an earlier answer (so hits land
on blocks that verification steps wrote); hits happen as often as without
speculation; no cached block holds a rejected draft (every indexed block's
K/V equals the plain engine's block of the same tokens); the host's pool
model and index follow every rollback; freed blocks are NaN-poisoned after
every step; every block returns, also under preemption."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.speculative import SpeculativeConfig
from tests.examples.conftest import assert_mirror_is_the_device_state

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=3, adaptive=False)
IDENTICAL = SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                              adaptive=False)
# test_draft_engine's sizes (one decode and one mixed shape: few programs)
# and a pool that preempts.
SIZES = dict(block_size=4, max_batch=2, max_tokens_per_step=8, max_model_len=64,
             min_bucket=8, bucket_midpoints=False, num_blocks=20,
             admission_headroom_steps=0)
PASSAGE = [30, 41, 52, 63, 74, 85, 96]


def _engine(model, spec, **kw) -> Engine:
  return Engine(model, EngineConfig(enable_prefix_caching=True, speculative_config=spec,
                                    **{**SIZES, **kw}))


@jax.jit
def _poison(cache, mask):
  """Every cache of `cache` (one, or the target's and the draft's) with the
  blocks where `mask` (bool[num_blocks]) is set all NaN."""
  return jax.tree.map(
      lambda p: jnp.where(mask[None, None, :, None, None], jnp.nan, p), cache)


def _check_and_poison(engine: Engine):
  """The host's pool model is the device state, the index names exactly the
  cacheable blocks, and every block nobody holds (refcount 0, not cached)
  is refilled with NaN: a stray read of a rolled-back block shows."""
  assert_mirror_is_the_device_state(engine)
  engine._pools[0].check_prefix_index()  # pylint: disable=protected-access
  state = jax.device_get(engine.block_state)
  mask = np.asarray(state.refcounts) == 0
  mask[bm.cached_blocks(state)] = False
  runner = engine._runner  # pylint: disable=protected-access
  runner.cache = _poison(runner.cache, jnp.asarray(mask))


def _serve(engine: Engine, requests, *, checked: bool) -> dict:
  """`{id: (tokens, prompt tokens served from the cache)}`, checked after
  every step when `checked`."""
  for r in requests:
    assert engine.add_request(r) is None, r
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
    if checked and engine._pending is not None:  # pylint: disable=protected-access
      engine._resolve_pending()  # pylint: disable=protected-access
      for o in engine._take_outputs():  # pylint: disable=protected-access
        outs[o.request_id] = o
      _check_and_poison(engine)
  engine.flush()
  for o in engine._take_outputs():  # pylint: disable=protected-access
    outs[o.request_id] = o
  return {k: (o.completions[0].token_ids, o.num_cached_tokens) for k, o in outs.items()}


def _questions(tag: str, n: int, new: int = 16) -> list[Request]:
  """Questions about one passage: the passage three times (hits for every
  prompt after the first), a distinct word, and the passage's start (prompt
  lookup proposes its continuation)."""
  return [Request(f"{tag}{i}", PASSAGE * 3 + [200 + i] + PASSAGE[:2],
                  SamplingParams(max_new_tokens=new + i)) for i in range(n)]


def _follow_ups(first: list[Request], answers: dict, new: int = 10) -> list[Request]:
  """Each prompt of `first` with its answer and a new question: the hit
  covers blocks that the answer's decode (verification steps) wrote."""
  return [Request(f"f{r.request_id}", r.prompt + answers[r.request_id][0]
                  + [300] + PASSAGE[:2], SamplingParams(max_new_tokens=new))
          for r in first]


def _phases(engine: Engine, n: int, *, checked: bool, reference: dict | None = None,
            new: int = 16) -> dict:
  """Serves the questions, then the follow-ups (built from `reference`'s
  answers, or from this run's), one phase after the other."""
  first = _questions("q", n, new)
  out = _serve(engine, first, checked=checked)
  out.update(_serve(engine, _follow_ups(first, reference or out), checked=checked))
  return out


def _cached_blocks_agree(spec: Engine, plain: Engine, requests: list[list[int]]):
  """Every block that both engines index for the same tokens (any prefix of
  `requests`' token lists) holds the same K/V in both: a block that kept a
  rejected draft's K/V would differ. Returns the blocks compared."""
  (a,), (b,) = spec._pools, plain._pools  # pylint: disable=protected-access
  ia, ib = a.prefix_index, b.prefix_index
  runners = (spec._runner, plain._runner)  # pylint: disable=protected-access
  ka, kb = (jax.device_get(r.cache) for r in runners)
  ka = ka[0] if isinstance(ka, tuple) else ka  # a draft's pair: the target's
  pairs = set()
  for tokens in requests:
    for x, y in zip(ia.lookup(ia.block_hashes(tokens)), ib.lookup(ib.block_hashes(tokens))):
      pairs.add((x, y))
  for x, y in sorted(pairs):
    for pa, pb in zip(jax.tree.leaves(ka), jax.tree.leaves(kb)):
      np.testing.assert_allclose(np.asarray(pa)[:, :, x], np.asarray(pb)[:, :, y],
                                 rtol=1e-4, atol=1e-5, err_msg=f"block {x} vs {y}")
  return len(pairs)


@pytest.fixture(scope="module")
def reference(model):
  """`(engine, outputs)` of speculation off, waiting for each step's
  results as speculation does (with asynchronous scheduling a sequence's
  last full block may hold a token in flight when it finishes, and goes
  unregistered: fewer hits)."""
  plain = _engine(model, None, async_scheduling=False)
  return plain, _phases(plain, 3, checked=False)


def test_ngram_with_prefix_caching_gives_the_same_tokens_and_hits(model, reference):
  """In a pool that preempts: the same tokens, the same hits prompt by
  prompt (follow-ups hit past their question, into blocks that
  verification steps wrote), and every block both engines cache for the
  same tokens holds the same K/V."""
  plain, want = reference
  engine = _engine(model, NGRAM)
  got = _phases(engine, 3, checked=True, reference=want)
  assert got == want
  st = engine.stats
  assert st.spec_steps > 0 and st.spec_accepted > 0 and st.preemptions > 0
  assert st.prefix_hit_tokens == plain.stats.prefix_hit_tokens > 0
  first = _questions("q", 3)
  assert max(got[f"f{r.request_id}"][1] - len(r.prompt) for r in first) > 0
  tokens = [r.prompt + got[r.request_id][0] for r in first]
  assert _cached_blocks_agree(engine, plain, tokens) > len(PASSAGE) // 4
  _assert_every_block_returns(engine)


def test_a_draft_model_with_prefix_caching_accepts_every_proposal(model, reference):
  """A draft identical to the target: its KV in blocks taken from the cache
  (written by ordinary steps and its own decode loop) gives the target's
  tokens, so every proposal is accepted, hits included, under preemption."""
  plain, want = reference
  engine = _engine(model, IDENTICAL)
  got = _phases(engine, 3, checked=True, reference=want)
  assert got == want
  st = engine.stats
  assert st.spec_steps > 0 and st.acceptance_rate == 1.0 and st.preemptions > 0
  assert st.prefix_hit_tokens == plain.stats.prefix_hit_tokens > 0
  _assert_every_block_returns(engine)


def _assert_every_block_returns(engine: Engine):
  """Nothing runs; every block is free or cached, none referenced."""
  state = jax.device_get(engine.block_state)
  bm.check_invariants(engine.block_state)
  assert_mirror_is_the_device_state(engine)
  assert not np.asarray(state.refcounts).any()
  assert int(state.num_free) + int(state.num_cached) == engine.config.num_blocks
  assert not engine.has_unfinished()
