"""Speculative decoding in the engine (`EngineConfig.speculative_config`,
method "ngram"): verification steps give exactly the outputs of plain
decoding, greedy and sampled (temperature, top-k, top-p: the same tokens
for the same seed), alone, batched and under preemption; the host's pool
model replays every rollback; every block returns; each shape (bucket and
draft budget) traces once and compiles at warm-up."""

from __future__ import annotations

import pytest

from paged_jax.entrypoints import generate
from paged_jax.serving import compiler, spec_host, spec_step
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.serving.spec_policy import SpecPolicy, SpecPolicyConfig
from paged_jax.speculative import SpeculativeConfig
from tests.examples.conftest import (BIG_POOL, SIZES, SMALL_POOL, count_lowerings,
                                     assert_mirror_is_the_device_state, assert_pool_empty,
                                     make_engine, random_requests)
from tests.examples.test_prefix_engine import _poison_unowned_blocks

# Every eligible step verifies (no sit-out, no cost rule: the counts the
# tests check do not depend on the machine's speed); ADAPTIVE has both.
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                         prompt_lookup_max=3, adaptive=False)
ADAPTIVE = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3)


def _run(engine: Engine, requests, *, checked: bool = True) -> dict:
  """`{id: [(tokens, finish reason), ...]}`; with `checked`, after every
  step the host's pool model equals the device's state and every block
  nobody owns is NaN-poisoned (a stray read of a rolled-back block shows)."""
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
      _poison_unowned_blocks(engine)
  engine.flush()
  for o in engine._take_outputs():  # pylint: disable=protected-access
    outs[o.request_id] = o
  return {k: [(c.token_ids, c.finish_reason) for c in o.completions]
          for k, o in outs.items()}


def _copying(i: int) -> Request:
  """A prompt that repeats a passage: prompt lookup proposes, and the tiny
  model's greedy continuation of a loop often follows it."""
  passage = [30 + 7 * i, 41, 52 + i, 63, 74]
  return Request(f"c{i}", passage * 4, SamplingParams(max_new_tokens=16 + i))


def test_greedy_outputs_are_identical_with_spec_on_and_off(model):
  requests = [_copying(i) for i in range(3)] + random_requests(
      4, 3, prompt=(3, 20), new=(6, 24))
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, speculative_config=SPEC)
  assert _run(engine, requests) == want
  st = engine.stats
  assert st.spec_steps > 0 and st.spec_proposed > 0
  assert 0 < st.acceptance_rate <= 1 and st.mean_accepted_length > 0
  assert_pool_empty(engine)
  for r in requests[:1] + requests[3:4]:  # alone
    alone = make_engine(model, speculative_config=SPEC)
    assert _run(alone, [r]) == {r.request_id: want[r.request_id]}
    assert_pool_empty(alone)


@pytest.mark.parametrize("k", [1, 8])  # 8: the loop (`spec_loop.py`) fills the pool
def test_a_small_pool_that_preempts_gives_the_same_outputs(model, k):
  requests = [_copying(i) for i in range(4)] + random_requests(
      1, 4, prompt=(8, 24), new=(8, 16))
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, num_blocks=SMALL_POOL + 4, admission_headroom_steps=0,
                       speculative_config=SPEC, num_scheduler_steps=k)
  assert _run(engine, requests) == want
  assert engine.stats.preemptions > 0 and engine.stats.spec_accepted > 0
  if k > 1:
    assert engine.stats.multistep_refused > 0  # a row stopped on a full pool in the loop
  assert_pool_empty(engine)


def test_every_verification_shape_traces_once_and_compiles_at_warmup(model):
  # One decode bucket (4 rows) and one mixed (16 tokens): the plain steps
  # of test_multistep's and test_spec_loop_engine's trace tests; test_engine's trace
  # test covers every plain bucket of SIZES.
  engine = Engine(model, EngineConfig(num_blocks=BIG_POOL, check_traces=True,
                                      speculative_config=SPEC,
                                      **{**SIZES, "min_bucket": 16}))
  engine.warmup()
  compiles = compiler.compiled_count()
  decode = [b for b in engine.buckets if b.decode_only]
  steps = engine._runner._spec_steps  # pylint: disable=protected-access
  k = SPEC.num_speculative_tokens
  assert sorted(steps) == sorted(
      (b, k, d) for b in decode for d in spec_step.draft_budgets(b.num_seqs, k))
  assert all(len(spec_step.draft_budgets(b.num_seqs, k)) <= spec_step.NUM_BUDGETS
             for b in decode)
  requests = [_copying(i) for i in range(4)]
  with count_lowerings() as lowered:  # nothing compiles while serving
    _run(engine, requests[:2], checked=False)
    _run(engine, requests[2:], checked=False)  # a second round: same shapes
    sampled = [Request(f"t{i}", r.prompt, SamplingParams(
        max_new_tokens=12, temperature=0.8, top_k=20, seed=i))
               for i, r in enumerate(requests)]
    _run(engine, sampled, checked=False)  # sampled rows: the same programs
  assert engine.stats.spec_steps > 0
  assert compiler.compiled_count() == compiles and engine.stats.compile_seconds == 0
  assert not lowered


def _requests_to_verify():
  return [_copying(i) for i in range(3)] + random_requests(
      4, 3, prompt=(3, 20), new=(6, 24))


def _adaptive(model, **policy) -> Engine:
  """An ADAPTIVE engine (one decode bucket) whose rows sit out one step
  per miss, so that the tiny model's few drafts get verified."""
  engine = make_engine(model, speculative_config=ADAPTIVE, min_bucket=16)
  engine._spec_policy = SpecPolicy(  # pylint: disable=protected-access
      SIZES["max_batch"], SpecPolicyConfig(base_sit_out=1, max_sit_out=1,
                                           max_idle_sit_out=1, **policy))
  return engine


def test_warmup_times_each_decode_program_for_the_cost_rule(model):
  """Warm-up times the plain step and every draft budget's verification on
  padding inputs (the policy's costs), and those calls change nothing."""
  requests = _requests_to_verify()
  want = _run(make_engine(model), requests, checked=False)
  engine = _adaptive(model)
  engine.warmup()
  pol, k = spec_host.policy(engine), ADAPTIVE.num_speculative_tokens
  decode = [b for b in engine.buckets if b.decode_only]
  for b in decode:
    costs = pol.costs(b.num_seqs)
    assert sorted(costs) == [0, *spec_step.draft_budgets(b.num_seqs, k)]
    assert all(v > 0 for v in costs.values())
  assert_mirror_is_the_device_state(engine)  # the timed calls moved nothing
  warm = pol.costs(decode[0].num_seqs)
  assert _run(engine, requests) == want
  assert pol.costs(decode[0].num_seqs) != warm  # the engine's steps measured too
  assert_pool_empty(engine)
  plain = make_engine(model, speculative_config=SPEC, min_bucket=16)
  plain.warmup()  # not adaptive: nothing timed
  assert spec_host.policy(plain).costs(decode[0].num_seqs) is None


def _spy(monkeypatch) -> tuple[list, list]:
  """From now on: the draft budget of every verification step dispatched,
  and the drafts every step found (before the cost rule)."""
  used, found = [], []
  dispatch, drafts = spec_host.dispatch_spec, spec_host._drafts  # pylint: disable=protected-access

  def spy_dispatch(runner, bucket, x, s):
    used.append(s.tokens.shape[0] - x.seq_ids.shape[0])
    return dispatch(runner, bucket, x, s)

  def spy_drafts(*args):
    out = drafts(*args)
    if out is not None:
      found.append(sum(d.size for d in out))
    return out

  monkeypatch.setattr(spec_host, "dispatch_spec", spy_dispatch)
  monkeypatch.setattr(spec_host, "_drafts", spy_drafts)
  # The injected costs alone decide (the engine's timings would add its
  # machine's excess: `SpecPolicy.observe`, tested in test_spec_policy).
  monkeypatch.setattr(SpecPolicy, "observe", lambda *args: None)
  return used, found


def test_the_cost_rule_trims_drafts_to_the_budget_that_pays(model, monkeypatch):
  """With every budget past one priced out, each verification step keeps only
  the drafts that budget holds (the rows' first drafts first); with every
  budget priced out, only the policy's probes verify. Outputs stay those
  of plain decoding."""
  requests = _requests_to_verify()
  want = _run(make_engine(model), requests, checked=False)
  k = ADAPTIVE.num_speculative_tokens
  S = SIZES["max_batch"]
  budgets = spec_step.draft_budgets(S, k)
  cheap = budgets[1]
  engine = _adaptive(model)
  spec_host.policy(engine).set_costs(S, {0: 1.0, **{d: 1.0 if d <= cheap else 100.0
                                                    for d in budgets}})
  used, found = _spy(monkeypatch)
  assert _run(engine, requests) == want
  assert used and set(used) <= set(budgets[:2]) and cheap in used
  assert max(found) > cheap  # some step's drafts were trimmed
  assert engine.stats.spec_proposed == sum(min(f, cheap) for f in found)
  assert engine.stats.spec_accepted > 0
  assert_pool_empty(engine)
  # No budget pays: every second step with drafts probes.
  never = _adaptive(model, probe_every=2)
  spec_host.policy(never).set_costs(S, {0: 1.0, **{d: 100.0 for d in budgets}})
  used.clear()
  found.clear()
  assert _run(never, requests) == want
  assert len(found) >= 2 and len(used) == len(found) // 2
  assert_pool_empty(never)


def test_a_request_that_stops_on_an_accepted_draft_stops_there(model):
  base = _run(make_engine(model), [_copying(0)], checked=False)["c0"][0][0]
  req = _copying(0)
  stop = base[6]
  want = _run(make_engine(model), [Request("s", req.prompt, SamplingParams(
      max_new_tokens=16, stop_token_ids=(stop,)))], checked=False)
  engine = make_engine(model, speculative_config=SPEC)
  engine.stream_deltas()
  got = _run(engine, [Request("s", req.prompt, SamplingParams(
      max_new_tokens=16, stop_token_ids=(stop,)))])
  assert got == want and got["s"][0][1] == "stop"
  streamed = [t for d in engine.take_deltas() if d.index >= 0 for t in d.token_ids]
  assert streamed == got["s"][0][0]
  assert_pool_empty(engine)


DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=2)


@pytest.mark.parametrize("kw,name", [
    (dict(max_beam_width=2), "max_beam_width=2 (beam search)"),
    # n-gram with K > 1: the loop of `spec_loop.py` (test_spec_loop_engine)
    (dict(num_scheduler_steps=4, speculative_config=DRAFT),
     "num_scheduler_steps=4 for method='draft_model'"),
])
def test_unsupported_configs_are_refused_by_name(kw, name):
  with pytest.raises(ValueError) as e:
    EngineConfig(num_blocks=8, **{"speculative_config": SPEC, **kw})
  assert str(e.value).startswith(
      f"speculative_config cannot be combined with {name}; ")


def test_a_config_that_is_not_a_speculative_config_is_refused():
  with pytest.raises(ValueError, match="must be a SpeculativeConfig"):
    EngineConfig(num_blocks=8, speculative_config={"method": "ngram"})


@pytest.mark.parametrize("params,why", [
    (dict(n=2), "n=2 is not supported"),
])
def test_unsupported_requests_are_rejected_by_name(model, params, why):
  engine = make_engine(model, speculative_config=SPEC)
  out = engine.add_request(Request("x", [1, 2, 3], SamplingParams(**params)))
  assert out is not None and out.rejected.startswith(why)


def test_speculative_config_flag(capsys):
  flag = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'
  args = generate.parse_args(["--speculative-config", flag])
  assert args.speculative_config == SpeculativeConfig(
      num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=4)
  assert generate.parse_args([]).speculative_config is None
  draft = '{"method": "draft_model", "num_speculative_tokens": 2}'
  code = generate.main(["--speculative-config", draft, "--num-scheduler-steps", "4",
                        "--num-requests", "1", "--no-progress"])
  assert code == 2
  assert ("--speculative-config cannot be combined with --num-scheduler-steps 4 "
          "for method='draft_model'" in capsys.readouterr().err)
  with pytest.raises(SystemExit):
    generate.parse_args(["--speculative-config", '{"method": "eagle"}'])
  assert "num_speculative_tokens" in capsys.readouterr().err


def test_a_mesh_is_refused_by_name(model):
  from paged_jax import sharding  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="cannot be combined with a device mesh"):
    Engine(model, EngineConfig(num_blocks=8, speculative_config=SPEC, **SIZES),
           mesh=sharding.make_mesh(1, 1))


def test_rows_that_need_more_of_a_step_fall_back_to_plain_steps(model):
  """Top log-probs: steps with such a row are ordinary ones. An active
  `min_tokens` mask and `logit_bias` are applied per query row by the
  verification (the bans by position). The outputs stay those of plain
  decoding."""
  prompt = _copying(1).prompt
  base = _run(make_engine(model), [_copying(2)], checked=False)["c2"][0][0]
  requests = [_copying(0),
              Request("lp", prompt, SamplingParams(max_new_tokens=8, logprobs=2)),
              Request("min", prompt, SamplingParams(max_new_tokens=10, min_tokens=6)),
              Request("bias", _copying(2).prompt, SamplingParams(
                  max_new_tokens=12, temperature=0.1,
                  logit_bias={base[3]: -100.0, base[5]: 3.0}))]
  want = _run(make_engine(model, max_logit_bias=2), requests, checked=False)
  engine = make_engine(model, max_logit_bias=2, speculative_config=SPEC)
  assert _run(engine, requests) == want
  assert engine.stats.spec_steps > 0  # once the others finished
  assert_pool_empty(engine)


# The tiny random model's logits are flat: low temperatures and tight
# filters give drafts a chance to be accepted (and 0.9 / 1.0 rows too).
SAMPLED = [dict(temperature=0.05), dict(temperature=1.0, top_k=2),
           dict(temperature=0.1, top_p=0.9), dict(temperature=0.9, top_k=50,
                                                   top_p=0.3)]


def _sampled(i: int, params: dict) -> Request:
  r = _copying(i)
  return Request(f"s{i}", r.prompt, SamplingParams(max_new_tokens=16 + i,
                                                   seed=17 * i, **params))


def test_sampled_outputs_are_identical_with_spec_on_and_off(model):
  """Each query row draws with the key plain decoding uses for that
  position, so the tokens are those of plain decoding for the same seed:
  temperature, top-k and top-p rows, mixed with greedy ones, batched."""
  requests = [_sampled(i, p) for i, p in enumerate(SAMPLED)] + [
      _copying(7)] + random_requests(5, 3, prompt=(3, 20), new=(6, 20),
                                     temperature=0.9)
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, speculative_config=SPEC)
  assert _run(engine, requests) == want
  st = engine.stats
  assert st.spec_steps > 0 and st.spec_accepted > 0
  assert 0 < st.acceptance_rate <= 1
  assert_pool_empty(engine)
  for r in requests[:2]:  # alone
    alone = make_engine(model, speculative_config=SPEC)
    assert _run(alone, [r]) == {r.request_id: want[r.request_id]}
  adaptive = make_engine(model, speculative_config=ADAPTIVE)  # sit-out, cost rule
  assert _run(adaptive, requests) == want
  assert_pool_empty(adaptive)


def test_sampled_rows_under_preemption_give_the_same_outputs(model):
  requests = [_sampled(i, SAMPLED[i % len(SAMPLED)]) for i in range(5)]
  want = _run(make_engine(model), requests, checked=False)
  engine = make_engine(model, num_blocks=SMALL_POOL + 4, admission_headroom_steps=0,
                       speculative_config=SPEC)
  assert _run(engine, requests) == want
  assert engine.stats.preemptions > 0 and engine.stats.spec_accepted > 0
  assert_pool_empty(engine)
