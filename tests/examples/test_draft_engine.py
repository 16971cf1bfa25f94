"""The draft-model proposer in the engine (`{"method": "draft_model", ...}`,
`serving.spec_draft`): a draft identical to the target accepts every
proposal; a draft cut to the target's first layer gives exactly the
target's tokens, greedy and sampled, under preemption; the draft's KV lives
in the target's blocks (one pool: every block returns, the host model
replays every step); each shape traces once; the config's errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.serving import spec_draft
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.speculative import SpeculativeConfig
from tests.examples.conftest import (assert_mirror_is_the_device_state, assert_pool_empty,
                                     random_requests)

# One decode shape (2 rows) and one mixed one (8 tokens): few programs to
# compile (each costs ~5 s of CPU on JAX 0.12; several mixed shapes are
# test_engine.py's test_steps_never_retrace's).
SIZES = dict(block_size=4, max_batch=2, max_tokens_per_step=8, max_model_len=64,
             min_bucket=8, bucket_midpoints=False)
POOL = 48
IDENTICAL = SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                              adaptive=False)
ONE_LAYER = SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                              draft_num_layers=1, adaptive=False)


def _engine(model, spec=None, num_blocks=POOL, **kw) -> Engine:
  return Engine(model, EngineConfig(num_blocks=num_blocks, speculative_config=spec,
                                    **{**SIZES, **kw}))


@jax.jit
def _poison(cache, mask):
  """Every cache of `cache` (one, or the target's and the draft's) with the
  blocks where `mask` (bool[num_blocks]) is set all NaN."""
  return jax.tree.map(
      lambda p: jnp.where(mask[None, None, :, None, None], jnp.nan, p), cache)


def _run(engine: Engine, requests, *, checked: bool = True) -> dict:
  """`{id: [(tokens, finish reason)]}`; with `checked`, after every step
  the host's pool model equals the device state and every block nobody
  owns is NaN in both caches (a stray read of a freed block shows)."""
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
      assert_mirror_is_the_device_state(engine)
      state = jax.device_get(engine.block_state)
      runner = engine._runner  # pylint: disable=protected-access
      runner.cache = _poison(runner.cache, np.asarray(state.refcounts) == 0)
  engine.flush()
  for o in engine._take_outputs():  # pylint: disable=protected-access
    outs[o.request_id] = o
  return {k: [(c.token_ids, c.finish_reason) for c in o.completions]
          for k, o in outs.items()}


def _requests(**params) -> list:
  passage = [30, 41, 52, 63, 74]
  return [Request("c", passage * 3, SamplingParams(max_new_tokens=14, **params))
          ] + random_requests(3, 3, prompt=(3, 14), new=(6, 18), **params)


# By default the identical draft runs with prefix caching and preemption
# (test_spec_prefix_engine.py: acceptance 1.0, both caches poisoned).
@pytest.mark.slow
def test_a_draft_identical_to_the_target_accepts_every_proposal(model):
  """The strongest check of the draft's cache: its KV, written by ordinary
  steps and by its own decode loop at the target's slots, gives the
  target's own greedy tokens, so every proposal is accepted."""
  requests = _requests()
  want = _run(_engine(model), requests, checked=False)
  engine = _engine(model, IDENTICAL)
  assert isinstance(engine._runner.cache, tuple)  # pylint: disable=protected-access
  assert _run(engine, requests) == want
  st = engine.stats
  assert st.spec_steps > 0 and st.spec_proposed > 0
  assert st.acceptance_rate == 1.0
  assert_pool_empty(engine)


def test_a_one_layer_draft_gives_the_target_tokens_under_preemption(model):
  """Greedy and sampled rows (accepted iff the target's seeded draw equals
  the draft's argmax: exact for any temperature), in a pool small enough
  to preempt (the draft's prefill is recomputed with the target's)."""
  requests = _requests() + [
      Request(f"s{i}", r.prompt, SamplingParams(max_new_tokens=12, seed=i, **p))
      for i, (r, p) in enumerate(zip(_requests(), [
          dict(temperature=0.05), dict(temperature=1.0, top_k=2)]))]
  want = _run(_engine(model, num_blocks=10), requests, checked=False)
  engine = _engine(model, ONE_LAYER, num_blocks=10, admission_headroom_steps=0)
  assert _run(engine, requests) == want
  st = engine.stats
  assert st.preemptions > 0 and st.spec_steps > 0
  assert 0 < st.acceptance_rate < 1 and st.mean_accepted_length > 0
  assert_pool_empty(engine)


def test_resizing_the_pool_is_refused_by_name(model):
  with pytest.raises(ValueError, match="not supported with a draft model"):
    _engine(model, ONE_LAYER).resize_kv_cache(POOL // 2)


@pytest.mark.slow  # ~45 s of compiles; n-gram's verification shapes are checked by default
def test_every_shape_traces_once(model):
  engine = Engine(model, EngineConfig(num_blocks=POOL, check_traces=True,
                                      speculative_config=ONE_LAYER, **SIZES))
  _run(engine, _requests()[:2], checked=False)
  _run(engine, _requests()[2:], checked=False)  # a second round: same shapes
  assert engine.stats.spec_steps > 0


def test_truncate_layers_keeps_the_first_layers(model):
  cut = spec_draft.truncate_layers(model, 1)
  assert cut.config.num_layers == 1 and model.config.num_layers == 2
  np.testing.assert_array_equal(cut.layers.self_attn.q_proj.kernel[...],
                                model.layers.self_attn.q_proj.kernel[...][:1])
  assert spec_draft.truncate_layers(model, 2) is model
  with pytest.raises(ValueError, match=r"draft_num_layers must be an int in \[1, 2\]"):
    spec_draft.truncate_layers(model, 3)


def test_a_draft_with_another_vocabulary_is_refused(model):
  from paged_jax import models  # pylint: disable=import-outside-toplevel
  other = models.tiny(0, vocab_size=256)
  with pytest.raises(ValueError, match="vocab_size=256 must equal the target's"):
    spec_draft.DraftPair(model, other)


@pytest.mark.parametrize("config,why", [
    ({"method": "draft_model", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "prompt_lookup_max does not apply to method="),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "tiny"},
     "model does not apply to method='ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3},
     "model must be a checkpoint name or path"),
    ({"method": "draft_model", "num_speculative_tokens": 2,
      "draft_num_layers": 0}, "draft_num_layers must be a positive int"),
])
def test_config_errors_name_the_key(config, why):
  with pytest.raises(ValueError, match=why):
    SpeculativeConfig.from_json(config)


def test_the_flag_reads_vllms_keys(model):
  spec = SpeculativeConfig.from_json(
      '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4}')
  assert (spec.method, spec.model, spec.num_speculative_tokens) == (
      "draft_model", "tiny", 4)
  assert spec.prompt_lookup_min is None and spec.draft_num_layers is None
  pair = spec_draft.attach(model, spec)  # "tiny": the seeded tiny Llama
  assert isinstance(pair, spec_draft.DraftPair) and pair.draft is not model
  assert pair.draft.config == model.config and pair.config is model.config
  with pytest.raises(ValueError, match="propose is the ngram proposer"):
    spec.propose(jnp.zeros((1, 4), jnp.int32), jnp.array([4]))


def test_the_kv_budget_counts_the_drafts_cache():
  """`--kv-budget-mb` sizes one pool for both caches (they share its
  blocks): a draft cut to n of L layers adds n/L of the target's bytes per
  token, an identical one doubles them, n-gram and a separate checkpoint
  add nothing here."""
  import argparse  # pylint: disable=import-outside-toplevel
  from paged_jax.entrypoints import engine_args  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  cfg = model_lib.LlamaConfig.tiny()
  base = cfg.kv_bytes_per_token()
  for spec, want in ((None, base), (IDENTICAL, 2 * base),
                     (ONE_LAYER, base + base // cfg.num_layers),
                     (SpeculativeConfig(method="ngram", num_speculative_tokens=2), base),
                     (SpeculativeConfig(method="draft_model", model="tiny",
                                        num_speculative_tokens=2), base)):
    args = argparse.Namespace(kv_cache_dtype=None, speculative_config=spec)
    assert engine_args.pool_bytes_per_token(args, cfg) == want, spec
