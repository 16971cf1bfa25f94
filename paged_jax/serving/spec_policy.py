"""When to speculate: per-row sit-out after rejected proposals, and a
cost rule that sizes each verification step (`SpecPolicy`; the engine keeps
one, `spec_host.py`).

Two rules, each one function:

* **Sit-out** (`may_propose` / `record`): a row whose proposal had none of
  its drafts accepted misses, and so does one that looked for drafts and
  found none before any draft of its sequence was accepted (such a row
  costs no verification, only the wait for its last token; once a sequence
  has copied, a gap in the match does not stop it); after `m` misses in a
  row it proposes nothing for `base_sit_out * 2 ** (m - 1)` steps (at most
  `max_sit_out`; after a miss that found no draft at most
  `max_idle_sit_out`: a copying answer often starts after a few tokens of
  preamble), taking a plain one-row slot meanwhile. Once a sequence has
  had a draft accepted, its first `grace_after_hit` rejections in a row
  cost no sit-out (a copying answer that paraphrases a word is back in
  step with its source a few tokens later); the doubling counts from the
  first miss past them. Any accepted draft resets it, and so does a
  new sequence taking the slot. On plain chat most rows stop proposing
  after a few steps, so a batch of them stops paying for drafts.
* **Cost** (`choose`): which of the proposed drafts a step of decode bucket
  `key` verifies, from each program's measured seconds per step
  (`set_costs`: the plain step and the verification step of every draft
  budget `D`, timed once at warm-up, `spec_host.measure_costs`; plus, per
  kind, the median excess of the engine's last `window` such steps over
  their program, `observe`: the host's work, and the overlap a
  verification step loses, since the next step waits for its results;
  RESULTS 16h: a 4-draft verification at batch 16 costs 1.07x the plain
  program alone, 1.5x in the engine) and each
  row's estimated acceptance `alpha` (`acceptance`: the chance that a
  draft is accepted once the drafts before it were; accepted drafts over
  drafts examined, the row's own record weighted against the batch's,
  from a prior of `prior_acceptance`). Draft `j` of a row is worth
  `alpha ** j` expected tokens; for each budget `D` the step keeps the `D`
  most valuable drafts (every row's first drafts before any row's second:
  the tail drafts go first) and expects `rows + their worth` tokens; the
  step takes the budget of most expected tokens per second, or no drafts
  at all when the plain step's `rows / costs[0]` is higher. So a
  verification that rounds its drafts up to a costly budget is trimmed to
  the budget below when that pays more, and at batch 16 on CPU (a budget of
  16 rows costs ~1.5x the plain step) a row verifies only what its
  acceptance pays for. While it chooses no drafts, one step in
  `probe_every` verifies its best budget anyway, so the acceptance
  estimates keep learning. Without costs for `key` (no warm-up) every
  draft is verified.

No clock is read here: the caller passes the measured seconds, so tests
inject costs and check the decisions exactly.

Example:
  >>> policy = SpecPolicy(max_seqs=2)
  >>> policy.record(0, owner="a", proposed=3, accepted=0)
  >>> policy.tick()
  >>> policy.may_propose(0, owner="a"), policy.may_propose(1, owner="b")
  (False, True)
  >>> policy = SpecPolicy(max_seqs=16)  # acceptance 0.7 (the prior)
  >>> policy.set_costs(16, {0: 0.124, 4: 0.132, 8: 0.144, 16: 0.181})
  >>> policy.choose(16, slots=range(16), drafts=[4] * 4 + [0] * 12).tolist()[:5]
  [2, 2, 2, 2, 0]
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
    grace_after_hit: rejections in a row that a sequence with an accepted
      draft takes without sitting out (>= 0; 0: every rejection sits out).
      RESULTS 16j: on the copying prompt at batch 1 the sit-out after the
      paraphrase's one rejected proposal skipped a step whose 4 drafts
      were all accepted (16 decode steps instead of the matcher's 15).
    probe_every: while the cost rule chooses no drafts, one step in this
      many verifies its best budget anyway (>= 1).
    window: the engine's measured steps per bucket and kind (plain or
      verification) whose median overhead is added to the programs' costs
      (>= 1).
    prior_acceptance: the acceptance estimate before anything is measured
      (in (0, 1)). SmolLM2's n-gram drafts measured 0.6 on plain chat
      (mostly first drafts) and ~0.8 copying (2.5 of 4 drafts accepted
      per row: alpha ~0.82 under this model; RESULTS 16h); below ~0.6 a
      fresh copying row at batch 1 may not pass the rule on noisy warm-up
      costs, and then learns its acceptance only from the probes.
    prior_weight: drafts examined that the prior (for the batch's estimate)
      and the batch's estimate (for a row's) count as (> 0).

  Raises:
    ValueError: naming the field, expected vs given.
  """

  base_sit_out: int = 2
  max_sit_out: int = 64
  max_idle_sit_out: int = 4
  grace_after_hit: int = 1
  probe_every: int = 16
  window: int = 8
  prior_acceptance: float = 0.7
  prior_weight: float = 2.0

  def __post_init__(self):
    if not 0 < self.prior_acceptance < 1:
      raise ValueError(f"prior_acceptance must be in (0, 1), got {self.prior_acceptance!r}")
    if not self.prior_weight > 0:
      raise ValueError(f"prior_weight must be > 0, got {self.prior_weight!r}")
    for name, low in (("base_sit_out", 1), ("max_sit_out", 1), ("max_idle_sit_out", 1),
                      ("probe_every", 1), ("window", 1), ("grace_after_hit", 0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if self.max_sit_out < self.base_sit_out:
      raise ValueError(f"max_sit_out={self.max_sit_out} must be >= "
                       f"base_sit_out={self.base_sit_out}")
    if not self.base_sit_out <= self.max_idle_sit_out <= self.max_sit_out:
      raise ValueError(f"max_idle_sit_out={self.max_idle_sit_out} must be in "
                       f"[base_sit_out={self.base_sit_out}, "
                       f"max_sit_out={self.max_sit_out}]")


def best_drafts(costs: dict, drafts: np.ndarray, alpha: np.ndarray) -> np.ndarray:
  """The cost rule (module docstring) on one step: how many of its drafts
  each row verifies.

  Args:
    costs: seconds per step: `costs[0]` the plain step, `costs[D]` the
      verification step with a budget of `D` draft rows (`D >= 1`).
    drafts: int[n], the drafts each of the step's `n` rows proposed.
    alpha: f64[n], each row's acceptance estimate, in [0, 1).

  Returns:
    i64[n], the first `m[i] <= drafts[i]` drafts of row `i` to verify; all
    zero when the plain step is expected to emit more tokens per second.
  """
  drafts = np.asarray(drafts, np.int64)
  n, total = drafts.shape[0], int(drafts.sum())
  if not total:
    return np.zeros(n, np.int64)
  rows = np.repeat(np.arange(n), drafts)
  j = np.arange(total) - np.repeat(np.cumsum(drafts) - drafts, drafts) + 1
  worth = np.asarray(alpha, np.float64)[rows] ** j
  order = np.argsort(-worth, kind="stable")  # ties: (row, j) order, prefixes
  gain = np.concatenate([[0.0], np.cumsum(worth[order])])
  best, take = n / costs[0], 0
  for budget in sorted(d for d in costs if d > 0):
    t = min(budget, total)
    rate = (n + gain[t]) / costs[budget]
    if rate > best:
      best, take = rate, t
    if budget >= total:
      break
  return np.bincount(rows[order[:take]], minlength=n).astype(np.int64)


PLAIN, SPEC = "plain", "spec"  # the two kinds of decode step `observe` tells apart


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
    self._accepted = np.zeros(max_seqs, np.int64)  # the row's drafts accepted
    self._examined = np.zeros(max_seqs, np.int64)  # and examined
    self._batch = np.zeros(2, np.int64)  # every row's: accepted, examined
    self._programs: dict = {}  # bucket key -> {draft budget (0: plain): seconds}
    self._excess: dict = {}  # (bucket key, PLAIN or SPEC) -> recent seconds
    self._skipped: dict = {}  # bucket key -> steps without drafts since a probe

  # ------------------------------------------------------------- sit-out

  def _claim(self, slot: int, owner):
    if self._owner[slot] is not owner:
      self._owner[slot] = owner
      self._misses[slot] = 0
      self._sit_until[slot] = 0
      self._hit[slot] = False
      self._accepted[slot] = self._examined[slot] = 0

  def may_propose(self, slot: int, owner) -> bool:
    """Whether the row in `slot` (held by `owner`, any object identifying
    its sequence) may propose drafts this step."""
    self._claim(slot, owner)
    return bool(self.step >= self._sit_until[slot])

  def record(self, slot: int, owner, proposed: int, accepted: int):
    """The outcome of a row's proposal: `proposed` drafts verified
    (0: it looked and found none), `accepted` of them accepted. A miss
    (none accepted; finding none counts only until the sequence's first
    accepted draft) starts or doubles its sit-out, except a sequence's
    first `grace_after_hit` rejections in a row after an accepted draft;
    an accepted draft ends the streak."""
    self._claim(slot, owner)
    if proposed > 0:  # examined: the accepted ones and the first rejected
      seen = np.array([accepted, min(proposed, accepted + 1)], np.int64)
      self._batch += seen
      self._accepted[slot] += seen[0]
      self._examined[slot] += seen[1]
    if accepted > 0:
      self._misses[slot] = 0
      self._hit[slot] = True
      return
    if proposed <= 0 and self._hit[slot]:
      return
    self._misses[slot] += 1
    c = self.config
    m = int(self._misses[slot])
    if self._hit[slot]:  # a copying sequence: its first rejections are free
      m -= c.grace_after_hit
      if m <= 0:
        return
    cap = c.max_sit_out if proposed > 0 else c.max_idle_sit_out
    wait = min(cap, c.base_sit_out << min(m - 1, 30))
    self._sit_until[slot] = self.step + 1 + wait

  def sit_out_steps(self, slot: int) -> int:
    """Steps until the row in `slot` may propose again (0: it may now)."""
    return max(0, int(self._sit_until[slot]) - self.step)

  def tick(self):
    """One decode step has been planned (call once per step, after
    `may_propose` of its rows)."""
    self.step += 1

  # ---------------------------------------------------------------- cost

  def set_costs(self, key, costs: dict):
    """The measured seconds of one call of each step program of decode
    bucket `key` (alone, at warm-up): `costs[0]` the plain step, `costs[D]`
    the verification step with a draft budget of `D` rows, for every budget
    the engine may choose (each > 0).

    Raises:
      ValueError: if the plain step's cost is missing or a cost is not > 0.
    """
    if 0 not in costs or not all(v > 0 for v in costs.values()):
      raise ValueError(f"costs must hold the plain step's (key 0) and be > 0, "
                       f"got {costs!r}")
    self._programs[key] = {int(d): float(v) for d, v in costs.items()}

  def observe(self, key, budget: int, seconds: float):
    """A decode step of bucket `key` as the engine ran it: a plain one
    (`budget` 0) or a verification with draft budget `budget`, `seconds`
    from its planning to the next step's (its results waited for when the
    next step waits). Its excess over the program's own cost is the host's
    and the pipeline's share, which `costs` adds (ignored without costs)."""
    programs = self._programs.get(key)
    if programs is None or budget not in programs:
      return
    recent = self._excess.setdefault((key, SPEC if budget else PLAIN), [])
    recent.append(seconds - programs[budget])
    del recent[:-self.config.window]

  def _overhead(self, key, kind: str) -> float:
    recent = (self._excess.get((key, kind))
              or self._excess.get((key, PLAIN)) or [0.0])  # unmeasured: the plain's
    return float(np.median(recent))

  def costs(self, key) -> dict | None:
    """The seconds per step of bucket `key` that the cost rule weighs (None:
    no `set_costs`): each program's warm-up cost plus the median excess
    the engine measured (`observe`) for its kind, plain or verification
    (before any verification is measured, the plain steps')."""
    programs = self._programs.get(key)
    if programs is None:
      return None
    plain, spec = self._overhead(key, PLAIN), self._overhead(key, SPEC)
    return {d: max(v + (spec if d else plain), 1e-9) for d, v in programs.items()}

  def acceptance(self, slot: int) -> float:
    """The row in `slot`'s estimated chance that a draft is accepted once
    the drafts before it were: its accepted over examined drafts, weighted
    against the batch's estimate (itself weighted against the prior)."""
    c = self.config
    w = c.prior_weight
    batch = (self._batch[0] + w * c.prior_acceptance) / (self._batch[1] + w)
    return float((self._accepted[slot] + w * batch) / (self._examined[slot] + w))

  def _best(self, key, slots, drafts, largest: bool, probe: bool = False
            ) -> np.ndarray:
    costs = self.costs(key)
    drafts = np.asarray(drafts, np.int64)
    if costs is None:  # not measured: every draft
      return drafts
    if largest:
      costs = {0: costs[0], max(costs): costs[max(costs)]}
    if probe:  # the best budget, however the plain step compares
      costs = {**costs, 0: float("inf")}
    alpha = np.array([self.acceptance(s) for s in slots], np.float64)
    return best_drafts(costs, drafts, alpha)

  def choose(self, key, slots, drafts, largest: bool = False) -> np.ndarray:
    """How many of its drafts each row of a step of decode bucket `key`
    verifies (the cost rule; call once per step that has drafts).

    Args:
      key: the decode bucket.
      slots: int[n], the rows' slots (for their acceptance).
      drafts: int[n], the drafts each row proposed.
      largest: only the largest budget (the speculative loop's layout,
        `spec_loop`: every row's `k` drafts in each iteration).

    Returns:
      i64[n], each row's first drafts to verify (all 0: a plain step); one
      step in `probe_every` that would verify none verifies the best
      budget's instead.
    """
    m = self._best(key, slots, drafts, largest)
    if m.any():
      self._skipped[key] = 0
      return m
    n = self._skipped.get(key, 0) + 1
    if n < self.config.probe_every or not np.any(drafts):
      self._skipped[key] = n
      return m
    self._skipped[key] = 0
    return self._best(key, slots, drafts, largest, probe=True)

  def would_verify(self, key, slots, drafts, largest: bool = False) -> bool:
    """Whether `choose(key, slots, drafts, largest)` would verify any draft
    now (changes nothing)."""
    return (bool(self._best(key, slots, drafts, largest).any())
            or (bool(np.any(drafts))
                and self._skipped.get(key, 0) + 1 >= self.config.probe_every))
