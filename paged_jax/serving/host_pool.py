"""An exact NumPy model of one pool's `BlockState`, for the scheduler.

The scheduler must know, before it dispatches a step, what the step's block
bookkeeping (`step.bookkeeping`: register -> release -> fork -> release ->
share -> reserve, run by the device inside the jitted step) will grant. Until
#21 it ran that very function, jitted, on a copy of the state on the host
CPU device, and read the answer back with a blocking `jax.device_get`. On the
CPU backend that small program queues behind the step running on the same
device, so planning step N+1 waited for step N to end; on an accelerator it
still cost a dispatch and a fetch per step.

`HostPool` computes the same transitions in NumPy, in place, on the host:

* **Exact.** Every array of the `BlockState` is modelled, the free stack's
  and the cached-block ring's slots included, with the same rules in the same
  order (`block_manager.reserve`'s in-order scan, `release`'s stack pushes in
  block order and ring appends in release order, `_compact_if_full`,
  `share`'s tombstones, `lru_len` reset when nothing is cached). So
  `to_state()` equals the device's state array for array, and the block ids
  the scheduler hands the device (prefix-cache hits, registrations) are the
  device's. `tests/paged_jax/serving/test_host_pool.py` proves it against
  `block_manager` with a hypothesis state machine; the engine checks a
  fingerprint of the device's state against the model's at every resolve.
* **Proportional to what changed.** Each operation first drops padding rows
  (-1), then touches only the listed sequences' rows and the blocks they own
  or take. Reservations that cross no block boundary cost no Python at all;
  the in-order scan runs in Python only over the entries that take a block
  or copy one, and only when the pool cannot serve every request at once or
  a copy-on-write is possible.
* **Transactional.** `begin()` opens a trial; `rollback()` undoes it (the
  scheduler's `_fit` retries after taking back an admission), `commit()`
  keeps it. The undo journal holds only the entries written.

`block_manager` stays the allocator: the device runs it in every step, and
this model is judged against it. `reserve`, its steady decode fast path and
the shared read-only results live in `host_reserve.py` (a mixin).
"""

from __future__ import annotations

import numpy as np

from paged_jax import block_manager as bm
from paged_jax import window_reclaim
from paged_jax.serving.host_reserve import (  # pylint: disable=unused-import
    HostReservation, Reserving, SteadyDecode, _first_occurrence)

NULL = bm.NULL_BLOCK
_MASK = 0xFFFFFFFF
_NO_CACHE_OK = np.ones((0,), bool)  # `cache_ok` without prefix caching
_NO_CACHE_OK.flags.writeable = False


def _any_real(ids) -> bool:
  """Whether `ids` names anything (an id >= 0): a call of all padding (-1)
  changes nothing and is skipped."""
  ids = np.asarray(ids)
  return bool(ids.size) and int(ids.max()) >= 0


def _leads(ids: np.ndarray) -> bool:
  """`_any_real` for an argument that lists its entries first (then
  padding): its first entry tells."""
  return bool(ids.shape[0]) and ids[0] >= 0


def _cdiv(a, b):
  return -(-a // b)


def _delta(arr: np.ndarray, idx, old, weights: np.ndarray) -> int:
  """`sum(weights[idx] * (arr[idx] - old))` as an int (`HostPool._set`)."""
  return int(np.vdot(np.subtract(arr[idx], old, dtype=np.int64), weights[idx]))


def fingerprint_weights(n: int) -> np.ndarray:
  """u32[n] weights of the fingerprint sums (odd, distinct)."""
  return (2 * np.arange(n, dtype=np.uint64) + 1).astype(np.uint32)


class HostPool(Reserving):
  """The exact NumPy model of one pool (see the module docstring);
  `reserve` and its read-only results are `host_reserve.Reserving`'s.

  Args:
    state: the pool's initial `BlockState` (one shard, not stacked).
  """

  def __init__(self, state: bm.BlockState):
    self.block_size = state.block_size
    self.window = state.window  # sliding-window reclamation (`window_reclaim`)
    self.caching = state.prefix_caching
    self.tables = np.array(state.block_tables, np.int32)
    self.lens = np.array(state.seq_lens, np.int32)
    self.refs = np.array(state.refcounts, np.int32)
    self.stack = np.array(state.free_stack, np.int32)
    self.num_free = int(state.num_free)
    self.num_blocks = self.refs.shape[0]
    self.max_seqs, self.width = self.tables.shape
    self.max_seq_len = self.width * self.block_size
    if self.caching:
      self.cacheable = np.array(state.cacheable, bool)
      self.lru = np.array(state.lru, np.int32)
      self.lru_pos = np.array(state.lru_pos, np.int32)
      self.lru_head = int(state.lru_head)
      self.lru_len = int(state.lru_len)
      self.num_cached = int(state.num_cached)
    else:
      self.num_cached = 0
    # Running fingerprint sums (mod 2**32): see `fingerprint`.
    self._w_blocks = fingerprint_weights(self.num_blocks).astype(np.int64)
    self._w_seqs = fingerprint_weights(self.max_seqs).astype(np.int64)
    self._w_cells = fingerprint_weights(self.max_seqs * self.width).astype(
        np.int64).reshape(self.max_seqs, self.width)
    self._sum_tables = int(np.sum((self.tables.astype(np.int64) + 1)
                                  * self._w_cells)) & _MASK
    self._journal: list | None = None
    self._saved: tuple | None = None
    self._arange = np.arange(self.max_seqs)  # scratch for `_leading_unique`
    self._arange_width = np.arange(self.width)
    self._mark = np.zeros(self.max_seqs, np.int64)
    self._null_evicted: dict[int, np.ndarray] = {}  # `_no_evictions`
    self._null_copies: dict[int, np.ndarray] = {}  # `_no_copies`
    self._null_forks: dict[int, np.ndarray] = {}  # `_no_forks`
    self._steady: SteadyDecode | None = None  # see `_steady_step`

  # ------------------------------------------------------------ transactions

  _SCALARS = ("num_free", "num_cached", "lru_head", "lru_len", "_sum_tables")

  def begin(self):
    """Opens a trial: changes from here on can be undone (`rollback`)."""
    self._journal = []
    self._saved = tuple(getattr(self, k, None) for k in self._SCALARS)

  def commit(self):
    self._journal, self._saved = None, None

  def rollback(self):
    """Undoes every change since `begin()`."""
    self._steady = None
    for arr, idx, old in reversed(self._journal):
      arr[idx] = old
    for k, v in zip(self._SCALARS, self._saved):
      if v is not None:
        setattr(self, k, v)
    self._journal, self._saved = None, None

  def _set(self, arr: np.ndarray, idx, vals, old=None):
    """`arr[idx] = vals`, journaled (and the block tables' fingerprint sum
    kept). `idx` names each entry of the tables once (no repeats); `old`:
    `arr[idx]` when the caller has it (a copy)."""
    if arr is self.lens and self._steady is not None and (
        self._steady.mask[idx].any()):  # (every change of a slot's blocks
      self._steady = None  # changes its length)
    if old is None:
      old = arr[idx]
      if isinstance(idx, slice):  # a view: keep the old values
        old = old.copy()
    if self._journal is not None:
      self._journal.append((arr, idx, old))
    arr[idx] = vals
    if arr is self.tables:
      self._sum_tables = (self._sum_tables + _delta(arr, idx, old, self._w_cells)) & _MASK

  def _add_refs(self, blocks: np.ndarray, delta: int):
    """`refs[blocks] += delta` per occurrence (blocks may repeat)."""
    if blocks.size == 0:
      return
    ids, counts = np.unique(blocks, return_counts=True)
    self._set(self.refs, ids, self.refs[ids] + delta * counts.astype(np.int32))

  # -------------------------------------------------------------- reading

  @property
  def num_available(self) -> int:
    return self.num_free + self.num_cached

  def fingerprint(self) -> np.ndarray:
    """u32[5]: `(num_free, num_cached, sum w*seq_lens, sum w*refcounts,
    sum w*(block_tables + 1))` mod 2**32, with `fingerprint_weights`; the
    device computes the same of its state (`step.state_fingerprint`). The
    first two sums are taken here (two dot products), the tables' is kept
    as they change (`_set`: they are large)."""
    lens = int(np.dot(self.lens, self._w_seqs)) & _MASK
    refs = int(np.dot(self.refs, self._w_blocks)) & _MASK
    return np.array([self.num_free & _MASK, self.num_cached & _MASK, lens, refs,
                     self._sum_tables], np.uint32)

  def to_state(self) -> bm.BlockState:
    """The modelled `BlockState`, as NumPy arrays (copies)."""
    cache = dict.fromkeys(("cacheable", "lru", "lru_pos", "lru_head",
                           "lru_len", "num_cached"))
    if self.caching:
      cache = dict(cacheable=self.cacheable.copy(), lru=self.lru.copy(),
                   lru_pos=self.lru_pos.copy(),
                   lru_head=np.int32(self.lru_head),
                   lru_len=np.int32(self.lru_len),
                   num_cached=np.int32(self.num_cached))
    return bm.BlockState(block_tables=self.tables.copy(), seq_lens=self.lens.copy(),
                         refcounts=self.refs.copy(), free_stack=self.stack.copy(),
                         num_free=np.int32(self.num_free),
                         block_size=self.block_size, window=self.window, **cache)

  # ------------------------------------------------------------ operations

  def _owned(self, sid: np.ndarray):
    """`(rows [k], cols [k])` of the blocks the slots `sid` own, slot by slot
    in order and each slot's blocks first to last."""
    nb = _cdiv(self.lens[sid].astype(np.int64), self.block_size)
    rows = np.repeat(np.arange(sid.shape[0]), nb)
    start = np.cumsum(nb) - nb
    cols = np.arange(rows.shape[0]) - np.repeat(start, nb)
    return rows, cols

  def register(self, seq_ids, cols, *, leading: bool = False) -> np.ndarray:
    """`block_manager.register`. `leading`: the caller's promise that the
    entries come first, then padding (-1): the few entries of a step (most
    register one or two blocks) are then checked in Python, not with a dozen
    whole-array operations."""
    seq_ids, cols = np.asarray(seq_ids), np.asarray(cols)
    if leading:
      k = int(np.count_nonzero(seq_ids >= 0))
      ms, bs, lens = self.max_seqs, self.block_size, self.lens
      ok = np.zeros(seq_ids.shape, bool)
      ok[:k] = good = [s < ms and 0 <= c < lens[s] // bs for s, c in
                       zip(seq_ids[:k].tolist(), cols[:k].tolist())]
      s, c = seq_ids[:k], cols[:k]
      if not all(good):
        s, c = s[ok[:k]], c[ok[:k]]
      if s.size:
        self._set(self.cacheable, self.tables[s, c], True)
      return ok
    ok = np.zeros(seq_ids.shape, bool)
    real = np.flatnonzero(seq_ids >= 0)
    if not real.size:
      return ok
    s = seq_ids[real]
    c = cols[real]
    good = ((s < self.max_seqs) & (c >= 0)
            & (c < self.lens[np.clip(s, 0, self.max_seqs - 1)] // self.block_size))
    ok[real] = good
    s, c = s[good], c[good]
    if s.size:
      self._set(self.cacheable, self.tables[s, c], True)
    return ok

  def release(self, seq_ids) -> np.ndarray:
    """`block_manager.release`."""
    seq_ids = np.asarray(seq_ids)
    ok = np.zeros(seq_ids.shape, bool)
    real = np.flatnonzero((seq_ids >= 0) & (seq_ids < self.max_seqs))
    if not real.size:
      return ok
    s = seq_ids[real]
    good = self.lens[s] > 0
    if s.size > 1:  # (a repeat can only be of a valid entry)
      good &= _first_occurrence(s)
    ok[real] = good
    order_idx = real[good]  # entry index in the call (release order)
    s = s[good]
    if s.size == 1:  # one sequence (the usual case)
      self._release_one(int(s[0]))
    elif s.size:
      rows, cols = self._owned(s)
      blocks = self.tables[s[rows], cols]
      if self.window is not None:  # reclaimed entries hold no reference
        held = blocks >= 0
        rows, cols, blocks = rows[held], cols[held], blocks[held]
      self._add_refs(blocks, -1)
      self._drop(np.unique(blocks), blocks, cols, order_idx[rows])
      self._set(self.tables, s, NULL)
      self._set(self.lens, s, 0)
    return ok

  def _release_one(self, slot: int):
    """`release` of the one valid slot `slot` (`0 <= slot < max_seqs`; none
    when it holds no sequence): its blocks are a slice of its table row,
    found with scalar reads (no filtering of a padded call, no `_owned`)."""
    n = _cdiv(int(self.lens[slot]), self.block_size)
    if not n:
      return
    row = (slot, slice(0, n))  # its cells past `n` are NULL already
    blocks = self.tables[row].copy()
    cells, cols = blocks, self._arange_width[:n]
    if self.window is not None:  # reclaimed entries hold no reference
      held = blocks >= 0
      cols, blocks = cols[held], blocks[held]
    ids = np.sort(blocks)  # (a table row names each block once)
    old = self.refs[ids]
    self._set(self.refs, ids, old - 1, old)
    self._drop(ids, blocks, cols, None)
    self._set(self.tables, row, NULL, cells)
    self._set(self.lens, slot, 0)

  def _drop(self, ids: np.ndarray, blocks: np.ndarray, cols: np.ndarray,
            order: np.ndarray | None):
    """The end of `release`, the released `blocks` (table columns `cols`,
    the entries' call indices `order`; None: one entry) dereferenced
    already, `ids` their distinct ids ascending: those left unreferenced go
    to the free stack, or with prefix caching, when cacheable, to the cached
    ring in release order."""
    freed = ids[self.refs[ids] == 0]  # ascending block ids
    if self.caching and freed.size:
      keep = self.cacheable[freed]
      to_stack = freed[~keep]
      kept = freed[keep]
    else:
      to_stack, kept = freed, freed[:0]
    if to_stack.size:
      self._set(self.stack, slice(self.num_free, self.num_free + to_stack.size),
                to_stack)
      self.num_free += int(to_stack.size)
    if kept.size:
      # Release order: entries as given, each one's blocks last first; a
      # block several released entries shared counts at its last release.
      pos = self.width - 1 - cols.astype(np.int64)
      if order is not None:
        pos += order.astype(np.int64) * self.width
      last = np.full(self.num_blocks, -1, np.int64)
      np.maximum.at(last, blocks, pos)
      kept = kept[np.argsort(last[kept], kind="stable")]
      self._append_ring(kept)

  def _ring_slot(self, k):
    return (self.lru_head + k) % self.lru.shape[0]

  def _append_ring(self, blocks: np.ndarray):
    size = self.lru.shape[0]
    if self.lru_len > size - blocks.size:  # `_compact_if_full`
      window = self._ring_slot(np.arange(self.lru_len))
      ent = self.lru[window]
      live = ent[ent >= 0]
      new = np.full(size, NULL, np.int32)
      new[:live.size] = live
      self._set(self.lru, slice(None), new)
      self._set(self.lru_pos, live, np.arange(live.size, dtype=np.int32))
      self.lru_head, self.lru_len = 0, self.num_cached
    slots = self._ring_slot(self.lru_len + np.arange(blocks.size))
    self._set(self.lru, slots, blocks)
    self._set(self.lru_pos, blocks, slots.astype(np.int32))
    self.lru_len += int(blocks.size)
    self.num_cached += int(blocks.size)

  def fork(self, parents, children) -> np.ndarray:
    """`block_manager.fork`."""
    parents, children = np.asarray(parents), np.asarray(children)
    ok = np.zeros(parents.shape, bool)
    real = np.flatnonzero((parents >= 0) | (children >= 0))
    if not real.size:
      return ok
    p, c = parents[real], children[real]
    ms = self.max_seqs
    self._steady = None  # (a parent's last block becomes shared)
    good = (p >= 0) & (p < ms) & (c >= 0) & (c < ms) & (p != c)
    pc, cc = np.clip(p, 0, ms - 1), np.clip(c, 0, ms - 1)
    good &= (self.lens[pc] > 0) & (self.lens[cc] == 0)
    good &= _first_occurrence(children)[real]  # over the whole call, as fork
    ok[real] = good
    p, c = p[good], c[good]
    if not p.size:
      return ok
    rows, cols = self._owned(p)
    blocks = self.tables[p[rows], cols]
    self._add_refs(blocks[blocks >= 0] if self.window is not None else blocks, 1)
    self._set(self.tables, c, self.tables[p])
    self._set(self.lens, c, self.lens[p])
    return ok

  def share(self, seq_ids, block_ids, counts) -> np.ndarray:
    """`block_manager.share` (the engine passes `max(counts, 1)`)."""
    seq_ids, block_ids, counts = (np.asarray(seq_ids), np.asarray(block_ids),
                                  np.asarray(counts))
    ok = np.zeros(seq_ids.shape, bool)
    real = np.flatnonzero(seq_ids >= 0)
    if real.size:
      s, blk, cnt = seq_ids[real], block_ids[real], counts[real]
      m = block_ids.shape[1]
      ms, nb = self.max_seqs, self.num_blocks
      inside = np.arange(m)[None, :] < cnt[:, None]
      good_blk = (blk >= 0) & (blk < nb) & self.cacheable[np.clip(blk, 0, nb - 1)]
      ranked = np.sort(np.where(inside, blk, NULL), axis=1)
      repeated = (np.any((ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0),
                         axis=1) if m > 1 else np.zeros(s.shape, bool))
      fo = _first_occurrence(seq_ids)[real]
      good = ((s < ms) & (self.lens[np.clip(s, 0, ms - 1)] == 0) & (cnt >= 1)
              & (cnt <= m) & fo & np.all(good_blk | ~inside, axis=1) & ~repeated)
      ok[real] = good
      s, blk, inside = s[good], blk[good], inside[good]
      if s.size:
        owned = blk[inside]
        self._add_refs(owned, 1)
        ids = np.unique(owned)
        slot = self.lru_pos[ids]
        leaving = ids[slot >= 0]
        if leaving.size:
          self._set(self.lru, self.lru_pos[leaving], NULL)
          self._set(self.lru_pos, leaving, -1)
          self.num_cached -= int(leaving.size)
        row = np.full((s.size, self.width), NULL, np.int32)
        row[:, :m] = np.where(inside, blk, NULL)
        self._set(self.tables, s, row)
        self._set(self.lens, s, cnt[good] * self.block_size)
    if self.num_cached == 0:
      self.lru_len = 0
    return ok

  def _cache_ok(self, reg_ok, register_seqs, share_seqs, share_blocks,
                share_counts, real) -> np.ndarray:
    """`bookkeeping`'s share (skipped when it has no entry, as on the
    device) and its `cache_ok bool[R + H]` (True on padding rows) from the
    registrations' `reg_ok` (None: none ran)."""
    if not real(share_seqs):
      share_ok = None
    elif self.window is None:
      share_ok = self.share(share_seqs, share_blocks, np.maximum(share_counts, 1))
    else:  # only the hit's last window, as `step.bookkeeping`
      share_ok = window_reclaim.share_host(self, share_seqs, share_blocks, share_counts)
    if reg_ok is None and share_ok is None:
      return np.ones(register_seqs.shape[0] + share_seqs.shape[0], bool)
    if reg_ok is None:
      reg_ok = np.zeros(register_seqs.shape, bool)
    if share_ok is None:
      share_ok = np.zeros(share_seqs.shape, bool)
    return np.concatenate([reg_ok | (register_seqs < 0), share_ok | (share_seqs < 0)])

  def bookkeeping(self, register_seqs, register_cols, release_early,
                  fork_parents, fork_children, release_late, share_seqs,
                  share_blocks, share_counts, seq_ids, q_lens, *,
                  packed: int | None = None, decode: int = 0):
    """`step.bookkeeping` on the model, in place (the same order: register ->
    release -> fork -> release -> share -> reserve; arguments in
    `step.BOOKKEEPING_FIELDS` order), then, with a `window`, the reclamation
    the device step runs after its model (`window_reclaim.reclaim`): the
    model is the pool as the step leaves it.

    `packed`: the caller's promise of the layout `Scheduler._fit` sends
    (`packing.InputPacking._bookkeeping_inputs`): each id argument lists its
    entries first, then padding (-1), and `seq_ids[:packed]` are distinct
    valid slots with sizes >= 0, the rest padding. The call then skips the
    scans that find that out (an all-padding argument is told by its first
    entry); the results are the same. None (the default): any inputs.
    `decode`: with `packed`, the promise that `q_lens[:decode]` are 1 (the
    plan's steady decode rows, `Plan.decode_rows`), which `reserve` serves
    without a scan while they stay the same (`SteadyDecode`).

    Returns:
      `(fork_ok bool[max_batch], HostReservation, cache_ok bool[R + H])`.
    """
    real = _any_real if packed is None else _leads
    cache_ok = _NO_CACHE_OK
    if self.caching:  # (the device skips an empty register or share too)
      cache_ok = (self.register(register_seqs, register_cols,
                                leading=packed is not None)
                  if real(register_seqs) else None)
    if packed is not None and _leads(release_early) and (
        release_early.shape[0] == 1 or release_early[1] < 0) and (
            release_early[0] < self.max_seqs):
      self._release_one(int(release_early[0]))  # one slot (a finished request)
    elif real(release_early):
      self.release(release_early)
    fork_ok = (self.fork(fork_parents, fork_children)
               if real(fork_parents) or real(fork_children)
               else self._no_forks(np.shape(fork_parents)[0]))
    if real(release_late):
      self.release(release_late)
    if self.caching:
      cache_ok = self._cache_ok(cache_ok, register_seqs, share_seqs, share_blocks,
                                share_counts, real)
    res = self.reserve(seq_ids, q_lens, packed, decode)
    if self.window is not None:
      window_reclaim.reclaim_host(self, seq_ids, q_lens, res.ok)
    return fork_ok, res, cache_ok
