"""`SamplingParams` refuses what the engine cannot hold (int32 ids, counts and
seeds on the device), naming the field, so the Python API is as safe as the
HTTP one; and `stop_ids` is the one rule for the tokens that end a sequence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged_jax.serving.sampling import SamplingParams

DEEP = json.loads("[" * 500 + "]" * 500)


@pytest.mark.parametrize("kw,match", [
    # The engine-killers of issue 26, through the Python API.
    (dict(stop_token_ids=[[1]]), r"stop_token_ids must hold int32 token ids, got \[1\]"),
    (dict(stop_token_ids=[2**70], min_tokens=1),
     "stop_token_ids must hold int32 token ids, got 1180591620717411303424"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must hold int32 token ids, got 'a'"),
    (dict(seed=-1, n=2), r"seed must be an int in \[0, 2\*\*31\), got -1"),
    (dict(seed=2**31 - 1, n=2), r"seed \+ 1 \(sample i uses seed \+ i\) must be < 2\*\*31"),
    (dict(seed=2**31 - 3, beam_width=4), r"seed \+ 3 \(sample i uses seed \+ i\)"),
    (dict(top_k=2**31), r"top_k must be >= 0 and < 2\*\*31, got 2147483648"),
    # Types: no bools for ints, no floats for ints, no strings for numbers.
    (dict(top_k=float("inf")), "top_k must be an int >= 0, got inf"),
    (dict(n=2.9), "n must be an int >= 1, got 2.9"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
    (dict(max_new_tokens=2**31), "max_new_tokens must be >= 1 and < 2\\*\\*31"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=5, max_new_tokens=4), r"min_tokens must be in \[0, max_new_tokens=4\]"),
    (dict(temperature="1"), "temperature must be a real number, got '1'"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite, got inf"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_p=1e-46), r"top_p must be in \(0, 1\] in float32, got 1e-46"),
    (dict(temperature=1e39), r"temperature must be <= 3.403e\+38 \(float32\), got 1e\+39"),
    (dict(length_penalty=float("inf")), "length_penalty must be finite, got inf"),
    (dict(seed=2**70), r"seed must be an int in \[0, 2\*\*31\), got 1180591620717411303424"),
    (dict(seed=1.0), r"seed must be an int in \[0, 2\*\*31\), got 1.0"),
    (dict(eos_token_ids=7), "eos_token_ids must be a tuple of int token ids, got 7"),
    (dict(stop_token_ids="ab"), "stop_token_ids must be a tuple of int token ids, got 'ab'"),
    (dict(stop_token_ids=[True]), "stop_token_ids must hold int32 token ids, got True"),
    (dict(stop_token_ids=[DEEP]),
     r"stop_token_ids must hold int32 token ids, got \[\[\[\.\.\.\]\]\]"),
    (dict(stop={"a": 1}), "stop strings must be non-empty str, got {'a': 1}"),
    (dict(stop=("",)), "stop strings must be non-empty str"),
    (dict(stop=(1,)), "stop strings must be non-empty str, got \\(1,\\)"),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
    (dict(ignore_eos=True, eos_token_ids=(2,)), "give eos_token_ids or ignore_eos, not both"),
    (dict(logit_bias={1: float("nan")}), r"logit_bias values must be finite numbers in "
     r"\[-100, 100\], got nan for token 1"),
    (dict(logit_bias={1: 1e9}), r"logit_bias values .* got 1000000000.0 for token 1"),
    (dict(logit_bias={1: True}), r"logit_bias values .* got True"),
    (dict(logit_bias={"1": 1.0}), "logit_bias keys must be int32 token ids >= 0, got '1'"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be int32 token ids >= 0, got -1"),
    (dict(logit_bias={2**31: 1.0}), "logit_bias keys must be int32 token ids >= 0"),
    (dict(logit_bias=[(1, 1.0), (1, 2.0)]), "logit_bias names a token id twice"),
    (dict(logit_bias=5), "logit_bias must map token ids to biases, got 5"),
    (dict(logprobs=-1), "logprobs must be >= 0, got -1"),
    (dict(logprobs=2.0), "logprobs must be an int >= 0, got 2.0"),
    (dict(logprobs=2, beam_width=2), r"logprobs is not served with beam search \(got "
     r"beam_width=2\)"),
])
def test_refuses_what_the_engine_cannot_hold(kw, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kw)


def test_accepts_and_normalises():
  p = SamplingParams(stop="\n", stop_token_ids=[np.int64(3)], eos_token_ids=[-1],
                     seed=np.int32(4), temperature=1, top_p=1, n=np.int64(2))
  assert p.stop == ("\n",) and p.stop_token_ids == (3,) and p.eos_token_ids == (-1,)
  assert type(p.seed) is int and type(p.n) is int and type(p.temperature) is float
  assert SamplingParams(seed=2**31 - 2, n=2).seed == 2**31 - 2  # seeds 2**31 - 2, - 1
  hash(p)  # still a frozen, hashable value


def test_stop_ids_is_the_one_rule():
  assert SamplingParams().stop_ids((2,)) == {2}
  assert SamplingParams(eos_token_ids=(5,), stop_token_ids=(7,)).stop_ids((2,)) == {5, 7}
  assert SamplingParams(ignore_eos=True, stop_token_ids=(7,)).stop_ids((2,)) == {7}
  assert SamplingParams(ignore_eos=True).stop_ids((2,)) == frozenset()


def test_request_fields():
  from paged_jax.serving.requests import Request  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="request_id must be hashable, got a list"):
    Request([1], [3, 4])
  with pytest.raises(ValueError, match="params must be a SamplingParams, got a dict"):
    Request("a", [3, 4], {"max_new_tokens": 4})
  assert Request("a", [3], cache_salt=7).cache_salt == 7  # the engine rejects it


def _values():
  from hypothesis import strategies as st  # pylint: disable=import-outside-toplevel
  scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(), st.text(max_size=3))
  return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.tuples(inner)), max_leaves=4)


def test_any_value_is_refused_with_a_value_error_or_fits_the_engine():
  hypothesis = pytest.importorskip("hypothesis")
  from hypothesis import strategies as st  # pylint: disable=import-outside-toplevel
  names = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "n", "beam_width",
           "eos_token_ids", "length_penalty", "stop_token_ids", "min_tokens", "stop",
           "ignore_eos"]

  @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
  @hypothesis.given(st.dictionaries(st.sampled_from(names), _values(), max_size=4))
  def check(kw):
    try:
      p = SamplingParams(**kw)
    except ValueError:
      return
    for name in ("max_new_tokens", "top_k", "n", "beam_width", "min_tokens"):
      assert type(getattr(p, name)) is int and 0 <= getattr(p, name) < 2**31
    assert 0 <= p.seed and p.seed + p.num_seqs - 1 < 2**31
    for ids in (p.eos_token_ids, p.stop_token_ids):
      assert type(ids) is tuple and all(type(t) is int and -2**31 <= t < 2**31 for t in ids)
    assert all(type(s) is str and s for s in p.stop) and type(p.ignore_eos) is bool
    assert all(np.isfinite(np.float32([p.temperature, p.top_p]))) and np.float32(p.top_p) > 0
    assert np.isfinite(p.length_penalty)

  check()  # pylint: disable=no-value-for-parameter
