"""The prefix cache's host side: chained block hashes, admission lookups, and
the blocks each step registers, kept in step with the pool model (an entry
is inserted when a step registers its block, dropped when the model's
reserve reports it evicted). A mixin of `scheduler.Scheduler`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from paged_jax import block_manager as bm
from paged_jax import prefix_cache
from paged_jax.serving.requests import PENDING, Seq
from paged_jax.serving.window_pool import PooledHost


_NONE_EVICTED = np.zeros((0,), np.int32)  # a step that evicts nothing
_NONE_EVICTED.flags.writeable = False


class Candidate(NamedTuple):
  """A full, computed block queued for registration (`_register_next`)."""

  seq: Seq
  slot: int  # the slot it was queued from (the block-table row)
  col: int  # its block-table column
  hash: bytes


class Registration(NamedTuple):
  """A block this step registers (`_registering`)."""

  slot: int
  col: int
  hash: bytes
  block: int  # the physical block


def register_rows(config) -> int:
  """Blocks a step can register for the prefix cache (`StepInputs.register_*`
  rows): a step completes at most `max_tokens_per_step // block_size` blocks
  of prefill plus one block per decoding sequence; what does not fit waits a
  step (a block released before it is registered is simply not cached)."""
  return config.max_tokens_per_step // config.block_size + config.max_batch


def _order(seq: Seq) -> tuple[int, int]:
  return seq.order


def registration_due(config) -> list | None:
  """The scheduler's list of sequences that may have a full block to
  register (those that completed one in a step, forked, or could not register
  all theirs yet: `Results._commit` and `_prepare_registrations` append), so
  a step registers without looking at every running row; None where
  sequences also grow elsewhere (multi-step decode, speculative decoding:
  every running row is looked at)."""
  if config.num_scheduler_steps > 1 or config.speculative_config is not None:
    return None
  return []


class PrefixCaching:
  """`Scheduler`'s prefix-cache bookkeeping (see the module docstring)."""

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
    hashes = seq.hashes[:limit]
    if getattr(self._pool, "window", None) is not None:  # one windowed pool
      blocks = self._window_hit(hashes)
    else:
      blocks = self._index.lookup(hashes)
      # Blocks this very step registers (computed by an earlier step, not in
      # the index until the step is accepted) are hits too: `share` runs after
      # `register` in the step's bookkeeping.
      same_step = self._registering_by_hash
      while len(blocks) < len(hashes) and hashes[len(blocks)] in same_step:
        blocks.append(same_step[hashes[len(blocks)]])
    blocks = self._extend_hit(seq, hashes, blocks)  # the host level's, if any
    if isinstance(self._pool, PooledHost):  # what every window's pool holds
      blocks = self._pool.usable_hit(blocks, self._registering)
    if blocks:
      self._shares[seq] = blocks
      seq.num_cached = len(blocks) * bs
      seq.num_registered = len(blocks)

  def _window_hit(self, hashes: list) -> list[int]:
    """The hit of `hashes` in a pool whose every layer has one sliding window
    (`window_reclaim.share`): the longest `n` whose columns `c(n) .. n - 1`
    (`c` = `block_manager.reclaimable_columns(window, n * block_size)`, what
    the next query sees) are all indexed or registered by this step; the
    columns before `c(n)` need not be cached (-1 in the list: they are never
    read). [] if none."""
    bs, window = self.config.block_size, self._pool.window
    same_step = self._registering_by_hash
    index = self._index
    found = []
    for h in hashes:
      b = index.block_of(h)
      found.append(same_step.get(h, -1) if b is None else b)
    best, run = 0, 0
    for j, b in enumerate(found):  # run: indexed columns ending at j
      run = run + 1 if b >= 0 else 0
      n = j + 1
      if run and run >= n - bm.reclaimable_columns(window, n * bs, bs):
        best = n
    if not best:
      return []
    skip = bm.reclaimable_columns(window, best * bs, bs)
    return [-1] * skip + found[skip:best]

  def _collect_registrations(self, seq: Seq):
    """Queues `seq`'s full, computed blocks not registered yet (`Candidate`s)
    for the next step's bookkeeping."""
    full = seq.num_cached // self.config.block_size
    self._extend_hashes(seq, full)
    for col in range(seq.num_registered, min(full, len(seq.hashes))):
      self._register_next.append(Candidate(seq, seq.slot, col, seq.hashes[col]))
      seq.num_registered = col + 1

  def _prepare_registrations(self):
    """Decides which queued blocks this step registers: one block per hash
    (a block whose hash is indexed already, or repeated in this step, stays
    unregistered and is emptied when released), at most `register_rows`; the
    rest of a live sequence waits for the next step. Reads the physical blocks
    from the host model before this step (a full block's entry never
    changes)."""
    bs = self.config.block_size
    due = self._register_due
    if due is None:  # every running row
      due = self._running
    elif due:  # in the running order (the first of equal blocks registers)
      due, self._register_due = sorted(set(due), key=_order), []
    for seq in due:  # only those with a newly full block
      if (seq.num_cached // bs > seq.num_registered and seq.slot >= 0
          and seq.fork_from < 0):
        self._collect_registrations(seq)
        if (self._register_due is not None
            and seq.num_cached // bs > seq.num_registered):
          self._register_due.append(seq)  # a token still in flight: next step
    queued, self._register_next = self._register_next, []
    self._registering = []
    self._registering_by_hash = {}
    if not queued:
      return
    tables = self._pool.tables  # before this step: a full block's entry stays
    taken: set[bytes] = set()
    for seq, slot, col, h in queued:
      if len(self._registering) == self._register_rows:
        if seq.slot == slot:  # still live there: again next step
          seq.num_registered = min(seq.num_registered, col)
          if self._register_due is not None:
            self._register_due.append(seq)
        continue
      block = int(tables[slot, col])
      if h in self._index or h in taken or block < 0:  # (< 0: slid out of a
        continue  # window before its turn came, emptied uncached)
      taken.add(h)
      self._registering.append(Registration(slot, col, h, block))
      self._registering_by_hash[h] = block

  def _commit_prefix_cache(self, evicted: np.ndarray, admitted: list[Seq]):
    """After the model accepted a step: index this step's registered blocks,
    drop the evicted ones, count the hits."""
    st, bs = self.stats, self.config.block_size
    for r in self._registering:
      if not self._index.insert(r.hash, r.block):
        raise RuntimeError("a registered block's hash was indexed already "
                           "(engine bug)")
    # (most steps evict nothing: one reduction, not a filtered copy)
    evicted = (evicted[evicted >= 0] if evicted.size and int(evicted.max()) >= 0
               else _NONE_EVICTED)
    if self._host_prefix is not None:  # before the index forgets `evicted`
      st.prefix_blocks_evicted += self._commit_offload(evicted, admitted)
    if evicted.size:
      st.prefix_blocks_evicted += self._index.evict(evicted)
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
