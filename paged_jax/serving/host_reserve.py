"""`HostPool.reserve`: `block_manager.reserve` on the host model, with its
steady decode fast path and the shared read-only results.

A mixin of `host_pool.HostPool` (it reads and writes the pool's arrays,
`lens`, `tables`, `refs`, `stack`, the cached-block ring, through
`HostPool._set` so that a trial can be rolled back), kept in its own file
by concern:

* **`reserve`** finds the scheduler's layout (`k` distinct valid entries,
  then padding) or filters any inputs, then grants every entry at once when
  the pool holds them all and nothing is copied, or runs
  `block_manager.reserve`'s in-order scan over the entries that take or copy
  a block (`_reserve`), evicting cached blocks last (`_evict`).
* **The steady decode fast path** (`SteadyDecode`): after granting one token
  to each of the same read-only `seq_ids`, the pool notes which entries
  cross a block boundary at which later step (their lengths grow by one a
  step); such steps add 1 to each length and give the crossing entries the
  free stack's top blocks, with no scan of the entries (`_steady_step`).
* **Shared read-only results** (`_granted`, `_no_copies`, `_no_forks`,
  `_no_evictions`): what most steps return, made once per shape, so such a
  step allocates and fills no array.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax import block_manager as bm

NULL = bm.NULL_BLOCK

@dataclasses.dataclass
class SteadyDecode:
  """What `HostPool.reserve` knows of the scheduler's steady decode rows:
  the same `k` slots, first in every call, each reserving one token a step
  (`bookkeeping`'s `decode` promise). Each such reservation adds 1 to their
  lengths, and an entry whose last block is full takes the next block off
  the free stack (no entry's last block is shared, so none copies). Which
  entries those are is known in advance: entry `i` crosses a block boundary
  at the steps `j` (counted from 0 when this was made) with
  `j % block_size == phase[i]`, `phase` = tokens left in its last block.
  The other entries of a call (admissions, prompts) take the general path
  after them. Forgotten when anything else changes one of the slots' lengths
  (`HostPool._set`), at a fork, or a rollback; a step that would evict a
  cached block or outgrow a sequence for them leaves it to the general path.

  Attributes:
    slots: i32[k], the slots (a copy).
    mask: bool[max_seqs], True on `slots` (`HostPool._set` reads it).
    order: i64[k], the entries by `phase`, ascending (entry order within a
      phase).
    bounds: `order[bounds[p]:bounds[p + 1]]` are the entries of phase `p`
      (a list of `block_size + 1` ints).
    seq_ids, num_new: the read-only arrays it was made from, or None: a call
      with these very arrays is all steady rows (no comparison needed).
    step: the steps reserved since it was made.
  """

  slots: np.ndarray
  mask: np.ndarray
  order: np.ndarray
  bounds: list
  seq_ids: np.ndarray | None = None
  num_new: np.ndarray | None = None
  step: int = 0

  @property
  def k(self) -> int:
    return self.slots.shape[0]


@dataclasses.dataclass
class HostReservation:
  """`block_manager.Reservation` on the host (NumPy)."""

  ok: np.ndarray  # bool[n]
  copy_src: np.ndarray  # i32[n]
  copy_dst: np.ndarray  # i32[n]
  evicted: np.ndarray | None  # i32[n, width], None without prefix caching


def _first_occurrence(ids: np.ndarray) -> np.ndarray:
  """bool[n]: True where `ids[i]` is not in `ids[:i]`."""
  out = np.zeros(ids.shape, bool)
  if ids.size:
    _, first = np.unique(ids, return_index=True)
    out[first] = True
  return out



class Reserving:
  """`reserve` and its read-only results, for `host_pool.HostPool` (see the
  module docstring). Expects the pool's attributes (`lens`, `tables`,
  `refs`, `stack`, `num_free`, `num_cached`, `block_size`, `max_seqs`,
  `max_seq_len`, `width`, `num_blocks`, `window`, `caching`, the ring's
  `lru*`, `_journal`, `_arange`, `_mark`, `_steady`, the `_null_*` caches)
  and its `_set`, `_add_refs` and `num_available`."""

  def reserve(self, seq_ids, num_new, leading: int | None = None,
              decode: int = 0) -> HostReservation:
    """`block_manager.reserve`. `leading`: the caller's promise that the
    first `leading` entries are distinct valid slots with sizes >= 0 and the
    rest padding (-1), the scheduler's layout (see `bookkeeping`'s
    `packed`); None: found out here. `decode`: with `leading`, the caller's
    promise that the first `decode` of them reserve one token each (its
    steady decode rows: `SteadyDecode`)."""
    seq_ids, num_new = np.asarray(seq_ids), np.asarray(num_new)
    n, ms = seq_ids.shape[0], self.max_seqs
    null = self._no_copies(n)
    res = HostReservation(
        ok=None, copy_src=null, copy_dst=null,
        evicted=self._no_evictions(n) if self.caching else None)
    steady, first = self._steady, 0
    if steady is not None and leading is not None and leading >= steady.k and (
        (seq_ids is steady.seq_ids and num_new is steady.num_new)
        or (decode >= steady.k
            and np.array_equal(seq_ids[:steady.k], steady.slots))):
      if self._steady_step(steady):  # its rows granted; the others follow
        first = steady.k
      else:  # (an eviction or a full sequence: the general path)
        self._steady = None
    k = self._leading_unique(seq_ids, num_new) if leading is None else leading
    if k is not None:  # the scheduler's layout: k valid entries, then padding
      real = self._arange[first:k]
      s, q = seq_ids[first:k], num_new[first:k]
      if seq_ids.flags.writeable:  # (`s` is journaled: a copy)
        s = s.copy()
    else:
      real = np.flatnonzero((seq_ids >= 0) & (seq_ids < ms) & (num_new >= 0))
      if real.size:
        real = real[_first_occurrence(seq_ids)[real]]
      s, q = seq_ids[real], num_new[real]
    if leading is None:  # any sizes: no overflow in `lens + q`
      q = q.astype(np.int64)
    if real.size == 1 and leading is not None and self._reserve_one(
        int(s[0]), int(q[0])):  # (one admission or prompt chunk: scalar reads)
      ok = None
    else:
      ok = self._reserve(real, s, q, res) if real.size else None
    if ok is None and k is not None:  # the first k granted, the rest padding
      res.ok = self._granted(n, k)
      if leading is not None and decode > first:  # (new) steady rows to note
        self._steady = self._steady_after(seq_ids, num_new, min(decode, k))
    else:
      res.ok = np.zeros(n, bool)
      res.ok[:first] = True
      res.ok[real] = True if ok is None else ok
    if self.caching and self.num_cached == 0:
      self.lru_len = 0
    return res

  def _steady_after(self, seq_ids, num_new, d: int) -> SteadyDecode | None:
    """The `SteadyDecode` of the first `d` entries of `seq_ids` (distinct
    slots), each just granted one token; None where it does not apply (a
    window with prefix caching, whose reclamation keeps blocks cached; or a
    last block shared: it would be copied). A window without caching
    applies: reclamation (`window_reclaim.reclaim_host`) changes no length
    and pushes what it frees on the free stack, whose top the next step
    takes, as the device's `reserve` does."""
    if self.window is not None and self.caching:
      return None
    bs = self.block_size
    slots = seq_ids[:d].copy()
    lens = self.lens[slots]
    if int(self.refs.max(initial=0)) > 1:  # a shared last block copies
      last = self.tables[slots, (lens - 1) // bs]
      if (self.refs[last] > 1).any():
        return None
    phase = (-lens) % bs  # tokens left in the last block
    order = np.argsort(phase, kind="stable")
    bounds = np.searchsorted(phase[order], np.arange(bs + 1)).tolist()
    mask = np.zeros(self.max_seqs, bool)
    mask[slots] = True
    whole = d == seq_ids.shape[0] or seq_ids[d] < 0  # (all the call's entries)
    if whole and not (seq_ids.flags.writeable or num_new.flags.writeable):
      return SteadyDecode(slots, mask, order, bounds, seq_ids, num_new)
    return SteadyDecode(slots, mask, order, bounds)

  def _steady_step(self, steady: SteadyDecode) -> bool:
    """Reserves one more token for each of `steady`'s slots, a new block
    (the free stack's top, in entry order) for each one whose last block is
    full. Returns False, changing nothing, when those need more than the
    free stack or a sequence is full (the general path evicts or refuses)."""
    bs, s = self.block_size, steady.slots
    p = steady.step % bs
    lo, hi = steady.bounds[p], steady.bounds[p + 1]
    if lo < hi:  # entries whose last block is full: one block each
      c = hi - lo
      rows = s[steady.order[lo:hi]]  # (in entry order: the stack's order)
      cols = self.lens[rows] // bs
      if c > self.num_free or int(cols.max()) >= self.width:
        return False
      ids = self.stack[self.num_free - c:self.num_free][::-1].copy()
      self._set(self.refs, ids, self.refs[ids] + 1)
      self._set(self.tables, (rows, cols), ids)
      if self.caching:
        self._set(self.cacheable, ids, False)
      self.num_free -= c
    old = self.lens[s]
    if self._journal is not None:
      self._journal.append((self.lens, s, old))
    self.lens[s] = old + 1  # (not `_set`: it would forget `steady`)
    steady.step += 1
    return True

  def _reserve_one(self, slot: int, q: int) -> bool:
    """`_reserve` of a single valid entry (`slot`, `q >= 0` tokens) by scalar
    reads, when it copies nothing, fits its sequence and the free stack
    holds its blocks (then it is granted): True. False, changing nothing,
    otherwise (the general path copies, evicts or refuses)."""
    bs = self.block_size
    old = int(self.lens[slot])
    new = old + q
    if new > self.max_seq_len:
      return False
    cur = -(-old // bs)
    grow = -(-new // bs) - cur
    if q and old % bs and self.refs[self.tables[slot, cur - 1]] > 1:
      return False  # its partial last block is shared: copy-on-write
    if grow > self.num_free:
      return False
    if grow:
      ids = self.stack[self.num_free - grow:self.num_free][::-1].copy()
      self._set(self.refs, ids, self.refs[ids] + 1)
      self._set(self.tables, (slot, self._arange_width[cur:cur + grow]), ids)
      if self.caching:
        self._set(self.cacheable, ids, False)
      self.num_free -= grow
    if q:
      self._set(self.lens, slot, new)
    return True

  def _granted(self, n: int, k: int) -> np.ndarray:
    """A read-only `bool[n]`, True on the first `k` entries, made once per
    `(n, k)`: the `ok` of a reservation that grants every one of `k` leading
    entries (most of them)."""
    out = self._null_forks.get((n, k))
    if out is None:
      out = np.zeros(n, bool)
      out[:k] = True
      out.flags.writeable = False
      self._null_forks[n, k] = out
    return out

  def _leading_unique(self, seq_ids, num_new) -> int | None:
    """`k` when the first `k` entries are distinct valid slots with sizes
    >= 0 and the rest are padding (-1): the layout the scheduler sends, which
    then skips the general filtering (a few whole-array operations, no sort).
    None otherwise."""
    n = seq_ids.shape[0]
    if n > self._arange.shape[0] or not n:
      return None
    k = int(np.count_nonzero(seq_ids >= 0))
    if k == 0 or (k < n and seq_ids[k:].max() >= 0):
      return None
    s = seq_ids[:k]
    if int(s.max()) >= self.max_seqs or int(num_new[:k].min()) < 0:
      return None
    mark, ar = self._mark, self._arange[:k]
    mark[s] = ar
    if (mark[s] != ar).any():  # a repeated slot
      return None
    return k

  def _reserve(self, real, s, q, res: HostReservation) -> np.ndarray | None:
    """The granted reservations of the valid, distinct entries `real` (slots
    `s`, sizes `q`, i64), in place; fills `res` but its `ok` (its shared
    read-only defaults are copied before a write). Returns `ok` of the
    entries, None when every one is granted."""
    bs = self.block_size
    old = self.lens[s]
    new_len = old + q
    all_valid = int(new_len.max()) <= self.max_seq_len  # every size fits a sequence
    if not all_valid:
      valid = q <= self.max_seq_len - old
      new_len = old + np.where(valid, q, 0)
    cur = (old + (bs - 1)) // bs
    grow = (new_len + (bs - 1)) // bs - cur
    avail = self.num_available
    # Copy-on-write candidates: a partial last block that someone else holds
    # (none while no block is shared).
    shared = int(self.refs.max(initial=0)) > 1
    if shared:
      last = self.tables[s, np.maximum(cur - 1, 0)]
      cow_cand = (q > 0) & (old % bs != 0) & (self.refs[last] > 1)
      if not all_valid:
        cow_cand &= valid
    if all_valid and not (shared and cow_cand.any()) and int(grow.sum()) <= avail:
      ok, cow, need = None, None, grow  # every entry granted, no copy
    else:  # the in-order scan, over the entries that take or copy a block
      if not shared:
        last = self.tables[s, np.maximum(cur - 1, 0)]
        cow_cand = np.zeros(s.shape, bool)
      if all_valid:
        valid = np.ones(s.shape, bool)
      ok = valid.copy()
      cow = np.zeros(s.shape, bool)
      need = np.zeros(s.shape, np.int64)
      last_refs = self.refs[np.clip(last, 0, self.num_blocks - 1)]
      copied: dict[int, int] = {}
      for i in np.flatnonzero(valid & ((grow > 0) | cow_cand)).tolist():
        c = bool(cow_cand[i]) and last_refs[i] - copied.get(int(last[i]), 0) > 1
        k = int(grow[i]) + c
        if k <= avail:
          avail -= k
          need[i], cow[i] = k, c
          if c:
            copied[int(last[i])] = copied.get(int(last[i]), 0) + 1
        else:
          ok[i] = False
      if not cow.any():
        cow = None
    take = need.nonzero()[0]
    if take.size:
      k = need[take]
      total = int(k.sum())
      # Blocks in request order: the top of the free stack, then evictions.
      from_stack = min(total, self.num_free)
      ids = self.stack[self.num_free - from_stack:self.num_free][::-1].copy()
      evicted = self._evict(total - from_stack) if total > from_stack else None
      new_ids = ids if evicted is None else np.concatenate([ids, evicted])
      first = cur[take] if cow is None else cur[take] - cow[take]
      if total == take.size:  # one block each (a decode step's usual case)
        owner, cols = take, first
      else:
        owner = np.repeat(take, k)
        cols = np.repeat(first, k) + (np.arange(total) - np.repeat(np.cumsum(k) - k, k))
      self._set(self.refs, new_ids, self.refs[new_ids] + 1)
      self._set(self.tables, (s[owner], cols), new_ids)
      if self.caching:
        self._set(self.cacheable, new_ids, False)
        if evicted is not None:
          self._set(self.lru_pos, evicted, -1)
          res.evicted = res.evicted.copy()  # the shared all-NULL one: a copy
          res.evicted[real[owner[from_stack:]], cols[from_stack:]] = evicted
          self.num_cached -= int(evicted.size)
      self.num_free -= from_stack
      if cow is not None:
        c = np.flatnonzero(cow)
        self._add_refs(last[c], -1)
        start = np.cumsum(need) - need
        res.copy_src = res.copy_src.copy()
        res.copy_dst = res.copy_dst.copy()
        res.copy_src[real[c]] = last[c]
        res.copy_dst[real[c]] = new_ids[start[c]]
    if ok is None:  # every entry granted
      self._set(self.lens, s, new_len, old)
      return None
    grown = np.flatnonzero(ok & (new_len != old))
    if grown.size:
      self._set(self.lens, s[grown], new_len[grown])
    return ok

  def _no_copies(self, n: int) -> np.ndarray:
    """A read-only all-`NULL` `i32[n]`, made once per `n`: the `copy_src`
    and `copy_dst` of a reservation that copies nothing."""
    out = self._null_copies.get(n)
    if out is None:
      out = np.full(n, NULL, np.int32)
      out.flags.writeable = False
      self._null_copies[n] = out
    return out

  def _no_forks(self, n: int) -> np.ndarray:
    """A read-only all-False `bool[n]`, made once per `n`: the `fork_ok` of
    a step that forks nothing."""
    out = self._null_forks.get(n)
    if out is None:
      out = np.zeros(n, bool)
      out.flags.writeable = False
      self._null_forks[n] = out
    return out

  def _no_evictions(self, n: int) -> np.ndarray:
    """A read-only all-`NULL` `i32[n, width]`, made once per `n`: the
    `evicted` of a reservation that evicts nothing (most of them), so such a
    call allocates and fills no `[n, width]` array."""
    cache = self._null_evicted
    out = cache.get(n)
    if out is None:
      out = np.full((n, self.width), NULL, np.int32)
      out.flags.writeable = False
      cache[n] = out
    return out

  def _evict(self, count: int) -> np.ndarray:
    """Pops the `count` least recently released cached blocks (`_evict`)."""
    size = self.lru.shape[0]
    out = []
    head, length = self.lru_head, self.lru_len
    while len(out) < count:
      b = int(self.lru[head])
      head = (head + 1) % size
      length -= 1
      if b >= 0:
        out.append(b)
    self.lru_head, self.lru_len = head, length
    return np.array(out, np.int32)
