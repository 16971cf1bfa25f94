"""Engine support for the text layer and the server: `abort_request`,
`stop_sequence`, `min_tokens`, `stop_token_ids`, sampled-token log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.serving import Request, SamplingParams
from tests.examples.conftest import BIG_POOL, make_engine


def _run(engine, steps):
  for _ in range(steps):
    engine.step()


def test_abort_frees_every_block_running_or_waiting(model):
  engine = make_engine(model)
  engine.stream_deltas(True)
  for i in range(4):  # a 16-token step budget: some wait
    engine.add_request(Request(i, list(range(3, 20)), SamplingParams(max_new_tokens=30)))
  engine.add_request(Request("n", list(range(3, 9)),
                             SamplingParams(n=2, temperature=1.0, max_new_tokens=30)))
  _run(engine, 2)
  assert engine.num_waiting > 0 and engine.usage()["blocks_used"] > 0
  assert not engine.abort_request("missing")
  for rid in (0, 3, "n", 1, 2):
    assert engine.abort_request(rid)
  assert not engine.abort_request(0)  # already gone
  assert not engine.has_unfinished()
  engine.flush()
  assert engine.usage()["blocks_used"] == 0
  assert int(engine.block_state.num_free) == BIG_POOL
  finals = {d.request_id: d.output for d in engine.take_deltas() if d.output}
  assert sorted(map(str, finals)) == ["0", "1", "2", "3", "n"]
  assert all(c.finish_reason == "abort" for o in finals.values() for c in o.completions)
  assert engine.stats.aborted == 5
  # The engine still serves afterwards.
  engine.add_request(Request("after", [5, 6, 7], SamplingParams(max_new_tokens=3)))
  (out,) = engine.run_until_done()
  assert len(out.completions[0].token_ids) == 3


def test_abort_between_fork_and_its_step(model):
  engine = make_engine(model)
  engine.add_request(Request("n", list(range(3, 9)),
                             SamplingParams(n=3, temperature=1.0, max_new_tokens=9)))
  engine.step()  # prompt done: the children fork at the next step
  assert engine.abort_request("n")
  engine.flush()
  assert int(engine.block_state.num_free) == BIG_POOL


def test_stop_sequence_finishes_with_stop_and_frees_blocks(model):
  engine = make_engine(model)
  engine.stream_deltas(True)
  engine.add_request(Request("a", list(range(3, 12)), SamplingParams(max_new_tokens=20)))
  _run(engine, 4)
  seen = [t for d in engine.take_deltas() for t in d.token_ids]
  assert len(seen) >= 2
  assert engine.stop_sequence("a", 0)
  assert not engine.stop_sequence("a", 0)
  (out,) = engine.step()
  assert out.completions[0].finish_reason == "stop"
  # Exactly the tokens the host had seen when it decided (a token still in
  # flight with asynchronous scheduling is dropped).
  assert out.completions[0].token_ids == seen
  engine.flush()
  assert int(engine.block_state.num_free) == BIG_POOL


def test_logprobs_of_the_sampled_tokens(model):
  engine = make_engine(model)
  engine.add_request(Request("g", list(range(3, 12)), SamplingParams(max_new_tokens=6)))
  (out,) = engine.run_until_done()
  c = out.completions[0]
  assert len(c.token_logprobs) == len(c.token_ids)
  lp = np.array(c.token_logprobs)
  assert np.all(lp <= 0) and np.all(np.isfinite(lp))
  # Greedy: each token is the most likely one, so its log-prob is the top one.
  tokens = np.array([list(range(3, 12)) + c.token_ids[:-1]], np.int32)
  logits = np.asarray(model.dense_logits(tokens), np.float64)[0, 8:]
  top = logits.max(-1, keepdims=True)
  want = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  assert c.token_ids == want.argmax(-1).tolist()
  np.testing.assert_allclose(lp, want[np.arange(len(lp)), c.token_ids], atol=1e-4)


def _first_token(model, prompt):
  engine = make_engine(model)
  engine.add_request(Request(0, prompt, SamplingParams(max_new_tokens=1)))
  return engine.run_until_done()[0].completions[0].token_ids[0]


def test_stop_token_ids_and_min_tokens(model):
  prompt = list(range(3, 12))
  first = _first_token(model, prompt)
  engine = make_engine(model)
  engine.add_request(Request("stop", prompt, SamplingParams(
      max_new_tokens=8, stop_token_ids=(first,))))
  engine.add_request(Request("min", prompt, SamplingParams(
      max_new_tokens=8, stop_token_ids=(first,), min_tokens=3)))
  outs = {o.request_id: o.completions[0] for o in engine.run_until_done()}
  assert outs["stop"].token_ids == [first] and outs["stop"].finish_reason == "stop"
  got = outs["min"].token_ids
  assert len(got) >= 3 and first not in got[:3]


def test_sampling_params_errors():
  with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_new_tokens=4\]"):
    SamplingParams(max_new_tokens=4, min_tokens=5)
  with pytest.raises(ValueError, match="stop strings must be non-empty str"):
    SamplingParams(stop=("",))


def test_min_tokens_with_too_many_stop_ids_is_rejected(model):
  engine = make_engine(model)
  out = engine.add_request(Request(0, [3, 4], SamplingParams(
      max_new_tokens=4, min_tokens=1, stop_token_ids=tuple(range(10, 20)))))
  assert out.rejected == "min_tokens needs at most 8 EOS and stop token ids, got 11"
