"""The speculation policy (`spec_policy.py`), deterministically: sit-out
with exponential back-off, reset by an accepted draft or a new sequence;
the cost rule on injected costs (against a brute force over every choice),
with its probes; the acceptance estimates; the config's checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from paged_jax.serving.spec_policy import SpecPolicy, SpecPolicyConfig, best_drafts
from paged_jax.speculative import SpeculativeConfig


def _sat_out(policy, slot, owner) -> int:
  """Steps the row in `slot` sits out from now (ticking through them)."""
  n = 0
  while not policy.may_propose(slot, owner):
    policy.tick()
    n += 1
  return n


def test_misses_back_off_exponentially_up_to_the_cap():
  policy = SpecPolicy(2, SpecPolicyConfig(base_sit_out=2, max_sit_out=16))
  waits = []
  for _ in range(6):
    assert policy.may_propose(0, "a")
    policy.record(0, "a", proposed=3, accepted=0)
    policy.tick()
    waits.append(_sat_out(policy, 0, "a"))
  assert waits == [2, 4, 8, 16, 16, 16]
  assert policy.may_propose(1, "b")  # other rows are not affected


def test_an_accepted_draft_ends_the_streak():
  policy = SpecPolicy(1, SpecPolicyConfig(base_sit_out=1, max_sit_out=64,
                                          grace_after_hit=0))
  for _ in range(3):
    policy.record(0, "a", 2, 0)
    policy.tick()
    _sat_out(policy, 0, "a")
  policy.record(0, "a", 2, 1)  # accepted: no sit-out, streak reset
  policy.tick()
  assert policy.may_propose(0, "a")
  policy.record(0, "a", 2, 0)
  policy.tick()
  assert _sat_out(policy, 0, "a") == 1  # back to the base


def test_a_row_that_found_no_draft_misses_with_a_shorter_cap():
  policy = SpecPolicy(1, SpecPolicyConfig(base_sit_out=2, max_idle_sit_out=5))
  waits = []
  for _ in range(3):
    policy.record(0, "a", proposed=0, accepted=0)
    policy.tick()
    waits.append(_sat_out(policy, 0, "a"))
  policy.record(0, "a", proposed=2, accepted=0)  # a rejection: the long cap
  policy.tick()
  waits.append(_sat_out(policy, 0, "a"))
  assert waits == [2, 4, 5, 16]


def test_finding_no_draft_after_an_accepted_one_is_not_a_miss():
  policy = SpecPolicy(1, SpecPolicyConfig(grace_after_hit=0))
  policy.record(0, "a", proposed=3, accepted=2)
  policy.tick()
  policy.record(0, "a", proposed=0, accepted=0)  # a gap in the copy
  policy.tick()
  assert policy.may_propose(0, "a")
  policy.record(0, "a", proposed=3, accepted=0)  # a rejection still misses
  policy.tick()
  assert not policy.may_propose(0, "a")
  assert policy.may_propose(0, "b")  # a new sequence: no hit yet
  policy.record(0, "b", proposed=0, accepted=0)
  policy.tick()
  assert not policy.may_propose(0, "b")


def test_a_copying_sequence_takes_its_first_rejections_without_sitting_out():
  policy = SpecPolicy(1, SpecPolicyConfig(base_sit_out=2, grace_after_hit=2))
  policy.record(0, "a", proposed=4, accepted=0)  # no hit yet: sits out
  policy.tick()
  assert _sat_out(policy, 0, "a") == 2
  policy.record(0, "a", proposed=4, accepted=4)  # a hit
  policy.tick()
  waits = []
  for _ in range(4):  # then a paraphrase: rejections in a row
    assert policy.may_propose(0, "a")
    policy.record(0, "a", proposed=4, accepted=0)
    policy.tick()
    waits.append(_sat_out(policy, 0, "a"))
  assert waits == [0, 0, 2, 4]  # the grace, then the doubling from the base
  policy.record(0, "a", proposed=4, accepted=1)  # back in step: grace renewed
  policy.tick()
  policy.record(0, "a", proposed=4, accepted=0)
  policy.tick()
  assert policy.may_propose(0, "a")
  assert policy.may_propose(0, "b")  # a new sequence: no hit, no grace
  policy.record(0, "b", proposed=4, accepted=0)
  policy.tick()
  assert not policy.may_propose(0, "b")


def test_a_new_sequence_in_the_slot_starts_afresh():
  policy = SpecPolicy(1, SpecPolicyConfig(base_sit_out=8, max_sit_out=8,
                                          max_idle_sit_out=8))
  policy.record(0, "a", 3, 0)
  policy.tick()
  assert not policy.may_propose(0, "a") and policy.sit_out_steps(0) > 0
  assert policy.may_propose(0, "b")  # another sequence took slot 0


# Seconds per step at 16 rows: the plain step and each draft budget (the
# shape of RESULTS 16g's measurement: 1.06x, 1.16x, 1.46x, 1.85x, 2.67x).
COSTS16 = {0: 0.124, 4: 0.132, 8: 0.144, 16: 0.181, 32: 0.230, 64: 0.331}


def _brute_force(costs, drafts, alpha):
  """The best expected tokens per second over every prefix of every row's
  drafts (each in the smallest budget holding it), and the plain step's."""
  n = len(drafts)
  best = n / costs[0]
  budgets = sorted(d for d in costs if d > 0)
  for m in itertools.product(*(range(d + 1) for d in drafts)):
    if 0 < sum(m) <= budgets[-1]:
      cost = costs[min(b for b in budgets if b >= sum(m))]
      gain = sum(a ** j for a, mi in zip(alpha, m) for j in range(1, mi + 1))
      best = max(best, (n + gain) / cost)
  return best


def _rate(costs, drafts, alpha, m):
  if not m.sum():
    return len(drafts) / costs[0]
  cost = costs[min(b for b in costs if b >= m.sum() and b > 0)]
  gain = sum(a ** j for a, mi in zip(alpha, m) for j in range(1, mi + 1))
  return (len(drafts) + gain) / cost


def test_best_drafts_is_the_best_choice_of_every_row_prefix():
  rng = np.random.default_rng(0)
  for _ in range(60):
    n = int(rng.integers(1, 5))
    drafts = rng.integers(0, 4, n)
    alpha = rng.uniform(0, 0.95, n)
    plain = float(rng.uniform(0.5, 1.5))
    budgets = sorted({int(b) for b in rng.integers(1, 3 * n + 1, 3)} | {3 * n})
    costs = {0: plain, **{b: plain * (1 + float(rng.uniform(0.02, 0.2)) * b)
                          for b in budgets}}
    m = best_drafts(costs, drafts, alpha)
    assert ((0 <= m) & (m <= drafts)).all()
    assert m.sum() <= budgets[-1]
    assert _rate(costs, drafts, alpha, m) == pytest.approx(
        _brute_force(costs, drafts, alpha), rel=1e-9), (costs, drafts, alpha, m)


def test_the_cost_rule_trims_tail_drafts_to_the_budget_that_pays():
  alpha = np.full(16, 0.5)
  four = np.array([4] * 4 + [0] * 12)
  # 16 drafts round up to a budget of 16 (1.46x the plain step): their
  # worth, 4 x (0.5 + 0.25 + ...) = 3.75 tokens, does not pay for it; the
  # first draft of each row in a budget of 4 (1.06x) does.
  assert best_drafts(COSTS16, four, alpha).tolist() == [1] * 4 + [0] * 12
  # High acceptance pays for every draft.
  assert best_drafts(COSTS16, four, np.full(16, 0.95)).tolist() == four.tolist()
  # Low acceptance pays for none: a plain step.
  assert not best_drafts(COSTS16, four, np.full(16, 0.05)).any()
  # One row at batch 1 (a verification of 4 drafts costs 1.68x): a copying
  # row's acceptance pays, a chat row's poor one does not.
  costs1 = {0: 0.0417, 1: 0.0608, 2: 0.0642, 4: 0.0701}
  assert best_drafts(costs1, np.array([4]), np.array([0.8])).tolist() == [4]
  assert best_drafts(costs1, np.array([4]), np.array([0.2])).tolist() == [0]
  assert best_drafts(COSTS16, np.zeros(16, int), alpha).tolist() == [0] * 16


def test_acceptance_is_estimated_per_row_against_the_batchs():
  c = SpecPolicyConfig(prior_acceptance=0.5, prior_weight=2.0)
  policy = SpecPolicy(3, c)
  assert policy.acceptance(0) == pytest.approx(0.5)  # the prior
  policy.record(0, "a", proposed=4, accepted=2)  # 3 examined, 2 accepted
  policy.record(1, "b", proposed=4, accepted=4)  # 4 examined, 4 accepted
  policy.record(1, "b", proposed=0, accepted=0)  # found none: nothing examined
  batch = (6 + 2 * 0.5) / (7 + 2)
  assert policy.acceptance(2) == pytest.approx(batch)
  assert policy.acceptance(0) == pytest.approx((2 + 2 * batch) / (3 + 2))
  assert policy.acceptance(1) == pytest.approx((4 + 2 * batch) / (4 + 2))
  policy.may_propose(1, "c")  # a new sequence: its own record starts afresh
  assert policy.acceptance(1) == pytest.approx(batch)


def test_choose_uses_the_buckets_costs_and_probes_while_it_verifies_nothing():
  policy = SpecPolicy(16, SpecPolicyConfig(probe_every=4, prior_acceptance=0.5))
  slots = list(range(16))
  four = [4] * 4 + [0] * 12
  assert policy.choose(16, slots, four).tolist() == four  # no costs: every draft
  policy.set_costs(16, COSTS16)
  assert policy.choose(16, slots, four).tolist() == [1] * 4 + [0] * 12
  for s in range(16):  # a batch whose drafts are all rejected
    for _ in range(5):
      policy.record(s, s, proposed=4, accepted=0)
  peeks, decisions = [], []
  for _ in range(8):
    peeks.append(policy.would_verify(16, slots, four))
    decisions.append(bool(policy.choose(16, slots, four).any()))
  assert decisions == [False, False, False, True] * 2  # a probe every 4
  assert peeks == decisions  # the peek changes nothing and foretells it
  assert policy.choose(8, slots[:8], [4] * 8).tolist() == [4] * 8  # its own costs
  # largest: the loop's layout, every row's k drafts in the largest budget
  fresh = SpecPolicy(16, SpecPolicyConfig(prior_acceptance=0.5))
  fresh.set_costs(16, COSTS16)
  assert fresh.choose(16, slots, four).any()
  assert not fresh.choose(16, slots, four, largest=True).any()
  assert not fresh.would_verify(16, slots, four, largest=True)
  with pytest.raises(ValueError, match=r"costs must hold the plain step's \(key 0\) "
                     r"and be > 0, got \{4: 0.1\}"):
    policy.set_costs(4, {4: 0.1})


def test_the_engines_measured_excess_per_kind_is_added_to_the_programs_costs():
  policy = SpecPolicy(16, SpecPolicyConfig(window=3, prior_acceptance=0.5))
  policy.observe(16, 0, 1.0)  # no costs yet: ignored
  assert policy.costs(16) is None
  policy.set_costs(16, COSTS16)
  assert policy.costs(16) == pytest.approx(COSTS16)
  policy.observe(16, 0, 0.124 + 0.040)  # plain steps: 40 ms of host work
  policy.observe(16, 0, 0.124 + 0.020)
  # Verification unmeasured: the plain steps' median excess for every kind.
  assert policy.costs(16) == pytest.approx({d: v + 0.030 for d, v in COSTS16.items()})
  four = [4] * 4 + [0] * 12
  assert policy.choose(16, range(16), four).tolist() == [1] * 4 + [0] * 12
  policy.observe(16, 4, 0.132 + 0.118)  # a verification that lost the overlap
  want = {d: v + (0.118 if d else 0.030) for d, v in COSTS16.items()}
  assert policy.costs(16) == pytest.approx(want)
  assert not policy.choose(16, range(16), four).any()  # 2 tokens do not pay 90 ms
  for excess in (0.5, 0.010, 0.012, 0.011):  # medians of the last `window`
    policy.observe(16, 8, 0.144 + excess)
  assert policy.costs(16)[4] == pytest.approx(0.132 + 0.011)
  policy.observe(16, 7, 1.0)  # a budget without a program: ignored
  policy.observe(8, 0, 1.0)  # another bucket: its own
  assert policy.costs(16)[4] == pytest.approx(0.132 + 0.011)


@pytest.mark.parametrize("kw,msg", [
    (dict(base_sit_out=0), "base_sit_out must be an int >= 1, got 0"),
    (dict(max_sit_out=True), "max_sit_out must be an int >= 1, got True"),
    (dict(probe_every=1.5), "probe_every must be an int >= 1, got 1.5"),
    (dict(base_sit_out=8, max_sit_out=4),
     "max_sit_out=4 must be >= base_sit_out=8"),
    (dict(grace_after_hit=-1), "grace_after_hit must be an int >= 0, got -1"),
    (dict(grace_after_hit=1.0), "grace_after_hit must be an int >= 0, got 1.0"),
    (dict(base_sit_out=2, max_idle_sit_out=1),
     r"max_idle_sit_out=1 must be in \[base_sit_out=2, max_sit_out=64\]"),
    (dict(prior_acceptance=1.0), r"prior_acceptance must be in \(0, 1\), got 1.0"),
    (dict(prior_weight=0.0), "prior_weight must be > 0, got 0.0"),
    (dict(window=0), "window must be an int >= 1, got 0"),
])
def test_config_errors_say_expected_and_given(kw, msg):
  with pytest.raises(ValueError, match=msg):
    SpecPolicyConfig(**kw)


def test_speculative_config_adaptive_is_a_bool():
  assert SpeculativeConfig(num_speculative_tokens=2).adaptive is True
  assert not SpeculativeConfig.from_json(
      '{"num_speculative_tokens": 2, "adaptive": false}').adaptive
  with pytest.raises(ValueError, match="adaptive must be a bool, got 1"):
    SpeculativeConfig(num_speculative_tokens=2, adaptive=1)
