"""Sliding-window block reclamation on one pool (`BlockState.window`).

When every layer of a model attends within a sliding window of `w` tokens
(Mistral with `sliding_window`), a block that no future query of a sequence
can see is dead weight: the engine gives it back to the pool after each step,
and its table entry becomes `NULL_BLOCK`, which every attention backend skips
(`pallas_kernels.contract`: a `NULL_BLOCK` inside `kv_len` contributes no
tokens and is never read). The rule is `block_manager.reclaimable_columns`:
after a step a sequence of `L` tokens gives back its leading
`max(L - w + 1, 0) // block_size` columns, so between steps it holds the
blocks covering `L - w + 1 .. L - 1`, at most `ceil((w - 1) / bs) + 1`
(<= `ceil(w / bs) + 1`), whatever its length.

Why after the step and not before the next reservation: a prefill chunk's
own queries read its early tokens, so nothing of the chunk can go before the
step has run; after it, the whole chunk's invisible prefix goes at once, and
the pool sees the freed blocks when it plans the next step (admissions
included), not one step later.

Two implementations of the one transition, judged against each other by the
engine's fingerprint at every step (`step.state_fingerprint`):

* `reclaim` (device, pure, jittable), run by `step.device_step` after the
  model has written and read the step's tokens;
* `reclaim_host` on the scheduler's exact NumPy model of the pool
  (`host_pool.HostPool.bookkeeping` runs it after its `reserve`).

Both touch only the columns that became invisible in this step: between
`reclaimable_columns(L - q)` and `reclaimable_columns(L)` for an entry that
grew by `q` tokens, at most `q // bs + 1`, so the work is O(batch x
num_tokens / block_size), not O(batch x max_blocks_per_seq). Freed blocks go
on the free stack in ascending block id, as `block_manager.release` pushes
them, so both sides hand out the same ids next.

With prefix caching (one windowed pool, or a hybrid model's local pools,
`serving.pooled_step`), a reclaimed block that was registered is cached, not emptied, exactly as a
released one (`block_manager._unref`; `reclaim_host` appends it to the ring
in the same release order): it still counts as available, and serves hits
until an allocation evicts it. Multi-step decode reclaims after each of its
loop's iterations (one pool). Not with speculative decoding (its rollback
would need the reclaimed blocks back), swap preemption or a mesh:
`paged_jax.serving.reclamation` decides where it runs.

Example:
  >>> import jax.numpy as jnp
  >>> from paged_jax import block_manager as bm
  >>> state = bm.init(num_blocks=8, block_size=4, max_seqs=1,
  ...                 max_blocks_per_seq=8, window=5)
  >>> state, res = bm.reserve(state, jnp.array([0]), jnp.array([20]))
  >>> state = reclaim(state, jnp.array([0]), jnp.array([20]), res.ok,
  ...                 max_new_tokens=20)
  >>> state.block_tables[0, :5].tolist(), int(state.num_free)  # keeps 16..19
  ([-1, -1, -1, -1, 4], 7)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm

NULL_BLOCK = bm.NULL_BLOCK


def max_new_columns(max_new_tokens: int, block_size: int) -> int:
  """Columns one entry growing by at most `max_new_tokens` can make
  invisible in one step (floors of `x / bs` and `(x + q) / bs` differ by at
  most `q // bs + 1`)."""
  return max_new_tokens // block_size + 1


def blocks_needed(num_tokens: int, block_size: int, window: int | None,
                  max_new_tokens: int, *, deferred: bool = False) -> int:
  """The most blocks one sequence of up to `num_tokens` tokens, growing by
  at most `max_new_tokens` per step, ever holds (within a step, before the
  step's reclamation), with reclamation for `window` (None: every block).

  Before a step a sequence of `L` tokens holds columns `[r(L), ceil(L /
  bs))`, `r = block_manager.reclaimable_columns`; growing by `q` it holds
  `ceil((L + q) / bs) - r(L) <= (q + w - 3) // bs + 2` (and one more
  while it copies a shared partial block: the shared one stays with its
  other holder, which the caller counts).

  With `deferred` (prefix caching: `reclaim` keeps a step's newly full
  blocks one step longer) up to `max_new_tokens // bs + 2` more.
  """
  full = -(-num_tokens // block_size)
  if window is None:
    return full
  extra = max_new_tokens // block_size + 2 if deferred else 0
  return min(full, (max_new_tokens + window - 3) // block_size + 3 + extra)


def reclaim_stop(window: int, lens, num_new, block_size: int, caching: bool):
  """The columns below which an entry that grew by `num_new` to `lens`
  holds no block after `reclaim`: the invisible ones
  (`block_manager.reclaimable_columns`); with prefix caching only those
  already full before this step, so that a block the step filled is
  registered by the next step's bookkeeping (its link made, in every pool)
  before it slides out, and slides out cached (`serving.pooled_step`)."""
  stop = bm.reclaimable_columns(window, lens, block_size)
  if caching:
    xp = jnp if isinstance(lens, jax.Array) else np
    stop = xp.minimum(stop, xp.maximum(lens - num_new, 0) // block_size)
  return stop


def reclaim(state: bm.BlockState, seq_ids: jax.Array, num_new: jax.Array,
            ok: jax.Array, *, max_new_tokens: int,
            deferred_columns: int = 0) -> bm.BlockState:
  """Gives back the blocks that this step's entries made invisible.

  Call it after the step's `block_manager.reserve(state, seq_ids, num_new)`
  and after the model ran (its queries read the step's blocks). Entries where
  `ok` is False (refused, padding) change nothing; a block shared with a fork
  stays until its last holder drops it.

  Args:
    state: a `BlockState` with `window` set.
    seq_ids: `i32[n]` the reservation's sequence slots (-1 padding).
    num_new: `i32[n]` the tokens each one grew by.
    ok: `bool[n]` the reservation's `ok`.
    max_new_tokens: static; an upper bound on `num_new` (the step's token
      rows).
    deferred_columns: static; with prefix caching, an upper bound on the
      columns the entry's previous step deferred (`reclaim_stop`):
      `max_tokens_per_step // block_size + 1`.

  Returns:
    The state, the reclaimed entries `NULL_BLOCK`.

  Raises:
    ValueError: if `state.window` is None.
  """
  if state.window is None:
    raise ValueError("reclaim needs a state with a window (block_manager.init("
                     "..., window=w)), got window=None")
  bs, max_seqs, width = state.block_size, state.max_seqs, state.max_blocks_per_seq
  caching = state.prefix_caching
  k = min(width, max_new_columns(max_new_tokens, bs) + (deferred_columns if caching else 0))
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  lens = state.seq_lens[sid]
  live = ok & (seq_ids >= 0)
  stop = reclaim_stop(state.window, lens, num_new, bs, caching)
  if caching:  # what the previous step deferred lies within k columns
    start = jnp.maximum(stop - k, 0)
  else:
    start = bm.reclaimable_columns(state.window, jnp.maximum(lens - num_new, 0), bs)
  cols = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]  # [n, k]
  take = live[:, None] & (cols < stop[:, None])
  cols = jnp.clip(cols, 0, width - 1)
  rows = jnp.take_along_axis(state.block_tables[sid], cols, axis=1)
  state = bm._unref(state, rows, take & (rows >= 0))  # pylint: disable=protected-access
  where = jnp.where(take, sid[:, None], max_seqs)  # past the end: dropped
  return state.replace(block_tables=state.block_tables.at[where, cols].set(
      NULL_BLOCK, mode="drop"))


def reclaim_host(pool, seq_ids: np.ndarray, num_new: np.ndarray,
                 ok: np.ndarray) -> None:
  """`reclaim` on a `host_pool.HostPool` (in place, journaled): the same
  entries, the same blocks freed, pushed on the stack in the same order."""
  seq_ids, num_new = np.asarray(seq_ids), np.asarray(num_new)
  real = np.flatnonzero(np.asarray(ok) & (seq_ids >= 0))
  if not real.size:
    return
  s = seq_ids[real]
  lens = pool.lens[s].astype(np.int64)
  bs, w = pool.block_size, pool.window
  stop = reclaim_stop(w, lens, num_new[real], bs, pool.caching)
  if pool.caching:  # every column below `stop` still held (exact, unbounded)
    held_cols = (np.arange(pool.width)[None, :] < stop[:, None]) & (pool.tables[s] >= 0)
    row, col = np.nonzero(held_cols)
    if not row.size:
      return
  else:
    start = bm.reclaimable_columns(w, np.maximum(lens - num_new[real], 0), bs)
    count = np.maximum(stop - start, 0)
    total = int(np.sum(count))
    if not total:
      return
    row = np.repeat(np.arange(s.size), count)
    col = np.repeat(start, count) + (np.arange(total) - np.repeat(np.cumsum(count) - count, count))
  blocks = pool.tables[s[row], col]
  mine = blocks >= 0
  held = blocks[mine]
  pool._add_refs(held, -1)  # pylint: disable=protected-access
  ids = np.unique(held)
  freed = ids[pool.refs[ids] == 0]  # ascending, as `block_manager._unref`
  if pool.caching and freed.size:
    keep = pool.cacheable[freed]
    kept, freed = freed[keep], freed[~keep]
    if kept.size:  # to the ring in release order, as `_free_or_cache`
      order = real[row][mine].astype(np.int64) * pool.width - col[mine]
      last = np.full(pool.num_blocks, np.iinfo(np.int64).min, np.int64)
      np.maximum.at(last, held, order)
      pool._append_ring(kept[np.argsort(last[kept], kind="stable")])  # pylint: disable=protected-access
  if freed.size:
    pool._set(pool.stack, np.arange(pool.num_free, pool.num_free + freed.size),  # pylint: disable=protected-access
              freed)
    pool.num_free += int(freed.size)
  pool._set(pool.tables, (s[row], col), NULL_BLOCK)  # pylint: disable=protected-access


def share_columns(window: int, block_size: int, share_blocks, share_counts,
                  links=None):
  """What a prefix-cache hit shares in a pool with a sliding window.

  A hit of `n` blocks starts its sequence at `n * block_size` tokens; its
  future queries see only columns from `c = block_manager.
  reclaimable_columns(window, n * block_size)` on. The pool shares its blocks
  of columns `c .. n - 1`, and the columns before `c` stay `NULL_BLOCK`,
  exactly the table reclamation would have left: a hit needs only its last
  window cached, and the blocks before it may have been evicted (the host
  marks them -1).

  Args:
    window: the pool's window (tokens).
    block_size: tokens per block.
    share_blocks: `i32[H, width]` the hits' blocks, per column (entries
      before `c` and past `n` are ignored).
    share_counts: `i32[H]` blocks each hit covers (`n`; 0 on padding rows,
      taken as 1).
    links: `i32[anchor_blocks]` or None. With it, `share_blocks` name another
      pool's blocks (a hybrid model's global pool, `serving.pooled_step`) and
      `links[b]` is this pool's block holding the same tokens (-1 none);
      None: `share_blocks` are this pool's.

  Returns:
    `(blocks i32[H, width], counts i32[H], rows i32[H, width], skip i32[H])`:
    the blocks and counts to hand `block_manager.share` (columns `c ..
    n - 1` shifted to the front: `n - c` blocks, at least 1), the table rows
    the sequences must end with (`NULL_BLOCK` before `c`), and `c`.
  """
  xp = jnp if isinstance(share_blocks, jax.Array) else np
  n = xp.maximum(share_counts, 1)
  skip = bm.reclaimable_columns(window, n * block_size, block_size)
  width = share_blocks.shape[1]
  cols = xp.arange(width, dtype=np.int32)[None, :]

  def mine(blocks):
    if links is None:
      return blocks
    return links[xp.clip(blocks, 0, links.shape[0] - 1)]

  shifted = xp.take_along_axis(share_blocks, xp.clip(cols + skip[:, None], 0, width - 1),
                               axis=1)
  blocks = xp.where(cols < (n - skip)[:, None], mine(shifted), NULL_BLOCK).astype(np.int32)
  rows = xp.where((cols >= skip[:, None]) & (cols < n[:, None]), mine(share_blocks),
                  NULL_BLOCK).astype(np.int32)
  return blocks, (n - skip).astype(np.int32), rows, skip


def share(state: bm.BlockState, seq_ids: jax.Array, block_ids: jax.Array,
          num_shared: jax.Array, *, links=None) -> tuple[bm.BlockState, jax.Array]:
  """`block_manager.share` in a pool with a window: each hit takes only the
  blocks its future queries see (`share_columns`), the table before them
  `NULL_BLOCK`, and `num_shared * block_size` tokens.

  Args:
    state: a `BlockState` with `window` and prefix caching.
    seq_ids: `i32[H]` empty sequence slots (-1 padding: refused, unchanged).
    block_ids: `i32[H, width]` the hits' blocks per column (see
      `share_columns`; with `links`, another pool's).
    num_shared: `i32[H]` blocks each hit covers.
    links: see `share_columns`.

  Returns:
    `(state, ok bool[H])`, `ok` as `block_manager.share`'s.
  """
  blocks, counts, rows, _ = share_columns(state.window, state.block_size,
                                          block_ids, num_shared, links)
  state, ok = bm.share(state, seq_ids, blocks, counts)
  write = jnp.where(ok, seq_ids, state.max_seqs)  # past the end: dropped
  state = state.replace(
      block_tables=state.block_tables.at[write].set(rows, mode="drop"),
      seq_lens=state.seq_lens.at[write].set(
          jnp.maximum(num_shared, 1) * state.block_size, mode="drop"))
  return state, ok


def share_host(pool, seq_ids: np.ndarray, block_ids: np.ndarray,
               num_shared: np.ndarray, *, links=None) -> np.ndarray:
  """`share` on a `host_pool.HostPool` (in place, journaled).

  Returns:
    `ok bool[H]`.
  """
  blocks, counts, rows, _ = share_columns(pool.window, pool.block_size,
                                          np.asarray(block_ids),
                                          np.asarray(num_shared), links)
  seq_ids = np.asarray(seq_ids)
  ok = pool.share(seq_ids, blocks, counts)
  if ok.any():
    s = seq_ids[ok]
    pool._set(pool.tables, s, rows[ok])  # pylint: disable=protected-access
    n = np.maximum(np.asarray(num_shared)[ok], 1)
    pool._set(pool.lens, s, n * pool.block_size)  # pylint: disable=protected-access
  return ok
