"""Defragmenting and resizing a block pool: `compact`, `resize`, `resize_cache`.

`compact(state)` moves every block that holds something (live: refcount > 0;
cached, with prefix caching) into the front of the pool, `[0, K)` for `K`
such blocks, and rewrites every reference to them in one pure, jittable
transition: the block tables, the refcounts, the free stack, and with prefix
caching `cacheable`, the eviction ring's entries and its index `lru_pos`
(the ring's order, head and length are kept, so eviction order is
unchanged). It moves as few blocks as possible: a block already below `K`
stays, and the `i`-th block above `K` goes into the `i`-th hole below it, so
the moves' sources (`>= K`) and destinations (`< K`) are disjoint and one
gather-scatter copies them (`kv_cache.copy_blocks`). Afterwards the empty
blocks are exactly `[K, num_blocks)`, handed out lowest id first.

The copy must happen before any step reads the new tables, and the host's
structures that name physical blocks follow `Compaction.new_ids`
(`prefix_cache.PrefixIndex.relabel`; the serving engine's NumPy pool model is
rebuilt from the new state).

`resize(state, new_num_blocks)` then shrinks the pool (after `compact`, to as
little as `num_used + num_cached`, or to `num_used` by dropping cached
blocks) or grows it, without restarting: the state's arrays get the new
size, and `resize_cache` gives the `KVCache` the same. The new size decides
array shapes, so it is static and the check whether live blocks fit is made
on the host (a resize is rare: one scalar read): a refusal is a value
(`Resized.ok` False) and leaves the state as it was.

Both are `O(num_blocks)`: compaction looks at every block once, vectorised.

Example:
  >>> state = bm.init(num_blocks=8, block_size=4, max_seqs=2,
  ...                 max_blocks_per_seq=4)
  >>> state, _ = bm.reserve(state, jnp.array([0, 1]), jnp.array([8, 8]))
  >>> state, _ = bm.release(state, jnp.array([0]))  # blocks 0, 1 empty
  >>> state, moves = compact(state)
  >>> int(moves.num_moves), state.block_tables[1, :2].tolist()
  (2, [0, 1])
  >>> state, res = resize(state, 2)
  >>> res.ok, state.num_blocks, int(state.num_free)
  (True, 2, 0)
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _int32
from paged_jax import block_manager as bm
from paged_jax.block_manager import NULL_BLOCK
from paged_jax.kv_cache import KVCache

_ring_slot = bm._ring_slot  # pylint: disable=protected-access


@flax.struct.dataclass
class Compaction:
  """Result of `compact`.

  Attributes:
    src: `i32[num_blocks]` blocks to move from; the first `num_moves` are
      real (ascending), `NULL_BLOCK` after.
    dst: `i32[num_blocks]` their new ids (all below every `src`).
    num_moves: `i32[]` blocks moved.
    new_ids: `i32[num_blocks]` each block's new id: its own for kept blocks
      that stayed, its destination for moved ones, `NULL_BLOCK` for empty
      ones. Relabel host-side structures with it.
  """

  src: jax.Array
  dst: jax.Array
  num_moves: jax.Array
  new_ids: jax.Array


def _kept(state: bm.BlockState) -> jax.Array:
  """`bool[num_blocks]` blocks holding K/V someone can read: live or cached."""
  kept = state.refcounts > 0
  if state.prefix_caching:
    kept |= state.lru_pos >= 0
  return kept


def compact(state: bm.BlockState) -> tuple[bm.BlockState, Compaction]:
  """Moves every live and cached block into `[0, K)` and rewrites all
  references to them (see the module docstring).

  Args:
    state: one pool's `BlockState` (not stacked data shards: `jax.vmap` it).

  Returns:
    `(new_state, Compaction)`; copy `src[:m] -> dst[:m]` for any `m >=
    num_moves` (`kv_cache.copy_blocks`) before a step reads the new tables.
    `block_manager.check_invariants` holds for the new state whenever it held
    for the old one, and every sequence reads the same K/V as before.
  """
  n = state.num_blocks
  ids = jnp.arange(n, dtype=jnp.int32)
  kept = _kept(state)
  k = jnp.sum(kept, dtype=jnp.int32)
  hole = ~kept & (ids < k)
  mover = kept & (ids >= k)  # as many as holes
  hole_rank = jnp.cumsum(hole, dtype=jnp.int32) - 1
  mover_rank = jnp.cumsum(mover, dtype=jnp.int32) - 1
  holes = jnp.zeros((n,), jnp.int32).at[jnp.where(hole, hole_rank, n)].set(
      ids, mode="drop")
  target = holes[jnp.clip(mover_rank, 0, n - 1)]
  new_ids = jnp.where(mover, target, jnp.where(kept, ids, NULL_BLOCK))
  slot = jnp.where(mover, mover_rank, n)
  moves = Compaction(
      src=jnp.full((n,), NULL_BLOCK, jnp.int32).at[slot].set(ids, mode="drop"),
      dst=jnp.full((n,), NULL_BLOCK, jnp.int32).at[slot].set(target,
                                                             mode="drop"),
      num_moves=jnp.sum(mover, dtype=jnp.int32), new_ids=new_ids)

  def relabel(x):  # block ids -> new ids, NULL_BLOCK and tombstones stay
    return jnp.where(x >= 0, new_ids[jnp.clip(x, 0, n - 1)], x)

  def permute(x, fill):  # per-block arrays follow their blocks
    return jnp.full_like(x, fill).at[jnp.where(kept, new_ids, n)].set(
        x, mode="drop")

  new = dict(block_tables=relabel(state.block_tables),
             refcounts=permute(state.refcounts, 0),
             free_stack=jnp.arange(n - 1, -1, -1, dtype=jnp.int32),
             num_free=n - k)
  if state.prefix_caching:
    new.update(cacheable=permute(state.cacheable, False),
               lru=relabel(state.lru), lru_pos=permute(state.lru_pos, -1))
  return state.replace(**new), moves


@dataclasses.dataclass(frozen=True)
class Resized:
  """Result of `resize` (host values: the decision was made on the host).

  Attributes:
    ok: False when a live block lies at or past `new_num_blocks` (the state
      is then returned unchanged: `compact` first, or free sequences).
    evicted: the cached blocks dropped because they lay past the new size
      (drop them from the prefix index), ascending; empty on failure.
  """

  ok: bool
  evicted: np.ndarray


def resize(state: bm.BlockState, new_num_blocks: int
           ) -> tuple[bm.BlockState, Resized]:
  """The pool with `new_num_blocks` blocks: grown, or shrunk after `compact`.

  Growing appends empty blocks `[num_blocks, new_num_blocks)`, handed out
  after the blocks already free. Shrinking keeps blocks `[0,
  new_num_blocks)`: it needs every live block below the new size, drops
  free ones past it, and evicts cached ones past it (`Resized.evicted`). The
  free stack keeps its order; the eviction ring keeps its order, rebuilt
  without tombstones in `2 * new_num_blocks` slots. Sequences, tables and
  refcounts are unchanged. Resize the cache with `resize_cache`.

  Args:
    state: one pool's `BlockState`.
    new_num_blocks: the new size (static: it decides the arrays' shapes).

  Returns:
    `(new_state, Resized)`; on refusal `(state, Resized(False, ...))`.

  Raises:
    ValueError: if `new_num_blocks` is not a positive int, or the new pool's
      flat slots (or its ring) would not fit int32; for stacked states.
  """
  m = _int32.positive_int("new_num_blocks", new_num_blocks)
  _int32.check_fits("cache slots", num_blocks=m, block_size=state.block_size)
  if state.prefix_caching:
    _int32.check_fits("cached-block ring slots", ring_per_block=2,
                      num_blocks=m)
  if state.block_tables.ndim != 2:
    raise ValueError(f"resize takes one pool's state, got block_tables of "
                     f"shape {state.block_tables.shape} (stacked data shards)")
  refs = np.asarray(state.refcounts)
  if np.any(refs[m:] > 0):
    return state, Resized(False, np.zeros((0,), np.int64))
  evicted = np.zeros((0,), np.int64)
  if state.prefix_caching:
    evicted = np.nonzero(np.asarray(state.lru_pos)[m:] >= 0)[0] + m
  return _resize(state, m), Resized(True, evicted)


def _fit(x: jax.Array, m: int, fill) -> jax.Array:
  """`x` (per-block, length `n`) cut or padded with `fill` to length `m`."""
  n = x.shape[0]
  if m <= n:
    return x[:m]
  return jnp.concatenate([x, jnp.full((m - n,), fill, x.dtype)])


@functools.partial(jax.jit, static_argnums=1)
def _resize(state: bm.BlockState, m: int) -> bm.BlockState:
  # Jitted: every leaf of the result is its own buffer (run eagerly,
  # `lru_len` and `num_cached` would be one array, and a step donating the
  # state would donate it twice).
  n = state.num_blocks
  extra = max(m - n, 0)
  # Free stack: the new blocks at the bottom (n first out of them), the old
  # free blocks that survive above them, in their order.
  pos = jnp.arange(n, dtype=jnp.int32)
  survive = (pos < state.num_free) & (state.free_stack < m)
  at = extra + jnp.cumsum(survive, dtype=jnp.int32) - 1
  stack = jnp.zeros((m,), jnp.int32).at[:extra].set(
      jnp.arange(m - 1, n - 1, -1, dtype=jnp.int32)).at[
          jnp.where(survive, at, m)].set(state.free_stack, mode="drop")
  new = dict(refcounts=_fit(state.refcounts, m, 0), free_stack=stack,
             num_free=extra + jnp.sum(survive, dtype=jnp.int32))
  if state.prefix_caching:
    size = state.lru.shape[0]
    cols = jnp.arange(size, dtype=jnp.int32)
    ent = state.lru[_ring_slot(state.lru_head, cols, size)]
    live = (cols < state.lru_len) & (ent >= 0) & (ent < m)
    rank = jnp.cumsum(live, dtype=jnp.int32) - 1
    lru = jnp.full((2 * m,), NULL_BLOCK, jnp.int32).at[
        jnp.where(live, rank, 2 * m)].set(ent, mode="drop")
    lru_pos = jnp.full((m,), -1, jnp.int32).at[jnp.where(live, ent, m)].set(
        rank, mode="drop")
    count = jnp.sum(live, dtype=jnp.int32)
    new.update(cacheable=_fit(state.cacheable, m, False), lru=lru,
               lru_pos=lru_pos, lru_head=jnp.zeros((), jnp.int32),
               lru_len=count, num_cached=count)
  return state.replace(**new)


def resize_cache(cache: KVCache, new_num_blocks: int) -> KVCache:
  """The cache cut to its first `new_num_blocks` blocks, or grown with zero
  blocks (scales too), for a pool `resize`d to that size.

  Raises:
    ValueError: if `new_num_blocks` is not a positive int or the pool's flat
      slots would not fit int32.
  """
  m = _int32.positive_int("new_num_blocks", new_num_blocks)
  _int32.check_fits("cache slots", num_blocks=m, block_size=cache.block_size)
  n = cache.num_blocks

  def fit(x):
    if m <= n:
      return x[:, :, :m]
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, m - n)
    return jnp.pad(x, pad)

  return cache.replace(**{f: fit(getattr(cache, f)) for f in
                          ("k_pages", "v_pages", "k_scales", "v_scales")
                          if getattr(cache, f) is not None})
