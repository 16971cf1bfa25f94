"""An exact NumPy model of the host tier (`paged_jax.host_tier`), for the
scheduler: with `host_pool.HostPool` (the device pool's model) it computes on
the host what `host_tier.swap_out` / `swap_in` / `drop` will do on the
device, before the step that runs them is dispatched.

Same rules, same order: `swap_out` serves requests in order (a later, smaller
one may still fit), pops host blocks from the top of the free stack in
request order and block order, then `release`s the moved device rows
(`HostPool.release`, padding where a request failed, so the released
entries keep their positions and the cached ring its order); `swap_in`
`reserve`s each moved sequence's whole length on its empty slot
(`HostPool.reserve`) and pushes the host blocks back row-major, in request
order. So `to_tier()` equals the device's `HostTier` array for array;
`tests/paged_jax/serving/test_host_tier_pool.py` proves it with a hypothesis
state machine.

Trials (`begin` / `rollback` / `commit`) snapshot the tier's arrays (they are
`max_seqs x max_blocks_per_seq` plus the free stack: small) and defer to the
device pool's own journal for its part.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax import host_tier
from paged_jax.serving.host_pool import (HostPool, _cdiv, _first_occurrence,
                                         fingerprint_weights)

NULL = host_tier.NULL_BLOCK
_MASK = 0xFFFFFFFF


@dataclasses.dataclass
class HostSwap:
  """`host_tier.Swap` on the host (NumPy)."""

  ok: np.ndarray  # bool[n]
  src: np.ndarray  # i32[n, width]
  dst: np.ndarray  # i32[n, width]
  evicted: np.ndarray | None  # i32[n, width]: swap_in with prefix caching


class HostTierPool:
  """The exact NumPy model of a `host_tier.HostTier` (module docstring).

  Args:
    tier: the tier's initial `HostTier` (one shard's).
  """

  def __init__(self, tier: host_tier.HostTier):
    self.block_size = tier.block_size
    self.tables = np.array(tier.tables, np.int32)
    self.lens = np.array(tier.seq_lens, np.int32)
    self.stack = np.array(tier.free_stack, np.int32)
    self.num_free = int(tier.num_free)
    self.num_blocks = self.stack.shape[0]
    self.max_seqs, self.width = self.tables.shape
    self._saved = None

  # ------------------------------------------------------------ trials

  def begin(self):
    """Opens a trial of the tier (the device pool's is its own `begin`)."""
    self._saved = (self.tables.copy(), self.lens.copy(), self.stack.copy(),
                   self.num_free)

  def commit(self):
    self._saved = None

  def rollback(self):
    """Undoes every change to the tier since `begin()`."""
    self.tables, self.lens, self.stack, self.num_free = self._saved
    self._saved = None

  # ------------------------------------------------------------ reading

  def fingerprint(self) -> np.ndarray:
    """u32[3]: `(num_free, sum w*seq_lens, sum w*(tables + 1))` mod 2**32,
    with `host_pool.fingerprint_weights`; `swap_step.tier_fingerprint` is the
    device's."""
    w_seqs = fingerprint_weights(self.max_seqs).astype(np.int64)
    w_cells = fingerprint_weights(self.tables.size).astype(np.int64)
    lens = int(np.dot(self.lens.astype(np.int64), w_seqs)) & _MASK
    cells = int(np.dot(self.tables.reshape(-1).astype(np.int64) + 1,
                       w_cells)) & _MASK
    return np.array([self.num_free, lens, cells], np.uint64).astype(np.uint32)

  def to_tier(self) -> host_tier.HostTier:
    """The modelled `HostTier`, as NumPy arrays (copies)."""
    return host_tier.HostTier(tables=self.tables.copy(), seq_lens=self.lens.copy(),
                              free_stack=self.stack.copy(),
                              num_free=np.int32(self.num_free),
                              block_size=self.block_size)

  @property
  def swapped(self) -> np.ndarray:
    """i32[k] the swapped-out slots, ascending."""
    return np.flatnonzero(self.lens > 0).astype(np.int32)

  # ------------------------------------------------------------ operations

  def _check(self, pool: HostPool):
    if (pool.max_seqs, pool.width, pool.block_size) != (
        self.max_seqs, self.width, self.block_size):
      raise ValueError(
          f"the host tier (tables {(self.max_seqs, self.width)}, block_size="
          f"{self.block_size}) must match the pool (tables "
          f"{(pool.max_seqs, pool.width)}, block_size={pool.block_size})")

  def _valid(self, seq_ids: np.ndarray, length: np.ndarray) -> np.ndarray:
    inside = (seq_ids >= 0) & (seq_ids < self.max_seqs)
    return inside & (length > 0) & _first_occurrence(seq_ids)

  def swap_out(self, pool: HostPool, seq_ids) -> HostSwap:
    """`host_tier.swap_out` on the models, in place.

    Args:
      pool: the device pool's model (released in place).
      seq_ids: `int[n]` live device slots, -1 padding.

    Returns:
      `HostSwap` with `src` device blocks, `dst` host blocks.
    """
    self._check(pool)
    seq_ids = np.asarray(seq_ids)
    n, width = seq_ids.shape[0], self.width
    sid = np.clip(seq_ids, 0, self.max_seqs - 1)
    length = pool.lens[sid].astype(np.int64)
    need = _cdiv(length, self.block_size)
    valid = self._valid(seq_ids, length) & (self.lens[sid] == 0)
    ok = np.zeros(n, bool)
    left = self.num_free
    for i in np.flatnonzero(valid).tolist():
      if need[i] <= left:
        ok[i] = True
        left -= int(need[i])
    src = np.full((n, width), NULL, np.int32)
    dst = np.full((n, width), NULL, np.int32)
    top = self.num_free
    for i in np.flatnonzero(ok).tolist():
      k = int(need[i])
      dst[i, :k] = self.stack[top - 1 - np.arange(k)]
      src[i, :k] = pool.tables[sid[i], :k]
      top -= k
      self.tables[sid[i]] = dst[i]
      self.lens[sid[i]] = length[i]
    self.num_free = left
    pool.release(np.where(ok, seq_ids, -1).astype(np.int32))
    return HostSwap(ok=ok, src=src, dst=dst, evicted=None)

  def swap_in(self, pool: HostPool, seq_ids) -> HostSwap:
    """`host_tier.swap_in` on the models, in place.

    Args:
      pool: the device pool's model (reserved in place).
      seq_ids: `int[n]` swapped-out slots, -1 padding.

    Returns:
      `HostSwap` with `src` host blocks, `dst` device blocks, `evicted` the
      cached device blocks evicted (prefix caching; else None).
    """
    self._check(pool)
    seq_ids = np.asarray(seq_ids)
    width = self.width
    sid = np.clip(seq_ids, 0, self.max_seqs - 1)
    length = self.lens[sid].astype(np.int64)
    pre = self._valid(seq_ids, length) & (pool.lens[sid] == 0)
    res = pool.reserve(np.where(pre, seq_ids, -1).astype(np.int32),
                       np.where(pre, length, 0).astype(np.int32))
    ok = pre & res.ok
    taking = ok[:, None] & (np.arange(width)[None, :]
                            < _cdiv(length, self.block_size)[:, None])
    src = np.where(taking, self.tables[sid], NULL).astype(np.int32)
    dst = np.where(taking, pool.tables[sid], NULL).astype(np.int32)
    self._give_back(sid, ok, src, taking)
    return HostSwap(ok=ok, src=src, dst=dst, evicted=res.evicted)

  def drop(self, seq_ids) -> np.ndarray:
    """`host_tier.drop`: forgets swapped-out slots (abort / finish).

    Args:
      seq_ids: `int[n]` swapped-out slots.

    Returns:
      `bool[n]` ok.
    """
    seq_ids = np.asarray(seq_ids)
    sid = np.clip(seq_ids, 0, self.max_seqs - 1)
    length = self.lens[sid].astype(np.int64)
    ok = self._valid(seq_ids, length)
    taking = ok[:, None] & (np.arange(self.width)[None, :]
                            < _cdiv(length, self.block_size)[:, None])
    self._give_back(sid, ok, self.tables[sid], taking)
    return ok

  def _give_back(self, sid, ok, blocks, taking):
    freed = blocks[taking]  # row-major: request order, then block order
    self.stack[self.num_free:self.num_free + freed.size] = freed
    self.num_free += int(freed.size)
    self.tables[sid[ok]] = NULL
    self.lens[sid[ok]] = 0

  def bookkeeping(self, pool: HostPool, register_seqs, register_cols,
                  release_early, fork_parents, fork_children, release_late,
                  share_seqs, share_blocks, share_counts, seq_ids, q_lens,
                  swap_out_ids, swap_in_ids, drop_ids=None):
    """`swap_step.bookkeeping` on the models, in place (register -> release
    -> drop -> swap_out -> fork -> release -> share -> swap_in -> reserve).

    Returns:
      `(fork_ok, HostReservation, cache_ok, out HostSwap, back HostSwap)`.
    """
    cache_ok = np.ones((0,), bool)
    if pool.caching:
      cache_ok = pool.register(register_seqs, register_cols) | (register_seqs < 0)
    pool.release(release_early)
    if drop_ids is not None and np.any(np.asarray(drop_ids) >= 0):
      self.drop(drop_ids)
    out = self._unless_empty(self.swap_out, pool, swap_out_ids)
    fork_ok = pool.fork(fork_parents, fork_children)
    pool.release(release_late)
    if pool.caching:
      share_ok = pool.share(share_seqs, share_blocks, np.maximum(share_counts, 1))
      cache_ok = np.concatenate([cache_ok, share_ok | (share_seqs < 0)])
    back = self._unless_empty(self.swap_in, pool, swap_in_ids)
    return fork_ok, pool.reserve(seq_ids, q_lens), cache_ok, out, back

  def _unless_empty(self, op, pool: HostPool, ids) -> HostSwap:
    """`op(pool, ids)`, skipped when every id is -1 (as the device skips it:
    `swap_step._swap_unless_empty`)."""
    ids = np.asarray(ids)
    if ids.size == 0 or np.any(ids >= 0):
      return op(pool, ids)
    none = np.full((ids.shape[0], self.width), NULL, np.int32)
    evicted = none.copy() if (pool.caching and op == self.swap_in) else None
    return HostSwap(ok=np.zeros(ids.shape, bool), src=none, dst=none.copy(),
                    evicted=evicted)
