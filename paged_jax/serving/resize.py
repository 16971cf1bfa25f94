"""Resizing a running engine's KV pool: grow it, or compact and shrink it,
without restarting and without losing a running sequence (issue #24 item 4).

`resize_pool(engine, num_blocks)` (`Engine.resize_kv_cache`):

1. applies the step in flight and runs the releases still queued (as
   `Engine.flush`; the requests that finish are kept for the next `step`);
2. on the host, refuses (returns False, nothing changed) when the live
   blocks (held by a sequence) outnumber `num_blocks`, or an unfinished
   request would need more at its longest;
3. on the device: `compaction.compact` moves every live and cached block into
   the front of the pool and rewrites every table, `kv_cache.copy_blocks`
   moves their K/V, `compaction.resize` cuts or grows the state (cached blocks
   past the new size are evicted) and `compaction.resize_cache` the cache;
4. on the host: the prefix index follows the compaction
   (`PrefixIndex.relabel`, then drops the evicted blocks), and the pool's
   NumPy model is rebuilt from the new state;
5. every compiled step is dropped (the pool's size is part of their shapes):
   the next steps compile again, or `Engine.warmup()` does it ahead.

Requests keep their slots, tokens and outputs: a run with a resize in the
middle gives the same greedy tokens as one without (tested). Not on a mesh,
not with sliding-window reclamation (a pool per window), not with
preemption by swap and not with the prefix cache's host level
(`kv_offloading_size`; the host tiers' copies name device blocks): refused
by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses

import jax
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import compaction
from paged_jax import kv_cache as kv_cache_lib
from paged_jax.serving import window_pool
from paged_jax.serving.host_pool import HostPool

if TYPE_CHECKING:
  from paged_jax.serving.engine import Engine


@jax.jit
def _compact(state, cache):
  state, moves = compaction.compact(state)
  cache = kv_cache_lib.copy_blocks(cache, moves.src, moves.dst)
  return state, cache, moves.new_ids


def check(engine: "Engine", num_blocks) -> int:
  """`num_blocks` as an int, or a ValueError saying what was expected."""
  if engine.mesh is not None:
    raise ValueError("resize_kv_cache runs on one device, not on a mesh")
  if engine.config.preemption_mode == "swap":
    raise ValueError("resize_kv_cache is not supported with "
                     "preemption_mode='swap'")
  spec = engine.config.speculative_config
  if spec is not None and spec.method == "draft_model":
    raise ValueError("resize_kv_cache is not supported with a draft model "
                     "(speculative_config method 'draft_model')")
  if engine.reclamation.on:
    raise ValueError("resize_kv_cache is not supported with sliding-window "
                     "block reclamation (sliding_window_reclamation=False turns "
                     "it off)")
  if engine.config.kv_offloading_size:
    raise ValueError("resize_kv_cache is not supported with "
                     "kv_offloading_size (the prefix cache's host level "
                     "names device blocks)")
  if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
    raise ValueError(f"num_blocks must be an int, got {num_blocks!r}")
  if int(num_blocks) <= 0:
    raise ValueError(f"num_blocks must be positive, got {num_blocks}")
  return int(num_blocks)


def resize_pool(engine: "Engine", num_blocks: int) -> bool:
  """Resizes `engine`'s pool to `num_blocks` blocks (module docstring).

  Returns:
    True when resized; False (nothing changed) when running sequences hold
    more than `num_blocks` blocks, or an unfinished request needs more at
    its longest (`Scheduler.largest_need`: it could never finish).

  Raises:
    ValueError: on a mesh, with preemption by swap, or for a size that is not
      a positive int.
  """
  m = check(engine, num_blocks)
  engine.drain()
  (pool,) = engine._pools  # pylint: disable=protected-access
  runner = engine._runner  # pylint: disable=protected-access
  if pool.num_live_blocks() > m or pool.largest_need() > m:
    return False
  state, cache, new_ids = _compact(runner.pool_state, runner.cache)
  state, res = compaction.resize(state, m)
  if not res.ok:  # the host model said it fits: the two disagree
    raise RuntimeError("resize refused after compaction (engine bug)")
  cache = compaction.resize_cache(cache, m)
  config = dataclasses.replace(engine.config, num_blocks=m)
  pool.follow_resize(config, state, np.asarray(new_ids), res.evicted)
  runner.replace_pool(config, state, cache)
  engine.config = config
  return True


class PoolResizing:
  """`Scheduler`'s side of `resize_pool` (a mixin: it reads the scheduler's
  queues, pool model and prefix index)."""

  def num_live_blocks(self) -> int:
    """Blocks held by sequences (neither free nor only cached)."""
    return self._pool.num_blocks - self._pool.num_free - self._pool.num_cached

  def largest_need(self) -> int:
    """Blocks the largest unfinished request needs at its longest (the
    admission rule of `_refusal`): a pool smaller than that never finishes it."""
    return max((need for s in self._waiting + self._running + self._swapped
                for need, _ in window_pool.pool_needs(
                    self._pool, s.group.prompt_len + s.group.params.max_new_tokens,
                    s.group.params.beam_width, self.config)), default=0)

  def follow_resize(self, config, state: bm.BlockState, new_ids: np.ndarray,
                    evicted: np.ndarray):
    """After `resize.resize_pool` (nothing in flight, no release queued):
    the config with the new `num_blocks`, the prefix index relabelled by the
    compaction's `new_ids` (old block -> new) without the `evicted` blocks
    (new ids), the pool's model rebuilt from the new `state`."""
    self.config = config
    if self._index is not None:
      self._index.relabel(new_ids)
      self._index.evict(evicted)
    self._pool = HostPool(state)
    self._fingerprint = self._pool.fingerprint()
    self._fitted = None
