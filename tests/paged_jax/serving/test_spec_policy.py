"""The speculation policy (`spec_policy.py`), deterministically: sit-out
with exponential back-off, reset by an accepted draft or a new sequence;
the timing rule on injected costs, with its probes; the config's checks."""

from __future__ import annotations

import pytest

from paged_jax.serving.spec_policy import PLAIN, SPEC, SpecPolicy, SpecPolicyConfig
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
  policy = SpecPolicy(1, SpecPolicyConfig(base_sit_out=1, max_sit_out=64))
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
  policy = SpecPolicy(1)
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


def test_a_new_sequence_in_the_slot_starts_afresh():
  policy = SpecPolicy(1, SpecPolicyConfig(base_sit_out=8, max_sit_out=8,
                                          max_idle_sit_out=8))
  policy.record(0, "a", 3, 0)
  policy.tick()
  assert not policy.may_propose(0, "a") and policy.sit_out_steps(0) > 0
  assert policy.may_propose(0, "b")  # another sequence took slot 0


def test_the_timing_rule_speculates_until_it_measures_costlier():
  policy = SpecPolicy(1, SpecPolicyConfig(probe_every=4, window=1, min_samples=1))
  assert policy.speculate(8)  # nothing measured
  policy.observe(8, PLAIN, seconds=0.08, tokens=8)  # 10 ms per token
  assert policy.speculate(8)  # the verification is not measured yet
  policy.observe(8, SPEC, seconds=0.12, tokens=16)  # 7.5 ms: cheaper
  assert policy.speculate(8)
  policy.observe(8, SPEC, seconds=0.12, tokens=10)  # 12 ms: costlier
  peeks, decisions = [], []
  for _ in range(8):
    peeks.append(policy.would_speculate(8))
    decisions.append(policy.speculate(8))
  assert decisions == [False, False, False, True] * 2  # a probe every 4
  assert peeks == decisions  # the peek changes nothing and foretells it
  assert policy.speculate(4)  # another bucket: its own costs
  policy.observe(8, SPEC, seconds=0.09, tokens=10)  # 9 ms: cheaper again
  assert policy.speculate(8)


def test_costs_are_medians_of_recent_steps_so_one_slow_step_does_not_decide():
  policy = SpecPolicy(1, SpecPolicyConfig(window=3, min_samples=2))
  policy.observe(1, PLAIN, 1.0, 1)
  assert policy.cost(1, PLAIN) is None  # one measurement: not enough
  policy.observe(1, PLAIN, 3.0, 1)
  assert policy.cost(1, PLAIN) == pytest.approx(2.0)
  for per in (10.0, 1.0):
    policy.observe(1, PLAIN, per, 1)
  assert policy.cost(1, PLAIN) == pytest.approx(3.0)  # median of 3, 10, 1
  policy.observe(1, PLAIN, 5.0, 0)  # no tokens: ignored
  assert policy.cost(1, PLAIN) == pytest.approx(3.0) and policy.cost(1, SPEC) is None
  policy.observe(1, SPEC, 50.0, 1)  # one slow verification
  policy.observe(1, PLAIN, 2.0, 1)
  assert policy.speculate(1)  # SPEC has 1 < min_samples: not decided
  policy.observe(1, SPEC, 1.5, 1)
  policy.observe(1, SPEC, 1.5, 1)
  assert policy.cost(1, SPEC) == pytest.approx(1.5) and policy.speculate(1)
  with pytest.raises(ValueError, match="kind must be 'plain' or 'spec', got 'x'"):
    policy.observe(1, "x", 1.0, 1)


@pytest.mark.parametrize("kw,msg", [
    (dict(base_sit_out=0), "base_sit_out must be an int >= 1, got 0"),
    (dict(max_sit_out=True), "max_sit_out must be an int >= 1, got True"),
    (dict(probe_every=1.5), "probe_every must be an int >= 1, got 1.5"),
    (dict(base_sit_out=8, max_sit_out=4),
     "max_sit_out=4 must be >= base_sit_out=8"),
    (dict(base_sit_out=2, max_idle_sit_out=1),
     r"max_idle_sit_out=1 must be in \[base_sit_out=2, max_sit_out=64\]"),
    (dict(window=0), "window must be an int >= 1, got 0"),
    (dict(window=2, min_samples=3), "min_samples=3 must be <= window=2"),
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
