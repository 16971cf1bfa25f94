"""Speculation inside the multi-step loop (`spec_loop.py`: n-gram drafts
proposed on the device, up to K verification iterations per dispatch):
the outputs of plain decoding, greedy for every K and sampled, alone,
batched, with prefix caching (a pool that fills inside the loop and
preempts: `test_spec_engine.py`); after every dispatch the host's pool model equals the
device's state and every block nobody owns is NaN-poisoned; every block
returns; each loop traces once and compiles at warm-up."""

from __future__ import annotations

import pytest

from paged_jax.serving import compiler, spec_loop_host
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests.examples.conftest import (BIG_POOL, SIZES, SMALL_POOL, assert_pool_empty,
                                     count_lowerings, make_engine, random_requests)
from tests.examples.test_spec_prefix_engine import _assert_every_block_returns
from tests.examples.test_spec_engine import (ADAPTIVE, SAMPLED, SPEC, _copying, _run,
                                             _sampled)


def _requests():
  return [_copying(i) for i in range(3)] + random_requests(
      4, 3, prompt=(3, 20), new=(6, 24))


@pytest.mark.parametrize("k", [4, pytest.param(2, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow)])
def test_greedy_outputs_are_identical_with_the_loop_for_every_k(model, k):
  requests = _requests()
  want = _run(make_engine(model), requests, checked=False)
  one = make_engine(model, speculative_config=SPEC)  # K = 1: a step per dispatch
  assert _run(one, requests, checked=False) == want
  engine = make_engine(model, speculative_config=SPEC, num_scheduler_steps=k)
  assert _run(engine, requests) == want
  st = engine.stats
  assert st.multisteps > 0 and st.spec_steps > st.multisteps  # iterations > dispatches
  assert st.spec_accepted > 0 and 0 < st.acceptance_rate <= 1
  assert st.steps < one.stats.steps
  assert_pool_empty(engine)
  r = requests[0]  # alone
  alone = make_engine(model, speculative_config=SPEC, num_scheduler_steps=k)
  assert _run(alone, [r]) == {r.request_id: want[r.request_id]}
  assert alone.stats.spec_accepted > 0
  assert_pool_empty(alone)


def test_sampled_outputs_are_identical_with_the_loop(model):
  """Each query row draws with plain decoding's key for its position: the
  tokens of plain decoding for the same seed, inside the loop too."""
  requests = [_sampled(i, p) for i, p in enumerate(SAMPLED)] + [_copying(7)]
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, speculative_config=SPEC, num_scheduler_steps=4)
  assert _run(engine, requests) == want
  assert engine.stats.multisteps > 0 and engine.stats.spec_accepted > 0
  assert_pool_empty(engine)


def test_a_stop_token_inside_the_loop_stops_there_and_streams(model):
  base = _run(make_engine(model), [_copying(0)], checked=False)["c0"][0][0]
  prompt = _copying(0).prompt
  params = SamplingParams(max_new_tokens=16, stop_token_ids=(base[6],))
  want = _run(make_engine(model), [Request("s", prompt, params)], checked=False)
  engine = make_engine(model, speculative_config=SPEC, num_scheduler_steps=8)
  engine.stream_deltas()
  got = _run(engine, [Request("s", prompt, params)])
  assert got == want and got["s"][0][1] == "stop"
  streamed = [t for d in engine.take_deltas() if d.index >= 0 for t in d.token_ids]
  assert streamed == got["s"][0][0]
  assert engine.stats.multisteps > 0
  assert_pool_empty(engine)


def test_prefix_caching_keeps_the_outputs_and_the_hits(model):
  """Two waves over one passage: the second's hits reach blocks the first
  wrote in the loop; the same hits as without speculation."""
  passage = _copying(0).prompt
  requests = [Request(f"p{i}", passage + [5 + i, 6, 7], SamplingParams(
      max_new_tokens=12 + i)) for i in range(3)]

  def waves(engine):
    return {**_run(engine, requests[:1]), **_run(engine, requests[1:])}
  plain = make_engine(model, SMALL_POOL + 8, enable_prefix_caching=True)
  want = waves(plain)
  engine = make_engine(model, SMALL_POOL + 8, enable_prefix_caching=True,
                       speculative_config=SPEC, num_scheduler_steps=4)
  assert waves(engine) == want
  assert engine.stats.multisteps > 0 and engine.stats.spec_accepted > 0
  assert engine.stats.prefix_hit_tokens == plain.stats.prefix_hit_tokens > 0
  _assert_every_block_returns(engine)


def test_the_adaptive_policy_keeps_the_outputs(model):
  requests = [_copying(i) for i in range(2)] + random_requests(6, 2, prompt=(3, 20),
                                                               new=(6, 24))
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, num_scheduler_steps=4, speculative_config=ADAPTIVE)
  assert _run(engine, requests) == want
  assert engine.stats.multisteps > 0
  assert_pool_empty(engine)


def test_the_history_is_synced_once_per_sequence_then_by_the_device(model):
  engine = make_engine(model, speculative_config=SPEC, num_scheduler_steps=4)
  r = _copying(0)
  _run(engine, [r], checked=False)
  h = spec_loop_host._history(engine)  # pylint: disable=protected-access
  assert engine.stats.multisteps >= 2
  # Written from the host: the prompt and the first token once (by the
  # first dispatch), nothing after; the device kept the rest.
  assert engine.__dict__["_history_writes"] == len(r.prompt) + 1
  assert all(o is None for o in h.owner)  # the finished sequence let go


def test_every_loop_traces_once_and_compiles_at_warmup(model):
  engine = Engine(model, EngineConfig(num_blocks=BIG_POOL, check_traces=True,
                                      speculative_config=SPEC, num_scheduler_steps=4,
                                      **{**SIZES, "min_bucket": 16}))
  engine.warmup()
  compiles = compiler.compiled_count()
  decode = [b for b in engine.buckets if b.decode_only]
  loops = engine._runner._spec_loops  # pylint: disable=protected-access
  assert sorted(loops) == sorted((b, 4) for b in decode)
  requests = [_copying(i) for i in range(4)]
  with count_lowerings() as lowered:  # nothing compiles while serving
    _run(engine, requests[:2], checked=False)
    _run(engine, requests[2:], checked=False)
    sampled = [Request(f"t{i}", r.prompt, SamplingParams(
        max_new_tokens=12, temperature=0.8, top_k=20, seed=i))
               for i, r in enumerate(requests)]
    _run(engine, sampled, checked=False)
  assert engine.stats.multisteps > 0 and engine.stats.spec_steps > 0
  assert compiler.compiled_count() == compiles and engine.stats.compile_seconds == 0
  assert not lowered
