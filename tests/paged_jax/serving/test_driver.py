"""`Driver`, the one loop over `Engine.step()`: arrival times on a fake clock
(order, ties, sleeping only when idle), rejections, aborts before arrival,
the step limit, and its three output forms on the tiny model's engine."""

from __future__ import annotations

import pytest

from paged_jax.serving.driver import Driver
from paged_jax.serving.requests import Completion, Request, RequestDelta, RequestOutput
from paged_jax.serving.sampling import SamplingParams
from paged_jax.serving.tokenizer import ByteTokenizer

STEP_S = 0.1  # each scripted step takes this long on the fake clock


class _Clock:
  def __init__(self):
    self.now, self.sleeps = 0.0, []

  def __call__(self):
    return self.now

  def sleep(self, s):
    assert s >= 0
    self.sleeps.append(round(s, 9))
    self.now += s


class _Scripted:
  """Each request runs `len(prompt)` steps, one token a step; prompt [] is rejected."""

  def __init__(self, clock):
    self.clock, self.left, self.added = clock, {}, []
    self.outputs, self.deltas, self.flushes, self.steps = [], [], 0, 0
    self.streaming = False

  def stream_deltas(self, on=True):
    self.streaming = on

  def add_request(self, r):
    self.added.append((r.request_id, self.clock.now))
    if not r.prompt:
      out = RequestOutput(r.request_id, 0, rejected="empty prompt")
      self._finish(out)
      return out
    self.left[r.request_id] = len(r.prompt)
    return None

  def _finish(self, out):
    self.outputs.append(out)
    if self.streaming:
      self.deltas.append(RequestDelta(out.request_id, -1, [], output=out))

  def abort_request(self, rid):
    return self.left.pop(rid, None) is not None

  def has_unfinished(self):
    return bool(self.left)

  def step(self):
    self.steps += 1
    self.clock.now += STEP_S
    for rid in list(self.left):
      self.left[rid] -= 1
      if self.streaming:
        self.deltas.append(RequestDelta(rid, 0, [7]))
      if self.left[rid] == 0:
        del self.left[rid]
        self._finish(RequestOutput(rid, 1, [Completion([7], "length")]))
    return self.flush_outputs()

  def flush(self):
    self.flushes += 1
    return self.flush_outputs()

  def flush_outputs(self):
    out, self.outputs = self.outputs, []
    return out

  def take_deltas(self):
    out, self.deltas = self.deltas, []
    return out


def _driver(**kw):
  clock = _Clock()
  eng = _Scripted(clock)
  return Driver(eng, clock=clock, sleep=clock.sleep, **kw), eng, clock


def test_requests_join_at_their_arrival_times_in_arrival_order():
  d, eng, clock = _driver()
  arrivals = {"late": 1.0, "a": 0.35, "now": 0.0, "b": 0.35}
  for rid, t in arrivals.items():
    d.add_request(Request(rid, [1, 1], SamplingParams()), arrival=t)
  assert eng.added == [] and d.has_unfinished() and d.num_arrivals_left == 4
  outs = d.run_until_done()
  assert [rid for rid, _ in eng.added] == ["now", "a", "b", "late"]  # ties: as given
  for rid, t in eng.added:
    assert arrivals[rid] <= t < arrivals[rid] + STEP_S + 1e-9, (rid, t)
  assert sorted(o.request_id for o in outs) == sorted(arrivals)
  # Idle twice: "now" ends at 0.2 s, "a" and "b" join at 0.35 and end at
  # 0.55 s, "late" is due at 1.0 s.
  assert clock.sleeps == [pytest.approx(0.15), pytest.approx(0.45)]
  assert not d.has_unfinished() and eng.flushes >= 2  # the idle one and the last


def test_requests_without_an_arrival_time_are_added_at_once():
  d, eng, _ = _driver()
  assert d.add_request(Request(0, [1], SamplingParams())) is None
  assert eng.added == [(0, 0.0)]
  rejected = d.add_request(Request(1, [], SamplingParams()))
  assert rejected.rejected == "empty prompt"
  outs = d.run_until_done()
  assert [(o.request_id, o.rejected) for o in outs] == [(1, "empty prompt"), (0, None)]


def test_only_rejected_requests_still_come_out():
  d, eng, _ = _driver()
  d.add_request(Request("x", [], SamplingParams()))
  assert [o.request_id for o in d.run_until_done()] == ["x"]
  assert eng.steps == 0


def test_stream_gives_deltas_and_close_turns_them_off():
  d, eng, _ = _driver(stream=True)
  assert eng.streaming
  d.add_request(Request("r", [1, 1, 1], SamplingParams()), arrival=0.2)
  deltas = list(d.run())
  assert [len(x.token_ids) for x in deltas if x.output is None] == [1, 1, 1]
  assert deltas[-1].output.request_id == "r"
  d.close()
  assert not eng.streaming


def test_abort_before_arrival_drops_the_request():
  d, eng, clock = _driver()
  d.add_request(Request("gone", [1], SamplingParams()), arrival=5.0)
  d.add_request(Request("kept", [1], SamplingParams()), arrival=0.0)
  assert d.abort_request("gone") and not d.abort_request("never")
  assert [o.request_id for o in d.run_until_done()] == ["kept"]
  assert [rid for rid, _ in eng.added] == ["kept"] and clock.sleeps == []


def test_step_limit_and_bad_arrival_times():
  d, _, _ = _driver()
  d.add_request(Request("long", [1] * 10, SamplingParams()))
  with pytest.raises(RuntimeError, match="still unfinished after 3 steps"):
    d.run_until_done(max_steps=3)
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=r"arrival must be seconds >= 0 \(finite\), got"):
      d.add_request(Request("t", [1], SamplingParams()), arrival=bad)


def test_on_step_sees_every_step_and_its_items():
  d, eng, _ = _driver()
  d.add_request(Request(0, [1, 1], SamplingParams()))
  seen = []
  d.run_until_done(on_step=lambda e, items: seen.append((e, len(items))))
  assert seen == [(eng, 0), (eng, 1)]


# ------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def engine():
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
  return Engine(model, EngineConfig(num_blocks=32, block_size=8, max_batch=4,
                                    max_tokens_per_step=32, max_model_len=64,
                                    min_bucket=4, bucket_midpoints=False))


def test_the_three_forms_agree_on_the_tiny_engine(engine):
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
  params = SamplingParams(max_new_tokens=5, ignore_eos=True)
  reqs = lambda: [Request(i, p, params) for i, p in enumerate(prompts)]  # noqa: E731

  d = Driver(engine)
  for i, r in enumerate(reqs()):
    d.add_request(r, arrival=0.01 * i)
  outs = {o.request_id: o.completions[0].token_ids for o in d.run_until_done()}
  assert sorted(outs) == [0, 1, 2] and all(len(t) == 5 for t in outs.values())
  assert engine.usage()["blocks_used"] == 0  # flushed: the pool is empty

  d = Driver(engine, stream=True)
  for r in reqs():
    d.add_request(r)
  streamed = {}
  for x in d.run():
    if x.output is None:
      streamed.setdefault(x.request_id, []).extend(x.token_ids)
  d.close()
  assert streamed == outs

  tok = ByteTokenizer()
  d = Driver(engine, tok)
  for r in reqs():
    d.add_request(r)
  finals = {x.request_id: x.completions[0] for x in d.run() if x.output is not None}
  assert {k: c.token_ids for k, c in finals.items()} == outs
  assert all(c.text == tok.decode(outs[k]) for k, c in finals.items())
  assert engine.usage()["blocks_used"] == 0
