"""The prefix cache's host level, the scheduler's side (issue #24; vLLM's
`--kv-offloading-size`). A mixin of `scheduler.Scheduler`.

With `EngineConfig.kv_offloading_size` GiB, cached blocks that the device
evicts are copied to a host pool (`paged_jax.prefix_tier.HostPrefixTier`
indexes them by hash, LRU), and an admission whose device lookup stops short
goes on there, block by block (a block on the device is taken from the
device, one on the host is loaded, the first block on neither ends the hit).

A host hit needs no new block transition. It is loaded into a *victim*: one
of the oldest cached blocks of the device ring, which no hit of this step
holds. Before the step the victim's old content is copied to the host (it is
an eviction like any other) and the host block is copied into it; the step
then `share`s the victim like any device hit (a cached block leaves the ring,
its refcount 1), and the device index maps the new hash to it. So the
step's bookkeeping, the host model and the device's fingerprint are exactly
those of prefix caching without the tier: only the index and the K/V change.

Stores ahead of eviction: a cached block's K/V never changes while it waits
in the device ring (refcount 0, full, registered), so it can be copied to
the host any time before its eviction. Once the pool has fewer than
`prestore_blocks` free blocks (the next steps may evict), a step that copies
anything also copies the ring's oldest blocks not on the host yet (up to
`prestore_blocks` in all), and a step whose ring head holds fewer than a
quarter that many blocks known to be on the host copies them even if it had
nothing else to move.
An eviction then finds its hash on the host and copies nothing: at 0% host
hits a steady decode evicts a block every few steps but dispatches one
batched copy per ~`3/4 prestore_blocks` evictions, not one per evicting step
(each dispatch costs the host ~0.1-0.5 ms on CPU: RESULTS.md 14f). An evicted
block not stored ahead (a step that evicted more than the head held, or
blocks cached and evicted within one step) is stored at its eviction, as
before: correctness never depends on the ahead count, which is only an
estimate (device hits that take blocks out of the ring are not counted).
Blocks stored ahead and then hit on the device cost their bytes for nothing
(at most `prestore_blocks` a dispatch).

Copies: each step's stores (its reserve's evictions and the victims' old
blocks, those not on the host yet, and the blocks stored ahead) go in ONE
batched device-to-host copy, its loads in ONE host-to-device copy after it
(`Runner.copy_prefix_blocks` over a `kv_offload.NumpyHostPool`: pairs padded
to a power of two; a store is a small device gather fetched asynchronously
and written into NumPy at the next copy call, a load a NumPy gather and one
device scatter), both dispatched before the step and awaited by nothing but
the step itself. A step that evicts nothing off the host, hits nothing on
the host, and either finds enough blocks stored ahead or has
`prestore_blocks` free blocks, dispatches nothing. Loads per
step are capped at `max_loads` blocks and stores at `max_stores`, so the
copy sizes are few and all compiled at warm-up
(`Runner.compile_prefix_copies`).

First version: one device, one decode step per dispatch, no speculation,
preemption by recompute (`check_config` refuses the rest).
"""

from __future__ import annotations

import math

import numpy as np

from paged_jax.prefix_tier import HostPrefixTier


def check_config(config) -> None:
  """Validates `EngineConfig.kv_offloading_size` (GiB; 0 = no host level).

  Raises:
    ValueError: naming the bad value or combination.
  """
  size = config.kv_offloading_size
  if (isinstance(size, bool) or not isinstance(size, (int, float))
      or not math.isfinite(size) or size < 0):
    raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got "
                     f"{size!r}")
  if not size:
    return
  if not config.enable_prefix_caching:
    raise ValueError("kv_offloading_size > 0 needs enable_prefix_caching=True "
                     "(it is the prefix cache's host level)")
  if config.preemption_mode != "recompute":
    raise ValueError("kv_offloading_size > 0 needs preemption_mode='recompute', "
                     f"got {config.preemption_mode!r}")
  if config.num_scheduler_steps != 1:
    raise ValueError("kv_offloading_size > 0 needs num_scheduler_steps=1, got "
                     f"{config.num_scheduler_steps}")
  if getattr(config, "speculative_config", None) is not None:
    raise ValueError("kv_offloading_size > 0 does not support "
                     "speculative_config yet")


def max_loads(config) -> int:
  """Blocks one step may load from the host: a power of two >= the blocks a
  step can evict (`max_tokens_per_step // block_size + max_batch`), so
  that the copies' padded sizes are 1, 2, ..., this, all compiled at
  warm-up."""
  n = config.max_tokens_per_step // config.block_size + config.max_batch
  return 1 << (n - 1).bit_length()


def max_stores(config) -> int:
  """Blocks one step may store: its evictions and its loads' victims (each
  at most `max_loads`), or the blocks it stores ahead, whichever is more; a
  power of two, so that the padded store sizes are all compiled at
  warm-up."""
  return 2 * max_loads(config)


# The most device memory one store's staging buffer (its gathered blocks)
# may take: it bounds `prestore_blocks` for large blocks.
PRESTORE_BYTES = 64 * 2**20


def prestore_blocks(config, bytes_per_block: int) -> int:
  """Ring blocks a step stores ahead of their eviction at most (module
  docstring): `max_stores`, but at most half the pool and
  `PRESTORE_BYTES` of staging."""
  return max(1, min(max_stores(config), config.num_blocks // 2,
                    PRESTORE_BYTES // bytes_per_block))


class Copies:
  """A step's copies: `out` device -> host, `back` host -> device, each a
  pair of `i32[k]` arrays (`src`, `dst`) as `swap_step.dispatch_copies`
  takes them."""

  class Pairs:
    def __init__(self, src, dst):
      self.src = np.asarray(src, np.int32)
      self.dst = np.asarray(dst, np.int32)

  def __init__(self, out_src, out_dst, in_src, in_dst):
    self.out = Copies.Pairs(out_src, out_dst)
    self.back = Copies.Pairs(in_src, in_dst)


class PrefixOffload:
  """`Scheduler`'s host level of the prefix cache (module docstring)."""

  def _init_prefix_offload(self):
    self._host_prefix: HostPrefixTier | None = None
    self._loads: dict = {}  # seq -> [(hash, host block, victim)], this step
    self._victims: set[int] = set()  # device blocks loaded into this step
    self._prefix_copies: Copies | None = None  # the committed step's
    self._max_loads = self._prestore = 0
    self._ahead = 0  # ring-head blocks on the host (an estimate: the trigger)

  def init_prefix_offload(self, num_host_blocks: int, bytes_per_block: int):
    """Turns the host level on with `num_host_blocks` host blocks of
    `bytes_per_block` (the engine calls it once the host pool is
    allocated)."""
    self._host_prefix = HostPrefixTier(num_host_blocks)
    self._max_loads = max_loads(self.config)
    self._prestore = min(prestore_blocks(self.config, bytes_per_block),
                         num_host_blocks)

  @property
  def host_prefix(self) -> HostPrefixTier | None:
    return self._host_prefix

  def prefix_host_usage(self) -> dict:
    t = self._host_prefix
    if t is None:
      return {"host_blocks_used": 0, "host_blocks_total": 0, "swapped": 0}
    return {"host_blocks_used": len(t), "host_blocks_total": t.num_blocks,
            "swapped": 0}

  def _ring_victims(self, n: int, exclude: set[int]) -> list[int]:
    """Up to `n` cached device blocks, oldest first, none in `exclude`."""
    pool = self._pool
    if n <= 0 or not pool.lru_len:
      return []
    window = (pool.lru_head + np.arange(pool.lru_len)) % pool.lru.shape[0]
    ring = pool.lru[window]
    ring = ring[ring >= 0]
    if exclude:
      ring = ring[~np.isin(ring, np.fromiter(exclude, np.int32))]
    return ring[:n].tolist()

  def _extend_hit(self, seq, hashes, blocks: list[int]) -> list[int]:
    """`blocks` (the device hit of `hashes`) extended block by block from
    the device index and the host level; records the loads."""
    tier = self._host_prefix
    if tier is None:
      return blocks
    for i, b in enumerate(blocks):  # a block loaded into this step is not a hit
      if b in self._victims:
        blocks = blocks[:i]
        break
    if len(blocks) >= len(hashes):
      return blocks
    held = {b for bl in self._shares.values() for b in bl}
    held.update(self._victims)
    held.update(blocks)
    loads, same_step = [], self._registering_by_hash
    loaded = sum(len(v) for v in self._loads.values())
    loading = {h for v in self._loads.values() for h, _, _ in v}
    i = len(blocks)
    while i < len(hashes):
      h = hashes[i]
      b = self._index.lookup([h])
      if b and b[0] not in held:
        blocks.append(b[0])
        held.add(b[0])
      elif h in same_step:
        blocks.append(same_step[h])
      elif (not b and h not in loading and loaded + len(loads) < self._max_loads
            and h in tier):
        victim = self._ring_victims(1, held)
        if not victim:
          break
        (host_block,) = tier.lookup([h])
        loads.append((h, host_block, victim[0]))
        held.add(victim[0])
        blocks.append(victim[0])
      else:
        break
      i += 1
    # A block taken from the device after the last load is fine; the hit
    # ends at the first block found nowhere.
    if loads:
      self._loads[seq] = loads
      self._victims.update(v for _, _, v in loads)
    return blocks

  def _drop_loads(self, seq):
    """An admission taken back: its loads are too."""
    loads = self._loads.pop(seq, None)
    if loads:
      self._victims.difference_update(v for _, _, v in loads)
      self._host_prefix.unpin([b for _, b, _ in loads])

  def _commit_offload(self, evicted: np.ndarray, admitted) -> int:
    """After the model accepted a step (before the index drops `evicted`,
    `i32[k]` real block ids): stores the evicted blocks and the victims' old
    blocks on the host (those not there yet), stores ahead (`_store_ahead`),
    re-indexes the victims, queues the step's copies. Returns the blocks the
    device index lost (victims; `evicted` is counted by the caller)."""
    tier = self._host_prefix
    mine = {seq: self._loads.get(seq, ()) for seq in admitted} if self._loads else {}
    loads = [ld for seq in admitted for ld in mine.get(seq, ())]
    stored = []
    if loads or evicted.size:
      stored = self._store_evicted([v for _, _, v in loads] + evicted.tolist())
    if self._pool.num_free < self._prestore and (
        stored or loads or self._ahead < self._prestore // 4):
      stored += self._store_ahead(max(self._prestore, len(stored)) - len(stored))
    if loads:
      self._reindex(loads)
    if self._loads or self._victims:
      self._loads, self._victims = {}, set()
    tier.begin_step()
    if stored or loads:
      self._prefix_copies = Copies(
          [b for b, _ in stored], [host for _, host in stored],
          [b for _, b, _ in loads], [v for _, _, v in loads])
    st, bs = self.stats, self.config.block_size
    for seq in admitted:  # first admissions, as the device hit rate
      if not seq.group.admitted:
        n = len(mine.get(seq, ()))
        device = len(self._shares.get(seq, ())) - n
        st.external_prefix_queried_tokens += seq.group.prompt_len - device * bs
        st.external_prefix_hit_tokens += n * bs
    return len(loads)

  def _store_evicted(self, gone: list[int]) -> list[tuple[int, int]]:
    """Host blocks for the device blocks `gone` (evicted, or victims of
    this step's loads) whose hash is not on the host yet: `[(device block,
    host block)]` to copy. One on the host already is not refreshed in the
    host's LRU here: `_store_ahead` refreshed it when it neared the ring's
    head (so a step that evicts only blocks stored ahead costs a dict
    lookup per block)."""
    hash_of, tier = self._index.hash_of, self._host_prefix
    self._ahead -= len(gone)
    todo = []
    for b in gone:
      h = hash_of(b)
      if h is not None and h not in tier:
        todo.append((h, b))
    if not todo:
      return []
    device_of = dict(todo)
    return [(device_of[h], host) for h, host in tier.store(h for h, _ in todo)]

  def _reindex(self, loads):
    """The victims of `loads` (`[(hash, host block, victim)]`) now hold the
    loaded hashes."""
    index = self._index
    index.evict([v for _, _, v in loads])
    for h, _, v in loads:
      if not index.insert(h, v):
        raise RuntimeError("a loaded block's hash was indexed already "
                           "(engine bug)")

  def _store_ahead(self, budget: int) -> list[tuple[int, int]]:
    """Host blocks for up to `budget` of the device ring's oldest blocks
    not on the host yet, as `[(device block, host
    block)]` to copy (module docstring). Run on the ring as this step
    leaves it: none of its blocks is written by this step (refcount 0), and
    each was computed by an earlier one. Sets the ahead count."""
    pool, tier, index = self._pool, self._host_prefix, self._index
    if budget <= 0 or not pool.lru_len:
      return []
    n = min(pool.lru_len, 4 * self._prestore)
    ring = pool.lru[(pool.lru_head + np.arange(n)) % pool.lru.shape[0]]
    held, todo = [], []  # (on the host already, not yet), in ring order
    for b in ring[ring >= 0].tolist():
      h = index.hash_of(b)
      if h is None:  # (a cached block is indexed; not expected)
        break
      if h in tier:
        held.append(h)
      elif len(todo) == budget:
        break
      else:
        todo.append((h, b))
    tier.store(held)  # refreshed in the host's LRU, in the device's order
    device_of = dict(todo)
    out = [(device_of[h], host) for h, host in tier.store(h for h, _ in todo)]
    self._ahead = len(held) + len(out)
    return out

  def take_prefix_copies(self) -> Copies | None:
    """The committed step's copies (None: nothing to move), once."""
    out, self._prefix_copies = self._prefix_copies, None
    return out
