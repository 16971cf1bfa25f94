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
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import NamedTuple

import numpy as np

from paged_jax import block_manager as bm
from paged_jax import prefix_cache
from paged_jax.serving import beam as beam_lib
from paged_jax.serving import sampling as sampling_lib
from paged_jax.serving import step as step_lib
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.host_pool import HostPool
from paged_jax.serving.requests import (PENDING, Completion, Group, Request,
                                        RequestDelta, RequestOutput, Seq)
from paged_jax.serving.stats import EngineStats
from paged_jax.serving.step import StepInputs, StepOutputs

@dataclasses.dataclass
class Pending:
  """What `Scheduler.resolve` needs of a dispatched step.

  Attributes:
    records: `(sample row, seq, token index)` of each token the step left
      `PENDING`.
    beam: `(sample row, seq)` of its beam-search rows (their group waits for
      them before its next step).
    num_entries: rows of `ok` that were real entries.
    num_forks: rows of `fork_ok` that were real forks.
    fingerprint: u32[5], the host model's `HostPool.fingerprint()` after
      this step's bookkeeping (the device's must equal it).
  """

  records: list
  beam: list
  num_entries: int
  num_forks: int
  fingerprint: np.ndarray

  def live(self) -> bool:
    """Whether applying the results still changes a request (a token of an
    unfinished sequence, a beam step of a group not aborted)."""
    return (any(not t.done for _, t, _ in self.records)
            or any(not s.group.aborted for _, s in self.beam))


class Bookkeeping(NamedTuple):
  """The inputs of `step.bookkeeping` (the `StepInputs` fields of the same
  names, in `step.BOOKKEEPING_FIELDS` order)."""

  register_seqs: np.ndarray  # i32[R]
  register_cols: np.ndarray  # i32[R]
  release_early: np.ndarray  # i32[max_seqs]
  fork_parents: np.ndarray  # i32[max_batch]
  fork_children: np.ndarray  # i32[max_batch]
  release_late: np.ndarray  # i32[max_seqs]
  share_seqs: np.ndarray  # i32[H]
  share_blocks: np.ndarray  # i32[H, max_blocks_per_seq]
  share_counts: np.ndarray  # i32[H]
  seq_ids: np.ndarray  # i32[num_seqs]
  q_lens: np.ndarray  # i32[num_seqs]

  def cut(self, num_seqs: int) -> "Bookkeeping":
    """The same inputs with `num_seqs` entry rows (the rest are padding)."""
    return self._replace(seq_ids=self.seq_ids[:num_seqs],
                         q_lens=self.q_lens[:num_seqs])


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def register_rows(config) -> int:
  """Blocks a step can register for the prefix cache (`StepInputs.register_*`
  rows): a step completes at most `max_tokens_per_step // block_size` blocks
  of prefill plus one block per decoding sequence; what does not fit waits a
  step (a block released before it is registered is simply not cached)."""
  return config.max_tokens_per_step // config.block_size + config.max_batch


class Scheduler:
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
    self._pool = HostPool(initial_state)
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
    self._register_next: list[tuple[Seq, int, int, bytes]] = []  # candidates
    self._registering: list[tuple[int, int, bytes, int]] = []  # this step's
    self._shares: dict[Seq, list[int]] = {}  # this step's hits (admissions)
    self._fitted: Bookkeeping | None = None  # the inputs `_fit` accepted
    # Per-slot sampling parameters, written when a sequence gets a slot
    # (`_bind`: admission, fork), read by `_build` with one gather per field.
    ms = self.max_seqs
    self._slot_temperature = np.zeros(ms, np.float32)
    self._slot_top_k = np.zeros(ms, np.int32)
    self._slot_top_p = np.ones(ms, np.float32)
    self._slot_seed = np.zeros(ms, np.int32)
    self._slot_ban_until = np.zeros(ms, np.int32)  # EOS masked below this position
    self._slot_banned = np.full((ms, sampling_lib.MAX_BANNED), -1, np.int32)
    self._fork_pending = False  # a child may wait to fork (see `_forks`)

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
    eos = frozenset(request.params.eos_token_ids or self.model_config.eos_token_ids
                    ) | frozenset(request.params.stop_token_ids)
    group = Group(request, self._orders, eos, self._step, time.perf_counter())
    self._orders += 1
    self._insert(self._waiting, group.live[0])
    return None

  def _rejection(self, request: Request) -> str | None:
    p, c = request.params, self.config
    prompt = request.prompt
    if not prompt:
      return "empty prompt"
    if request.cache_salt is not None and not isinstance(request.cache_salt, (str, bytes)):
      return f"cache_salt must be a str or bytes, got {request.cache_salt!r}"
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
    stops = set(p.eos_token_ids or self.model_config.eos_token_ids) | set(p.stop_token_ids)
    if p.min_tokens and len(stops) > sampling_lib.MAX_BANNED:
      return (f"min_tokens needs at most {sampling_lib.MAX_BANNED} EOS and stop "
              f"token ids, got {len(stops)}")
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
    """Blocks used (held by sequences) / cached (free to reuse, their K/V
    kept for prefix-cache hits) / total, running and waiting sequences (from
    the last step)."""
    pool = self._pool
    used = self.config.num_blocks - pool.num_free - pool.num_cached
    return {"blocks_used": used, "blocks_cached": pool.num_cached,
            "blocks_total": self.config.num_blocks,
            "running": len(self._running), "waiting": len(self._waiting)}

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
    there (read by every step that samples it, `_build`)."""
    seq.slot = slot
    g = seq.group
    p = g.params
    self._slot_temperature[slot] = 0.0 if p.beam_width > 1 else p.temperature
    self._slot_top_k[slot] = p.top_k
    self._slot_top_p[slot] = p.top_p
    self._slot_seed[slot] = p.seed + seq.index
    self._slot_ban_until[slot] = g.prompt_len + p.min_tokens if p.min_tokens else 0
    self._slot_banned[slot] = -1
    if p.min_tokens:
      ban = sorted(g.eos)
      self._slot_banned[slot, :len(ban)] = ban

  def _release(self, seq: Seq, late: bool = False):
    """Queues `seq`'s slot for release by the next step's bookkeeping (after
    that step's forks when `late`: a finished parent whose children fork).
    Its full blocks not registered yet are registered first (prefix caching:
    they stay cached after the release)."""
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
    released, its tokens recomputed when it is admitted again."""
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
    plan[:] = [(s, n) for s, n in plan if s is not seq]
    self._running.remove(seq)
    self._free_slots.append(seq.slot)
    seq.slot = -1
    if self._shares.pop(seq, None) is not None:  # its hit is taken back too
      seq.num_cached = seq.num_registered = 0
    self._insert(self._waiting, seq)

  def _schedule(self) -> tuple[list[tuple[Seq, int]], list[Seq], Seq | None]:
    """Proposes this step's (sequence, new tokens) entries, oldest first,
    within the token budget and batch rows; `_fit` then makes them fit the
    pool. Returns `(plan, admitted, first)`: the entries, this step's
    admissions, and the oldest running sequence (never preempted)."""
    c = self.config
    bs = c.block_size
    budget = c.max_tokens_per_step
    plan: list[tuple[Seq, int]] = []
    running = list(self._running)
    first = running[0] if running else None
    growth = 0  # blocks the running entries take this step (no copies counted)
    for i, seq in enumerate(running):
      # Leave one token of budget for each running sequence after this one.
      room = budget - (len(running) - 1 - i)
      cached = seq.num_cached
      n = min(len(seq.tokens) - cached, room)
      if n > 0:
        plan.append((seq, n))
        budget -= n
        growth += -(-(cached + n) // bs) - -(-cached // bs)
    # Block-aware admission: a prompt is admitted only if its blocks leave
    # the running sequences room to grow for `admission_headroom_steps`
    # decode steps beyond this one (each crosses a block boundary once per
    # `bs` steps), so an admission is not soon paid for by a preemption and
    # its recomputation. (An estimate: `_fit` stays exact.)
    free = self._pool.num_available - growth
    headroom = -(-len(plan) * c.admission_headroom_steps // bs)
    admitted: list[Seq] = []
    rows = len(self._running) + sum(s.group.unborn for s in self._running
                                    if s.index == 0 and s.group.unborn)
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
      if (c.admission_headroom_steps and self._running and not c.static_batching
          and need > free - headroom):
        self.stats.deferred_admissions += 1
        break
      free -= need
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
      forks = int(np.sum(x.fork_parents >= 0))
      pool.begin()
      fork_ok, res, cache_ok = pool.bookkeeping(*x)
      if not fork_ok[:forks].all():
        pool.rollback()
        raise RuntimeError(f"a fork was refused: engine bookkeeping bug ({self.usage()})")
      if not cache_ok.all():
        pool.rollback()
        raise RuntimeError("a prefix-cache registration or hit was refused: "
                           f"the index and the pool disagree (engine bug)")
      refused = np.flatnonzero(~res.ok[:len(plan)])
      if not refused.size:
        pool.commit()
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
      seq = plan[refused[0]][0]
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

  @classmethod
  def work(cls, plan) -> tuple[int, int]:
    """`(token rows, sequence rows)` that `plan` needs: its tokens, and the
    larger of its entries and its sample rows."""
    tokens = samples = 0
    for s, n in plan:
      tokens += n
      if s.num_cached + n == len(s.tokens):
        g = s.group
        samples += g.params.n if (g.unborn and not g.is_beam) else 1
    return tokens, max(len(plan), samples)

  def _forks(self) -> list[Seq]:
    """Every pending child forks at the next step, planned or not (its parent
    may write its next token in that step). No scan while none was made."""
    if not self._fork_pending:
      return []
    forks = [s for s in self._running if s.fork_from >= 0]
    self._fork_pending = bool(forks)
    return forks

  # ----------------------------------------------------------- prefix cache

  def _extend_hashes(self, seq: Seq, num_blocks: int):
    """Extends `seq.hashes` to its first `num_blocks` full blocks, stopping at
    a block that holds a token still in flight (`PENDING`)."""
    bs = self.config.block_size
    index, hashes = self._index, seq.hashes
    while len(hashes) < num_blocks:
      i = len(hashes)
      block = seq.tokens[i * bs:(i + 1) * bs]
      if PENDING in block:
        return
      parent = hashes[-1] if hashes else index.root(seq.group.request.salt_bytes())
      hashes.append(index.chain(parent, block))

  def _lookup(self, seq: Seq):
    """Admission: starts `seq` on the longest cached prefix of its tokens
    (its last token is always computed: `prefix_cache.max_hit_blocks`)."""
    bs = self.config.block_size
    limit = prefix_cache.max_hit_blocks(len(seq.tokens), bs)
    self._extend_hashes(seq, limit)
    blocks = self._index.lookup(seq.hashes[:limit])
    if blocks:
      self._shares[seq] = blocks
      seq.num_cached = len(blocks) * bs
      seq.num_registered = len(blocks)

  def _collect_registrations(self, seq: Seq):
    """Queues `seq`'s full, computed blocks not registered yet (`(seq, slot,
    col, hash)`) for the next step's bookkeeping."""
    full = seq.num_cached // self.config.block_size
    self._extend_hashes(seq, full)
    for col in range(seq.num_registered, min(full, len(seq.hashes))):
      self._register_next.append((seq, seq.slot, col, seq.hashes[col]))
      seq.num_registered = col + 1

  def _prepare_registrations(self):
    """Decides which queued blocks this step registers: one block per hash
    (a block whose hash is indexed already, or repeated in this step, stays
    unregistered and is emptied when released), at most `register_rows`; the
    rest of a live sequence waits for the next step. Reads the physical blocks
    from the host model before this step (a full block's entry never
    changes)."""
    for seq in self._running:
      if seq.slot >= 0 and seq.fork_from < 0:
        self._collect_registrations(seq)
    queued, self._register_next = self._register_next, []
    self._registering = []
    if not queued:
      return
    tables = self._pool.tables  # before this step: a full block's entry stays
    taken: set[bytes] = set()
    for seq, slot, col, h in queued:
      if len(self._registering) == self._register_rows:
        if seq.slot == slot:  # still live there: again next step
          seq.num_registered = min(seq.num_registered, col)
        continue
      if h in self._index or h in taken:
        continue
      taken.add(h)
      self._registering.append((slot, col, h, int(tables[slot, col])))

  def _commit_prefix_cache(self, evicted: np.ndarray, admitted: list[Seq]):
    """After the model accepted a step: index this step's registered blocks,
    drop the evicted ones, count the hits."""
    st, bs = self.stats, self.config.block_size
    for _, _, h, block in self._registering:
      if not self._index.insert(h, block):
        raise RuntimeError("a registered block's hash was indexed already "
                           "(engine bug)")
    st.prefix_blocks_evicted += self._index.evict(evicted[evicted >= 0])
    st.prefix_blocks_registered += len(self._registering)
    for seq in admitted:
      hit = len(self._shares.get(seq, ())) * bs
      st.prefix_tokens_saved += hit
      g = seq.group
      if not g.admitted:  # the hit rate counts prompts, at first admission
        g.admitted = True
        g.output.num_cached_tokens = hit
        st.prefix_queried_tokens += g.prompt_len
        st.prefix_hit_tokens += hit

  def _bookkeeping_inputs(self, plan, num_seqs: int) -> Bookkeeping:
    """The arguments of `step.bookkeeping` for `plan` with `num_seqs` entry
    rows. Padding entries (-1, 0 tokens) change nothing, so every row count
    gives the same state."""
    c = self.config
    register_seqs = np.full(self._register_rows, -1, np.int32)
    register_cols = np.zeros(self._register_rows, np.int32)
    for i, (slot, col, _, _) in enumerate(self._registering):
      register_seqs[i], register_cols[i] = slot, col
    width = self._pool.width
    share_seqs = np.full(self._share_rows, -1, np.int32)
    share_blocks = np.full((self._share_rows, width), -1, np.int32)
    share_counts = np.zeros(self._share_rows, np.int32)
    for i, (seq, blocks) in enumerate(self._shares.items()):
      share_seqs[i], share_counts[i] = seq.slot, len(blocks)
      share_blocks[i, :len(blocks)] = blocks
    release_early = np.full(self.max_seqs, -1, np.int32)
    release_late = np.full(self.max_seqs, -1, np.int32)
    release_early[:len(self._release_next)] = self._release_next
    release_late[:len(self._release_late_next)] = self._release_late_next
    fork_parents = np.full(c.max_batch, -1, np.int32)
    fork_children = np.full(c.max_batch, -1, np.int32)
    for i, s in enumerate(self._forks()):
      fork_parents[i] = s.fork_from
      fork_children[i] = s.slot
    seq_ids = np.full(num_seqs, -1, np.int32)
    q_lens = np.zeros(num_seqs, np.int32)
    if plan:
      seq_ids[:len(plan)] = [s.slot for s, _ in plan]
      q_lens[:len(plan)] = [n for _, n in plan]
    return Bookkeeping(register_seqs, register_cols, release_early, fork_parents,
                       fork_children, release_late, share_seqs, share_blocks,
                       share_counts, seq_ids, q_lens)

  def _build(self, plan, bucket: Bucket, book: Bookkeeping | None = None):
    """`(StepInputs, samples)` of `plan` in shape `bucket`; `samples` are the
    `(token row, seq, lane)` of each sample row. `book`: the bookkeeping
    inputs `_fit` accepted for `plan` (`max_batch` entry rows; cut to the
    bucket's here, the rows past the plan being padding), else built.
    Changes nothing.

    One pass over the entries (each one's tokens, or the slot whose last
    sampled token the device holds); the sample rows' parameters are
    gathered from the per-slot arrays `_bind` wrote."""
    num_tokens, S = bucket.num_tokens, bucket.num_seqs
    book = self._bookkeeping_inputs(plan, S) if book is None else book.cut(S)
    tokens = np.zeros(num_tokens, np.int32)
    token_slots = np.full(num_tokens, -1, np.int32)
    samples = []  # (sample row, seq, sample index)
    slots, ends, extra = [], [], []  # per sample: its seq's slot, position
    row = 0
    for s, n in plan:
      toks, start = s.tokens, s.num_cached
      end = start + n
      if toks[end - 1] == PENDING:  # sampled by the step in flight: on the device
        if n != 1 or end != len(toks):
          raise RuntimeError("a pending token outside a decode row (engine bug)")
        token_slots[row] = s.slot
      else:
        tokens[row:row + n] = toks[start:end]
      row += n
      if end == len(toks):  # the entry samples after this step
        g = s.group
        if g.unborn and not g.is_beam:  # the prompt's n samples, one row
          for lane in range(g.params.n):
            extra.append((len(samples), lane - s.index))
            samples.append((row - 1, s, lane))
            slots.append(s.slot)
            ends.append(end)
        else:
          samples.append((row - 1, s, s.index))
          slots.append(s.slot)
          ends.append(end)
    k = len(samples)
    sample_rows = np.zeros(S, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.int32)
    positions = np.zeros(S, np.int32)
    banned = np.full((S, sampling_lib.MAX_BANNED), -1, np.int32)
    if k:
      sl = np.asarray(slots, np.int32)
      sample_rows[:k] = [r for r, _, _ in samples]
      temperature[:k] = self._slot_temperature[sl]
      top_k[:k] = self._slot_top_k[sl]
      top_p[:k] = self._slot_top_p[sl]
      seeds[:k] = self._slot_seed[sl]
      for r, offset in extra:
        seeds[r] += offset
      positions[:k] = ends
      masked = positions[:k] < self._slot_ban_until[sl]
      if masked.any():
        banned[:k][masked] = self._slot_banned[sl[masked]]
    x = StepInputs(**book._asdict(), tokens=tokens, token_slots=token_slots,
                   sample_slots=np.full(S, -1, np.int32), sample_rows=sample_rows,
                   temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds,
                   positions=positions, banned=banned)
    return x, samples

  def begin_step(self) -> list[tuple[Seq, int]] | None:
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
    self._registering, self._shares = [], {}
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

  # ------------------------------------------------------------ results

  def _commit(self, plan, samples, forks, x: StepInputs) -> "Pending":
    """Applies everything about this step the host knows before it runs: the
    forks are done, the entries' tokens are cached, every (non-beam) sample
    appends a `PENDING` token whose value the device keeps for the next step
    (`x.sample_slots`), a prompt that samples `n` forks its other samples,
    and a sequence whose pending token is its last (`max_new_tokens`)
    retires now. What needs the tokens' values (EOS, beam search, streaming,
    latency) waits for `resolve`."""
    for s in forks:
      s.fork_from = -1
    computed = 0
    for s, n in plan:
      s.num_cached += n
      computed += n
    self.stats.computed_tokens += computed
    records = []  # (sample row, target seq, token index)
    beam = []  # (sample row, seq)
    finals = []
    target_slots = []  # the slot each non-beam sample row's token goes to
    children: dict[int, Seq] = {}  # lane -> child of the prompt sampled now
    for r, (_, s, lane) in enumerate(samples):
      g = s.group
      if g.is_beam:
        beam.append((r, s))
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
      t.tokens.append(PENDING)
      target_slots.append(t.slot)
      records.append((r, t, len(t.tokens) - 1))
      if len(t.tokens) - g.prompt_len >= g.params.max_new_tokens:
        t.final = True
        finals.append(t)
    if records:
      x.sample_slots[np.array([r for r, _, _ in records])] = target_slots
    for t in finals:  # after every child exists (a parent may retire late)
      self._retire(t)
    return Pending(records, beam, len(plan), len(forks), self._fingerprint)

  def resolve(self, pending: "Pending", out: StepOutputs, now: float):
    """Applies a step's results: the pending tokens' values, EOS, streaming
    deltas, latency, beam search."""
    self._now = now
    # The device ran the same bookkeeping on the same state as the host
    # model (`_fit`): it grants exactly what the model granted, and ends in
    # the same state.
    if not (out.ok[:pending.num_entries].all()
            and out.fork_ok[:pending.num_forks].all()):
      raise RuntimeError("the device refused what the host model granted: "
                         "the block states diverged (engine bug)")
    if not np.array_equal(out.fingerprint, pending.fingerprint):
      raise RuntimeError(
          f"the device's block state fingerprint {out.fingerprint.tolist()} "
          f"differs from the host model's {pending.fingerprint.tolist()}: the "
          "block states diverged (engine bug)")
    tokens = out.tokens.tolist()
    logprobs = out.token_logprobs.tolist()
    deltas = self._deltas if self.collect_deltas else None
    itls = []
    for r, t, idx in pending.records:
      if t.done:  # stopped by an EOS the step before; this token is void
        continue
      tok = tokens[r]
      t.tokens[idx] = tok
      t.token_logprobs.append(logprobs[r])
      g = t.group
      if g.output.first_token_step is None:
        self._first_token(g)
      # Latency, the stream, finishing (a sampled, non-beam token).
      if t.last_token_time is not None:
        itls.append(now - t.last_token_time)
      t.last_token_time = now
      reason = None
      if tok in g.eos:
        reason = "stop"
      elif t.final and idx == len(t.tokens) - 1:
        reason = "length"
      if deltas is not None:
        deltas.append(RequestDelta(g.request.request_id, t.index, [tok], reason,
                                   logprobs=[logprobs[r]]))
      if reason is not None:
        del t.tokens[idx + 1:]  # a token sampled after the EOS is void
        self._finish_seq(t, reason)
    self.stats.itl.add_many(itls)
    rows: dict[int, list] = {}
    for r, s in pending.beam:
      if s.group.aborted:
        continue
      rows.setdefault(id(s.group), [s.group, {}])[1][id(s)] = (
          out.top_logprobs[r], out.top_ids[r])
    for g, by_seq in rows.values():
      self._beam_update(g, by_seq)

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
                                   token_logprobs=list(seq.token_logprobs))
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
                                       token_logprobs=list(seq.token_logprobs))
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
