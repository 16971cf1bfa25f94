"""Top log-probs (`SamplingParams.logprobs`) and `logit_bias` through the
engine, on the tiny model, checked against the dense model's logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax.serving import compiler
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests.examples.conftest import SIZES, DenseOracle, serve

TOL = 2e-4  # paged vs dense forward, float32


@pytest.fixture(scope="module")
def model():
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  return model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def oracle(model):
  return DenseOracle(model)


@pytest.fixture(scope="module")
def engine(model):
  """One trace-checked engine for the module: no program traced twice."""
  # A bias width of 2: the sizes of test_spec_engine's and
  # test_engines_of_other_bias_widths_do_not_share_steps' engines (their
  # step programs; the same xdist unit, tests/conftest.py).
  e = Engine(model, EngineConfig(num_blocks=64, check_traces=True, max_logit_bias=2,
                                 **SIZES))
  e.warmup()
  return e


def _ref(oracle, prompt, generated, i):
  """f32[vocab]: log_softmax of the dense logits before generated token `i`."""
  return np.asarray(jax.nn.log_softmax(oracle.next_logits(list(prompt) + generated[:i])))


def test_top_logprobs_match_the_model(engine, oracle):
  prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}
  reqs = [Request("a", prompts["a"], SamplingParams(max_new_tokens=5, logprobs=5)),
          Request("b", prompts["b"], SamplingParams(max_new_tokens=5)),
          Request("c", prompts["c"], SamplingParams(max_new_tokens=4, temperature=1.0,
                                                    seed=3, logprobs=8))]
  compiles = compiler.compiled_count()
  out = serve(engine, reqs)
  assert compiler.compiled_count() == compiles
  assert out["b"].completions[0].top_logprobs is None  # not asked
  for rid, n in (("a", 5), ("c", 8)):
    c = out[rid].completions[0]
    assert len(c.top_logprobs) == len(c.token_ids) == len(c.token_logprobs)
    for i, (tok, lp, top) in enumerate(zip(c.token_ids, c.token_logprobs, c.top_logprobs)):
      ref = _ref(oracle, prompts[rid], c.token_ids, i)
      ids = [t for t, _ in top]
      vals = np.array([v for _, v in top])
      assert len(top) == n and len(set(ids)) == n
      assert np.all(np.diff(vals) <= 0)  # sorted, best first
      np.testing.assert_allclose(vals, ref[ids], atol=TOL)
      assert vals[-1] >= np.sort(ref)[::-1][n] - TOL  # no better token left out
      np.testing.assert_allclose(lp, ref[tok], atol=TOL)  # the sampled token's
      if rid == "a":  # greedy: the sampled token is the best one
        assert ids[0] == tok or abs(vals[0] - ref[tok]) < TOL


def test_logprobs_past_the_limit_is_rejected(engine):
  out = engine.add_request(Request("x", [1, 2], SamplingParams(logprobs=9)))
  assert out is not None and "logprobs must be <= 8 (the engine's max_logprobs), got 9" in out.rejected
  engine.run_until_done()


def test_top_logprobs_stream_in_deltas(engine):
  e = engine
  e.stream_deltas()
  e.add_request(Request("s", [3, 4, 5], SamplingParams(max_new_tokens=3, logprobs=2)))
  e.run_until_done()
  deltas = [d for d in e.take_deltas() if d.index == 0]
  e.stream_deltas(False)
  assert [len(d.top_logprobs[0]) for d in deltas] == [2, 2, 2]


def _greedy(engine, prompts, **params):
  reqs = [Request(rid, p, SamplingParams(max_new_tokens=5, **params.get(rid, {})))
          for rid, p in prompts.items()]
  return {rid: o.completions[0] for rid, o in serve(engine, reqs).items()}


def test_logit_bias_forces_and_bans_and_leaves_neighbours_alone(engine):
  prompts = {"up": [5, 6, 7, 8], "plain": [9, 10, 11], "down": [12, 13, 14, 15, 16]}
  base = _greedy(engine, prompts)
  forced = next(t for t in range(300, 512) if t not in base["up"].token_ids)
  banned = list(dict.fromkeys(base["down"].token_ids))[:2]  # its first token too
  compiles = compiler.compiled_count()
  got = _greedy(engine, prompts, up=dict(logit_bias={forced: 100.0}, logprobs=2),
                down=dict(logit_bias={t: -100 for t in banned}))
  assert compiler.compiled_count() == compiles  # (and check_traces: no program traced again)
  assert got["up"].token_ids == [forced] * 5
  # The log-probs are of the biased distribution the sampler drew from.
  assert all(top[0][0] == forced and top[0][1] > -1e-3 for top in got["up"].top_logprobs)
  assert not set(got["down"].token_ids) & set(banned)
  assert got["down"].token_ids != base["down"].token_ids
  assert got["plain"].token_ids == base["plain"].token_ids  # the unbiased neighbour
  np.testing.assert_allclose(got["plain"].token_logprobs, base["plain"].token_logprobs,
                             atol=1e-5)


def test_logit_bias_the_engine_cannot_hold_is_rejected(engine, model):
  for bias, why in (({t: 1.0 for t in range(3)}, "logit_bias must hold at most 2 entries "
                     "(the engine's max_logit_bias), got 3"),
                    ({512: 1.0}, r"logit_bias token id 512 is outside the vocabulary")):
    out = engine.add_request(Request("x", [1, 2], SamplingParams(logit_bias=bias)))
    assert out is not None and why in out.rejected, out
  off = Engine(model, EngineConfig(num_blocks=64, **SIZES))  # max_logit_bias 0
  out = off.add_request(Request("y", [1, 2], SamplingParams(logit_bias={3: 1.0})))
  assert "at most 0 entries (the engine's max_logit_bias)" in out.rejected
  pool = off._pools[0]  # pylint: disable=protected-access
  slots = off._runner.slots  # pylint: disable=protected-access  # [data, ...]
  assert slots.bias_ids.shape == (1, pool.max_seqs, 0) == slots.bias_values.shape


def test_engines_of_other_bias_widths_do_not_share_steps(model):
  """Equal sizes share compiled steps (`compiler.py`), but `max_logit_bias`
  is the width of two step inputs: a regression test for sharing them."""
  req = lambda bias: Request("r", [3, 4, 5], SamplingParams(max_new_tokens=2,  # noqa: E731
                                                           logit_bias=bias))
  off = Engine(model, EngineConfig(num_blocks=64, **SIZES))
  on = Engine(model, EngineConfig(num_blocks=64, max_logit_bias=2, **SIZES))
  plain = serve(off, [req({})])["r"].completions[0].token_ids
  forced = serve(on, [req({400: 100.0})])["r"].completions[0].token_ids
  assert forced == [400, 400] and plain != forced


def test_top_logprobs_are_fetched_only_for_steps_that_asked(engine, monkeypatch):
  runner = engine._runner  # pylint: disable=protected-access
  real, asked = runner.fetch, []

  def fetch(out, num_pools, *, top=True):
    asked.append(top)
    return real(out, num_pools, top=top)

  monkeypatch.setattr(runner, "fetch", fetch)
  serve(engine, [Request("p", [3, 4], SamplingParams(max_new_tokens=3, logprobs=0))])
  assert asked and not any(asked)
  asked.clear()
  serve(engine, [Request("q", [3, 4], SamplingParams(max_new_tokens=3, logprobs=1))])
  assert asked.count(True) == 3  # its three sampling steps (not e.g. a release-only one)
