"""Requests, their outputs, and the engine's per-sequence bookkeeping."""

from __future__ import annotations

import dataclasses
from typing import Hashable

from paged_jax.serving.sampling import SamplingParams


@dataclasses.dataclass
class Request:
  """A generation request: a prompt (token ids) and how to sample.

  Attributes:
    request_id: any hashable id.
    prompt: the prompt's token ids.
    params: how to sample.
    cache_salt: with prefix caching, requests share cached blocks only with
      requests of the same salt (a tenant, an adapter: vLLM's `cache_salt`);
      None and "" are the same, unsalted.
  """

  request_id: Hashable
  prompt: list[int]
  params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  cache_salt: str | bytes | None = None

  def __post_init__(self):
    # The fields the engine keys on or reads first; the prompt's tokens and
    # the salt are the engine's to judge (a rejection, not an exception).
    try:
      hash(self.request_id)
    except TypeError:
      raise ValueError(f"request_id must be hashable, got a "
                       f"{type(self.request_id).__name__}") from None
    if not isinstance(self.params, SamplingParams):
      raise ValueError(f"params must be a SamplingParams, got a "
                       f"{type(self.params).__name__}")

  def salt_bytes(self) -> bytes:
    """`cache_salt` as bytes (UTF-8 for a str)."""
    salt = self.cache_salt or b""
    return salt.encode() if isinstance(salt, str) else bytes(salt)


@dataclasses.dataclass
class Completion:
  """One generated sequence.

  Attributes:
    token_ids: generated ids (the EOS token included when it stopped there).
    finish_reason: "stop" (an EOS or stop token, or `Engine.stop_sequence`),
      "length" (the output budget) or "abort" (`Engine.abort_request`).
    logprob: summed log-probability (beam search only).
    token_logprobs: log-probability of each generated token under the model
      (before temperature; not for beam search); left out of `==`.
    top_logprobs: with `SamplingParams.logprobs = N`, per generated token
      its N most likely alternatives as `(token id, log-prob)`, best first
      (the same distribution as `token_logprobs`); None otherwise; left out
      of `==`.
  """

  token_ids: list[int]
  finish_reason: str
  logprob: float | None = None
  # Not compared: float noise varies with the batch a token was sampled in.
  token_logprobs: list[float] | None = dataclasses.field(default=None, compare=False)
  top_logprobs: list[list[tuple[int, float]]] | None = dataclasses.field(
      default=None, compare=False)


@dataclasses.dataclass
class RequestOutput:
  """What the engine returns for a request.

  Attributes:
    request_id: the request's id.
    prompt_len: prompt length in tokens.
    completions: `n` samples in sample order, or `beam_width` beam hypotheses
      best first; empty for a rejected request.
    rejected: why the request was refused, or None.
    preemptions: how often one of its sequences was preempted.
    num_cached_tokens: prompt tokens served from the prefix cache at its
      first admission (vLLM's name); 0 without prefix caching.
    arrival_step / first_token_step / finish_step: engine steps (latency in
      steps, for reports).
    arrival_time / first_token_time / finish_time: `time.perf_counter()`
      seconds when the request was added, its first token reached the host,
      and it finished.
  """

  request_id: Hashable
  prompt_len: int
  completions: list[Completion] = dataclasses.field(default_factory=list)
  rejected: str | None = None
  preemptions: int = 0
  num_cached_tokens: int = 0
  arrival_step: int = 0
  first_token_step: int | None = None
  finish_step: int | None = None
  arrival_time: float = 0.0
  first_token_time: float | None = None
  finish_time: float | None = None

  @property
  def ttft(self) -> float | None:
    """Seconds from arrival to the first token (None before it)."""
    if self.first_token_time is None:
      return None
    return self.first_token_time - self.arrival_time

  @property
  def tpot(self) -> float | None:
    """Seconds per output token after the first, over the longest completion
    (`(finish - first token) / (tokens - 1)`); None with fewer than 2 tokens."""
    longest = max((len(c.token_ids) for c in self.completions), default=0)
    if self.finish_time is None or self.first_token_time is None or longest < 2:
      return None
    return (self.finish_time - self.first_token_time) / (longest - 1)


@dataclasses.dataclass
class RequestDelta:
  """What streaming returns as tokens arrive (`Engine.take_deltas`, `LLM.stream`).

  Attributes:
    request_id: the request's id.
    index: the sample index (`n > 1`), or for beam search the hypothesis'
      rank; -1 on the last delta of a request, which carries `output`.
    token_ids: the new tokens of that sequence (beam search: the whole
      hypothesis, once, when the request finishes).
    finish_reason: "stop" or "length" on a sequence's last delta, else None.
    output: the final `RequestOutput`, on the request's last delta only.
    logprobs: the log-probability of each of `token_ids` (not beam search).
    top_logprobs: with `SamplingParams.logprobs = N`, each of `token_ids`'
      N most likely alternatives, `(token id, log-prob)` best first.
  """

  request_id: Hashable
  index: int
  token_ids: list[int]
  finish_reason: str | None = None
  output: RequestOutput | None = None
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None


class Group:
  """The engine's state for one accepted request (host side)."""

  def __init__(self, request: Request, order: int, eos: frozenset[int], step: int,
               now: float):
    self.request = request
    self.params = request.params
    self.order = order
    self.eos = eos
    self.prompt_len = len(request.prompt)
    self.output = RequestOutput(request.request_id, self.prompt_len,
                                arrival_step=step, arrival_time=now)
    self.done: dict[int, Completion] = {}  # sample index -> completion
    self.beam_finished: list = []  # (logprob, tokens, reason) for beam search
    self.live: list[Seq] = []
    self.unborn = 0  # sequences still to be forked from the prompt
    self.aborted = False  # `Engine.abort_request`: results in flight ignored
    self.admitted = False  # admitted once (prefix-cache hit rate: prompts)
    self.restart()

  @property
  def is_beam(self) -> bool:
    return self.params.beam_width > 1

  def restart(self) -> "Seq":
    """Back to a single prompt sequence (first admission or beam preemption)."""
    self.beam_finished = []
    self.unborn = self.params.num_seqs - 1
    root = Seq(self, 0, list(self.request.prompt))
    self.live = [root]
    return root


PENDING = -1  # a sampled token not on the host yet (`Seq.tokens`)


class Seq:
  """One sequence: prompt plus generated tokens, and where its K/V lives."""

  __slots__ = ("group", "index", "tokens", "num_cached", "slot", "fork_from",
               "logprob", "last_token_time", "final", "done", "token_logprobs",
               "hashes", "num_registered", "top_logprobs", "limit")

  def __init__(self, group: Group, index: int, tokens: list[int]):
    self.group = group
    self.index = index  # sample index (seed offset) or beam lane
    self.tokens = tokens  # prompt + generated; the last one may not be cached
    # `len(tokens)` at the output budget (prompt + `max_new_tokens`).
    self.limit = group.prompt_len + group.params.max_new_tokens
    self.num_cached = 0  # tokens whose K/V are in the cache
    self.slot = -1  # block-state sequence slot, -1 when not resident
    self.fork_from = -1  # slot to fork from at the next step, -1 = none
    self.logprob = 0.0  # beam score
    self.last_token_time = None  # perf_counter() of its last sampled token
    # Asynchronous steps: a token sampled by a step whose results have not
    # reached the host yet is `PENDING` in `tokens` (always the last one).
    self.final = False  # its last token in flight reaches max_new_tokens
    self.done = False  # finished: its completion is recorded
    self.token_logprobs: list[float] = []  # per generated token (not beam)
    # Per generated token, its top alternatives (`SamplingParams.logprobs`).
    self.top_logprobs: list[list[tuple[int, float]]] | None = (
        [] if group.params.logprobs else None)
    # Prefix caching: chained hashes of its full blocks of known tokens (by
    # content, so they survive preemption), and how many of its current
    # slot's blocks are registered (or known to be held under their hash).
    self.hashes: list[bytes] = []
    self.num_registered = 0

  @property
  def order(self) -> tuple[int, int]:
    """Priority: older requests first, then lower sample index."""
    return (self.group.order, self.index)

  @property
  def generated(self) -> list[int]:
    return self.tokens[self.group.prompt_len:]
