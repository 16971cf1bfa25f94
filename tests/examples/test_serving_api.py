"""The installed serving API: `LLM.generate`, `LLM.stream`, buckets, latency."""

from __future__ import annotations

import pytest

from paged_jax.serving import LLM, EngineConfig, Request, SamplingParams
from tests.examples.conftest import BIG_POOL, SIZES, make_engine, random_requests, serve


def _llm(model, **kw):
  return LLM(model, num_blocks=BIG_POOL, **{**SIZES, **kw})


def test_stream_deltas_concatenate_to_the_offline_result(model):
  prompts = [r.prompt for r in random_requests(7, 4)]
  params = [SamplingParams(max_new_tokens=9),
            SamplingParams(n=2, temperature=0.8, seed=5, max_new_tokens=7),
            SamplingParams(beam_width=2, max_new_tokens=5),
            SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, seed=2)]
  prompts.append(list(range(3, 90)))  # too long: rejected
  params.append(SamplingParams())
  want = _llm(model, max_beam_width=2).generate(prompts, params)
  llm = _llm(model, max_beam_width=2)
  got: dict = {}
  finals = {}
  for d in llm.stream(prompts, params):
    if d.output is not None:
      assert d.index == -1 and d.request_id not in finals
      finals[d.request_id] = d.output
    else:
      got.setdefault(d.request_id, {}).setdefault(d.index, []).extend(d.token_ids)
  assert sorted(finals) == list(range(5))
  assert finals[4].rejected and "max_model_len" in finals[4].rejected
  for i, out in enumerate(want[:4]):
    assert finals[i].completions == out.completions
    assert [got[i][j] for j in range(len(out.completions))] == [
        c.token_ids for c in out.completions]
  assert len(got[0][0]) == 9 or want[0].completions[0].finish_reason == "stop"
  engine = llm.engine
  assert int(engine.block_state.num_free) == BIG_POOL
  assert not engine.take_deltas()  # streaming stopped, nothing kept
  st = engine.stats
  assert st.ttft.count == 4 and st.e2e.count == 4
  assert 0 < st.ttft.mean <= st.e2e.mean
  assert st.itl.count > 0 and len(st.buckets) <= len(engine.buckets)
  assert all(o.ttft is not None and o.ttft <= o.finish_time - o.arrival_time
             for o in finals.values() if not o.rejected)


def test_buckets_give_the_same_tokens_with_less_padding(model):
  requests = random_requests(8, 6, prompt=(3, 24), new=(2, 14))
  fixed = make_engine(model, min_bucket=SIZES["max_tokens_per_step"])
  bucketed = make_engine(model)
  want, got = serve(fixed, requests), serve(bucketed, requests)
  assert {k: o.completions for k, o in got.items()} == {
      k: o.completions for k, o in want.items()}
  f, b = fixed.stats, bucketed.stats
  assert f.computed_tokens == b.computed_tokens > 0
  assert b.padded_rows < f.padded_rows
  assert 1.0 <= b.padding_ratio < f.padding_ratio
  assert {k[:2] for k in f.buckets} == {(4, 4), (16, 4)}  # the two fixed shapes
  assert len(bucketed.compiled_buckets) > 2


def test_llm_errors(model):
  with pytest.raises(ValueError, match="give an EngineConfig or its fields, not both"):
    LLM(model, EngineConfig(num_blocks=8), max_batch=2)
  llm = _llm(model)
  with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
    llm.generate([[3, 4], [5, 6]], [SamplingParams()])
  with pytest.raises(ValueError, match="request ids must be unique"):
    llm.generate([Request("a", [3]), Request("a", [4])])
