"""The steady decode rows of a plan (`packing.Plan.decode_rows`) are packed,
committed and resolved with whole-array operations; every other entry goes
through the per-entry loops. Both must give the same engine: the same
workload (samples `n > 1`, beam search, top log-probs, stop ids, budgets, an
abort, a stop, preemption, prefix caching) runs on an engine whose plans name
their decode rows and on one whose plans never do, and every step's inputs,
every output and every streamed delta must be equal."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from benchmarks import stub_model
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

_MODEL = stub_model.StubModel()


def _engine(fast: bool, caching: bool, num_blocks: int, stream: bool):
  engine = Engine(_MODEL, EngineConfig(
      num_blocks=num_blocks, block_size=4, max_batch=8, max_tokens_per_step=32,
      max_model_len=96, min_bucket=32, bucket_midpoints=False,  # decode 8, mixed 32
      enable_prefix_caching=caching, admission_headroom_steps=0))
  engine.stream_deltas(stream)
  sched = engine._pools[0]  # pylint: disable=protected-access
  schedule = sched._schedule  # pylint: disable=protected-access
  seen = []  # the decode rows of every plan that had entries

  def planned():
    plan, admitted, first = schedule()
    if not fast:
      plan.decode_rows = 0
    return plan, admitted, first
  sched._schedule = planned  # pylint: disable=protected-access
  fit = sched._fit  # pylint: disable=protected-access

  def fitted(plan, admitted, first):
    plan = fit(plan, admitted, first)
    if plan:
      seen.append(plan.decode_rows)
    return plan
  sched._fit = fitted  # pylint: disable=protected-access
  inputs = []  # every step's inputs, on the host
  runner = engine._runner  # pylint: disable=protected-access
  for name in ("dispatch", "dispatch_bookkeeping"):
    method = getattr(runner, name)

    def recorded(*args, method=method, **kwargs):
      xs = next(a for a in args if isinstance(a, list))
      inputs.append(jax.tree.map(np.array, xs))
      return method(*args, **kwargs)
    setattr(runner, name, recorded)
  return engine, inputs, seen


def _serve(engine, seed: int):
  rng = random.Random(seed)
  vocab = _MODEL.config.vocab_size
  outs, deltas = [], []
  shared = [rng.randrange(vocab) for _ in range(8)]
  for step in range(400):
    if step < 40 and rng.random() < 0.5:
      prompt = (shared if rng.random() < 0.5 else []) + [
          rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
      kind = rng.random()
      p = {"max_new_tokens": rng.randint(1, 24)}
      if kind < 0.2:
        p.update(temperature=0.8, seed=rng.randint(0, 99), n=rng.randint(2, 3))
      elif kind < 0.3:
        p.update(beam_width=2)
      elif kind < 0.45:
        p.update(logprobs=rng.randint(0, 3))
      elif kind < 0.6:
        p.update(stop_token_ids=(rng.randrange(vocab),), min_tokens=rng.randint(0, 3))
      engine.add_request(Request(f"r{step}", prompt, SamplingParams(**p)))
    if step == 12:
      engine.abort_request(next(iter(_live(engine)), None))
    if step == 16:
      engine.stop_sequence(next(iter(_live(engine)), None), 0)
    outs += engine.step()
    deltas += engine.take_deltas()
    if step > 40 and not engine.has_unfinished():
      break
  outs += engine.flush()
  deltas += engine.take_deltas()
  return outs, deltas


def _live(engine):
  return [s.group.request.request_id
          for s in engine._pools[0]._running]  # pylint: disable=protected-access


def _comparable(outs):
  return sorted(((o.request_id, o.rejected, o.preemptions, o.first_token_step,
                  o.finish_step,
                  [(c.token_ids, c.finish_reason, c.logprob, c.token_logprobs,
                    c.top_logprobs) for c in o.completions]) for o in outs), key=str)


@pytest.mark.parametrize("caching,num_blocks,stream", [
    (False, 24, False), (True, 24, False), (False, 24, True)])
def test_decode_rows_give_the_same_engine(caching, num_blocks, stream):
  fast, fast_inputs, fast_seen = _engine(True, caching, num_blocks, stream)
  slow, slow_inputs, slow_seen = _engine(False, caching, num_blocks, stream)
  fast_outs, fast_deltas = _serve(fast, seed=num_blocks)
  slow_outs, slow_deltas = _serve(slow, seed=num_blocks)
  assert max(fast_seen) > 0 and max(slow_seen) == 0  # both paths ran
  assert len(fast_inputs) == len(slow_inputs)
  for a, b in zip(fast_inputs, slow_inputs):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(x, y)
  assert _comparable(fast_outs) == _comparable(slow_outs)
  assert [(d.request_id, d.index, d.token_ids, d.finish_reason, d.logprobs,
           d.top_logprobs) for d in fast_deltas] == [
               (d.request_id, d.index, d.token_ids, d.finish_reason, d.logprobs,
                d.top_logprobs) for d in slow_deltas]
  assert fast.stats.preemptions > 0
  fast.flush()
  assert fast.usage()["blocks_used"] == 0 and not fast.has_unfinished()


def test_steady_decode_steps_send_the_same_inputs():
  """While the running rows stay the same and each one's last token is in
  flight, a step's inputs do not change (the block state they act on lives
  on the device): the engine sends the very same read-only `StepInputs`
  again, across block boundaries too, and the tokens are those of an engine
  that waits for every step (its inputs carry the tokens)."""
  def serve(async_scheduling):
    # `_engine`'s sizes without caching (3 x 25 tokens fit in 24 blocks):
    # the steps test_decode_rows_give_the_same_engine compiled.
    engine = Engine(_MODEL, EngineConfig(
        num_blocks=24, block_size=4, max_batch=8, max_tokens_per_step=32,
        max_model_len=96, min_bucket=32, bucket_midpoints=False,
        async_scheduling=async_scheduling))
    sent = []
    runner = engine._runner  # pylint: disable=protected-access
    dispatch = runner.dispatch

    def recorded(bucket, xs, *args):
      sent.append(xs[0])
      return dispatch(bucket, xs, *args)
    runner.dispatch = recorded
    for i in range(3):
      engine.add_request(Request(f"r{i}", [i + 1] * (3 + i),
                                 SamplingParams(max_new_tokens=20)))
    return engine.run_until_done(), sent
  outs, sent = serve(True)
  ids = [id(x) for x in sent]
  again = sum(a == b for a, b in zip(ids, ids[1:]))
  assert again >= 15  # 20 tokens: crossing 5 block boundaries, each row
  for a, b in zip(sent, sent[1:]):
    if a is b:
      assert not any(v.flags.writeable for v in jax.tree.leaves(a))
  waited, _ = serve(False)
  tokens = lambda outs: {o.request_id: [c.token_ids for c in o.completions] for o in outs}
  assert tokens(outs) == tokens(waited)
