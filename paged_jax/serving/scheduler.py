"""The host side of one block pool: queues, admission, preemption, building a
step's inputs and applying its results.

Scheduling is vLLM-v1 style, oldest first: every running sequence gets its
next tokens (one for decode, a chunk for a prefill that is still going),
waiting sequences are admitted while batch rows, the token budget and free
blocks allow; when the pool cannot hold the running sequences' growth, the
newest are preempted (their blocks released, their tokens recomputed later).
The oldest running sequence (or beam group) is never preempted, and admission
guarantees that any single request fits the pool alone, so every accepted
request completes.

Blocks have one source of truth, the block manager's pure functions, which
the device runs in every step (`step.bookkeeping`: register -> release ->
fork -> release -> share -> reserve). Each `Scheduler` keeps an exact NumPy
model of its pool (`host_pool.HostPool`, proven equal to `block_manager` by
a model-based test) and, before a step is dispatched, applies to it the same
bookkeeping with the very inputs the device will get (`_fit`). So the
scheduler plans from exact answers -- which reservations fit, which blocks a
hit or a registration names, what an allocation evicts -- without running or
reading anything on the device: planning step N+1 never waits for step N.
When the model refuses an entry, the scheduler rolls the trial back, takes
back this step's admissions from that entry on or preempts the newest
running sequence (the entry itself when nothing newer is left), and tries
again. The device then grants exactly what the model granted; at resolve the
step's `ok` masks and a fingerprint of the device's state
(`step.state_fingerprint`) are checked against the model's (a difference
raises).

`Engine` drives one `Scheduler` per pool (one per data shard on a mesh); the
device arrays live in the `Runner`.

This file holds the queues, admission, preemption and fitting a step to the
pool; which requests are accepted is `admission.py`, block-aware admission's
room `block_room.py`; the other concerns are
mixins in their own files: input packing (`packing.py`), the prefix cache's
host side (`prefix.py`) and applying results (`results.py`), multi-step
decode (`multistep_host.py`); the pool model is `host_pool.py`.
"""

from __future__ import annotations

import bisect
import time

import numpy as np

from paged_jax import block_manager as bm
from paged_jax import prefix_cache
from paged_jax.serving import shared_pool
from paged_jax.serving import window_pool
from paged_jax.serving.block_room import BlockRoom
from paged_jax.serving.admission import (  # pylint: disable=unused-import
    limits_rejection, request_rejection, size_rejection, vocab_rejection)
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.host_pool import HostPool
from paged_jax.serving.multistep_host import MultiStep
from paged_jax.serving.packing import (Bookkeeping, Entry, InputPacking, Plan,
                                      SteadyInputs)
from paged_jax.serving.prefix_offload import PrefixOffload
from paged_jax.serving.prefix import (Candidate, PrefixCaching, Registration,
                                      register_rows, registration_due)
from paged_jax.serving.requests import (Group, Request, RequestDelta,
                                        RequestOutput, Seq)
from paged_jax.serving.resize import PoolResizing
from paged_jax.serving.results import Pending, Results
from paged_jax.serving.slot_state import HostSlots
from paged_jax.serving.stats import EngineStats
from paged_jax.serving.step import StepInputs
from paged_jax.serving.swap import Swapping

__all__ = ["Bookkeeping", "Pending", "Scheduler", "register_rows"]

def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


class Scheduler(Swapping, InputPacking, PrefixCaching, PrefixOffload, Results,
                MultiStep, PoolResizing):
  """The host side of one block pool: queues, admission, preemption, the
  step's inputs and applying its results. `Engine` drives one per pool (one
  per data shard on a mesh); the device arrays live in the `Engine`."""

  def __init__(self, config, model_config, max_model_len: int,
               stats: EngineStats, initial_state: bm.BlockState):
    self.config = config
    self.model_config = model_config
    self.max_model_len = max_model_len
    self.max_seqs = 2 * config.max_batch
    self.stats = stats
    # The exact NumPy model of this pool's block state: the bookkeeping the
    # device runs, applied on the host to the same inputs (see `_fit`); on
    # several hosts each process keeps its own.
    self._pool = window_pool.host_model(initial_state)  # one pool, or per window
    self._fingerprint = self._pool.fingerprint()  # after the last fitted step
    self._waiting: list[Seq] = []  # sorted by order
    self._running: list[Seq] = []  # sorted by order
    self._free_slots = list(range(self.max_seqs - 1, -1, -1))
    self._release_next: list[int] = []
    self._release_late_next: list[int] = []
    self._release_late_pending: list[int] = []  # slots free after next step
    self._orders = 0
    self._step = 0
    self._outputs: list[RequestOutput] = []
    self.collect_deltas = False  # streaming: keep per-token deltas
    self._deltas: list[RequestDelta] = []
    self._now = time.perf_counter()  # when the last step's results arrived
    # Prefix caching (`initial_state.prefix_caching`): the host index of
    # cached blocks (`prefix_cache.py`), kept exactly in step with the
    # host model of the pool: a block is indexed when this step registers
    # it, dropped when the model's reserve reports it evicted.
    caching = initial_state.prefix_caching
    self._index = (prefix_cache.PrefixIndex(config.block_size)
                   if caching else None)
    self._register_rows = register_rows(config) if caching else 0
    self._share_rows = config.max_batch if caching else 0
    self._register_next: list[Candidate] = []  # candidates
    self._register_due = registration_due(config) if caching else None
    self._registering: list[Registration] = []  # this step's
    self._registering_by_hash: dict[bytes, int] = {}  # the same, by hash
    self._shares: dict[Seq, list[int]] = {}  # this step's hits (admissions)
    self._fitted: Bookkeeping | None = None  # the inputs `_fit` accepted
    # The last steady decode step's inputs, sent again while its rows stay
    # the same (`packing.SteadyInputs`).
    self._steady_inputs: SteadyInputs | None = None
    # Per-slot sampling parameters: the host's copy of the device's
    # `SlotState`, written when a sequence gets a slot (`_bind`: admission,
    # fork); only the rows written go to the device (`take_slot_updates`).
    self._slots = HostSlots(self.max_seqs, config.max_logit_bias)
    self._irregular = np.zeros(self.max_seqs, bool)  # see `_bind`
    self._fork_pending = False  # a child may wait to fork (see `_forks`)
    self._init_swapping(initial_state)  # preemption by swap (`swap.py`)
    self._init_prefix_offload()  # the prefix cache's host level

  # ----------------------------------------------------------------- requests

  def add_request(self, request: Request) -> RequestOutput | None:
    """Queues `request`, or rejects it if it can never be served.

    Returns:
      None when accepted; a `RequestOutput` with `rejected` set otherwise
      (also returned by the next `step` or `run_until_done`).
    """
    reason = self._rejection(request)
    if reason is not None:
      now = time.perf_counter()
      out = RequestOutput(request.request_id, len(request.prompt),
                          rejected=reason, arrival_step=self._step,
                          arrival_time=now, finish_time=now)
      self.stats.rejected += 1
      self._outputs.append(out)
      if self.collect_deltas:
        self._deltas.append(RequestDelta(request.request_id, -1, [], output=out))
      return out
    eos = request.params.stop_ids(self.model_config.eos_token_ids)
    group = Group(request, self._orders, eos, self._step, time.perf_counter())
    self._orders += 1
    self._insert(self._waiting, group.live[0])
    return None

  def _rejection(self, request: Request) -> str | None:
    """`admission.request_rejection` for this engine and pool."""
    return request_rejection(request, config=self.config,
                             model_config=self.model_config,
                             max_model_len=self.max_model_len, pool=self._pool)

  def has_unfinished(self) -> bool:
    return bool(self._waiting or self._running or self._swapped)

  def has_releases(self) -> bool:
    return bool(self._release_next or self._release_late_next) or self.has_swaps()

  def usage(self) -> dict:
    """Blocks used (held by sequences) / cached (free to reuse, their K/V
    kept for prefix-cache hits) / total, running and waiting sequences, and
    the host tier's (`swap.Swapping.host_usage`), from the last step."""
    used, cached, running, waiting = self.gauges()
    return {"blocks_used": used, "blocks_cached": cached,
            "blocks_total": self._pool.num_blocks,
            "running": running, "waiting": waiting, **self.host_usage()}

  def gauges(self) -> tuple[int, int, int, int]:
    """`(blocks used, blocks cached, running, waiting)` of `usage`, without
    building its dict (the stats sample them every step)."""
    pool = self._pool
    return (pool.num_blocks - pool.num_free - pool.num_cached, pool.num_cached,
            len(self._running), len(self._waiting))

  @property
  def prefix_index(self) -> prefix_cache.PrefixIndex | None:
    """The prefix-cache index (None without prefix caching)."""
    return self._index

  def check_prefix_index(self):
    """Asserts that the index names exactly the pool's cacheable blocks
    (tests: no entry points at a block that was evicted and reused)."""
    if self._index is not None:
      prefix_cache.check_consistent(self._index, self.mirror_state())

  def mirror_state(self) -> bm.BlockState:
    """The host model's `BlockState` (NumPy copies; equal to the device's
    once the steps dispatched so far have run)."""
    return self._pool.to_state()

  @property
  def num_running(self) -> int:
    return len(self._running)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  # --------------------------------------------------------------- scheduling

  @staticmethod
  def _insert(queue: list[Seq], seq: Seq):
    if not queue or queue[-1].order < seq.order:  # the newest: O(1)
      queue.append(seq)
      return
    keys = [s.order for s in queue]
    queue.insert(bisect.bisect(keys, seq.order), seq)

  def _bind(self, seq: Seq, slot: int):
    """Gives `seq` sequence slot `slot` and writes its sampling parameters
    there (sent to the device before the next step, `take_slot_updates`)."""
    seq.slot = slot
    g = seq.group
    self._slots.bind(slot, g.params, seq.index, g.prompt_len, g.eos)
    # Never a steady decode row (`Plan`): beam search, or a prompt whose
    # samples are still to fork (cleared in `_commit` once they have).
    self._irregular[slot] = g.is_beam or bool(g.unborn)

  def take_slot_updates(self, rows: int | None = None):
    """The slot-state rows written since the last call, for
    `Runner.write_slots` (`HostSlots.take_updates`); None if none."""
    return self._slots.take_updates(rows)

  def slot_updates_pending(self) -> int:
    """Slot-state rows written and not sent yet."""
    return self._slots.num_pending

  @property
  def _slot_ban_until(self) -> np.ndarray:
    """i32[max_seqs]: each slot's `min_tokens` ban limit (host copy)."""
    return self._slots.state.ban_until

  def _release(self, seq: Seq, late: bool = False):
    """Queues `seq`'s slot for release by the next step's bookkeeping (after
    that step's forks when `late`: a finished parent whose children fork).
    Its full blocks not registered yet are registered first (prefix caching:
    they stay cached after the release)."""
    if self._drop_swapped(seq):
      return
    if seq.slot >= 0:
      if seq.fork_from < 0:  # a pending child holds no device state
        if self._index is not None:
          self._collect_registrations(seq)
        if late:  # the slot is free after the next step
          self._release_late_next.append(seq.slot)
          self._release_late_pending.append(seq.slot)
        else:
          self._release_next.append(seq.slot)
          self._free_slots.append(seq.slot)
      else:
        self._free_slots.append(seq.slot)
    seq.slot = -1
    seq.fork_from = -1
    seq.num_registered = 0

  def _preempt(self, victim: Seq, plan: list):
    """Preempts `victim` (its whole group for beam search): its blocks are
    released, its tokens recomputed when it is admitted again (or swapped
    out: `swap.py`)."""
    if isinstance(plan, Plan):  # an entry may leave its decode rows
      plan.decode_rows = 0
    if self._swap_out_victim(victim, plan):
      return
    group = victim.group
    victims = list(group.live) if group.is_beam else [victim]
    for seq in victims:
      plan[:] = [(s, n) for s, n in plan if s is not seq]
      if seq in self._running:
        self._running.remove(seq)
      if seq in self._waiting:
        self._waiting.remove(seq)
      self.stats.recomputed_tokens += seq.num_cached
      self._release(seq)
      seq.num_cached = 0
    group.output.preemptions += 1
    self.stats.preemptions += 1
    if group.is_beam:
      self._insert(self._waiting, group.restart())
    else:
      self._insert(self._waiting, victim)

  def _unadmit(self, seq: Seq, plan: list):
    """Takes back an admission of this step (it holds no blocks yet)."""
    if self._unswap_in(seq, plan):
      return
    plan[:] = [(s, n) for s, n in plan if s is not seq]
    self._running.remove(seq)
    self._free_slots.append(seq.slot)
    seq.slot = -1
    self._drop_loads(seq)  # its host-level loads too (`prefix_offload.py`)
    if self._shares.pop(seq, None) is not None:  # its hit is taken back too
      seq.num_cached = seq.num_registered = 0
    self._insert(self._waiting, seq)

  def _schedule(self) -> tuple[list[Entry], list[Seq], Seq | None]:
    """Proposes this step's (sequence, new tokens) entries, oldest first,
    within the token budget and batch rows; `_fit` then makes them fit the
    pool. Returns `(plan, admitted, first)`: the entries, this step's
    admissions, and the oldest running sequence (never preempted)."""
    c = self.config
    bs = c.block_size
    budget = c.max_tokens_per_step
    running = self._running
    first = running[0] if running else None
    need = [len(s.tokens) - s.num_cached for s in running]
    total = sum(need)
    if total <= budget and (not need or min(need) >= 1):
      # Every running entry gets all its tokens (then each one's room, the
      # budget left after it minus one per later entry, holds them too).
      plan = Plan(zip(running, need))
      budget -= total
      if total == len(need):  # one token each: steady decode (see `Plan`)
        plan.decode_rows = len(need)
    else:
      plan = Plan()
      for i, (seq, want) in enumerate(zip(running, need)):
        # Leave one token of budget for each running sequence after this one.
        n = min(want, budget - (len(running) - 1 - i))
        if n > 0:
          plan.append((seq, n))
          budget -= n
    admitted: list[Seq] = []
    if not (self._waiting or self._swapped):  # nothing to admit: no scan
      return plan, admitted, first
    room = BlockRoom(self._pool, c, running, plan)  # block-aware admission
    rows = len(self._running)
    if self._irregular.any():  # (a prompt whose samples are still to fork is)
      rows += sum(s.group.unborn for s in self._running
                  if s.index == 0 and s.group.unborn)
    budget, rows = self._swap_in_admissions(plan, admitted, budget, rows)
    if c.static_batching and self._running:
      return plan, admitted, first
    while self._waiting and self._free_slots:
      seq = self._waiting[0]
      new_rows = 1 + (seq.group.unborn if seq.index == 0 else 0)
      if rows + new_rows > c.max_batch:
        break
      n = min(len(seq.tokens), budget)
      if n <= 0 and not c.static_batching:
        break
      need = -(-n // bs)  # before a prefix-cache hit (a heuristic: `_fit` is exact)
      costs = room.costs(seq) if room.check else []
      if not room.fits(need, costs):
        self.stats.deferred_admissions += 1
        break
      room.take(need, costs)
      self._waiting.pop(0)
      self._bind(seq, self._free_slots.pop())
      self._insert(self._running, seq)
      admitted.append(seq)
      rows += new_rows
      if self._index is not None and len(self._shares) < self._share_rows:
        self._lookup(seq)
        n = min(len(seq.tokens) - seq.num_cached, n)
      if n > 0:
        plan.append((seq, n))
        budget -= n
    return plan, admitted, first

  def _fit(self, plan, admitted: list[Seq], first: Seq | None):
    """Makes `plan` fit the pool exactly: runs the step's bookkeeping (the
    same bookkeeping the device runs, on the host model) and, while it
    refuses an entry, takes back the admissions from that entry on, or
    preempts the newest running sequence (the entry itself when nothing newer
    is left and it is not the oldest). Commits the model to the result.

    Raises:
      RuntimeError: if a fork is refused or the oldest sequence cannot grow
        alone (admission guarantees neither happens).
    """
    queued = len(self._register_next)
    pool = self._pool
    while True:
      x = self._bookkeeping_inputs(plan, self.config.max_batch)
      forks = len(self._forks())
      pool.begin()
      if type(pool) in (HostPool, shared_pool.SharedHost):  # pylint: disable=unidiomatic-typecheck
        # (not a subclass or a pool per window: they take no layout promise)
        fork_ok, res, cache_ok = pool.bookkeeping(
            *x, packed=len(plan), decode=getattr(plan, "decode_rows", 0))
      else:
        fork_ok, res, cache_ok = pool.bookkeeping(*x)
      if forks and not fork_ok[:forks].all():
        pool.rollback()
        raise RuntimeError(f"a fork was refused: engine bookkeeping bug ({self.usage()})")
      if cache_ok.size and not cache_ok.all():
        pool.rollback()
        raise RuntimeError("a prefix-cache registration or hit was refused: "
                           "the index and the pool disagree (engine bug)")
      granted = res.ok[:len(plan)].all()
      refused = None if granted else np.flatnonzero(~res.ok[:len(plan)])
      if granted:
        pool.commit()
        k = getattr(plan, "decode_rows", 0)
        if k and self._irregular.any() and self._irregular[x.seq_ids[:k]].any():
          plan.decode_rows = 0  # a beam or an unforked prompt among them
        self._fingerprint = pool.fingerprint()
        self._fitted = x  # `build_step` reuses them
        # A slot preempted here is released by this very step: blocks queued
        # for it now would be read from a table gone by the next step. (None
        # are: its blocks were collected in `_prepare_registrations`.)
        del self._register_next[queued:]
        if self._index is not None:
          self._commit_prefix_cache(res.evicted, admitted)
        return plan
      pool.rollback()
      self.stats.refused_reservations += 1
      seq, _ = plan[refused[0]]
      if seq in admitted:  # it and every later admission wait
        for s in admitted[admitted.index(seq):]:
          self._unadmit(s, plan)
        del admitted[admitted.index(seq):]
        continue
      newer = [v for v in self._running if v.order > seq.order
               and not (seq.group.is_beam and v.group is seq.group)]
      if newer:
        victim = newer[-1]
        if victim in admitted:
          admitted.remove(victim)
          self._unadmit(victim, plan)
        else:
          self._preempt(victim, plan)
        continue
      protected = seq is first or (seq.group is first.group and seq.group.is_beam)
      if protected:
        raise RuntimeError(f"the oldest sequence cannot grow alone: {self.usage()}")
      self._preempt(seq, plan)

  # ------------------------------------------------------------------- a step

  def _forks(self) -> list[Seq]:
    """Every pending child forks at the next step, planned or not (its parent
    may write its next token in that step). No scan while none was made."""
    if not self._fork_pending:
      return []
    forks = [s for s in self._running if s.fork_from >= 0]
    self._fork_pending = bool(forks)
    return forks

  def begin_step(self) -> list[Entry] | None:
    """Schedules this step; None when the pool has nothing to run or release.

    Raises:
      RuntimeError: if requests wait while nothing runs and none can start
        (admission guarantees this never happens).
    """
    if self._index is not None:
      self._prepare_registrations()
    plan, admitted, first = self._schedule()
    if plan or self.has_releases() or self._registering:
      plan = self._fit(plan, admitted, first)
    if not plan and not self.has_releases() and not self._registering:
      if self._waiting and not self._running:  # admission guarantees progress
        raise RuntimeError(f"engine stalled with nothing running: {self.usage()}")
      return None
    return plan

  def build_step(self, plan, bucket: Bucket) -> tuple[StepInputs, "Pending"]:
    """This step's `StepInputs` for `plan` in shape `bucket`, and commits the
    step on the host as if it had run (see `_commit`): the next step can be
    scheduled before this one's results arrive. Returns `(inputs, pending)`;
    hand `pending` and the step's outputs for this pool to `resolve`."""
    x, samples = self._build(plan, bucket, self._fitted)
    self._fitted = None
    forks = self._forks()
    self._release_next, self._release_late_next = [], []
    self._registering, self._registering_by_hash, self._shares = [], {}, {}
    # Slots released after this step's forks are free for the next step.
    self._free_slots.extend(self._release_late_pending)
    self._release_late_pending = []
    pending = self._commit(plan, samples, forks, x)
    return x, pending

  def end_step(self):
    self._step += 1

  def take_outputs(self) -> list[RequestOutput]:
    outs, self._outputs = self._outputs, []
    return outs

  def take_deltas(self) -> list[RequestDelta]:
    out, self._deltas = self._deltas, []
    return out
