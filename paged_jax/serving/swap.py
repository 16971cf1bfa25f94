"""Preemption by swap, the scheduler's side (issue #24; vLLM v0's
`--preemption-mode swap`).

With `EngineConfig.preemption_mode == "swap"` a preempted sequence whose K/V
fits the host tier is moved there instead of being dropped: it keeps its
sequence slot and its computed tokens, waits in `_swapped`, and is admitted
again before any waiting request, its blocks coming back from host memory
instead of being recomputed. Beam groups, a sample whose fork is still
pending (or that a pending fork reads), and a victim the tier cannot hold
are recomputed as before.

Blocks keep one source of truth: the swaps join the step's bookkeeping
(`swap_step.bookkeeping`: register -> release -> drop -> swap_out -> fork ->
release -> share -> swap_in -> reserve), which the host applies first to its
exact models (`SwapPool`: `host_pool.HostPool` plus
`host_tier_pool.HostTierPool`, one trial for both) inside `_fit`, so every
swap the device runs is one the models granted; the step's fingerprint
covers the tier too. The copies go with the models' pairs
(`swap_step.dispatch_copies`, before the step, in `runner.Runner`).

First version: one device (no mesh), no prefix caching, one decode step per
dispatch (`EngineConfig` refuses the other combinations).
"""

from __future__ import annotations

import numpy as np

from paged_jax import host_tier
from paged_jax.serving import swap_step
from paged_jax.serving.host_pool import HostPool
from paged_jax.serving.host_tier_pool import HostSwap, HostTierPool

MODES = ("recompute", "swap")


def check_config(config) -> None:
  """Validates `EngineConfig.preemption_mode` / `swap_space_blocks`.

  Raises:
    ValueError: naming the bad value or combination.
  """
  mode, n = config.preemption_mode, config.swap_space_blocks
  if mode not in MODES:
    raise ValueError(f"preemption_mode must be one of {MODES}, got {mode!r}")
  if not isinstance(n, int) or isinstance(n, bool) or n < 0:
    raise ValueError(f"swap_space_blocks must be an int >= 0, got {n!r}")
  if mode == "swap":
    if n < 1:
      raise ValueError("preemption_mode='swap' needs swap_space_blocks >= 1, "
                       f"got {n}")
    if config.enable_prefix_caching:
      raise ValueError("preemption_mode='swap' does not support "
                       "enable_prefix_caching yet")
    if config.num_scheduler_steps != 1:
      raise ValueError("preemption_mode='swap' needs num_scheduler_steps=1, "
                       f"got {config.num_scheduler_steps}")
    if getattr(config, "speculative_config", None) is not None:
      # The verification step's dispatch carries no swaps.
      raise ValueError("preemption_mode='swap' does not support "
                       "speculative_config yet")


class SwapPool(HostPool):
  """The device pool's model and the host tier's, in one trial: `begin`,
  `commit`, `rollback` and `fingerprint` (u32[8]: the pool's 5, the tier's
  3) cover both, and `bookkeeping` runs the swaps queued in `ids`."""

  def __init__(self, state, tier: host_tier.HostTier, rows: int):
    super().__init__(state)
    self.tier = HostTierPool(tier)
    self.rows = rows
    self.ids = {"out": [], "in": [], "drop": []}  # this step's slots
    self.last: tuple[HostSwap, HostSwap] | None = None  # the committed trial's

  def begin(self):
    super().begin()
    self.tier.begin()

  def commit(self):
    super().commit()
    self.tier.commit()

  def rollback(self):
    super().rollback()
    self.tier.rollback()

  def fingerprint(self) -> np.ndarray:
    return np.concatenate([super().fingerprint(), self.tier.fingerprint()])

  def arrays(self) -> swap_step.SwapInputs:
    def pad(ids):
      out = np.full(self.rows, -1, np.int32)
      out[:len(ids)] = ids
      return out
    return swap_step.SwapInputs(swap_out=pad(self.ids["out"]),
                                swap_in=pad(self.ids["in"]),
                                drop=pad(self.ids["drop"]))

  def bookkeeping(self, *x):
    s = self.arrays()
    fork_ok, res, cache_ok, out, back = self.tier.bookkeeping(
        self, *x, s.swap_out, s.swap_in, s.drop)
    if not np.all(out.ok[s.swap_out >= 0]):  # `_swap_out_victim` checked room
      raise RuntimeError(f"a swap-out was refused: engine bug (slots "
                         f"{s.swap_out.tolist()}, ok {out.ok.tolist()})")
    refused = [int(i) for i, ok in zip(s.swap_in, back.ok) if i >= 0 and not ok]
    if refused:  # its entry must not reserve on the empty slot: refuse it too
      res.ok = res.ok & ~np.isin(np.asarray(x[-2]), refused)  # (`ok` may be shared)
    self.last = (out, back, s)
    return fork_ok, res, cache_ok


class Swapping:
  """`Scheduler`'s swap preemption (see the module docstring)."""

  def _init_swapping(self, initial_state):
    self._swapped = []  # sorted by order: swapped-out sequences
    self._swap_built = None  # the last built step's (SwapInputs, out, back)
    c = self.config
    if c.preemption_mode != "swap":
      return
    tier = host_tier.init(initial_state, num_host_blocks=c.swap_space_blocks)
    self._pool = SwapPool(initial_state, tier, c.max_batch)
    self._fingerprint = self._pool.fingerprint()

  def _find(self, request_id):
    for seq in self._running + self._waiting + self._swapped:
      if seq.group.request.request_id == request_id:
        return seq.group
    return None

  def _swap_out_victim(self, victim, plan) -> bool:
    """Swaps `victim` out instead of recomputing it when it can; True if so."""
    pool = self._pool
    g = victim.group
    if (not isinstance(pool, SwapPool) or g.is_beam or victim.fork_from >= 0
        or victim.slot < 0 or victim not in self._running
        or any(s.fork_from == victim.slot for s in g.live)):
      return False
    bs = self.config.block_size
    need = -(-int(pool.lens[victim.slot]) // bs)
    queued = sum(-(-int(pool.lens[s]) // bs) for s in pool.ids["out"])
    if need == 0 or need > pool.tier.num_free - queued:
      return False
    plan[:] = [(s, n) for s, n in plan if s is not victim]
    self._running.remove(victim)
    pool.ids["out"].append(victim.slot)
    self._insert(self._swapped, victim)
    g.output.preemptions += 1
    self.stats.preemptions += 1
    self.stats.swapped_out += 1
    return True

  def _swap_in_admissions(self, plan, admitted, budget: int, rows: int):
    """Admits swapped-out sequences first, oldest first, while rows, the
    token budget and (an estimate: `_fit` is exact) the pool allow; they join
    `admitted`, so `_fit` takes them back like any admission. Returns
    `(budget, rows)`."""
    pool = self._pool
    if not self._swapped:
      return budget, rows
    bs = self.config.block_size
    free = pool.num_available
    while self._swapped and rows < self.config.max_batch and budget > 0:
      seq = self._swapped[0]
      need = -(-int(pool.tier.lens[seq.slot]) // bs) + 1
      if need > free:
        break
      free -= need
      self._swapped.pop(0)
      pool.ids["in"].append(seq.slot)
      self._insert(self._running, seq)
      admitted.append(seq)
      rows += 1
      n = min(len(seq.tokens) - seq.num_cached, budget)
      if n > 0:
        plan.append((seq, n))
        budget -= n
    return budget, rows

  def _unswap_in(self, seq, plan) -> bool:
    """Takes back this step's swap-in of `seq`; True if it was one."""
    pool = self._pool
    if not isinstance(pool, SwapPool) or seq.slot not in pool.ids["in"]:
      return False
    plan[:] = [(s, n) for s, n in plan if s is not seq]
    self._running.remove(seq)
    pool.ids["in"].remove(seq.slot)
    self._insert(self._swapped, seq)
    return True

  def _drop_swapped(self, seq) -> bool:
    """A swapped-out sequence that finished or was aborted: its host blocks
    are dropped by the next step (its slot is free after it). True if so."""
    if seq not in self._swapped:
      return False
    self._swapped.remove(seq)
    self._pool.ids["drop"].append(seq.slot)
    self._release_late_pending.append(seq.slot)  # free after the next step
    seq.slot = -1
    return True

  def host_usage(self) -> dict:
    """`{"host_blocks_used", "host_blocks_total", "swapped"}`: the host
    tier's blocks holding swapped-out K/V, its size, and the sequences
    swapped out; with the prefix cache's host level its blocks (all 0
    without a host tier)."""
    pool = self._pool
    if not isinstance(pool, SwapPool):  # the prefix cache's host level, if any
      return self.prefix_host_usage()
    t = pool.tier
    return {"host_blocks_used": t.num_blocks - t.num_free,
            "host_blocks_total": t.num_blocks, "swapped": len(self._swapped)}

  def has_swaps(self) -> bool:
    return isinstance(self._pool, SwapPool) and any(self._pool.ids.values())

  def take_swaps(self):
    """The step just built's `(SwapInputs, out, back)` (None without swap
    preemption), counted in the stats; clears the queued swaps."""
    pool = self._pool
    if not isinstance(pool, SwapPool):
      return None
    if pool.last is None:
      return None
    out, back, s = pool.last
    pool.last = None
    for k, sent in (("out", s.swap_out), ("in", s.swap_in), ("drop", s.drop)):
      pool.ids[k] = [i for i in pool.ids[k] if i not in set(sent.tolist())]
    blocks_out = int(np.sum((out.src >= 0) & (out.dst >= 0)))
    blocks_in = int(np.sum((back.src >= 0) & (back.dst >= 0)))
    self.stats.swapped_in += int(np.sum(back.ok))
    self.stats.swap_blocks_out += blocks_out
    self.stats.swap_blocks_in += blocks_in
    return s, out, back
