"""The continuous-batching engine against the dense oracle and against itself."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax.serving import beam as beam_lib
from paged_jax.serving import compiler
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax import block_manager as bm
from paged_jax import kv_cache
from tests.examples.conftest import (BIG_POOL, SIZES, SMALL_POOL, count_lowerings,
                                     assert_mirror_is_the_device_state,
                                     make_engine, random_requests, serve)


def tokens(outputs: dict) -> dict:
  return {k: [(c.token_ids, c.finish_reason) for c in o.completions]
          for k, o in outputs.items()}


def assert_pool_empty(engine: Engine):
  bm.check_invariants(engine.block_state)
  assert_mirror_is_the_device_state(engine)
  assert int(engine.block_state.num_free) == engine.config.num_blocks
  assert not engine.has_unfinished()


def test_paged_greedy_matches_dense_oracle_and_solo_runs(model, oracle):
  requests = random_requests(0, 7)
  batched = serve(make_engine(model), requests)
  for r in requests:
    want = oracle.greedy(r.prompt, r.params.max_new_tokens)
    (got,) = batched[r.request_id].completions
    assert got.token_ids == want, r.request_id
    assert got.finish_reason == ("stop" if want[-1] in oracle.eos else "length")
    solo = serve(make_engine(model), [r])
    assert solo[r.request_id].completions == [got], r.request_id


def test_preemption_and_recompute_give_the_same_outputs(model):
  requests = random_requests(1, 8, prompt=(8, 24), new=(8, 16))
  big = make_engine(model)
  small = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  want, got = serve(big, requests), serve(small, requests)
  assert small.stats.preemptions > 0
  assert big.stats.preemptions == 0
  assert tokens(got) == tokens(want)
  assert sum(o.preemptions for o in got.values()) == small.stats.preemptions
  assert_pool_empty(big)
  assert_pool_empty(small)


def test_block_aware_admission_preempts_less_with_the_same_outputs(model):
  requests = random_requests(1, 8, prompt=(8, 24), new=(8, 16))
  eager = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  aware = make_engine(model, num_blocks=SMALL_POOL)  # the default headroom
  want, got = serve(eager, requests), serve(aware, requests)
  assert tokens(got) == tokens(want)
  assert eager.stats.preemptions > aware.stats.preemptions
  assert eager.stats.recomputed_tokens > aware.stats.recomputed_tokens > 0 or (
      aware.stats.preemptions == 0 and aware.stats.recomputed_tokens == 0)
  assert aware.stats.deferred_admissions > 0
  assert_pool_empty(aware)


def test_forked_samples_match_independent_runs_with_the_same_seeds(model):
  params = dict(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=12)
  prompt = list(range(10, 20))  # 10 tokens: a partial last block (block_size 4)
  forked = Request("forked", prompt, SamplingParams(n=3, seed=7, **params))
  alone = [Request(i, prompt, SamplingParams(seed=7 + i, **params)) for i in range(3)]
  engine = make_engine(model)
  got = serve(engine, [forked])["forked"].completions
  want = serve(make_engine(model), alone)
  assert got == [want[i].completions[0] for i in range(3)]
  assert len({tuple(c.token_ids) for c in got}) > 1  # the samples do differ
  assert_pool_empty(engine)


def test_sample_whose_parent_stops_at_once_still_forks(model):
  prompt = list(range(10, 19))
  params = dict(temperature=1.0, max_new_tokens=6)
  first = serve(make_engine(model), [Request(0, prompt, SamplingParams(seed=4, **params))])
  stop = first[0].completions[0].token_ids[0]  # sample 0 stops on its first token
  params["eos_token_ids"] = (stop,)
  engine = make_engine(model)
  got = serve(engine, [Request("g", prompt, SamplingParams(n=2, seed=4, **params))])
  alone = serve(make_engine(model), [Request(1, prompt, SamplingParams(seed=5, **params))])
  assert got["g"].completions[0].token_ids == [stop]
  assert got["g"].completions[1] == alone[1].completions[0]
  assert len(alone[1].completions[0].token_ids) > 1
  assert_pool_empty(engine)


def test_fork_shares_prompt_blocks_and_copies_the_partial_one(model):
  engine = make_engine(model)
  prompt = list(range(10, 20))  # blocks [0:4] [4:8] full, [8:10] partial
  engine.add_request(Request("r", prompt, SamplingParams(n=3, max_new_tokens=8,
                                                         temperature=1.0)))
  engine.step()  # prefill, 3 samples drawn
  engine.step()  # fork, copy-on-write, first decode of each sample
  state = engine.block_state
  live = np.nonzero(np.asarray(state.seq_lens))[0]
  assert len(live) == 3
  tables = np.asarray(state.block_tables)[live]
  assert (tables[:, :2] == tables[0, :2]).all()  # full prompt blocks shared
  assert len(set(tables[:, 2].tolist())) == 3  # the partial block was copied
  refs = np.asarray(state.refcounts)
  assert (refs[tables[0, :2]] == 3).all()
  bm.check_invariants(state)
  engine.run_until_done()
  assert_pool_empty(engine)


def dense_beam_search(oracle, prompt, width, max_new_tokens):
  """Beam search on the dense oracle with the engine's rules."""
  k = max(8, 2 * width)
  beams, finished = [beam_lib.Beam([], 0.0)], []
  while True:
    cands = []
    for b in beams:
      lg = oracle.next_logits(list(prompt) + b.tokens)
      lp = np.asarray(jax.nn.log_softmax(lg))
      ids = np.argsort(-lp, kind="stable")[:k]
      cands.append((lp[ids], ids))
    live, done = beam_lib.beam_search_step(beams, cands, width=width,
                                           eos_token_ids=tuple(oracle.eos))
    finished += [(lp, beams[p].tokens + [t], "stop") for p, t, lp in done]
    complete = len(finished) >= width
    if complete or len(beams[0].tokens) + 1 >= max_new_tokens or not live:
      if not complete:
        finished += [(lp, beams[p].tokens + [t], "length") for p, t, lp in live]
      break
    beams = [beam_lib.Beam(beams[p].tokens + [t], lp) for p, t, lp in live]
  finished.sort(key=lambda f: -f[0] / max(len(f[1]), 1))
  return [(t, r) for _, t, r in finished[:width]]


def test_beam_search_matches_dense_beam_search(model, oracle):
  prompt = list(range(30, 41))
  req = Request("b", prompt, SamplingParams(beam_width=3, max_new_tokens=8))
  engine = make_engine(model, max_beam_width=3)
  (out,) = serve(engine, [req]).values()
  got = [(c.token_ids, c.finish_reason) for c in out.completions]
  assert got == dense_beam_search(oracle, prompt, 3, 8)
  assert_pool_empty(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(beam_width=2, max_new_tokens=10),
    SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=14),
], ids=["beam", "n2"])
def test_beam_and_sampling_groups_survive_preemption(model, params):
  requests = [Request("old", list(range(100, 120)), SamplingParams(max_new_tokens=16)),
              Request("group", list(range(50, 59)), params)]
  big = make_engine(model, max_beam_width=2)
  small = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0, max_beam_width=2)
  want, got = serve(big, requests), serve(small, requests)
  assert got["group"].preemptions > 0 and got["old"].preemptions == 0
  assert tokens(got) == tokens(want)
  assert_pool_empty(small)


def test_steps_never_retrace(model):
  # Buckets from 2 tokens (the shared SIZES start at 8): two decode and three
  # mixed shapes, so that a lone row's decode takes the smallest one.
  engine = Engine(model, EngineConfig(num_blocks=BIG_POOL, check_traces=True,
                                      max_beam_width=2, **{**SIZES, "min_bucket": 2}))
  requests = random_requests(3, 6, prompt=(2, 30), new=(1, 12))
  requests += [Request("n", [5, 6, 7], SamplingParams(n=2, temperature=0.7, max_new_tokens=5)),
               Request("b", [8, 9], SamplingParams(beam_width=2, max_new_tokens=4))]
  engine.warmup()  # traces every bucket once; serving must not trace again
  assert engine.compiled_buckets == tuple(sorted(engine.buckets))
  compiles = compiler.compiled_count()
  assert len(engine.buckets) == 5  # decode 2, 4; mixed 4, 8, 16
  with count_lowerings() as lowered:
    for r in requests[:3]:
      engine.add_request(r)
    old_pages = engine.cache.k_pages
    for _ in range(3):
      engine.step()
    assert old_pages.is_deleted()  # the cache is donated, updated in place
    for r in requests[3:]:  # arrivals while others run
      engine.add_request(r)
    outputs = engine.run_until_done()
    assert len(outputs) == len(requests)
    # One alone: its decode steps take the smallest decode bucket.
    engine.add_request(Request("alone", [3, 4], SamplingParams(max_new_tokens=3)))
    assert len(engine.run_until_done()) == 1
  assert engine.stats.decode_steps > 0 and engine.stats.mixed_steps > 0
  assert engine.stats.bookkeeping_steps > 0  # a step of releases only, too
  used = {(n, d) for n, _, d in engine.stats.buckets}
  assert len({n for n, d in used if d}) >= 2 and len({n for n, d in used if not d}) >= 2
  # Nothing compiled after warm-up: not a step shape, not a mirror variant,
  # not the bookkeeping-only step, not an eager op.
  assert compiler.compiled_count() == compiles and engine.stats.compile_seconds == 0
  assert not lowered
  assert_pool_empty(engine)


def test_contiguous_static_batching_gives_the_same_outputs(model):
  from paged_jax.entrypoints import workload  # pylint: disable=import-outside-toplevel
  requests = random_requests(4, 6)
  kw = dict(kv_tokens=128, progress=False, **{**SIZES, "min_bucket": 16})
  # Separate layers, as `paged-jax generate` loads the tiny model on CPU
  # (`loader.default_scan_layers`): both engines' sizes are then
  # test_generate.py's `SMALL` run's, whose 4 step programs (2 per engine)
  # this compiles once for both modules (one xdist unit, tests/conftest.py).
  model = model.with_scan_layers(False)
  paged, paged_out = workload.run_workload("paged", model, requests, **kw)
  contig, contig_out = workload.run_workload("contiguous", model, requests, **kw)
  assert [o.completions for o in paged_out] == [o.completions for o in contig_out]
  assert contig["num_blocks"] == 2 and contig["peak_running"] <= 2
  assert paged["peak_running"] > contig["peak_running"]
  assert paged["generated_tokens"] == contig["generated_tokens"] > 0
  assert paged["kv_bytes"] == contig["kv_bytes"]


def test_eos_stops_a_sequence(model, oracle):
  prompt = [11, 12, 13]
  full = oracle.greedy(prompt, 6)
  stop = full[2]
  req = Request("e", prompt, SamplingParams(max_new_tokens=6, eos_token_ids=(stop,)))
  (out,) = serve(make_engine(model), [req]).values()
  first = full.index(stop)
  assert out.completions[0].token_ids == full[:first + 1]
  assert out.completions[0].finish_reason == "stop"


def test_rejects_requests_that_can_never_fit(model):
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  cases = {
      "long": (list(range(3, 60)), SamplingParams(max_new_tokens=10), "max_model_len"),
      "pool": (list(range(3, 40)), SamplingParams(max_new_tokens=20), "the pool has 12"),
      "vocab": ([3, 9999], SamplingParams(), "outside the vocabulary"),
      "empty": ([], SamplingParams(), "empty prompt"),
      "wide": ([3, 4], SamplingParams(n=5), "max_batch is 4"),
      "beam": ([3, 4], SamplingParams(beam_width=2), "max_beam_width=1"),
  }
  for rid, (prompt, params, why) in cases.items():
    out = engine.add_request(Request(rid, prompt, params))
    assert out is not None and why in out.rejected, (rid, out)
  assert engine.stats.rejected == len(cases)
  assert not engine.has_unfinished()


def test_request_that_does_not_fit_now_waits(model):
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  reqs = [Request(i, list(range(3, 33)), SamplingParams(max_new_tokens=10))
          for i in range(2)]  # 40 tokens = 10 of the 12 blocks each
  for r in reqs:
    engine.add_request(r)
  engine.step()
  assert engine.num_running == 1 and engine.num_waiting == 1
  outputs = engine.run_until_done()
  assert sorted(o.request_id for o in outputs) == [0, 1]
  assert all(len(o.completions[0].token_ids) == 10 for o in outputs)
  assert_pool_empty(engine)


@pytest.mark.parametrize("kw,match", [
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(num_blocks=8, block_size=0), "block_size must be a positive int"),
    (dict(num_blocks=8, max_batch=8, max_tokens_per_step=4), "must be >= max_batch"),
    (dict(num_blocks=8, max_model_len=1), "max_model_len must be >= 2"),
    (dict(num_blocks=8, max_batch=2, max_beam_width=3), "max_beam_width=3 must be <="),
    (dict(num_blocks=8, admission_headroom_steps=-1),
     "admission_headroom_steps must be an int >= 0, got -1"),
    (dict(num_blocks=8, admission_headroom_steps=2**24 + 1),
     "admission_headroom_steps must be <= 16777216, got 16777217"),
    (dict(num_blocks=8, max_logprobs=2**40), "max_logprobs must be <= 65536, got 1099511627776"),
    (dict(num_blocks=8, max_logit_bias=10**12), "max_logit_bias must be <= 65536"),
    (dict(num_blocks=8, max_logit_bias=-1), "max_logit_bias must be an int >= 0, got -1"),
])
def test_engine_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig(**kw)


def test_online_arrivals_and_trace_requests(model):
  from paged_jax.entrypoints import workload  # pylint: disable=import-outside-toplevel
  from paged_jax import traces  # pylint: disable=import-outside-toplevel
  trace = traces.make_trace(workload.sharegpt_mini(48, scale=1 / 12), 5,
                            request_rate=200.0, seed=1)
  requests = workload.requests_from_trace(trace, vocab_size=512, exclude_ids=(2,))
  assert [len(r.prompt) for r in requests] == trace.prompt_lens.tolist()
  offline, off_out = workload.run_workload("paged", model, requests, kv_tokens=256,
                                           progress=False, **SIZES)
  online, on_out = workload.run_workload(
      "paged", model, requests, kv_tokens=256, progress=False,
      arrival_times=trace.arrival_times, **SIZES)
  assert [o.completions for o in on_out] == [o.completions for o in off_out]
  assert online["served"] == offline["served"] == 5


def test_samples_that_cannot_all_fit_take_turns(model):
  # Each sample needs 10 of the 12 blocks at its longest; both cannot fit at
  # once, so the newer one is preempted and recomputed after the older ends.
  req = Request("g", list(range(20, 40)),
                SamplingParams(n=2, temperature=1.0, seed=1, max_new_tokens=20))
  small = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  for_small = small.add_request(req)
  assert for_small is None
  got = {o.request_id: o for o in small.run_until_done(max_steps=500)}
  want = serve(make_engine(model), [req])
  assert got["g"].completions == want["g"].completions
  assert got["g"].preemptions > 0
  assert_pool_empty(small)


@pytest.mark.slow  # compiles every bucket of one more engine
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_quantized_cache_engine_serves_like_float(model, cache_dtype):
  """The engine's donated steps (prefill, decode, copy-on-write) run over an
  8-bit cache; on the tiny random model greedy outputs mostly agree with the
  float32 cache's (8-bit noise may flip near-tied tokens, so the check is on
  the first tokens and the share)."""
  requests = random_requests(7, 4, new=(6, 10))
  want = serve(make_engine(model), requests)
  engine = make_engine(model, cache_dtype=cache_dtype)
  assert engine.cache.dtype == kv_cache.cache_dtype(cache_dtype)
  got = serve(engine, requests)
  firsts = [got[r.request_id].completions[0].token_ids[0] ==
            want[r.request_id].completions[0].token_ids[0] for r in requests]
  assert sum(firsts) >= 3, firsts
  assert_mirror_is_the_device_state(engine)
