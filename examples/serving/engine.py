"""A continuous-batching engine over the paged KV cache.

Each `Engine.step()`:

1. schedules on the host (vLLM-v1 style, oldest first): every running
   sequence gets its next tokens (one for decode, a chunk for a prefill that
   is still going), waiting sequences are admitted while batch rows, the token
   budget and free blocks allow; when the pool cannot hold the running
   sequences' growth, the newest are preempted (their blocks released, their
   tokens recomputed later);
2. runs ONE jitted device step with the cache and block state donated:
   release -> fork -> reserve -> copy-on-write -> `step_metadata` ->
   `Llama.paged_forward` -> logits of the rows to sample -> sampling and top
   log-probs;
3. applies the results: appends tokens, finishes sequences (EOS or budget),
   and queues their blocks for release at the start of the next step.

Two compiled shapes, each traced once: a decode step (`max_batch` token rows,
the decode attention kernel) and a mixed step (`max_tokens_per_step` rows, the
ragged kernel) for steps with prefill chunks. Shapes never depend on the
requests in flight.

The block state on the device is the truth. The host keeps a conservative
estimate of free blocks (it assumes copy-on-write wherever it may happen and
counts shared blocks as not freed) to plan admissions and preemptions, and
re-reads the exact count after every step. A reservation the device refuses
is not an error: that sequence simply does not advance this step, and the
next step preempts to make room. The oldest running sequence is never
preempted, and admission guarantees that any single request fits the pool
alone, so every accepted request completes.

On a `(data, model)` device mesh (`Engine(..., mesh=...)`) the model is
tensor-parallel and each data shard is a replica with its own pool and its
own `Scheduler`; one jitted step (`step.mesh_device_step`) serves them all.

With `static_batching=True` and `block_size == max_model_len` the same engine
is a contiguous max-length cache with static batching (the baseline paging is
compared against): every sequence reserves one max-length slot, and new
requests start only when the whole batch has finished.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import time
from typing import Callable

import chex
import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from examples.llama import tensor_parallel
from examples.llama.model import Llama
from examples.serving import sampling
from examples.serving.requests import Completion, Group, Request, RequestOutput, Seq
from examples.serving.step import (ModelDef, StepInputs, StepOutputs,
                                   device_step, mesh_device_step,
                                   shared_mesh_step, shared_step)
from paged_jax import block_manager as bm
from paged_jax import sharding


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine sizes (they fix the compiled shapes).

  Attributes:
    num_blocks: physical KV blocks in the pool.
    block_size: tokens per block.
    max_batch: sequences per step (rows of the decode step).
    max_tokens_per_step: token rows of a mixed (prefill) step; >= max_batch.
    max_model_len: longest prompt + output; default the model's
      `max_position_embeddings` capped at the pool size.
    max_beam_width: largest beam width served (fixes the log-prob rows).
    static_batching: admit only when nothing runs (the contiguous baseline).
    cache_dtype: KV dtype name, default the model's.
    check_traces: compile this engine's own step functions wrapped in
      `chex.assert_max_traces(n=1)` (tests; call `chex.clear_trace_counter()`
      before building a second such engine). Otherwise engines share one
      jitted step, so engines of equal sizes compile once per process.
  """

  num_blocks: int
  block_size: int = 16
  max_batch: int = 16
  max_tokens_per_step: int = 128
  max_model_len: int | None = None
  max_beam_width: int = 1
  static_batching: bool = False
  cache_dtype: str | None = None
  check_traces: bool = False

  def __post_init__(self):
    for name in ("num_blocks", "block_size", "max_batch", "max_tokens_per_step",
                 "max_beam_width"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.max_tokens_per_step < self.max_batch:
      raise ValueError(f"max_tokens_per_step={self.max_tokens_per_step} must be >= "
                       f"max_batch={self.max_batch} so every decode fits a step")
    if self.max_model_len is not None and self.max_model_len < 2:
      raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
    if self.max_beam_width > self.max_batch:
      raise ValueError(f"max_beam_width={self.max_beam_width} must be <= "
                       f"max_batch={self.max_batch}")


@dataclasses.dataclass
class EngineStats:
  """Counters the engine keeps while it runs."""

  steps: int = 0
  decode_steps: int = 0
  mixed_steps: int = 0
  generated_tokens: int = 0
  computed_tokens: int = 0  # prompt, recompute and decode tokens run
  preemptions: int = 0
  refused_reservations: int = 0
  finished: int = 0
  rejected: int = 0
  host_seconds: float = 0.0  # scheduling + input building + applying results
  device_seconds: float = 0.0  # dispatch until the results are on the host
  decode_device_seconds: float = 0.0  # the part of it in decode steps
  blocks_used: list = dataclasses.field(default_factory=list)  # after each step
  running: list = dataclasses.field(default_factory=list)
  waiting: list = dataclasses.field(default_factory=list)


class Scheduler:
  """The host side of one block pool: queues, admission, preemption, the
  step's inputs and applying its results. `Engine` drives one per pool (one
  per data shard on a mesh); the device arrays live in the `Engine`."""

  def __init__(self, config: EngineConfig, model_config, max_model_len: int,
               stats: EngineStats):
    self.config = config
    self.model_config = model_config
    self.max_model_len = max_model_len
    self.max_seqs = 2 * config.max_batch
    self.stats = stats
    self._num_free = config.num_blocks
    self._waiting: list[Seq] = []  # sorted by order
    self._running: list[Seq] = []  # sorted by order
    self._free_slots = list(range(self.max_seqs - 1, -1, -1))
    self._release_next: list[int] = []
    self._release_late_next: list[int] = []
    self._release_late_pending: list[int] = []  # slots free after next step
    self._pending_freed = 0  # blocks the queued releases return (estimate)
    self._orders = 0
    self._step = 0
    self._outputs: list[RequestOutput] = []

  # ----------------------------------------------------------------- requests

  def add_request(self, request: Request) -> RequestOutput | None:
    """Queues `request`, or rejects it if it can never be served.

    Returns:
      None when accepted; a `RequestOutput` with `rejected` set otherwise
      (also returned by the next `step` or `run_until_done`).
    """
    reason = self._rejection(request)
    if reason is not None:
      out = RequestOutput(request.request_id, len(request.prompt),
                          rejected=reason, arrival_step=self._step)
      self.stats.rejected += 1
      self._outputs.append(out)
      return out
    eos = frozenset(request.params.eos_token_ids or self.model_config.eos_token_ids)
    group = Group(request, self._orders, eos, self._step)
    self._orders += 1
    self._insert(self._waiting, group.live[0])
    return None

  def _rejection(self, request: Request) -> str | None:
    p, c = request.params, self.config
    prompt = request.prompt
    if not prompt:
      return "empty prompt"
    vocab = self.model_config.vocab_size
    bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
    if bad:
      return f"prompt token {bad[0]!r} is outside the vocabulary [0, {vocab})"
    total = len(prompt) + p.max_new_tokens
    if total > self.max_model_len:
      return (f"prompt ({len(prompt)}) + max_new_tokens ({p.max_new_tokens}) = "
              f"{total} exceeds max_model_len={self.max_model_len}")
    if p.num_seqs > c.max_batch:
      return f"needs {p.num_seqs} sequences at once, max_batch is {c.max_batch}"
    if p.beam_width > c.max_beam_width:
      return f"beam_width={p.beam_width} exceeds the engine's max_beam_width={c.max_beam_width}"
    # Beam groups are preempted whole, so all beams must fit together (at
    # worst each beam owns all its blocks; retired beams are released before
    # the next forks and reservations).
    need = p.beam_width * _cdiv(total, c.block_size)
    if need > c.num_blocks:
      return (f"needs {need} blocks of {c.block_size} tokens at its longest, "
              f"the pool has {c.num_blocks}")
    return None

  def has_unfinished(self) -> bool:
    return bool(self._waiting or self._running)

  def has_releases(self) -> bool:
    return bool(self._release_next or self._release_late_next)

  def usage(self) -> dict:
    """Blocks used / total, running and waiting sequences (from the last step)."""
    used = self.config.num_blocks - self._num_free
    return {"blocks_used": used, "blocks_total": self.config.num_blocks,
            "running": len(self._running), "waiting": len(self._waiting)}

  @property
  def num_running(self) -> int:
    return len(self._running)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  # --------------------------------------------------------------- scheduling

  @staticmethod
  def _insert(queue: list[Seq], seq: Seq):
    keys = [s.order for s in queue]
    queue.insert(bisect.bisect(keys, seq.order), seq)

  def _blocks_needed(self, seq: Seq, n: int) -> int:
    bs = self.config.block_size
    cow = int(seq.maybe_shared_tail and n > 0 and seq.num_cached % bs != 0)
    return _cdiv(seq.num_cached + n, bs) - _cdiv(seq.num_cached, bs) + cow

  def _freed_by(self, seq: Seq) -> int:
    if seq.slot < 0 or seq.fork_from >= 0:
      return 0
    return seq.exclusive_blocks

  def _release(self, seq: Seq, late: bool = False):
    if seq.slot >= 0:
      if seq.fork_from < 0:  # a pending child holds no device state
        self._pending_freed += self._freed_by(seq)
        if late:  # after this step's forks; the slot is free after next step
          self._release_late_next.append(seq.slot)
          self._release_late_pending.append(seq.slot)
        else:
          self._release_next.append(seq.slot)
          self._free_slots.append(seq.slot)
      else:
        self._free_slots.append(seq.slot)
    seq.slot = -1
    seq.fork_from = -1

  def _preempt(self, victim: Seq, plan: list) -> int:
    """Preempts `victim` (its whole group for beam search); returns blocks freed."""
    group = victim.group
    victims = list(group.live) if group.is_beam else [victim]
    before = self._pending_freed
    freed = 0
    for seq in victims:
      for i, (s, n) in enumerate(plan):
        if s is seq:
          freed += self._blocks_needed(s, n)
          del plan[i]
          break
      if seq in self._running:
        self._running.remove(seq)
      if seq in self._waiting:
        self._waiting.remove(seq)
      self._release(seq)
      seq.num_cached = 0
      seq.exclusive_blocks = 0
      seq.maybe_shared_tail = False
    group.output.preemptions += 1
    self.stats.preemptions += 1
    if group.is_beam:
      self._insert(self._waiting, group.restart())
    else:
      self._insert(self._waiting, victim)
    return freed + self._pending_freed - before

  def _schedule(self) -> list[tuple[Seq, int]]:
    """Picks this step's (sequence, new tokens) entries, oldest first."""
    c = self.config
    free = self._num_free + self._pending_freed
    budget = c.max_tokens_per_step
    plan: list[tuple[Seq, int]] = []
    queue = list(self._running)
    # Never preempted: the oldest sequence, or the oldest group for beam
    # search (a beam group goes whole). Admission guarantees it fits alone.
    first = queue[0] if queue else None
    while queue:
      seq = queue.pop(0)
      if seq not in self._running:  # preempted with its beam group
        continue
      # Leave one token of budget for each running sequence after this one.
      room = budget - len(queue)
      n = min(len(seq.tokens) - seq.num_cached, room)
      if n <= 0:
        continue
      need = self._blocks_needed(seq, n)
      protected = seq is first or (seq.group is first.group and seq.group.is_beam)
      while need > free:  # preempt the newest (not seq's own beam group)
        queue = [v for v in queue if v in self._running]  # drop preempted beams
        victims = [v for v in queue
                   if not (seq.group.is_beam and v.group is seq.group)]
        if not victims:
          break
        queue.remove(victims[-1])
        free += self._preempt(victims[-1], plan)
      if need > free and not protected:
        free += self._preempt(seq, plan)
        continue
      plan.append((seq, n))
      free -= need
      budget -= n

    rows = len(self._running) + sum(g.unborn for g in {s.group for s in self._running})
    if c.static_batching and self._running:
      return plan
    while self._waiting and self._free_slots:
      seq = self._waiting[0]
      new_rows = 1 + (seq.group.unborn if seq.index == 0 else 0)
      if rows + new_rows > c.max_batch:
        break
      n = min(len(seq.tokens), budget)
      if c.static_batching:
        need = _cdiv(len(seq.tokens), c.block_size)
      else:
        need = self._blocks_needed(seq, n)
        if n <= 0:
          break
      if need > free:
        break
      self._waiting.pop(0)
      seq.slot = self._free_slots.pop()
      self._insert(self._running, seq)
      rows += new_rows
      free -= need
      if n > 0:
        plan.append((seq, n))
        budget -= n
    return plan

  # ------------------------------------------------------------------- a step

  def _build(self, plan, decode_only: bool):
    c = self.config
    num_tokens = c.max_batch if decode_only else c.max_tokens_per_step
    S = c.max_batch
    a = dict(
        release_early=np.full(self.max_seqs, -1, np.int32),
        release_late=np.full(self.max_seqs, -1, np.int32),
        fork_parents=np.full(S, -1, np.int32),
        fork_children=np.full(S, -1, np.int32),
        seq_ids=np.full(S, -1, np.int32), q_lens=np.zeros(S, np.int32),
        tokens=np.zeros(num_tokens, np.int32),
        sample_rows=np.zeros(S, np.int32), temperature=np.zeros(S, np.float32),
        top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
        seeds=np.zeros(S, np.int32), positions=np.zeros(S, np.int32))
    a["release_early"][:len(self._release_next)] = self._release_next
    a["release_late"][:len(self._release_late_next)] = self._release_late_next
    # Every pending child forks now, planned or not: its parent may write its
    # next token this step.
    forks = [s for s in self._running if s.fork_from >= 0]
    for i, s in enumerate(forks):
      a["fork_parents"][i] = s.fork_from
      a["fork_children"][i] = s.slot
    samples = []  # (sample row, seq, sample index)
    row = 0
    for j, (s, n) in enumerate(plan):
      a["seq_ids"][j] = s.slot
      a["q_lens"][j] = n
      a["tokens"][row:row + n] = s.tokens[s.num_cached:s.num_cached + n]
      row += n
      if s.num_cached + n == len(s.tokens):
        g = s.group
        lanes = range(g.params.n) if (g.unborn and not g.is_beam) else [s.index]
        for lane in lanes:
          samples.append((row - 1, s, lane))
    for r, (tok_row, s, lane) in enumerate(samples):
      p = s.group.params
      a["sample_rows"][r] = tok_row
      a["temperature"][r] = 0.0 if p.beam_width > 1 else p.temperature
      a["top_k"][r] = p.top_k
      a["top_p"][r] = p.top_p
      a["seeds"][r] = p.seed + lane
      a["positions"][r] = len(s.tokens)
    return StepInputs(**a), samples, forks

  def begin_step(self) -> list[tuple[Seq, int]] | None:
    """Schedules this step; None when the pool has nothing to run or release.

    Raises:
      RuntimeError: if requests wait while nothing runs and none can start
        (admission guarantees this never happens).
    """
    plan = self._schedule()
    if not plan and not self._release_next and not self._release_late_next:
      if self._waiting and not self._running:  # admission guarantees progress
        raise RuntimeError(f"engine stalled with nothing running: {self.usage()}")
      return None
    return plan

  def build_step(self, plan, decode_only: bool):
    """This step's `StepInputs` for `plan` (also hands over the queued
    releases); returns `(inputs, applier)`, the applier taking the step's
    outputs for this pool."""
    x, samples, forks = self._build(plan, decode_only)
    self._release_next, self._release_late_next = [], []
    self._pending_freed = 0
    return x, lambda out: self._apply(plan, samples, forks, out)

  def end_step(self):
    self._step += 1

  def take_outputs(self) -> list[RequestOutput]:
    outs, self._outputs = self._outputs, []
    return outs

  def sync_free(self, out: StepOutputs):
    """Takes the exact free-block count from a step's outputs."""
    self._num_free = int(out.num_free)

  # ------------------------------------------------------------ results

  def _apply(self, plan, samples, forks, out: StepOutputs):
    self._num_free = int(out.num_free)
    self._free_slots.extend(self._release_late_pending)
    self._release_late_pending = []
    for i, s in enumerate(forks):
      if not out.fork_ok[i]:  # parent live and child empty by construction
        raise RuntimeError(f"fork into slot {s.slot} failed: engine bookkeeping bug")
      s.fork_from = -1
    failed = set()
    for j, (s, n) in enumerate(plan):
      if out.ok[j]:
        s.num_cached += n
        self.stats.computed_tokens += n
      else:
        failed.add(id(s))
        self.stats.refused_reservations += 1
        if s.num_cached == 0 and s.fork_from < 0:
          # A refused new admission: its slot is still empty on the device.
          self._running.remove(s)
          self._free_slots.append(s.slot)
          s.slot = -1
          self._insert(self._waiting, s)
    for s in self._running:  # exact sharing figures for the next plan
      if s.slot >= 0 and s.fork_from < 0:
        s.exclusive_blocks = int(out.exclusive_blocks[s.slot])
        s.maybe_shared_tail = bool(out.tail_shared[s.slot])
    beam_rows: dict[int, list] = {}
    by_seq: dict[int, list] = {}
    for r, (_, s, lane) in enumerate(samples):
      if id(s) in failed:
        continue
      if s.group.is_beam:
        beam_rows.setdefault(id(s.group), [s.group, {}])[1][id(s)] = (
            out.top_logprobs[r], out.top_ids[r])
      else:
        by_seq.setdefault(id(s), [s, []])[1].append((lane, int(out.tokens[r])))
    for s, lanes in by_seq.values():
      g = s.group
      if g.output.first_token_step is None:
        g.output.first_token_step = self._step
      targets = [s]
      if g.unborn:  # prompt done: the other samples fork from it next step
        bs = self.config.block_size
        for lane, _ in lanes[1:]:
          child = Seq(g, lane, list(g.request.prompt))
          child.num_cached = s.num_cached
          child.fork_from = s.slot
          child.slot = self._free_slots.pop()
          self._insert(self._running, child)
          g.live.append(child)
          targets.append(child)
        for t in targets:  # until the next step's figures say otherwise
          t.exclusive_blocks = 0
          t.maybe_shared_tail = bool(s.num_cached % bs)
        g.unborn = 0
      for t, (_, tok) in zip(targets, lanes):
        t.tokens.append(tok)
      for t, (_, tok) in zip(targets, lanes):
        self._maybe_finish(t, tok)
    for g, rows in beam_rows.values():
      self._beam_update(g, rows, failed)

  def _maybe_finish(self, seq: Seq, tok: int):
    g = seq.group
    reason = None
    if tok in g.eos:
      reason = "stop"
    elif len(seq.generated) >= g.params.max_new_tokens:
      reason = "length"
    if reason is None:
      return
    g.done[seq.index] = Completion(list(seq.generated), reason)
    self._retire(seq)
    if len(g.done) == g.params.n:
      self._finish_group(g)

  def _retire(self, seq: Seq):
    """Drops a finished sequence; its blocks go back at the next step."""
    g = seq.group
    has_children = seq.slot >= 0 and any(s.fork_from == seq.slot for s in g.live)
    if seq in self._running:
      self._running.remove(seq)
    g.live.remove(seq)
    self._release(seq, late=has_children)  # after the children's fork

  def _finish_group(self, g: Group):
    out = g.output
    out.finish_step = self._step
    if g.is_beam:
      lp = g.params.length_penalty
      ranked = sorted(g.beam_finished,
                      key=lambda b: -b[0] / max(len(b[1]), 1) ** lp)
      out.completions = [Completion(t, r, l) for l, t, r in ranked[:g.params.beam_width]]
    else:
      out.completions = [g.done[i] for i in range(g.params.n)]
    self.stats.finished += 1
    self.stats.generated_tokens += sum(len(c.token_ids) for c in out.completions)
    self._outputs.append(out)

  def _beam_update(self, g: Group, rows: dict, failed: set):
    """One beam-search expansion for group `g` from its rows' top log-probs."""
    live = list(g.live)
    if any(id(s) in failed for s in live) or len(rows) != len(live):
      # A lane did not advance: restart the group (beam search is deterministic).
      self._preempt(live[0], [])
      return
    if g.output.first_token_step is None:
      g.output.first_token_step = self._step
    width = g.params.beam_width
    beams = [sampling.Beam(s.generated, s.logprob) for s in live]
    cands = [rows[id(s)] for s in live]
    new_live, finished = sampling.beam_search_step(
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
    bs = self.config.block_size
    for p, s in enumerate(live):
      if p not in claimed:
        self._retire_beam(s)
    free_lanes = [i for i in range(width) if i not in used_lanes]
    for (parent, t, lp), lane in zip(children, free_lanes):
      child = Seq(g, lane, parent.tokens[:parent.num_cached] + [t])
      child.num_cached = parent.num_cached
      child.fork_from = parent.slot
      child.logprob = lp
      child.slot = self._free_slots.pop()
      self._insert(self._running, child)
      g.live.append(child)
      for s in (child, parent):
        s.exclusive_blocks = 0
        s.maybe_shared_tail = bool(parent.num_cached % bs)
    g.live.sort(key=lambda s: s.index)
    g.unborn = 0

  def _retire_beam(self, seq: Seq):
    if seq in self._running:
      self._running.remove(seq)
    if seq in seq.group.live:
      seq.group.live.remove(seq)
    self._release(seq)


class Engine:
  """Continuous batching over a paged KV cache (see the module docstring).

  On a `(data, model)` mesh (`mesh=paged_jax.sharding.make_mesh(...)`) the
  model is laid out tensor-parallel over `model`
  (`examples.llama.tensor_parallel.shard_model`) and every data shard is a
  replica with its own pool of `config.num_blocks` blocks, its own block state
  and `config.max_batch` sequences: `EngineConfig` sizes are per data shard.
  Requests go to the data shard with the fewest unfinished requests; one
  jitted step runs every shard at once.

  Several hosts (after `jax.distributed.initialize`): every process runs the
  same program with the same requests in the same order, so every process
  keeps the same (deterministic) host schedule; each places only its own
  devices' shards of the step inputs and reads back the step's small
  outputs. The weights, cache and block states stay where the mesh puts them.

  Example:
    >>> model = init_model(LlamaConfig.tiny())
    >>> engine = Engine(model, EngineConfig(num_blocks=64))
    >>> engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    >>> outputs = engine.run_until_done()
  """

  def __init__(self, model: Llama, config: EngineConfig, mesh: Mesh | None = None):
    self.config = config
    self.mesh = mesh
    if mesh is not None:
      model = tensor_parallel.shard_model(model, mesh)
    self.model_config = model.config
    bs = config.block_size
    max_len = config.max_model_len or min(model.config.max_position_embeddings,
                                          config.num_blocks * bs)
    self.max_model_len = max_len
    self.max_seqs = 2 * config.max_batch
    # Top log-probs returned per sample row: 2 * beam width candidates, at
    # least 8 so that beam widths up to 4 share one compiled step.
    self.num_logprobs = min(max(8, 2 * config.max_beam_width),
                            model.config.vocab_size)
    self.stats = EngineStats()
    data = 1 if mesh is None else mesh.shape[sharding.DATA]
    self._pools = [Scheduler(config, model.config, max_len, self.stats)
                   for _ in range(data)]
    graphdef, params = nnx.split(model)
    model_def = ModelDef(graphdef, params)
    self._params = jax.tree.leaves(params)  # flat: cheap to pass every step
    mc = model.config
    blocks_per_seq = _cdiv(max_len, bs)
    if mesh is None:
      self._state = bm.init(num_blocks=config.num_blocks, block_size=bs,
                            max_seqs=self.max_seqs,
                            max_blocks_per_seq=blocks_per_seq)
      self._cache = model.make_cache(config.num_blocks, bs, config.cache_dtype)
      step_fn, shared = device_step, shared_step
    else:
      self._state = sharding.init_block_states(
          mesh, num_blocks_per_shard=config.num_blocks, block_size=bs,
          max_seqs_per_shard=self.max_seqs, max_blocks_per_seq=blocks_per_seq)
      self._cache = sharding.create_cache(
          mesh, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
          num_blocks_per_shard=config.num_blocks, block_size=bs,
          head_dim=mc.head_dim, dtype=config.cache_dtype or mc.jnp_dtype)
      step_fn = functools.partial(mesh_device_step, mesh=mesh)
      shared = functools.partial(shared_mesh_step, mesh=mesh)
    self._steps = {}
    for decode_only in (True, False):
      if config.check_traces:
        def fn(model_def, params, cache, state, x, *, decode_only, num_logprobs):
          return step_fn(model_def, params, cache, state, x,
                         decode_only=decode_only, num_logprobs=num_logprobs)
        fn.__name__ = "decode_step" if decode_only else "mixed_step"
        step = jax.jit(chex.assert_max_traces(fn, n=1), donate_argnums=(2, 3),
                       static_argnums=(0,),
                       static_argnames=("decode_only", "num_logprobs"))
      else:
        step = shared
      self._steps[decode_only] = functools.partial(
          step, model_def, decode_only=decode_only, num_logprobs=self.num_logprobs)
    self._outputs: list[RequestOutput] = []

  # ----------------------------------------------------------------- requests

  def add_request(self, request: Request) -> RequestOutput | None:
    """Queues `request` (on the data shard with the fewest unfinished
    requests), or rejects it if it can never be served.

    Returns:
      None when accepted; a `RequestOutput` with `rejected` set otherwise
      (also returned by the next `step` or `run_until_done`).
    """
    pool = min(self._pools, key=lambda p: p.num_running + p.num_waiting)
    return pool.add_request(request)

  def has_unfinished(self) -> bool:
    return any(p.has_unfinished() for p in self._pools)

  @property
  def num_running(self) -> int:
    return sum(p.num_running for p in self._pools)

  @property
  def num_waiting(self) -> int:
    return sum(p.num_waiting for p in self._pools)

  @property
  def data_shards(self) -> int:
    """Data shards (block pools): the mesh's data axis, 1 without a mesh."""
    return len(self._pools)

  @property
  def block_state(self) -> bm.BlockState:
    """The `BlockState` (on a mesh: the data shards' states, stacked)."""
    return self._state

  @property
  def cache(self):
    """The `KVCache` (donated to every step: do not hold on to it)."""
    return self._cache

  def usage(self) -> dict:
    """Blocks used / total, running and waiting sequences (from the last
    step), summed over the data shards."""
    total = {}
    for p in self._pools:
      for k, v in p.usage().items():
        total[k] = total.get(k, 0) + v
    return total

  # ------------------------------------------------------------------- a step

  def _device_inputs(self, xs: list[StepInputs]) -> StepInputs:
    if self.mesh is None:
      (x,) = xs
      return x
    x = jax.tree.map(lambda *a: np.stack(a), *xs)
    # Every process builds the same inputs (see `Engine`); each places only
    # the shards its own devices hold.
    s = NamedSharding(self.mesh, P(sharding.DATA))
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), x)

  def lower_step(self, decode_only: bool) -> jax.stages.Lowered:
    """The jitted step of one shape, lowered for inspection (`.as_text()`,
    `.compile().as_text()`, `.cost_analysis()`); runs nothing."""
    xs = [p._build([], decode_only)[0] for p in self._pools]  # pylint: disable=protected-access
    fn = self._steps[decode_only]
    return fn.func.lower(*fn.args, self._params, self._cache, self._state,
                         self._device_inputs(xs), **fn.keywords)

  def _run(self, decode_only: bool, xs: list[StepInputs]) -> list[StepOutputs]:
    """Runs the device step on the pools' inputs; returns each pool's outputs."""
    fn = self._steps[decode_only]
    x = self._device_inputs(xs)
    self._cache, self._state, out = fn(self._params, self._cache, self._state, x)
    if not all(a.is_fully_addressable for a in jax.tree.leaves(out)):
      out = multihost_utils.process_allgather(out, tiled=True)  # several hosts
    out = jax.device_get(out)
    if self.mesh is None:
      return [out]
    return [jax.tree.map(lambda a, i=i: a[i], out) for i in range(len(xs))]

  def step(self) -> list[RequestOutput]:
    """Runs one engine step; returns the requests that finished (or were
    rejected) since the last call."""
    t0 = time.perf_counter()
    plans = [p.begin_step() for p in self._pools]
    if all(plan is None for plan in plans):
      return self._take_outputs()
    plans = [plan or [] for plan in plans]
    decode_only = all(n == 1 for plan in plans for _, n in plan)
    built = [p.build_step(plan, decode_only) for p, plan in zip(self._pools, plans)]
    t1 = time.perf_counter()
    outs = self._run(decode_only, [x for x, _ in built])
    t2 = time.perf_counter()
    for (_, apply), out in zip(built, outs):
      apply(out)
    st = self.stats
    st.steps += 1
    st.decode_steps += decode_only
    st.mixed_steps += not decode_only
    usage = self.usage()
    st.blocks_used.append(usage["blocks_used"])
    st.running.append(usage["running"])
    st.waiting.append(usage["waiting"])
    for p in self._pools:
      p.end_step()
    st.device_seconds += t2 - t1
    st.decode_device_seconds += (t2 - t1) * decode_only
    st.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
    return self._take_outputs()

  def warmup(self):
    """Compiles both step shapes with all-padding inputs (changes nothing)."""
    if self.has_unfinished() or any(p.has_releases() for p in self._pools):
      raise RuntimeError("warmup() needs an idle engine")
    for decode_only in (True, False):
      xs = [p.build_step([], decode_only)[0] for p in self._pools]
      for p, out in zip(self._pools, self._run(decode_only, xs)):
        p.sync_free(out)

  def _take_outputs(self):
    outs = []
    for p in self._pools:
      outs += p.take_outputs()
    return outs

  def run_until_done(self, max_steps: int = 1_000_000,
                     on_step: Callable[["Engine", list], None] | None = None
                     ) -> list[RequestOutput]:
    """Steps until every request has finished; returns all outputs."""
    outputs = self._take_outputs()
    for _ in range(max_steps):
      if not self.has_unfinished():
        break
      done = self.step()
      outputs += done
      if on_step is not None:
        on_step(self, done)
    else:
      raise RuntimeError(f"requests still unfinished after {max_steps} steps")
    self.flush()
    return outputs

  def flush(self):
    """Runs the releases still queued (so the pool is empty when idle)."""
    if any(p.has_releases() for p in self._pools):
      self.step()
