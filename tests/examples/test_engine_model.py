"""Model-based test of the engine: random arrivals and steps under pool pressure.

A hypothesis state machine adds requests (greedy, sampled n > 1, beam search)
and steps a small-pool engine in any interleaving. After every step the block
manager's invariants hold and the host's bookkeeping agrees with the device
(each live sequence slot belongs to exactly one running sequence). At the end
every accepted request has completed, greedy requests with the dense oracle's
tokens, and every block is back in the pool.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax import block_manager as bm
from tests.examples.conftest import (SMALL_POOL, DenseOracle,
                                     assert_mirror_is_the_device_state, make_engine)
from paged_jax.models.llama import model as model_lib

_MODEL = None
_ORACLE = None


def _shared():
  global _MODEL, _ORACLE
  if _MODEL is None:
    _MODEL = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
    _ORACLE = DenseOracle(_MODEL)
  return _MODEL, _ORACLE


class EngineMachine(RuleBasedStateMachine):

  def __init__(self):
    super().__init__()
    model, self.oracle = _shared()
    self.engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0, max_beam_width=2)
    self.accepted = {}
    self.outputs = {}
    self.next_id = 0

  @rule(prompt_len=st.integers(1, 20), new=st.integers(1, 12),
        kind=st.sampled_from(["greedy", "greedy", "n2", "beam"]), seed=st.integers(0, 9),
        early_stops=st.booleans())
  def add(self, prompt_len, new, kind, seed, early_stops):
    prompt = [int(t) for t in np.random.default_rng(self.next_id).integers(3, 512, prompt_len)]
    # A wide EOS set makes sequences stop early, at any step.
    eos = tuple(range(100, 160)) if early_stops else ()
    params = {"greedy": SamplingParams(max_new_tokens=new, eos_token_ids=eos),
              "n2": SamplingParams(max_new_tokens=new, n=2, temperature=1.0, seed=seed,
                                   eos_token_ids=eos),
              "beam": SamplingParams(max_new_tokens=new, beam_width=2,
                                     eos_token_ids=eos)}[kind]
    req = Request(self.next_id, prompt, params)
    self.next_id += 1
    if self.engine.add_request(req) is None:
      self.accepted[req.request_id] = req

  @precondition(lambda self: self.engine.has_unfinished())
  @rule(steps=st.integers(1, 4))
  def step(self, steps):
    for _ in range(steps):
      for o in self.engine.step():
        self.outputs[o.request_id] = o

  @invariant()
  def pool_is_consistent(self):
    state = self.engine.block_state
    bm.check_invariants(state)
    assert_mirror_is_the_device_state(self.engine)
    lens = np.asarray(state.seq_lens)
    slots = [s.slot for p in self.engine._pools for s in p._running  # pylint: disable=protected-access
             if s.fork_from < 0]
    assert len(slots) == len(set(slots))
    assert all(lens[s] > 0 for s in slots if s >= 0)
    assert self.engine.usage()["blocks_used"] <= SMALL_POOL

  def teardown(self):
    for o in self.engine.run_until_done(max_steps=3000):
      self.outputs[o.request_id] = o
    for rid, req in self.accepted.items():
      out = self.outputs[rid]
      assert out.rejected is None
      assert len(out.completions) == req.params.num_seqs
      if req.params.num_seqs == 1:
        want = self.oracle.greedy(req.prompt, req.params.max_new_tokens,
                                  req.params.eos_token_ids or None)
        assert out.completions[0].token_ids == want, rid
    bm.check_invariants(self.engine.block_state)
    assert int(self.engine.block_state.num_free) == SMALL_POOL


TestEngineModel = EngineMachine.TestCase
TestEngineModel.settings = hypothesis.settings(
    max_examples=6, stateful_step_count=12, deadline=None, derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck))


@pytest.mark.slow
class TestEngineModelLong(EngineMachine.TestCase):
  settings = hypothesis.settings(
      max_examples=100, stateful_step_count=30, deadline=None,
      suppress_health_check=list(hypothesis.HealthCheck))
