"""Block-aware admission: how many blocks a step leaves for new prompts.

`Scheduler._schedule` admits a waiting prompt only if its blocks leave the
running sequences room to grow in every pool (an estimate: `Scheduler._fit`
is exact), so that it is not soon paid for by a preemption. `BlockRoom` is
that estimate for one step, made once from the pool model and the running
sequences, then asked per waiting prompt (`fits`) and charged for each one
admitted (`take`):

* a pool keeping every block: `admission_headroom_steps` decode steps beyond
  this one (a block per `bs` steps each), after the running entries' growth
  this step;
* a windowed pool: `window_pool.local_admission_room`;
* the shared pool of a hybrid model (`shared_pool.SharedHost`): one room,
  a prompt's cost summed over its sub-groups (`SharedHost.admission_room`).

Off (everything fits) without `admission_headroom_steps`, with nothing
running, or with static batching.
"""

from __future__ import annotations

from paged_jax.serving import shared_pool
from paged_jax.serving import window_pool


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


class BlockRoom:
  """Block-aware admission's room for one step (see the module docstring).

  Args:
    pool: the scheduler's pool model (`window_pool.host_model`'s).
    config: the `EngineConfig` (`block_size`, `admission_headroom_steps`,
      `max_tokens_per_step`, `static_batching`).
    running: the running `Seq`s (`tokens`, `num_cached`).
    plan: this step's entries so far (a `packing.Plan`: `(Seq, tokens)`,
      its `decode_rows` leading one-token rows).
  """

  def __init__(self, pool, config, running, plan):
    c = config
    bs = self.block_size = c.block_size
    self.pool = pool
    self.check = bool(c.admission_headroom_steps and running and not c.static_batching)
    self.shared = self.check and isinstance(pool, shared_pool.SharedHost)
    pools = window_pool.host_pools(pool) if self.check and not self.shared else []
    self.windowed = [p for p in pools if p.window is not None]
    self.rooms = window_pool.local_admission_room(
        self.windowed, running, rows=len(plan), block_size=bs,
        max_tokens_per_step=c.max_tokens_per_step) if self.windowed else []
    if self.shared:  # one pool for every layer group: one room, a prompt's cost summed
      self.rooms = [pool.admission_room(
          running, rows=len(plan), max_tokens_per_step=c.max_tokens_per_step,
          headroom_steps=c.admission_headroom_steps)]
    self.full = [p for p in pools if p.window is None]
    self.free = (min(p.num_available for p in self.full) - _growth(plan, bs)
                 if self.full else 0)
    self.headroom = _cdiv(len(plan) * c.admission_headroom_steps, bs)

  def costs(self, seq) -> list[int]:
    """The blocks `seq`'s whole prompt holds in each room."""
    if self.shared:
      return [self.pool.held(len(seq.tokens))]
    return [window_pool.held_blocks(p.window, len(seq.tokens), self.block_size)
            for p in self.windowed]

  def fits(self, need: int, costs: list[int]) -> bool:
    """Whether a prompt whose chunk takes `need` new blocks (`costs` in each
    room, `costs`) leaves the room the running sequences need."""
    if not self.check:
      return True
    return not ((self.full and need > self.free - self.headroom)
                or any(k > r for k, r in zip(costs, self.rooms)))

  def take(self, need: int, costs: list[int]):
    """Charges an admitted prompt (`fits`' arguments)."""
    self.free -= need
    self.rooms = [r - k for r, k in zip(self.rooms, costs)]


def _growth(plan, bs: int) -> int:
  """Blocks the running entries of `plan` take this step (no copies counted;
  a steady decode row a block when its last is full)."""
  d = plan.decode_rows
  return sum(1 for seq, _ in plan[:d] if not seq.num_cached % bs) + sum(
      _cdiv(seq.num_cached + n, bs) - _cdiv(seq.num_cached, bs)
      for seq, n in (plan[d:] if d else plan))
