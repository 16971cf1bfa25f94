"""Applying a step's results on the host: what is known at dispatch (the
step's `PENDING` tokens, forks of a prompt's samples, sequences at their
budget) and what arrives after it (the tokens, EOS, streaming deltas,
latency, beam search), finishing and aborting requests. A mixin of
`scheduler.Scheduler`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np

from paged_jax.serving import beam as beam_lib
from paged_jax.serving.requests import (PENDING, Completion, Group, RequestDelta,
                                        Seq)
from paged_jax.serving.step import StepInputs, StepOutputs


class BeamRow(NamedTuple):
  """A beam-search row of a dispatched step (its group waits for it)."""

  row: int
  seq: Seq


@dataclasses.dataclass
class Pending:
  """What `Scheduler.resolve` needs of a dispatched step.

  Attributes:
    rows, seqs, indices: the tokens the step left `PENDING`, by column:
      token `i` is sampled by sample row `rows[i]` for sequence `seqs[i]`,
      at `seqs[i].tokens[indices[i]]` (`records` iterates the three).
    beam: the `BeamRow`s of its beam-search rows (their group waits for
      them before its next step).
    num_entries: rows of `ok` that were real entries.
    num_forks: rows of `fork_ok` that were real forks.
    fingerprint: u32[5], the host model's `HostPool.fingerprint()` after
      this step's bookkeeping (the device's must equal it).
    top: whether a row asked for top log-probs (`SamplingParams.logprobs`):
      only then, or for beam rows, does the host fetch them.
  """

  rows: list[int]
  seqs: list[Seq]
  indices: list[int]
  beam: list[BeamRow]
  num_entries: int
  num_forks: int
  fingerprint: np.ndarray
  top: bool = False

  @property
  def records(self):
    """`(sample row, seq, token index)` of each pending token, in order."""
    return zip(self.rows, self.seqs, self.indices)

  def live(self) -> bool:
    """Whether applying the results still changes a request (a token of an
    unfinished sequence, a beam step of a group not aborted)."""
    return (any(not t.done for t in self.seqs)
            or any(not s.group.aborted for _, s in self.beam))


class Results:
  """`Scheduler`'s applying of results (see the module docstring)."""

  def _commit(self, plan, samples, forks, x: StepInputs) -> "Pending":
    """Applies everything about this step the host knows before it runs: the
    forks are done, the entries' tokens are cached, every (non-beam) sample
    appends a `PENDING` token whose value the device keeps for the next step
    (`x.sample_slots`), a prompt that samples `n` forks its other samples,
    and a sequence whose pending token is its last (`max_new_tokens`)
    retires now. What needs the tokens' values (EOS, beam search, streaming,
    latency) waits for `resolve`."""
    # Prefix caching: the sequences that complete a block in this step (or
    # fork now) register it in a later one (`prefix.PrefixCaching`).
    due, bs = self._register_due, self.config.block_size
    for s in forks:
      s.fork_from = -1
    if due is not None and forks:
      due.extend(forks)
    # The plan's steady decode rows (`packing.Plan`) first: entry, token row
    # and sample row `i` are one, each appends one `PENDING` token.
    k = getattr(plan, "decode_rows", 0)
    computed = k
    for s, n in plan[k:] if k else plan:
      s.num_cached += n
      computed += n
      if due is not None and s.num_cached // bs != (s.num_cached - n) // bs:
        due.append(s)
    self.stats.computed_tokens += computed
    rows: list[int] = list(range(k))  # the pending tokens, by column (`Pending`)
    targets: list[Seq] = samples.seqs[:k]
    indices: list[int] = []
    beam: list[BeamRow] = []
    finals = []
    for t in targets:
      toks = t.tokens
      toks.append(PENDING)
      t.num_cached += 1
      if due is not None and not t.num_cached % bs:
        due.append(t)
      indices.append(len(toks) - 1)
      if len(toks) >= t.limit:  # its output budget
        t.final = True
        finals.append(t)
    # (each decode row's token goes to its own slot: `_build` wrote it)
    top = bool(k) and bool(self._slots.state.wants_top[x.sample_seqs[:k]].any())
    children: dict[int, Seq] = {}  # lane -> child of the prompt sampled now
    tail = len(rows)
    for r, s, lane in zip(range(k, len(samples)), samples.seqs[k:], samples.lanes[k:]):
      g = s.group
      if g.is_beam:
        beam.append(BeamRow(r, s))
        continue
      if lane != s.index:  # another sample of a prompt: its child's token
        t = children[lane]
      else:
        t = s
        if g.unborn:  # prompt done: the other samples fork from it next step
          children = {}
          for child_lane in range(1, g.params.n):
            child = Seq(g, child_lane, list(g.request.prompt))
            child.hashes = s.hashes[:len(child.tokens) // self.config.block_size]
            child.num_cached = s.num_cached
            child.fork_from = s.slot
            self._fork_pending = True
            self._bind(child, self._free_slots.pop())
            self._insert(self._running, child)
            g.live.append(child)
            children[child_lane] = child
          g.unborn = 0
          self._irregular[[s.slot] + [c.slot for c in children.values()]] = False
      toks = t.tokens
      toks.append(PENDING)
      rows.append(r)
      targets.append(t)
      indices.append(len(toks) - 1)
      if len(toks) >= t.limit:
        t.final = True
        finals.append(t)
    if len(rows) > tail:  # the slot each other non-beam sample row's token goes to
      x.sample_slots[np.asarray(rows[tail:], np.int32)] = [t.slot for t in targets[tail:]]
      top = top or any(t.group.params.logprobs for t in targets[tail:])
    for t in finals:  # after every child exists (a parent may retire late)
      self._retire(t)
    return Pending(rows, targets, indices, beam, len(plan), len(forks),
                   self._fingerprint, top)

  def resolve(self, pending: "Pending", out: StepOutputs, now: float):
    """Applies a step's results: the pending tokens' values, EOS, streaming
    deltas, latency, beam search."""
    self._now = now
    # The device ran the same bookkeeping on the same state as the host
    # model (`_fit`): it grants exactly what the model granted, and ends in
    # the same state.
    if not (out.ok[:pending.num_entries].all()
            and (not pending.num_forks or out.fork_ok[:pending.num_forks].all())):
      raise RuntimeError("the device refused what the host model granted: "
                         "the block states diverged (engine bug)")
    if out.fingerprint.tobytes() != pending.fingerprint.tobytes():  # (both u32[5])
      raise RuntimeError(
          f"the device's block state fingerprint {out.fingerprint.tolist()} "
          f"differs from the host model's {pending.fingerprint.tolist()}: the "
          "block states diverged (engine bug)")
    n = len(pending.rows)  # (ascending: the identity when the last is n - 1)
    if n and pending.rows[-1] == n - 1:  # sample row i for token i (decode rows)
      tokens = out.tokens[:n].tolist()
      logprobs = out.token_logprobs[:n].tolist()
      records = zip(tokens, logprobs, pending.seqs, pending.indices)
    else:
      tokens = out.tokens.tolist()
      logprobs = out.token_logprobs.tolist()
      records = ((tokens[r], logprobs[r], t, idx) for r, t, idx in pending.records)
    top_lp = top_ids = None
    if pending.top:  # fetched for this step (`InFlight.wants_top`)
      top_lp, top_ids = out.top_logprobs.tolist(), out.top_ids.tolist()
    deltas = self._deltas if self.collect_deltas else None
    itls = []
    if deltas is None and top_lp is None:
      # No stream and no top log-probs: `_take_token` inlined, its finishing
      # (`_end`) called only for a row that stops.
      for tok, logprob, t, idx in records:
        if t.done:  # stopped by an EOS the step before; this token is void
          continue
        toks = t.tokens
        toks[idx] = tok
        t.token_logprobs.append(logprob)
        last = t.last_token_time
        if last is None:  # (its group's first token, unless a sibling's came)
          self._first_token(t.group)
        else:
          itls.append(now - last)
        t.last_token_time = now
        if tok in t.group.eos or (t.final and idx == len(toks) - 1):
          self._end(t, idx, tok)
    else:
      for r, t, idx in pending.records:
        if t.done:  # stopped by an EOS the step before; this token is void
          continue
        tok = tokens[r]
        t.tokens[idx] = tok
        self._take_token(t, idx, tok, logprobs[r],
                         None if top_lp is None else (top_ids[r], top_lp[r]),
                         now, deltas, itls)
    self.stats.itl.add_many(itls)
    rows: dict[int, list] = {}
    for r, s in pending.beam:
      if s.group.aborted:
        continue
      rows.setdefault(id(s.group), [s.group, {}])[1][id(s)] = (
          out.top_logprobs[r], out.top_ids[r])
    for g, by_seq in rows.values():
      self._beam_update(g, by_seq)

  def _take_token(self, t: Seq, idx: int, tok: int, logprob: float, top_row,
                  now: float, deltas: list | None, itls: list):
    """Applies a sampled (non-beam) token `tok`, already at `t.tokens[idx]`:
    its log-probs (`top_row`: the row's `(top ids, top log-probs)` when
    fetched), the first-token time, the inter-token latency (arrival times:
    `now`), the stream's delta, and finishing on a stop id or the budget."""
    t.token_logprobs.append(logprob)
    top = None
    if t.top_logprobs is not None:
      k = t.group.params.logprobs
      top_ids, top_lps = top_row
      top = list(zip(top_ids[:k], top_lps[:k]))
      t.top_logprobs.append(top)
    g = t.group
    if g.output.first_token_step is None:
      self._first_token(g)
    if t.last_token_time is not None:
      itls.append(now - t.last_token_time)
    t.last_token_time = now
    if deltas is not None:
      reason = self._reason(t, idx, tok)
      deltas.append(RequestDelta(g.request.request_id, t.index, [tok], reason,
                                 logprobs=[logprob],
                                 top_logprobs=None if top is None else [top]))
    if tok in g.eos or (t.final and idx == len(t.tokens) - 1):
      self._end(t, idx, tok)

  @staticmethod
  def _reason(t: Seq, idx: int, tok: int) -> str | None:
    """Why the token `tok` at `t.tokens[idx]` ends `t`: "stop" (an EOS or
    stop id), "length" (its last token within the budget), or None."""
    if tok in t.group.eos:
      return "stop"
    if t.final and idx == len(t.tokens) - 1:
      return "length"
    return None

  def _end(self, t: Seq, idx: int, tok: int):
    """Finishes `t` at its token `tok` (`t.tokens[idx]`, which ends it:
    `_reason`); a token sampled after it is void."""
    reason = self._reason(t, idx, tok)
    del t.tokens[idx + 1:]
    self._finish_seq(t, reason)

  def _first_token(self, g: Group):
    out = g.output
    if out.first_token_step is None:
      out.first_token_step = self._step
      out.first_token_time = self._now
      self.stats.ttft.add(self._now - out.arrival_time)

  def _finish_seq(self, seq: Seq, reason: str):
    """`seq` is done (`reason`): its completion, its blocks back next step.
    Tokens still in flight (`PENDING`) after the decision are void."""
    g = seq.group
    while seq.tokens and seq.tokens[-1] == PENDING:
      seq.tokens.pop()
    seq.done = True
    g.done[seq.index] = Completion(list(seq.generated), reason,
                                   token_logprobs=list(seq.token_logprobs),
                                   top_logprobs=_copy(seq.top_logprobs))
    self._retire(seq)
    if len(g.done) == g.params.n:
      self._finish_group(g)

  def _find(self, request_id) -> Group | None:
    for seq in self._running + self._waiting:
      if seq.group.request.request_id == request_id:
        return seq.group
    return None

  def stop_sequence(self, request_id, index: int) -> bool:
    """Finishes sample `index` of a running (non-beam) request now, with
    finish reason "stop" (the host decided, e.g. a stop string); its blocks
    are released by the next step, like those of a sequence that sampled
    EOS. Returns False when there is no such live sequence."""
    g = self._find(request_id)
    if g is None or g.is_beam:
      return False
    seq = next((s for s in g.live if s.index == index), None)
    if seq is None or index in g.done:
      return False
    self._finish_seq(seq, "stop")
    return True

  def abort_request(self, request_id) -> bool:
    """Drops a request (waiting or running): every sequence leaves the queues
    and its slot is queued for release by the next step, as preemption and
    finishing do. Its `RequestOutput` (completions so far, finish reason
    "abort") ends its stream. Returns False when the request is unknown or
    already finished."""
    g = self._find(request_id)
    if g is None:
      return False
    for seq in list(g.live):
      if seq in self._running:
        self._running.remove(seq)
      if seq in self._waiting:
        self._waiting.remove(seq)
    for seq in list(g.live):  # children first: a pending fork holds no state
      if seq.fork_from >= 0:
        self._release(seq)
    for seq in list(g.live):
      self._release(seq)
      while seq.tokens and seq.tokens[-1] == PENDING:  # in flight: void
        seq.tokens.pop()
      seq.done = True  # results still in flight for it are ignored
      if not g.is_beam and seq.index not in g.done:
        g.done[seq.index] = Completion(list(seq.generated), "abort",
                                       token_logprobs=list(seq.token_logprobs),
                                       top_logprobs=_copy(seq.top_logprobs))
    g.live = []
    g.aborted = True
    out = g.output
    out.finish_step, out.finish_time = self._step, time.perf_counter()
    out.completions = [g.done[i] for i in sorted(g.done)]
    self.stats.aborted += 1
    self._outputs.append(out)
    if self.collect_deltas:
      self._deltas.append(RequestDelta(out.request_id, -1, [], output=out))
    return True

  def _retire(self, seq: Seq):
    """Drops a finished sequence (once); its blocks go back at the next step
    (after the children's forks when it has children that fork then)."""
    if seq.slot < 0 and seq not in seq.group.live:
      return  # retired already
    g = seq.group
    has_children = seq.slot >= 0 and any(s.fork_from == seq.slot for s in g.live)
    if seq in self._running:
      self._running.remove(seq)
    if seq in self._waiting:  # preempted while its last token was in flight
      self._waiting.remove(seq)
    if seq in g.live:
      g.live.remove(seq)
    self._release(seq, late=has_children)

  def _finish_group(self, g: Group):
    out = g.output
    out.finish_step = self._step
    out.finish_time = self._now
    if g.is_beam:
      ranked = beam_lib.rank_finished(g.beam_finished, width=g.params.beam_width,
                                      length_penalty=g.params.length_penalty)
      out.completions = [Completion(t, r, l) for l, t, r in ranked]
      if self.collect_deltas:  # beam hypotheses are final only now
        self._deltas += [RequestDelta(out.request_id, i, list(c.token_ids),
                                      c.finish_reason)
                         for i, c in enumerate(out.completions)]
    else:
      out.completions = [g.done[i] for i in range(g.params.n)]
    self.stats.finished += 1
    self.stats.generated_tokens += sum(len(c.token_ids) for c in out.completions)
    if out.tpot is not None:
      self.stats.tpot.add(out.tpot)
    self.stats.e2e.add(out.finish_time - out.arrival_time)
    self._outputs.append(out)
    if self.collect_deltas:
      self._deltas.append(RequestDelta(out.request_id, -1, [], output=out))

  def _beam_update(self, g: Group, rows: dict):
    """One beam-search expansion for group `g` from its rows' top log-probs."""
    live = list(g.live)
    if len(rows) != len(live):
      # A lane did not advance: restart the group (beam search is deterministic).
      self._preempt(live[0], [])
      return
    self._first_token(g)
    width = g.params.beam_width
    beams = [beam_lib.Beam(s.generated, s.logprob) for s in live]
    cands = [rows[id(s)] for s in live]
    new_live, finished = beam_lib.beam_search_step(
        beams, cands, width=width, eos_token_ids=tuple(g.eos))
    for p, t, lp in finished:
      g.beam_finished.append((lp, live[p].generated + [t], "stop"))
    done = len(g.beam_finished) >= width
    at_budget = len(live[0].generated) + 1 >= g.params.max_new_tokens
    if done or at_budget or not new_live:
      if not done:
        for p, t, lp in new_live:
          g.beam_finished.append((lp, live[p].generated + [t], "length"))
      for s in live:
        self._retire_beam(s)
      g.unborn = 0
      self._finish_group(g)
      return
    claimed: set[int] = set()
    used_lanes = set()
    children = []
    for p, t, lp in new_live:
      parent = live[p]
      if p not in claimed:
        claimed.add(p)
        parent.tokens.append(t)
        parent.logprob = lp
        used_lanes.add(parent.index)
      else:
        children.append((parent, t, lp))
    for p, s in enumerate(live):
      if p not in claimed:
        self._retire_beam(s)
    free_lanes = [i for i in range(width) if i not in used_lanes]
    for (parent, t, lp), lane in zip(children, free_lanes):
      child = Seq(g, lane, parent.tokens[:parent.num_cached] + [t])
      child.hashes = parent.hashes[:parent.num_cached // self.config.block_size]
      child.num_cached = parent.num_cached
      child.fork_from = parent.slot
      self._fork_pending = True
      child.logprob = lp
      self._bind(child, self._free_slots.pop())
      self._insert(self._running, child)
      g.live.append(child)
    g.live.sort(key=lambda s: s.index)
    g.unborn = 0

  def _retire_beam(self, seq: Seq):
    if seq in self._running:
      self._running.remove(seq)
    if seq in seq.group.live:
      seq.group.live.remove(seq)
    self._release(seq)


def _copy(top):
  return None if top is None else list(top)
