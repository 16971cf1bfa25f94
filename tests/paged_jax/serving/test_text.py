"""TextEngine over a scripted engine: stop strings across tokens, held-back
text, EOS not decoded, multi-byte characters, aborts."""

from __future__ import annotations

import types

import pytest

from paged_jax.serving import Completion, Request, RequestDelta, RequestOutput, SamplingParams
from paged_jax.serving.driver import Driver
from paged_jax.serving.text import TextEngine
from paged_jax.serving.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


class _Scripted:
  """An engine that emits one scripted token per step per request."""

  def __init__(self):
    self.model_config = types.SimpleNamespace(eos_token_ids=(2,))
    self.scripts, self.stopped, self.deltas = {}, [], []

  def stream_deltas(self, on):
    pass

  def add_request(self, r: Request):
    self.scripts[r.request_id] = [list(r.prompt), 0, r.params]

  def has_unfinished(self):
    return bool(self.scripts)

  def flush(self):
    pass

  def stop_sequence(self, rid, index):
    self.stopped.append(rid)
    self._finish(rid, "stop")
    return True

  def abort_request(self, rid):
    self._finish(rid, "abort")
    return True

  def _finish(self, rid, reason):
    toks, i, _ = self.scripts.pop(rid)
    self.deltas.append(RequestDelta(rid, -1, [], output=RequestOutput(
        rid, 0, [Completion(toks[:i], reason, token_logprobs=[-1.0] * i)])))

  def step(self):
    for rid, s in list(self.scripts.items()):
      toks, i, p = s
      tok = toks[i]
      s[1] += 1
      done = "stop" if tok == 2 else "length" if s[1] == len(toks) else None
      self.deltas.append(RequestDelta(rid, 0, [tok], done, logprobs=[-1.0]))
      if done:
        self._finish(rid, done)

  def take_deltas(self):
    out, self.deltas = self.deltas, []
    return out


def _run(te):
  deltas = []
  while te.has_unfinished():
    deltas += te.step()
  return deltas


def test_stop_string_across_tokens_cuts_and_stops():
  eng = _Scripted()
  te = Driver(eng, TOK)
  # "ab€<END>cd": the stop string spans 5 tokens; "€" is 3 bytes.
  te.add_request(Request("a", TOK.encode("ab€<END>cd", add_special_tokens=False),
                         SamplingParams(max_new_tokens=20, stop=("<END>", "zz"))))
  deltas = _run(te)
  assert eng.stopped == ["a"]
  pieces = [d.text for d in deltas if d.output is None]
  assert "".join(pieces) == "ab€"
  assert all("\ufffd" not in p for p in pieces)
  assert not any("<" in p for p in pieces)  # a possible stop string is held back
  final = deltas[-1]
  assert final.completions[0].text == "ab€"
  assert final.completions[0].finish_reason == "stop"
  assert [d.finish_reason for d in deltas if d.output is None][-1] == "stop"


def test_eos_is_not_decoded_and_text_is_complete():
  eng = _Scripted()
  te = Driver(eng, TOK)
  te.add_request(Request("b", TOK.encode("hé", add_special_tokens=False) + [2],
                         SamplingParams(max_new_tokens=20)))
  deltas = _run(te)
  assert "".join(d.text for d in deltas if d.output is None) == "hé"
  c = deltas[-1].completions[0]
  assert c.text == "hé" and c.finish_reason == "stop" and c.token_ids[-1] == 2
  assert c.logprobs == [-1.0] * 4


def test_abort_keeps_the_text_so_far():
  eng = _Scripted()
  te = Driver(eng, TOK)
  te.add_request(Request("c", TOK.encode("xyz", add_special_tokens=False),
                         SamplingParams(max_new_tokens=20)))
  te.step()
  te.abort_request("c")
  deltas = _run(te) + te.text.take()
  (final,) = [d for d in deltas if d.output is not None]
  assert final.completions[0].text == "x" and final.completions[0].finish_reason == "abort"
  assert not te.has_unfinished()


class _FailingTokenizer(ByteTokenizer):
  """Decoding raises once a stream meets the id of "!"."""

  def stream_decoder(self):
    inner = super().stream_decoder()

    class Dec:
      def add(self, ids):
        if TOK.encode("!", add_special_tokens=False)[0] in ids:
          raise RuntimeError("decoding failed")
        return inner.add(ids)

      def flush(self):
        return inner.flush()

    return Dec()


def test_a_failure_while_decoding_fails_that_request_alone():
  engine = _Scripted()
  te = Driver(engine, _FailingTokenizer())
  bad = TOK.encode("ab!cd", add_special_tokens=False)
  good = TOK.encode("hello", add_special_tokens=False)
  te.add_request(Request("bad", bad, SamplingParams(max_new_tokens=20)))
  te.add_request(Request("good", good, SamplingParams(max_new_tokens=20)))
  deltas = _run(te)
  bad_deltas = [d for d in deltas if d.request_id == "bad"]
  assert "".join(d.text for d in bad_deltas) == "ab"
  assert bad_deltas[-1].error.startswith("internal error while serving this request")
  assert bad_deltas[-1].output is None and "bad" not in engine.scripts  # aborted
  good_deltas = [d for d in deltas if d.request_id == "good"]
  assert "".join(d.text for d in good_deltas) == "hello"
  assert good_deltas[-1].output is not None and good_deltas[-1].error is None
  assert not te.has_unfinished()


def test_a_failure_while_adding_leaves_nothing_behind():
  engine = _Scripted()
  te = TextEngine(engine, TOK)

  def add_request(r):
    engine.scripts[r.request_id] = [list(r.prompt), 0, r.params]  # queued, then raised
    raise RuntimeError("add failed")

  real, engine.add_request = engine.add_request, add_request
  with pytest.raises(RuntimeError, match="add failed"):
    te.add_request(Request("x", [5, 6], SamplingParams()))
  assert not te.has_unfinished() and "x" not in engine.scripts  # aborted, forgotten
  engine.add_request = real
  te.add_request(Request("y", [5], SamplingParams()))
  with pytest.raises(ValueError, match="request id 'y' is already running"):
    te.add_request(Request("y", [5], SamplingParams()))
