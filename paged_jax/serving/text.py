"""Text in, text out over an `Engine`: streaming decode and stop strings.

`TextEngine` wraps an `Engine` and a tokenizer (`tokenizer.py`). Each step it
turns the engine's token deltas into `TextDelta`s: the new text of each
sequence (multi-byte characters complete), its tokens and their log-probs.
Stop strings (`SamplingParams.stop`) are matched on the decoded text: the
text is cut where a stop string starts, the sequence is finished at once
(`Engine.stop_sequence`, its blocks back at the next step) with finish reason
"stop". While a stop string might still be forming, the last
`len(longest stop) - 1` characters are held back. An EOS or stop token ends
the text and is not decoded (it stays in `token_ids`).

A failure while turning one request's tokens into text (its tokenizer
raised, say) fails that request alone: it is aborted in the engine and ends
with a `TextDelta` whose `error` is set; the others go on.

It does not step the engine: `driver.Driver(engine, tokenizer)` does, and
returns these deltas.

Example:
  >>> driver = Driver(engine, ByteTokenizer())   # driver.text is the TextEngine
  >>> driver.add_request(Request("a", ByteTokenizer().encode("Hi"),
  ...                            SamplingParams(stop=("\\n",))))
  >>> for d in driver.run():
  ...   print(d.text, end="")
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Hashable

from paged_jax.serving.engine import Engine
from paged_jax.serving.requests import Request, RequestOutput
from paged_jax.serving.tokenizer import Tokenizer


@dataclasses.dataclass
class TextCompletion:
  text: str
  token_ids: list[int]
  logprobs: list[float] | None
  finish_reason: str | None
  top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass
class TextDelta:
  """New text of one sequence, or (index -1, `output` set) a request's end.

  Attributes:
    request_id, index: as in `RequestDelta`.
    text: the new text (may be empty while characters or a possible stop
      string are held back).
    token_ids, logprobs: the new tokens and their log-probabilities.
    top_logprobs: each new token's top alternatives `(token id, log-prob)`
      when the request asked for them (`SamplingParams.logprobs`).
    finish_reason: "stop", "length" or "abort" on a sequence's last delta.
    output: the `RequestOutput` (completions' token ids) on the last delta;
      `completions` then holds each sequence's `TextCompletion`.
    error: set (index -1, no `output`) when serving this request failed; it
      is the request's last delta and the request is aborted in the engine.
  """

  request_id: Hashable
  index: int
  text: str = ""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] | None = None
  finish_reason: str | None = None
  output: RequestOutput | None = None
  completions: list[TextCompletion] | None = None
  error: str | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None


class _SeqText:
  def __init__(self, decoder):
    self.decoder = decoder
    self.text = ""
    self.emitted = 0
    self.searched = 0
    self.token_ids: list[int] = []
    self.logprobs: list[float] = []
    self.top_logprobs: list | None = None
    self.finish_reason: str | None = None


class _Req:
  def __init__(self, request: Request, stop_ids: frozenset[int]):
    self.request = request
    self.stop = request.params.stop
    self.hold = max((len(s) for s in self.stop), default=1) - 1
    self.stop_ids = stop_ids
    self.seqs: dict[int, _SeqText] = {}


class TextEngine:
  """An `Engine` with text deltas and stop strings (see the module docstring).

  Args:
    engine: the `Engine` (its deltas are turned on).
    tokenizer: a `tokenizer.Tokenizer`.
  """

  def __init__(self, engine: Engine, tokenizer: Tokenizer):
    self.engine = engine
    self.tokenizer = tokenizer
    self._reqs: dict[Hashable, _Req] = {}
    engine.stream_deltas(True)

  def add_request(self, request: Request) -> RequestOutput | None:
    """`Engine.add_request`; the rejection (if any) also ends the stream.
    If it raises, the request is forgotten here too."""
    rid = request.request_id
    if rid in self._reqs:
      raise ValueError(f"request id {rid!r:.80} is already running")
    self._reqs[rid] = _Req(request, request.params.stop_ids(
        self.engine.model_config.eos_token_ids))
    try:
      return self.engine.add_request(request)
    except BaseException:
      del self._reqs[rid]
      try:  # in case the engine queued it before it raised
        self.engine.abort_request(rid)
      except Exception:  # pylint: disable=broad-except  # the first error is the one
        pass
      raise

  def abort_request(self, request_id) -> bool:
    return self.engine.abort_request(request_id)

  def has_unfinished(self) -> bool:
    return self.engine.has_unfinished() or bool(self._reqs)

  def take(self) -> list[TextDelta]:
    """The text deltas of the engine's deltas since the last call."""
    out = []
    for d in self.engine.take_deltas():
      r = self._reqs.get(d.request_id)
      if r is None:
        continue
      try:
        delta = self._text(r, d)
      except Exception:  # pylint: disable=broad-except  # this request alone
        delta = self.fail_request(d.request_id, "decoding its output raised")
      if delta is not None:
        out.append(delta)
    return out

  def fail_request(self, request_id, reason: str) -> TextDelta | None:
    """Fails `request_id` alone: aborts it in the engine (its blocks come
    back at the next step), forgets it, logs the exception being handled (if
    any) and returns its last delta (`error` set); None if not running."""
    if self._reqs.pop(request_id, None) is None:
      return None
    if sys.exc_info()[0] is not None:
      traceback.print_exc(file=sys.stderr)
    self.engine.abort_request(request_id)
    return TextDelta(request_id, -1, error=f"internal error while serving this "
                     f"request ({reason}); the server goes on")

  def _text(self, r: _Req, d) -> TextDelta | None:
    if d.output is not None:
      return self._final(r, d.output)
    if r.request.params.beam_width > 1:
      s = self._seq(r, d.index)
      s.token_ids = list(d.token_ids)
      s.text = self.tokenizer.decode([t for t in d.token_ids if t not in r.stop_ids])
      s.finish_reason = d.finish_reason
      s.logprobs = None
      return TextDelta(d.request_id, d.index, s.text, list(d.token_ids),
                       None, d.finish_reason)
    return self._tokens(r, d.index, d.token_ids, d.logprobs, d.finish_reason,
                        d.top_logprobs)

  def _seq(self, r: _Req, index: int) -> _SeqText:
    if index not in r.seqs:
      r.seqs[index] = _SeqText(self.tokenizer.stream_decoder())
    return r.seqs[index]

  def _tokens(self, r: _Req, index, token_ids, logprobs, finish_reason, top=None):
    s = self._seq(r, index)
    if s.finish_reason is not None:  # stopped by a stop string: drop the rest
      return None
    s.token_ids += token_ids
    s.logprobs += logprobs or []
    if top is not None:
      s.top_logprobs = (s.top_logprobs or []) + list(top)
    ids = list(token_ids)
    if finish_reason == "stop" and ids and ids[-1] in r.stop_ids:
      ids = ids[:-1]
    s.text += s.decoder.add(ids)
    if finish_reason is not None:
      s.text += s.decoder.flush()
    if r.stop:
      start = max(0, s.searched - r.hold)
      hits = [i for i in (s.text.find(stop, start) for stop in r.stop) if i >= 0]
      s.searched = len(s.text)
      if hits:
        s.text = s.text[:min(hits)]
        if finish_reason is None:
          self.engine.stop_sequence(r.request.request_id, index)
        finish_reason = "stop"
    s.finish_reason = finish_reason
    upto = len(s.text) if finish_reason else max(s.emitted, len(s.text) - r.hold)
    text, s.emitted = s.text[s.emitted:upto], upto
    return TextDelta(r.request.request_id, index, text, list(token_ids),
                     list(logprobs) if logprobs is not None else None, finish_reason,
                     top_logprobs=None if top is None else list(top))

  def _final(self, r: _Req, output: RequestOutput) -> TextDelta:
    comps = []
    for i, c in enumerate(output.completions):
      s = r.seqs.get(i)
      if s is None:
        s = self._seq(r, i)
      if s.finish_reason is None:  # aborted: what was decoded so far
        s.text += s.decoder.flush()
        s.finish_reason = c.finish_reason
      comps.append(TextCompletion(s.text, list(c.token_ids), s.logprobs or
                                  c.token_logprobs, s.finish_reason,
                                  s.top_logprobs or c.top_logprobs))
    del self._reqs[output.request_id]
    return TextDelta(output.request_id, -1, output=output, completions=comps)
