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

Copies: each step's stores (its reserve's evictions and the victims' old
blocks, those not on the host yet) go in ONE batched device-to-host copy,
its loads in ONE host-to-device copy after it (`Runner.copy_prefix_blocks`
over a `kv_offload.NumpyHostPool`: pairs padded to a power of two; a store
is a small device gather fetched asynchronously and written into NumPy at
the next copy call, a load a NumPy gather and one device scatter), both
dispatched before the step and awaited by nothing but the step itself. A step that evicts
nothing and hits nothing on the host dispatches nothing. Loads per step are
capped at `max_loads` blocks, so the copy sizes are few and all compiled at
warm-up (`Runner.compile_prefix_copies`).

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
    self._max_loads = 0

  def init_prefix_offload(self, num_host_blocks: int):
    """Turns the host level on with `num_host_blocks` host blocks (the
    engine calls it once the host pool is allocated)."""
    self._host_prefix = HostPrefixTier(num_host_blocks)
    self._max_loads = max_loads(self.config)

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
    """After the model accepted a step (before the index drops `evicted`):
    stores the evicted blocks and the victims' old blocks on the host,
    re-indexes the victims, queues the step's copies. Returns the blocks
    the device index lost (victims; `evicted` is counted by the caller)."""
    tier, index = self._host_prefix, self._index
    mine = {seq: self._loads.get(seq, ()) for seq in admitted}
    loads = [ld for seq in admitted for ld in mine[seq]]
    victims = [v for _, _, v in loads]
    gone = [(index.hash_of(int(b)), int(b)) for b in victims]
    evicted = np.asarray(evicted).reshape(-1)
    gone += [(index.hash_of(b), b) for b in evicted[evicted >= 0].tolist()]
    gone = [(h, b) for h, b in gone if h is not None]
    device_of = dict(gone)
    stored = tier.store(h for h, _ in gone)
    index.evict(victims)
    for h, _, v in loads:
      if not index.insert(h, v):
        raise RuntimeError("a loaded block's hash was indexed already "
                           "(engine bug)")
    self._loads, self._victims = {}, set()
    tier.begin_step()
    if stored or loads:
      self._prefix_copies = Copies(
          [device_of[h] for h, _ in stored], [b for _, b in stored],
          [b for _, b, _ in loads], victims)
    st, bs = self.stats, self.config.block_size
    for seq in admitted:  # first admissions, as the device hit rate
      if not seq.group.admitted:
        device = len(self._shares.get(seq, ())) - len(mine[seq])
        st.external_prefix_queried_tokens += seq.group.prompt_len - device * bs
        st.external_prefix_hit_tokens += len(mine[seq]) * bs
    return len(victims)

  def take_prefix_copies(self) -> Copies | None:
    """The committed step's copies (None: nothing to move), once."""
    out, self._prefix_copies = self._prefix_copies, None
    return out
