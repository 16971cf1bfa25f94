"""Top log-probs (`SamplingParams.logprobs`) and `logit_bias` through the
engine, on the tiny model, checked against the dense model's logits."""

from __future__ import annotations

import chex
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
  """One trace-counted engine for the module: every compiled shape traces once."""
  chex.clear_trace_counter()
  e = Engine(model, EngineConfig(num_blocks=64, check_traces=True, **SIZES))
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
  assert out is not None and "logprobs=9 exceeds the engine's max_logprobs=8" in out.rejected
  engine.run_until_done()


def test_top_logprobs_stream_in_deltas(engine):
  e = engine
  e.stream_deltas()
  e.add_request(Request("s", [3, 4, 5], SamplingParams(max_new_tokens=3, logprobs=2)))
  e.run_until_done()
  deltas = [d for d in e.take_deltas() if d.index == 0]
  e.stream_deltas(False)
  assert [len(d.top_logprobs[0]) for d in deltas] == [2, 2, 2]
