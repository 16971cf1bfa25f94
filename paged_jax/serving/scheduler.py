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

Blocks have one source of truth, the block manager's pure functions. Each
`Scheduler` holds a host mirror of its pool's `BlockState` (on the host CPU)
and, before a step is dispatched, runs on it `step.bookkeeping` -- the very
function the device step runs (release -> fork -> release -> reserve) -- with
the very inputs the device will get (`_fit`). So the scheduler plans from
exact answers: which reservations fit, how many blocks a release returns,
where copy-on-write happens are all decided by `block_manager.reserve` /
`release` / `fork`, never re-derived here. When the mirror refuses an entry,
the scheduler takes back this step's admissions from that entry on, or
preempts the newest running sequence (the entry itself when nothing newer is
left), and runs the bookkeeping again; the device then grants exactly what
the mirror granted (checked: a difference raises). Why a mirror rather than
reading the device's state: the host must decide before it dispatches, and
reading the device every step would stall the pipeline; the bookkeeping is
deterministic and small (O(batch x blocks per sequence)), so running it twice
is cheap and the two copies cannot drift.

`Engine` drives one `Scheduler` per pool (one per data shard on a mesh); the
device arrays live in the `Runner`.
"""

from __future__ import annotations

import bisect
import time

import jax
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import prefix_cache
from paged_jax.serving import beam as beam_lib
from paged_jax.serving import compiler
from paged_jax.serving import sampling as sampling_lib
from paged_jax.serving import step as step_lib
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.requests import (PENDING, Completion, Group, Request,
                                        RequestDelta, RequestOutput, Seq)
from paged_jax.serving.stats import EngineStats
from paged_jax.serving.step import StepInputs, StepOutputs

# The bookkeeping on the host mirror: the device step's own function.
_trial = jax.jit(step_lib.bookkeeping, static_argnames="present")
# (release_early, forks, release_late) present: a late release (a finished
# fork parent) only comes with forks.
_PRESENT = tuple((a, b, c) for a in (False, True) for b in (False, True)
                 for c in (False, True) if b or not c)


class Pending:
  """What `Scheduler.resolve` needs of a dispatched step: the sample rows of
  the tokens it left `PENDING` (`(row, seq, token index)`) and its beam-search
  rows (`(row, seq)`; their group waits for them before its next step)."""

  __slots__ = ("records", "beam", "num_entries", "num_forks")

  def __init__(self, records, beam, num_entries: int, num_forks: int):
    self.records = records
    self.beam = beam
    self.num_entries = num_entries  # rows of `ok` that were real entries
    self.num_forks = num_forks  # rows of `fork_ok` that were real forks

  def live(self) -> bool:
    """Whether applying the results still changes a request (a token of an
    unfinished sequence, a beam step of a group not aborted)."""
    return (any(not t.done for _, t, _ in self.records)
            or any(not s.group.aborted for _, s in self.beam))


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
    # The host mirror of this pool's block state (on the host CPU): the same
    # pure bookkeeping the device runs, on the same inputs (see `_fit`).
    # (a local device: on several hosts each process keeps its own mirror).
    self._cpu = jax.sharding.SingleDeviceSharding(
        jax.local_devices(backend="cpu")[0])
    self._mirror = jax.device_put(initial_state, self._cpu)
    self._mirror_sig = compiler.signature(self._mirror)
    self._mirror_exes: dict = {}  # present -> compiled bookkeeping
    self.compile_seconds = 0.0  # mirror variants compiled on first use
    self._num_free = initial_state.num_blocks  # the mirror's, as an int
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
    # mirror: a block is indexed when this step registers it, dropped when
    # the mirror's reserve reports it evicted.
    caching = initial_state.prefix_caching
    self._index = (prefix_cache.PrefixIndex(config.block_size)
                   if caching else None)
    self._register_rows = register_rows(config) if caching else 0
    self._share_rows = config.max_batch if caching else 0
    self._register_next: list[tuple[Seq, int, int, bytes]] = []  # candidates
    self._registering: list[tuple[int, int, bytes, int]] = []  # this step's
    self._shares: dict[Seq, list[int]] = {}  # this step's hits (admissions)
    self._num_cached = 0  # the mirror's cached blocks, as an int
    self._fitted = None  # the bookkeeping inputs `_fit` accepted this step
    self._tables = np.asarray(initial_state.block_tables)  # the mirror's

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
    stops = p.stop_ids(self.model_config.eos_token_ids)
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
    used = self.config.num_blocks - self._num_free - self._num_cached
    return {"blocks_used": used, "blocks_cached": self._num_cached,
            "blocks_total": self.config.num_blocks,
            "running": len(self._running), "waiting": len(self._waiting)}

  @property
  def prefix_index(self) -> prefix_cache.PrefixIndex | None:
    """The prefix-cache index (None without prefix caching)."""
    return self._index

  def check_prefix_index(self):
    """Asserts that the index names exactly the mirror's cacheable blocks
    (tests: no entry points at a block that was evicted and reused)."""
    if self._index is not None:
      prefix_cache.check_consistent(self._index, jax.device_get(self._mirror))

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
    budget = c.max_tokens_per_step
    plan: list[tuple[Seq, int]] = []
    running = list(self._running)
    first = running[0] if running else None
    for i, seq in enumerate(running):
      # Leave one token of budget for each running sequence after this one.
      room = budget - (len(running) - 1 - i)
      n = min(len(seq.tokens) - seq.num_cached, room)
      if n > 0:
        plan.append((seq, n))
        budget -= n
    admitted: list[Seq] = []
    rows = len(self._running) + sum(g.unborn for g in {s.group for s in self._running})
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
      self._waiting.pop(0)
      seq.slot = self._free_slots.pop()
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
    same pure function the device runs, on the host mirror) and, while it
    refuses an entry, takes back the admissions from that entry on, or
    preempts the newest running sequence (the entry itself when nothing newer
    is left and it is not the oldest). Commits the mirror to the result.

    Raises:
      RuntimeError: if a fork is refused or the oldest sequence cannot grow
        alone (admission guarantees neither happens).
    """
    queued = len(self._register_next)
    while True:
      x = self._bookkeeping_inputs(plan, self.config.max_batch)
      forks = int(np.sum(x[3] >= 0))
      present = (bool(self._release_next), forks > 0, bool(self._release_late_next))
      state, fork_ok, res, cache_ok = self._run_mirror(x, present)
      # One transfer for everything the host reads of the trial.
      caching = self._index is not None
      ok, fork_ok, num_free, cache_ok, num_cached, evicted, tables = jax.device_get(
          (res.ok, fork_ok, state.num_free, cache_ok, state.num_cached,
           res.evicted, state.block_tables if caching else None))
      if not fork_ok[:forks].all():
        raise RuntimeError(f"a fork was refused: engine bookkeeping bug ({self.usage()})")
      if not cache_ok.all():
        raise RuntimeError("a prefix-cache registration or hit was refused: "
                           f"the index and the pool disagree (engine bug)")
      refused = np.flatnonzero(~ok[:len(plan)])
      if not refused.size:
        self._mirror, self._num_free = state, int(num_free)
        self._fitted = x  # `build_step` reuses them
        # A slot preempted here is released by this very step: blocks queued
        # for it now would be read from a table gone by the next step. (None
        # are: its blocks were collected in `_prepare_registrations`.)
        del self._register_next[queued:]
        if caching:
          self._tables = tables  # the mirror's block tables, on the host
          self._commit_prefix_cache(int(num_cached), evicted, admitted)
        return plan
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

  @staticmethod
  def _sample_lanes(s: Seq, n: int) -> range | list[int]:
    """Sample lanes that entry `(s, n)` samples after this step (none while a
    prefill chunk has not reached the last token)."""
    if s.num_cached + n != len(s.tokens):
      return []
    g = s.group
    return range(g.params.n) if (g.unborn and not g.is_beam) else [s.index]

  @classmethod
  def work(cls, plan) -> tuple[int, int]:
    """`(token rows, sequence rows)` that `plan` needs: its tokens, and the
    larger of its entries and its sample rows."""
    tokens = sum(n for _, n in plan)
    samples = sum(len(cls._sample_lanes(s, n)) for s, n in plan)
    return tokens, max(len(plan), samples)

  def _forks(self) -> list[Seq]:
    """Every pending child forks at the next step, planned or not (its parent
    may write its next token in that step)."""
    return [s for s in self._running if s.fork_from >= 0]

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
    from the mirror before this step (a full block's entry never changes)."""
    for seq in self._running:
      if seq.slot >= 0 and seq.fork_from < 0:
        self._collect_registrations(seq)
    queued, self._register_next = self._register_next, []
    self._registering = []
    if not queued:
      return
    tables = self._tables
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

  def _commit_prefix_cache(self, num_cached: int, evicted: np.ndarray,
                           admitted: list[Seq]):
    """After the mirror accepted a step: index this step's registered blocks,
    drop the evicted ones, count the hits."""
    st, bs = self.stats, self.config.block_size
    for _, _, h, block in self._registering:
      if not self._index.insert(h, block):
        raise RuntimeError("a registered block's hash was indexed already "
                           "(engine bug)")
    st.prefix_blocks_evicted += self._index.evict(evicted[evicted >= 0])
    st.prefix_blocks_registered += len(self._registering)
    self._num_cached = num_cached
    for seq in admitted:
      hit = len(self._shares.get(seq, ())) * bs
      st.prefix_tokens_saved += hit
      g = seq.group
      if not g.admitted:  # the hit rate counts prompts, at first admission
        g.admitted = True
        g.output.num_cached_tokens = hit
        st.prefix_queried_tokens += g.prompt_len
        st.prefix_hit_tokens += hit

  def _bookkeeping_inputs(self, plan, num_seqs: int) -> tuple[np.ndarray, ...]:
    """The arguments of `step.bookkeeping` for `plan` with `num_seqs` entry
    rows, in `step.BOOKKEEPING_FIELDS` order. Padding entries (-1, 0 tokens)
    change nothing, so every row count gives the same state."""
    c = self.config
    register_seqs = np.full(self._register_rows, -1, np.int32)
    register_cols = np.zeros(self._register_rows, np.int32)
    for i, (slot, col, _, _) in enumerate(self._registering):
      register_seqs[i], register_cols[i] = slot, col
    width = self._mirror.max_blocks_per_seq
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
    for j, (s, n) in enumerate(plan):
      seq_ids[j] = s.slot
      q_lens[j] = n
    return (register_seqs, register_cols, release_early, fork_parents,
            fork_children, release_late, share_seqs, share_blocks, share_counts,
            seq_ids, q_lens)

  def _build(self, plan, bucket: Bucket, book=None):
    """`(StepInputs, samples)` of `plan` in shape `bucket`; `samples` are the
    `(token row, seq, lane)` of each sample row. `book`: the bookkeeping
    inputs `_fit` accepted for `plan` (`max_batch` entry rows; cut to the
    bucket's here, the rows past the plan being padding), else built.
    Changes nothing."""
    num_tokens, S = bucket.num_tokens, bucket.num_seqs
    if book is None:
      book = self._bookkeeping_inputs(plan, S)
    else:
      book = book[:-2] + tuple(a[:S] for a in book[-2:])  # seq_ids, q_lens
    a = dict(zip(step_lib.BOOKKEEPING_FIELDS, book))
    a.update(
        tokens=np.zeros(num_tokens, np.int32),
        token_slots=np.full(num_tokens, -1, np.int32),
        sample_slots=np.full(S, -1, np.int32),
        sample_rows=np.zeros(S, np.int32), temperature=np.zeros(S, np.float32),
        top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
        seeds=np.zeros(S, np.int32), positions=np.zeros(S, np.int32),
        banned=np.full((S, sampling_lib.MAX_BANNED), -1, np.int32))
    row = 0
    for s, n in plan:
      chunk = s.tokens[s.num_cached:s.num_cached + n]
      a["tokens"][row:row + n] = chunk
      if chunk[-1] == PENDING:  # sampled by the step in flight: on the device
        if n != 1 or len(s.tokens) - s.num_cached != 1 or PENDING in chunk[:-1]:
          raise RuntimeError("a pending token outside a decode row (engine bug)")
        a["tokens"][row] = 0
        a["token_slots"][row] = s.slot
      row += n
    samples = []  # (sample row, seq, sample index)
    row = 0
    for s, n in plan:
      row += n
      for lane in self._sample_lanes(s, n):
        samples.append((row - 1, s, lane))
    for r, (tok_row, s, lane) in enumerate(samples):
      p = s.group.params
      a["sample_rows"][r] = tok_row
      a["temperature"][r] = 0.0 if p.beam_width > 1 else p.temperature
      a["top_k"][r] = p.top_k
      a["top_p"][r] = p.top_p
      a["seeds"][r] = p.seed + lane
      a["positions"][r] = len(s.tokens)
      if len(s.tokens) - s.group.prompt_len < p.min_tokens:  # EOS masked
        ban = sorted(s.group.eos)
        a["banned"][r, :len(ban)] = ban
    return StepInputs(**a), samples

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

  def mirror_jobs(self) -> dict:
    """The host mirror's bookkeeping variants to compile (`compiler.py`):
    every `present` combination the engine can produce (a late release only
    comes with forks)."""
    x = self._bookkeeping_inputs([], self.config.max_batch)
    return {self._mirror_key(present): self._mirror_lowerer(present, x)
            for present in _PRESENT}

  def _mirror_key(self, present):
    return ("mirror", self._mirror_sig, present)

  def _mirror_lowerer(self, present, x):
    specs = [compiler.spec(a, self._cpu) for a in x]
    return lambda: compiler.HostLowered(
        _trial.lower(self._mirror, *specs, present=present))

  def _run_mirror(self, x, present):
    exe = self._mirror_exes.get(present)
    if exe is None:
      done, seconds = compiler.compile_all(
          {self._mirror_key(present): self._mirror_lowerer(present, x)})
      self.compile_seconds += seconds
      exe = self._mirror_exes[present] = done[self._mirror_key(present)]
    return exe(self._mirror, *x)

  def set_mirror_executables(self, done: dict):
    for key, exe in done.items():
      if key[:2] == ("mirror", self._mirror_sig):
        self._mirror_exes[key[2]] = exe

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
    for s, n in plan:
      s.num_cached += n
      self.stats.computed_tokens += n
    records = []  # (sample row, target seq, token index)
    beam = []  # (sample row, seq)
    lanes_of: dict[int, list] = {}
    for r, (_, s, lane) in enumerate(samples):
      if s.group.is_beam:
        beam.append((r, s))
      else:
        lanes_of.setdefault(id(s), [s, []])[1].append((r, lane))
    finals = []
    for s, lanes in lanes_of.values():
      g = s.group
      targets = [s]
      if g.unborn:  # prompt done: the other samples fork from it next step
        for _, lane in lanes[1:]:
          child = Seq(g, lane, list(g.request.prompt))
          child.hashes = s.hashes[:len(child.tokens) // self.config.block_size]
          child.num_cached = s.num_cached
          child.fork_from = s.slot
          child.slot = self._free_slots.pop()
          self._insert(self._running, child)
          g.live.append(child)
          targets.append(child)
        g.unborn = 0
      for t, (r, _) in zip(targets, lanes):
        t.tokens.append(PENDING)
        x.sample_slots[r] = t.slot
        records.append((r, t, len(t.tokens) - 1))
        if len(t.generated) >= g.params.max_new_tokens:
          t.final = True
          finals.append(t)
    for t in finals:  # after every child exists (a parent may retire late)
      self._retire(t)
    return Pending(records, beam, len(plan), len(forks))

  def resolve(self, pending: "Pending", out: StepOutputs, now: float):
    """Applies a step's results: the pending tokens' values, EOS, streaming
    deltas, latency, beam search."""
    self._now = now
    # The device ran the same bookkeeping on the same state as the host
    # mirror (`_fit`): it grants exactly what the mirror granted.
    if not (out.ok[:pending.num_entries].all()
            and out.fork_ok[:pending.num_forks].all()):
      raise RuntimeError("the device refused what the host mirror granted: "
                         "the block states diverged (engine bug)")
    for r, t, idx in pending.records:
      if t.done:  # stopped by an EOS the step before; this token is void
        continue
      tok = int(out.tokens[r])
      t.tokens[idx] = tok
      t.token_logprobs.append(float(out.token_logprobs[r]))
      self._first_token(t.group)
      self._on_token(t, tok, idx)
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

  def _on_token(self, seq: Seq, tok: int, idx: int):
    """A sampled (non-beam) token arrived: latency, the stream, finishing."""
    g = seq.group
    if seq.last_token_time is not None:
      self.stats.itl.add(self._now - seq.last_token_time)
    seq.last_token_time = self._now
    reason = None
    if tok in g.eos:
      reason = "stop"
    elif seq.final and idx == len(seq.tokens) - 1:
      reason = "length"
    if self.collect_deltas:
      self._deltas.append(RequestDelta(g.request.request_id, seq.index, [tok],
                                       reason, logprobs=[seq.token_logprobs[-1]]))
    if reason is None:
      return
    del seq.tokens[idx + 1:]  # a token sampled after the EOS is void
    self._finish_seq(seq, reason)

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
      child.logprob = lp
      child.slot = self._free_slots.pop()
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
