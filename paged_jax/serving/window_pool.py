"""One KV pool per attention window: sizing, caches and the host model.

A hybrid model (Gemma 2, Gemma 3) has global layers, which keep every block
of a sequence, and local layers of window `w`, which after reclamation keep
at most `ceil(w / bs) + 1` (`window_reclaim`). Reclaiming frees memory only
if a local layer's blocks hold that layer's K/V alone. By default the
engine shares one pool between the layer groups (`shared_pool`); with
prefix caching, or several local windows, it gives each distinct window its
own pool (`layout` is the rule): a `BlockState` (`pooled_step.
PooledState`), a `KVCache` of that group's layers and, on the host, a
`HostPool` (`PooledHost` holds them). Every sequence lives in every pool at
the same length; a step's entry is served only if every pool grants it.

Sizing (`pool_sizes`): the engine's `num_blocks` says how much KV memory
there is, in blocks of every layer (`num_blocks * num_layers` layer-blocks).
Each local pool first gets the blocks a step's prefill chunk may take before
its reclamation (`ceil(max_tokens_per_step / bs) + 1`); the rest is split in
proportion to what one sequence of `max_model_len` tokens needs per group
(`hybrid_capacity.local_blocks`, plus one block of decode growth in local
groups): so at `max_model_len` the pools run out together, and the same
bytes hold `hybrid_capacity.plan_hybrid(...).ratio` times the sequences.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax import block_manager as bm
from paged_jax import hybrid_capacity
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import window_reclaim
from paged_jax.models.llama import pooled as pooled_model
from paged_jax.serving import pooled_step
from paged_jax.serving import reclamation
from paged_jax.serving import shared_pool
from paged_jax.serving.host_pool import HostPool


def pool_sizes(num_blocks: int, layer_windows, *, block_size: int,
               max_model_len: int, max_tokens_per_step: int,
               deferred: bool = False) -> tuple[int, ...]:
  """Blocks per pool (`pooled.pool_windows` order) in the memory of
  `num_blocks` blocks of every layer (see the module docstring). With
  `deferred` (prefix caching: `window_reclaim.reclaim_stop`) a local pool
  first gets two chunks.

  Raises:
    ValueError: if a pool could not hold one sequence of `max_model_len`
      tokens.
  """
  layer_windows = list(layer_windows)
  groups = hybrid_capacity.groups_from_windows(layer_windows)
  budget = num_blocks * len(layer_windows)  # layer-blocks
  chunk = (-(-max_tokens_per_step // block_size) + 1) * (1 + deferred)
  extra = [0 if g.window is None else chunk for g in groups]
  per_seq = [hybrid_capacity.local_blocks(g.window, max_model_len, block_size)
             + (g.window is not None) for g in groups]
  left = budget - sum(g.num_layers * e for g, e in zip(groups, extra))
  weight = sum(g.num_layers * b for g, b in zip(groups, per_seq))
  sizes = tuple(e + max(left, 0) * b // weight for e, b in zip(extra, per_seq))
  for g, n in zip(groups, sizes):
    need = window_reclaim.blocks_needed(max_model_len, block_size, g.window,
                                        max_tokens_per_step, deferred=deferred)
    if n < need:
      raise ValueError(
          f"num_blocks={num_blocks} split over the windows' pools gives the "
          f"window-{g.window} pool {n} blocks, less than one sequence of "
          f"max_model_len={max_model_len} tokens needs ({need}); give more "
          "blocks or sliding_window_reclamation=False")
  return sizes


def layout(config, pools: tuple) -> tuple[bool, str]:
  """`(shared, why)`: the one rule that picks a hybrid model's KV layout.
  Shared (`shared_pool`: one pool, every layer group's sub-groups drawing
  from it, vLLM's layout) unless prefix caching is on (its hits are
  anchored on a global pool's blocks with links into the local pools,
  `pooled_step`'s "Prefix caching", not built for the shared pool) or the
  model has several local windows (the shared pool reclaims for one); then
  a pool per window (this module), `why` saying which."""
  if config.enable_prefix_caching:
    return False, ("prefix caching: hits are anchored on the global pool "
                   "with links into each window's pool")
  if len({w for w in pools if w is not None}) > 1:
    return False, f"several local windows {pools}: the shared pool reclaims for one"
  return True, ""


def shared_size(num_blocks: int, layer_windows, *, block_size: int,
                max_model_len: int, max_tokens_per_step: int) -> int:
  """Blocks of the shared pool (`shared_pool`) in the memory of `num_blocks`
  blocks of every layer: `num_blocks * num_layers / G` blocks of `G` layers.

  Raises:
    ValueError: if it could not hold one sequence of `max_model_len` tokens.
  """
  layer_windows = list(layer_windows)
  g, subs, _, _ = pooled_model.sub_groups(layer_windows)
  size = num_blocks * len(layer_windows) // g
  need = sum(window_reclaim.blocks_needed(max_model_len, block_size, w,
                                          max_tokens_per_step) for w in subs)
  if size < need:
    raise ValueError(
        f"num_blocks={num_blocks} gives the shared pool {size} blocks of {g} "
        f"layers, less than one sequence of max_model_len={max_model_len} "
        f"tokens needs in its {len(subs)} sub-groups ({need}); give more "
        "blocks or sliding_window_reclamation=False")
  return size


def plan(config, model_config, decision, *, max_model_len: int, max_seqs: int,
         max_blocks_per_seq: int):
  """`(decision, state | None)`: the empty KV pool(s) of a hybrid model
  (`decision.pools`): one shared pool (`shared_pool.SharedState`, sized by
  `shared_size`) or a pool per window (`pooled_step.PooledState`, sized by
  `pool_sizes`), chosen by `layout` and logged with the reason. Where they
  cannot hold one sequence, with `sliding_window_reclamation` None (auto)
  the decision becomes off (logged, the reason kept) and the state None.

  Raises:
    ValueError: from the sizing, with `sliding_window_reclamation=True`.
  """
  windows = [s.sliding_window for s in model_config.layer_specs]
  shared, why = layout(config, decision.pools)
  try:
    if shared:
      size = shared_size(config.num_blocks, windows, block_size=config.block_size,
                         max_model_len=max_model_len,
                         max_tokens_per_step=config.max_tokens_per_step)
    else:
      sizes = pool_sizes(
          config.num_blocks, windows, block_size=config.block_size,
          max_model_len=max_model_len,
          max_tokens_per_step=config.max_tokens_per_step,
          deferred=config.enable_prefix_caching)
  except ValueError as e:
    if config.sliding_window_reclamation:
      raise
    decision = reclamation.Reclamation(None, str(e))
    reclamation.log(decision)
    return decision, None
  decision = dataclasses.replace(decision, layout="shared" if shared else why)
  reclamation.log(decision)
  if shared:
    return decision, shared_pool.init(
        size, pooled_model.sub_groups(windows)[1], block_size=config.block_size,
        max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
  return decision, pooled_step.init(
      sizes, decision.pools, block_size=config.block_size, max_seqs=max_seqs,
      max_blocks_per_seq=max_blocks_per_seq,
      prefix_caching=config.enable_prefix_caching)


def make_caches(model_config, sizes, *, block_size: int, dtype) -> tuple:
  """One zeroed `KVCache` per pool, of that pool's layers."""
  windows = [s.sliding_window for s in model_config.layer_specs]
  pool_of, _ = pooled_model.layer_pools(windows)
  c = model_config
  return tuple(kv_cache_lib.KVCache.create(
      num_layers=pool_of.count(g), num_kv_heads=c.num_kv_heads, num_blocks=n,
      block_size=block_size, head_dim=c.head_dim,
      dtype=kv_cache_lib.cache_dtype(dtype, c.jnp_dtype))
                for g, n in enumerate(sizes))


class PooledHost:
  """The exact NumPy model of every pool (one `HostPool` each), read by the
  scheduler as one pool: `bookkeeping` runs every pool's on the same inputs
  and grants an entry only where all did (the scheduler then takes back an
  admission or preempts and tries again, rolling every pool back).

  With prefix caching (`pooled_step`'s "Prefix caching") it also models the
  local pools' links (anchor block -> local block) and keeps, host only, the
  reverse map (`_owner`: local block -> the anchor block it was registered
  with), which tells a live link from a stale one; `usable_hit` shortens a
  hit to what every pool holds. The prefix index names anchor blocks:
  `tables`, `reserve`'s `evicted` and `cacheable` are the anchor's.
  """

  window = None

  def __init__(self, state: pooled_step.PooledState):
    self.pools = [HostPool(s) for s in state.states]
    first = self.pools[0]
    self.block_size, self.width = first.block_size, first.width
    self.max_seqs = first.max_seqs
    self.num_blocks = sum(p.num_blocks for p in self.pools)
    self.caching = state.prefix_caching
    self.anchor = state.anchor if self.caching else None
    self.links = [None if l is None else np.array(l, np.int32)
                  for l in state.links]
    self._owner = [None if l is None else np.full(p.num_blocks, bm.NULL_BLOCK, np.int32)
                   for l, p in zip(self.links, self.pools)]
    self._journal: list | None = None

  def begin(self):
    self._journal = []
    for p in self.pools:
      p.begin()

  def commit(self):
    self._journal = None
    for p in self.pools:
      p.commit()

  def rollback(self):
    for arr, idx, old in reversed(self._journal):
      arr[idx] = old
    self._journal = None
    for p in self.pools:
      p.rollback()

  def _set(self, arr: np.ndarray, idx, vals):
    if self._journal is not None:
      self._journal.append((arr, idx, arr[idx].copy()))
    arr[idx] = vals

  @property
  def num_free(self) -> int:
    return sum(p.num_free for p in self.pools)

  @property
  def num_cached(self) -> int:
    return sum(p.num_cached for p in self.pools)

  @property
  def num_available(self) -> int:
    """The fewest blocks any pool has left (a prompt chunk takes the same
    number of new blocks in each: the admission estimate's bound)."""
    return min(p.num_available for p in self.pools)

  @property
  def lens(self) -> np.ndarray:
    return self.pools[0].lens

  @property
  def tables(self) -> np.ndarray:
    """The anchor's block tables (prefix caching: the index's blocks)."""
    return self.pools[self.anchor].tables

  def fingerprint(self) -> np.ndarray:
    """`u32[num_pools, 5]`, as `pooled_step.fingerprint`."""
    return np.stack([p.fingerprint() for p in self.pools])

  def to_state(self) -> pooled_step.PooledState:
    return pooled_step.PooledState(
        tuple(p.to_state() for p in self.pools),
        tuple(None if l is None else l.copy() for l in self.links))

  def usable_hit(self, blocks: list, registering=()) -> list:
    """The longest prefix of a hit's anchor `blocks` that every pool can
    serve: `n` blocks where each local pool holds, linked, the blocks of the
    columns the next query sees (`window_reclaim.share_columns`). `registering`
    are this step's `prefix.Registration`s (linked by this step: their local
    block is the one at their slot and column now). Without prefix caching,
    `blocks` unchanged."""
    if not self.caching or not blocks:
      return blocks
    bs = self.block_size
    anchor = np.asarray(blocks, np.int64)
    n = np.arange(1, anchor.size + 1)
    joint = np.ones(anchor.size, bool)
    pending = {r.block: (r.slot, r.col) for r in registering}
    for pool, links, owner in zip(self.pools, self.links, self._owner):
      if links is None:
        continue
      mine = links[anchor]
      safe = np.clip(mine, 0, pool.num_blocks - 1)
      valid = (mine >= 0) & pool.cacheable[safe] & (owner[safe] == anchor)
      for j, b in enumerate(blocks):
        if b in pending:
          valid[j] = pool.tables[pending[b]] >= 0
      # run[j]: valid columns ending at j.
      run = np.zeros(anchor.size, np.int64)
      count = 0
      for j, v in enumerate(valid.tolist()):
        count = count + 1 if v else 0
        run[j] = count
      need = n - bm.reclaimable_columns(pool.window, n * bs, bs)
      joint &= (need >= 1) & (run >= need)
    best = int(n[joint].max()) if joint.any() else 0
    return blocks[:best]

  def bookkeeping(self, *args):
    """`HostPool.bookkeeping` on every pool (a local pool's, with prefix
    caching, as `pooled_step._local_bookkeeping`); `ok` where every pool
    granted; `evicted` the anchor's."""
    if self.caching:
      outs = self._caching_bookkeeping(args)
      anchor = self.anchor
    else:
      outs = [p.bookkeeping(*args) for p in self.pools]
      anchor = 0
    fork_ok, res, cache_ok = outs[anchor]
    ok = res.ok.copy()
    fork_ok = fork_ok.copy()
    cache_ok = cache_ok.copy()
    for f, r, c in outs:
      ok &= r.ok
      fork_ok &= f
      cache_ok &= c
    return fork_ok, dataclasses.replace(res, ok=ok), cache_ok

  def _caching_bookkeeping(self, args) -> list:
    register_seqs, register_cols = np.asarray(args[0]), np.asarray(args[1])
    anchor_tables = self.pools[self.anchor].tables
    # Before any pool registers: the anchor's and each local pool's blocks at
    # the registered (slot, column).
    regs = [None if links is None else pooled_step._link_registrations(  # pylint: disable=protected-access
        links, anchor_tables, pool.tables, register_seqs, register_cols)
            for pool, links in zip(self.pools, self.links)]
    outs = []
    for g, pool in enumerate(self.pools):
      if self.links[g] is None:
        outs.append(pool.bookkeeping(*args))
      else:
        outs.append(self._local_bookkeeping(g, pool, *regs[g], *args))
    return outs

  def _local_bookkeeping(self, g, pool: HostPool, anchor, mine, register_seqs,
                         register_cols, release_early, fork_parents,
                         fork_children, release_late, share_seqs, share_blocks,
                         share_counts, seq_ids, q_lens):
    """`pooled_step._local_bookkeeping` on the model, in place, then the
    step's reclamation (as `HostPool.bookkeeping`)."""
    real = anchor >= 0
    if real.any():
      a, m = anchor[real], mine[real]
      self._set(self.links[g], a, m)
      self._set(self._owner[g], m[m >= 0], a[m >= 0])
    reg_seqs = np.where(mine >= 0, register_seqs, -1)
    cache_ok = pool.register(reg_seqs, register_cols) | (reg_seqs < 0)
    pool.release(release_early)
    fork_ok = pool.fork(fork_parents, fork_children)
    pool.release(release_late)
    share_seqs = np.asarray(share_seqs)
    share_ok = window_reclaim.share_host(pool, share_seqs, share_blocks,
                                         share_counts, links=self.links[g])
    cache_ok = np.concatenate([cache_ok, share_ok | (share_seqs < 0)])
    res = pool.reserve(seq_ids, q_lens)
    window_reclaim.reclaim_host(pool, seq_ids, q_lens, res.ok)
    return fork_ok, res, cache_ok


def host_model(state):
  """The scheduler's model of the device pools: a `HostPool`, a
  `PooledHost` for a `pooled_step.PooledState`, a `shared_pool.SharedHost`
  for a `shared_pool.SharedState`."""
  if isinstance(state, pooled_step.PooledState):
    return PooledHost(state)
  if isinstance(state, shared_pool.SharedState):
    return shared_pool.SharedHost(state)
  return HostPool(state)


def pool_needs(pool, total: int, beam_width: int, config) -> list[tuple[int, int]]:
  """Per pool: `(blocks a request of up to `total` tokens and `beam_width`
  beams needs at its longest, the pool's blocks)`. Beam groups are preempted
  whole, so all beams must fit together (at worst each beam owns all its
  blocks; retired beams are released before the next forks and
  reservations); with a window, what reclamation lets a sequence hold
  (`window_reclaim.blocks_needed`); the shared pool: summed over its
  sub-groups."""
  if isinstance(pool, shared_pool.SharedHost):
    return [(beam_width * sum(window_reclaim.blocks_needed(
        total, config.block_size, w, config.max_tokens_per_step)
                              for w in pool.windows), pool.num_blocks)]
  return [(beam_width * window_reclaim.blocks_needed(
      total, config.block_size, p.window, config.max_tokens_per_step,
      deferred=p.caching), p.num_blocks)
          for p in host_pools(pool)]


def held_blocks(window: int | None, length: int, block_size: int) -> int:
  """Blocks a sequence of `length` tokens holds in a pool of `window` (None:
  every block) between steps, after its reclamation (prefix caching's
  deferred columns not counted): `ceil(length / bs) -
  block_manager.reclaimable_columns(window, length, bs)`."""
  return -(-length // block_size) - bm.reclaimable_columns(window, length, block_size)


def host_pools(pool) -> list:
  """The `HostPool`s of the scheduler's model `pool` (a `PooledHost`'s, or
  `pool` itself)."""
  return list(getattr(pool, "pools", [pool]))


def local_admission_room(pools, running, *, rows: int, block_size: int,
                         max_tokens_per_step: int) -> list[int]:
  """Block-aware admission's room in each of `pools`, `HostPool`s with a
  window (`host_pools`):
  what is left once every running sequence holds its whole prompt (its
  blocks between steps, `held_blocks`) and the pool keeps room for a step:

    room[g] = available[g] - sum_s (held(w_g, len(s.tokens)) - held(w_g, s.num_cached))
              - ceil(rows / bs) - (ceil(max_tokens_per_step / bs) + 1)

  A sequence of a windowed pool grows only inside a step: one block when a
  decode row crosses a block boundary (`ceil(rows / bs)` of them a step, on
  average), and a prompt chunk's blocks, both reclaimed after the step. A
  global pool's rows keep their growth, so it keeps the growth rule
  (`Scheduler._schedule`); charging a windowed pool that rule refused
  admissions that its blocks had room for. A waiting prompt of `P` tokens
  then costs `held(w_g, P)` blocks of `room[g]` (`Scheduler._schedule`).

  Args:
    pools: the windowed `HostPool`s.
    running: the running `Seq`s (`tokens`, `num_cached`).
    rows: this step's planned entries.
    block_size, max_tokens_per_step: the engine's.

  Returns:
    One int per pool (may be negative: no room)."""
  bs = block_size
  reserve = -(-rows // bs) + -(-max_tokens_per_step // bs) + 1
  return [p.num_available - reserve - sum(
      held_blocks(p.window, len(s.tokens), bs) - held_blocks(p.window, s.num_cached, bs)
      for s in running) for p in pools]


def block_rejection(pool, total: int, beam_width: int, config) -> str | None:
  """Why a request of up to `total` tokens and `beam_width` beams can never
  fit the pools alone (None if it can)."""
  for need, have in pool_needs(pool, total, beam_width, config):
    if need > have:
      return (f"needs {need} blocks of {config.block_size} tokens at its "
              f"longest, the pool has {have}")
  return None

