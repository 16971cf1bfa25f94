"""When to speculate: per-row sit-out after rejected proposals, and a
per-step timing rule (`SpecPolicy`; the engine keeps one, `spec_host.py`).

Two rules, each one function:

* **Sit-out** (`may_propose` / `record`): a row whose proposal had none of
  its drafts accepted misses, and so does one that looked for drafts and
  found none before any draft of its sequence was accepted (such a row
  costs no verification, only the wait for its last token; once a sequence
  has copied, a gap in the match does not stop it); after `m` misses in a
  row it proposes nothing for `base_sit_out * 2 ** (m - 1)` steps (at most
  `max_sit_out`; after a miss that found no draft at most
  `max_idle_sit_out`: a copying answer often starts after a few tokens of
  preamble), taking a plain one-row slot meanwhile. Any accepted draft resets it, and so does a
  new sequence taking the slot. On plain chat most rows stop proposing
  after a few steps, so a batch of them stops paying for drafts.
* **Timing** (`speculate` / `observe`): per decode bucket, the median of
  the last `window` measured seconds per emitted token of the plain
  step (as the engine runs it then: asynchronously, when no row proposes)
  and of the verification step. A step speculates unless the
  verification's cost per token exceeds the plain step's (with at least
  `min_samples` of each measured: one step that the machine's load
  slowed does not decide it); while it does,
  one step in `probe_every` speculates anyway to measure again (costs
  change with the batch's acceptance). Before both are measured, it
  speculates.

No clock is read here: the caller passes the measured seconds, so tests
inject costs and check the decisions exactly.

Example:
  >>> policy = SpecPolicy(max_seqs=2)
  >>> policy.record(0, owner="a", proposed=3, accepted=0)
  >>> policy.tick()
  >>> policy.may_propose(0, owner="a"), policy.may_propose(1, owner="b")
  (False, True)
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecPolicyConfig:
  """The policy's constants (hashable).

  Attributes:
    base_sit_out: steps a row sits out after its first miss (>= 1).
    max_sit_out: the longest sit-out, in steps (>= base_sit_out).
    max_idle_sit_out: the longest after a miss that found no draft
      (>= base_sit_out, <= max_sit_out).
    probe_every: while the timing rule skips speculation, one step in this
      many speculates to measure again (>= 1).
    window: measurements per bucket and kind the medians are over (>= 1).
    min_samples: measurements of each kind before the timing rule may skip
      (>= 1, <= window).

  Raises:
    ValueError: naming the field, expected vs given.
  """

  base_sit_out: int = 2
  max_sit_out: int = 64
  max_idle_sit_out: int = 4
  probe_every: int = 16
  window: int = 8
  min_samples: int = 3

  def __post_init__(self):
    for name in ("base_sit_out", "max_sit_out", "max_idle_sit_out", "probe_every",
                 "window", "min_samples"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if self.max_sit_out < self.base_sit_out:
      raise ValueError(f"max_sit_out={self.max_sit_out} must be >= "
                       f"base_sit_out={self.base_sit_out}")
    if not self.base_sit_out <= self.max_idle_sit_out <= self.max_sit_out:
      raise ValueError(f"max_idle_sit_out={self.max_idle_sit_out} must be in "
                       f"[base_sit_out={self.base_sit_out}, "
                       f"max_sit_out={self.max_sit_out}]")
    if self.min_samples > self.window:
      raise ValueError(f"min_samples={self.min_samples} must be <= "
                       f"window={self.window}")


PLAIN, SPEC = "plain", "spec"  # the two kinds of decode step `observe` takes


class SpecPolicy:
  """The engine's speculation decisions (see the module docstring).

  Args:
    max_seqs: sequence slots.
    config: the `SpecPolicyConfig`.
  """

  def __init__(self, max_seqs: int, config: SpecPolicyConfig = SpecPolicyConfig()):
    self.config = config
    self.step = 0  # decode steps seen (`tick`)
    self._misses = np.zeros(max_seqs, np.int64)
    self._sit_until = np.zeros(max_seqs, np.int64)
    self._owner: list = [None] * max_seqs
    self._hit = np.zeros(max_seqs, bool)  # some draft of the sequence accepted
    self._costs: dict = {}  # (bucket key, kind) -> recent seconds per token
    self._skipped: dict = {}  # bucket key -> steps skipped since a spec one

  # ------------------------------------------------------------- sit-out

  def _claim(self, slot: int, owner):
    if self._owner[slot] is not owner:
      self._owner[slot] = owner
      self._misses[slot] = 0
      self._sit_until[slot] = 0
      self._hit[slot] = False

  def may_propose(self, slot: int, owner) -> bool:
    """Whether the row in `slot` (held by `owner`, any object identifying
    its sequence) may propose drafts this step."""
    self._claim(slot, owner)
    return self.step >= self._sit_until[slot]

  def record(self, slot: int, owner, proposed: int, accepted: int):
    """The outcome of a row's proposal: `proposed` drafts verified
    (0: it looked and found none), `accepted` of them accepted. A miss
    (none accepted; finding none counts only until the sequence's first
    accepted draft) starts or doubles its sit-out; an accepted draft ends
    the streak."""
    self._claim(slot, owner)
    if accepted > 0:
      self._misses[slot] = 0
      self._hit[slot] = True
      return
    if proposed <= 0 and self._hit[slot]:
      return
    self._misses[slot] += 1
    c = self.config
    cap = c.max_sit_out if proposed > 0 else c.max_idle_sit_out
    wait = min(cap, c.base_sit_out << min(int(self._misses[slot]) - 1, 30))
    self._sit_until[slot] = self.step + 1 + wait

  def sit_out_steps(self, slot: int) -> int:
    """Steps until the row in `slot` may propose again (0: it may now)."""
    return max(0, int(self._sit_until[slot]) - self.step)

  def tick(self):
    """One decode step has been planned (call once per step, after
    `may_propose` of its rows)."""
    self.step += 1

  # -------------------------------------------------------------- timing

  def cost(self, key, kind: str) -> float | None:
    """The median seconds per token of the last `window` `kind` steps of
    bucket `key` (None: fewer than `min_samples` measured)."""
    recent = self._costs.get((key, kind), ())
    if len(recent) < self.config.min_samples:
      return None
    return float(np.median(recent))

  def observe(self, key, kind: str, seconds: float, tokens: int):
    """A measured step of bucket `key`: `kind` (`PLAIN` or `SPEC`) took
    `seconds` and emitted `tokens` tokens."""
    if kind not in (PLAIN, SPEC):
      raise ValueError(f"kind must be {PLAIN!r} or {SPEC!r}, got {kind!r}")
    if tokens <= 0 or not seconds > 0:
      return
    recent = self._costs.setdefault((key, kind), [])
    recent.append(seconds / tokens)
    del recent[:-self.config.window]

  def _costlier(self, key) -> bool:
    plain, spec = self.cost(key, PLAIN), self.cost(key, SPEC)
    return plain is not None and spec is not None and spec > plain

  def speculate(self, key) -> bool:
    """Whether a step of bucket `key` should speculate (call once per such
    step): unless the verification's measured cost per token exceeds the
    plain step's, then once every `probe_every` steps (to measure again)."""
    if not self._costlier(key):
      self._skipped[key] = 0
      return True
    n = self._skipped.get(key, 0) + 1
    if n >= self.config.probe_every:
      self._skipped[key] = 0
      return True
    self._skipped[key] = n
    return False

  def would_speculate(self, key) -> bool:
    """What the next `speculate(key)` will answer (changes nothing)."""
    return (not self._costlier(key)
            or self._skipped.get(key, 0) + 1 >= self.config.probe_every)
