"""Asynchronous scheduling: step N+1 is dispatched before step N's results are
read, and nothing a user sees changes (tokens, finish reasons, streams, the
pool)."""

from __future__ import annotations

import dataclasses

from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests.examples.conftest import SMALL_POOL, make_engine, random_requests, serve
from tests.examples.test_engine import assert_pool_empty, tokens


def _with_eos_mid_sequence(model, requests):
  """`requests` with each one's EOS set to a token it generates part-way
  (found by a first run), so sequences stop while their next step is already
  in flight."""
  first = serve(make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0, async_scheduling=False,
                            max_beam_width=2), requests)
  out = []
  for r in requests:
    gen = first[r.request_id].completions[0].token_ids
    eos = (gen[len(gen) // 2],) if len(gen) > 2 else ()
    out.append(dataclasses.replace(
        r, params=dataclasses.replace(r.params, eos_token_ids=eos)))
  return out


def test_async_matches_sync_with_eos_forks_sampling_and_preemption(model):
  requests = random_requests(5, 6, new=(4, 14))
  requests += [Request("n3", [7, 8, 9, 10], SamplingParams(
                   n=3, temperature=0.8, seed=4, max_new_tokens=7)),
               Request("n2-short", [11, 12], SamplingParams(n=2, max_new_tokens=1)),
               Request("beam", [13, 14, 15], SamplingParams(beam_width=2,
                                                            max_new_tokens=5))]
  requests = _with_eos_mid_sequence(model, requests)
  # One pool size for every engine here (the steps compile once); it is
  # small enough to preempt.
  sync = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0, async_scheduling=False,
                     max_beam_width=2)
  asyn = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0, max_beam_width=2)
  want, got = serve(sync, requests), serve(asyn, requests)
  assert tokens(got) == tokens(want)
  stops = sum(c.finish_reason == "stop" for o in got.values() for c in o.completions)
  assert stops >= 4  # EOS arrived while the sequence's next step was in flight
  assert asyn.stats.preemptions > 0
  for engine in (sync, asyn):
    assert_pool_empty(engine)


def test_results_are_read_after_the_next_dispatch(model):
  engine = make_engine(model)
  events = []
  runner = engine._runner  # pylint: disable=protected-access
  dispatch, fetch = runner.dispatch, runner.fetch
  runner.dispatch = lambda *a: (events.append("dispatch"), dispatch(*a))[1]
  runner.fetch = lambda *a, **k: (events.append("fetch"), fetch(*a, **k))[1]
  serve(engine, random_requests(6, 3, new=(6, 8)))
  # Every fetch but the last (the final step's, when nothing is left to
  # dispatch) comes right after the dispatch of the next step.
  assert events[:3] == ["dispatch", "dispatch", "fetch"]
  body = events[1:]
  assert body.count("fetch") >= 6
  for i, e in enumerate(body[:-2]):
    if e == "fetch":
      assert body[i - 1] == "dispatch", events


def test_streams_are_the_same_with_and_without_async(model):
  requests = _with_eos_mid_sequence(model, random_requests(8, 4, new=(4, 10)))
  streams = []
  for flag in (False, True):
    engine = make_engine(model, async_scheduling=flag)
    engine.stream_deltas()
    serve(engine, requests)
    by_id = {}
    for d in engine.take_deltas():
      if d.index >= 0:
        by_id.setdefault((d.request_id, d.index), []).append(
            (tuple(d.token_ids), d.finish_reason))
    streams.append(by_id)
  assert streams[0] == streams[1]
  for deltas in streams[1].values():  # one delta per token, the last finishes
    assert deltas[-1][1] in ("stop", "length")
    assert all(reason is None for _, reason in deltas[:-1])
