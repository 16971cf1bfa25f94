"""Multi-step decode (`EngineConfig.num_scheduler_steps`): K decode steps per
dispatch, blocks reserved on the device, give the same outputs as one step
per dispatch; the host's pool model replays the loop exactly."""

from __future__ import annotations

import pytest

from paged_jax import block_manager as bm
from paged_jax.entrypoints import generate
from paged_jax.serving import compiler
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.multistep import MAX_STEPS
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests.examples.conftest import (BIG_POOL, SIZES, SMALL_POOL, count_lowerings,
                                     assert_mirror_is_the_device_state, assert_pool_empty,
                                     make_engine, random_requests)
from tests.examples.test_prefix_engine import _poison_unowned_blocks


def _run(engine: Engine, requests, *, checked: bool = True) -> dict:
  """Serves `requests`: `{id: [(tokens, finish reason), ...]}`. With
  `checked`, after every K-step dispatch its results are applied at once and
  the host's pool model must equal the device's state array for array, and
  every block nobody owns is refilled with NaN (a stray read would show)."""
  for r in requests:
    assert engine.add_request(r) is None, r
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
    pending = engine._pending  # pylint: disable=protected-access
    if checked and pending is not None and pending.multi is not None:
      engine._resolve_pending()  # pylint: disable=protected-access
      for o in engine._take_outputs():  # pylint: disable=protected-access
        outs[o.request_id] = o
      assert_mirror_is_the_device_state(engine)
      _poison_unowned_blocks(engine)
  engine.flush()
  for o in engine._take_outputs():  # pylint: disable=protected-access
    outs[o.request_id] = o
  return {k: [(c.token_ids, c.finish_reason) for c in o.completions]
          for k, o in outs.items()}


# K = 4 and 8 in the default run (4's programs are the other tests' too; 8
# also runs alone); K = 2 is the same loop with another static length.
@pytest.mark.parametrize("ks", [(4, 8), pytest.param((2,), marks=pytest.mark.slow)])
def test_greedy_outputs_are_identical_for_every_k_alone_and_batched(model, ks):
  requests = random_requests(11, 6, prompt=(3, 20), new=(6, 30))
  single = make_engine(model)
  want = _run(single, requests, checked=False)
  solo = {}
  for r in requests[:2] if 8 in ks else ():
    e = make_engine(model)
    solo[r.request_id] = (_run(e, [r], checked=False)[r.request_id], e.stats.steps)
  for k in ks:
    engine = make_engine(model, num_scheduler_steps=k)
    assert _run(engine, requests) == want, k
    assert engine.stats.multisteps > 0 and engine.stats.multistep_tokens > 0
    assert engine.stats.steps < single.stats.steps
    assert_pool_empty(engine)
    for r in requests[:2] if k == 8 else ():
      alone = make_engine(model, num_scheduler_steps=k)
      tokens, steps = solo[r.request_id]
      assert _run(alone, [r]) == {r.request_id: tokens}, (k, r.request_id)
      assert alone.stats.steps < steps
      assert_pool_empty(alone)


def test_a_pool_that_fills_inside_the_loop_preempts_with_the_same_outputs(model):
  requests = random_requests(1, 8, prompt=(8, 24), new=(8, 16))
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0,
                       num_scheduler_steps=8)
  assert _run(engine, requests) == want
  assert engine.stats.multistep_refused > 0  # a row stopped on a full pool
  assert engine.stats.preemptions > 0
  assert_pool_empty(engine)


def test_prefix_caching_with_multistep_gives_the_same_outputs(model):
  shared = list(range(40, 53))  # 3 full blocks of 4, and one token more
  requests = [Request(i, shared + [60 + i] * (i + 1), SamplingParams(max_new_tokens=9 + 3 * i))
              for i in range(5)]
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, num_blocks=SMALL_POOL + 8, enable_prefix_caching=True,
                       admission_headroom_steps=0, num_scheduler_steps=4)
  assert _run(engine, requests) == want
  assert engine.stats.multisteps > 0 and engine.stats.prefix_hit_tokens > 0
  for p in engine._pools:  # pylint: disable=protected-access
    p.check_prefix_index()
  bm.check_invariants(engine.block_state)
  assert_mirror_is_the_device_state(engine)


def test_forks_seeds_stop_ids_min_tokens_and_budgets_end_mid_loop(model):
  base = _run(make_engine(model), [Request("g", [7, 8, 9], SamplingParams(max_new_tokens=20))],
              checked=False)
  stop = base["g"][0][0][5]  # sampled 6th: ends inside a K = 4 loop
  requests = [
      Request("n", list(range(10, 20)), SamplingParams(n=3, temperature=0.9, top_k=40,
                                                       seed=7, max_new_tokens=11)),
      Request("stop", [7, 8, 9], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,))),
      Request("min", [7, 8, 9], SamplingParams(max_new_tokens=12, min_tokens=7,
                                               stop_token_ids=(stop,))),
      Request("len", [5, 6], SamplingParams(max_new_tokens=7)),  # 7: mid-loop for K = 4
      Request("lp", [4, 5, 6], SamplingParams(max_new_tokens=6, logprobs=2,
                                              temperature=0.5, seed=3)),
  ]
  want_engine = make_engine(model)
  want = _run(want_engine, requests, checked=False)
  assert want["stop"][0] == (base["g"][0][0][:6], "stop")
  assert want["min"][0][1] in ("length", "stop") and len(want["min"][0][0]) > 6
  engine = make_engine(model, num_scheduler_steps=4)
  engine.stream_deltas()
  got = _run(engine, requests)
  assert got == want
  assert engine.stats.multisteps > 0
  # The stream carries every token once, in order, with its log-probs.
  streamed: dict = {}
  for d in engine.take_deltas():
    if d.index >= 0:
      streamed.setdefault((d.request_id, d.index), []).extend(d.token_ids)
      assert len(d.logprobs) == len(d.token_ids)
      if d.request_id == "lp":
        assert len(d.top_logprobs[0]) == 2
  assert streamed == {
      (rid, i): c[0] for rid, cs in got.items() for i, c in enumerate(cs)}
  assert_pool_empty(engine)


def test_beam_search_falls_back_to_single_steps(model):
  req = [Request("b", [8, 9, 10], SamplingParams(beam_width=2, max_new_tokens=6))]
  want = _run(make_engine(model, max_beam_width=2), req, checked=False)
  engine = make_engine(model, max_beam_width=2, num_scheduler_steps=4)
  assert _run(engine, req) == want
  assert engine.stats.multisteps == 0


def test_every_multistep_shape_traces_once_and_compiles_at_warmup(model):
  # One decode bucket (4 rows) and one mixed (16 tokens): the plain steps
  # of test_spec_engine's and test_spec_loop_engine's trace tests; test_engine's trace
  # test covers every plain bucket of SIZES.
  engine = Engine(model, EngineConfig(num_blocks=BIG_POOL, check_traces=True,
                                      num_scheduler_steps=4,
                                      **{**SIZES, "min_bucket": 16}))
  engine.warmup()
  compiles = compiler.compiled_count()
  runner = engine._runner  # pylint: disable=protected-access
  decode = [b for b in engine.buckets if b.decode_only]
  assert sorted(runner._multi) == [(b, 4) for b in decode]  # pylint: disable=protected-access
  requests = random_requests(5, 6, prompt=(2, 20), new=(4, 20))
  with count_lowerings() as lowered:  # nothing compiles while serving
    _run(engine, requests[:4], checked=False)
    _run(engine, requests[4:], checked=False)  # a second round: same shapes
  assert engine.stats.multisteps > 0
  assert compiler.compiled_count() == compiles and engine.stats.compile_seconds == 0
  assert not lowered


@pytest.mark.parametrize("k", [0, -3, MAX_STEPS + 1, True, 2.0])
def test_num_scheduler_steps_out_of_range_is_one_clear_error(k):
  with pytest.raises(ValueError) as e:
    EngineConfig(num_blocks=8, num_scheduler_steps=k)
  assert str(e.value) == (f"num_scheduler_steps must be an int in [1, {MAX_STEPS}], "
                          f"got {k!r}")


def test_num_scheduler_steps_flag(capsys):
  assert generate.parse_args(["--num-scheduler-steps", "4"]).num_scheduler_steps == 4
  assert generate.parse_args([]).num_scheduler_steps == EngineConfig(
      num_blocks=8).num_scheduler_steps
  code = generate.main(["--num-scheduler-steps", "0", "--num-requests", "1",
                        "--no-progress"])
  assert code == 2
  err = capsys.readouterr().err
  assert f"--num-scheduler-steps must be an int in [1, {MAX_STEPS}], got 0" in err


def test_abort_and_stop_while_a_multistep_dispatch_runs(model):
  """Rows the host finishes while their K-step dispatch runs (an abort, a
  stop string's `stop_sequence`) still took blocks on the device: the replay
  counts them, their tokens are dropped, and every block comes back."""
  engine = make_engine(model, num_scheduler_steps=4)
  for i in range(3):
    engine.add_request(Request(i, [9 + i, 4, 7], SamplingParams(max_new_tokens=30)))
  def in_flight():
    return engine._pending  # pylint: disable=protected-access
  while in_flight() is None or in_flight().multi is None:
    engine.step()
  assert engine.abort_request(0) and engine.stop_sequence(1)
  outs = {o.request_id: o for o in engine.run_until_done()}
  assert outs[0].completions[0].finish_reason == "abort"
  assert outs[1].completions[0].finish_reason == "stop"
  want = _run(make_engine(model), [Request(2, [11, 4, 7], SamplingParams(max_new_tokens=30))],
              checked=False)
  assert [(c.token_ids, c.finish_reason) for c in outs[2].completions] == want[2]
  assert_pool_empty(engine)
