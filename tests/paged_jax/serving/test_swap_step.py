"""The step with swaps in its bookkeeping (`swap_step.device_step`) on the
tiny model: with no swap it is `step.device_step` exactly (outputs, cache,
state) and leaves the tier as it was; swapping a live slot out and back in
within real engine steps keeps the host model's fingerprints."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import host_tier
from paged_jax import sharding
from paged_jax.serving import runner as runner_lib
from paged_jax.serving import step as step_lib
from paged_jax.serving import swap_step
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.host_pool import HostPool
from paged_jax.serving.host_tier_pool import HostTierPool
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.models.llama import model as model_lib

S = 2  # swap rows per step
_STATIC = ("decode_only", "num_logprobs")
# The engine's step on one device: a 1x1 mesh, its arrays stacked per data
# shard (`[1, ...]`); here on one pool's arrays, as `swap_step.device_step`.
_MESH = sharding.make_mesh(1, 1)


def _one_pool_step(model_def, params, cache, state, last, slots, x, **kw):
  stack = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
  cache, *rest = step_lib.device_step(model_def, params, cache, *map(
      stack, (state, last, slots, x)), mesh=_MESH, **kw)
  return (cache,) + tuple(jax.tree.map(lambda a: a[0], rest))


_plain = jax.jit(_one_pool_step, static_argnums=(0,), static_argnames=_STATIC)
_swapping = jax.jit(swap_step.device_step, static_argnums=(0,),
                    static_argnames=_STATIC)
_tier_fp = jax.jit(swap_step.tier_fingerprint)


@pytest.fixture(scope="module")
def recorded():
  """Runs a small engine (the example tests' sizes: two step shapes, decode
  4 rows and mixed 16 tokens, compiled once per session); returns its runner
  and, per dispatched step, the arrays it started from and its inputs. The
  tests only read them."""
  steps = []
  original = runner_lib.Runner.dispatch

  def dispatch(self, bucket, xs, swaps=None):
    snap = jax.tree.map(np.asarray, (self.cache, self.state, self.last_tokens,
                                     self.slots))
    one = jax.tree.map(lambda a: a[0], snap[1:])  # the one data shard's
    snap = (snap[0],) + one
    steps.append((bucket, snap, xs[0]))
    return original(self, bucket, xs, swaps)

  model = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
  engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, max_batch=4,
                                      max_tokens_per_step=16, max_model_len=64,
                                      min_bucket=16, bucket_midpoints=False))
  rng = np.random.default_rng(0)
  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(runner_lib.Runner, "dispatch", dispatch)
    for i in range(3):
      prompt = rng.integers(3, 400, size=5 + 3 * i).tolist()
      assert engine.add_request(Request(i, prompt, SamplingParams(max_new_tokens=6))) is None
    engine.run_until_done()
  return engine._runner, steps  # pylint: disable=protected-access


def test_no_swap_is_the_plain_step(recorded):
  runner, steps = recorded
  none = swap_step.SwapInputs(swap_out=jnp.full(S, -1, jnp.int32),
                              swap_in=jnp.full(S, -1, jnp.int32),
                              drop=jnp.full(S, -1, jnp.int32))
  # One step of each kind (the step's static branch): a mixed step that
  # prefills, and a decode step with several rows.
  first = [next(s for s in steps if s[0].decode_only == d) for d in (False, True)]
  assert np.sum(first[1][2].seq_ids >= 0) >= 2
  for bucket, (cache, state, last, slots), x in first:
    kw = dict(decode_only=bucket.decode_only, num_logprobs=runner.num_logprobs)
    args = (runner._model_def, runner._params)  # pylint: disable=protected-access
    tier = host_tier.init(state, num_host_blocks=8)
    want = _plain(*args, cache, state, last, slots, x, **kw)
    got = _swapping(*args, cache, state, tier, last, slots, x, none, **kw)
    wc, ws, wl, wo = want
    gc, gs, gt, gl, go, swaps = got
    np.testing.assert_array_equal(
        go.fingerprint, np.concatenate([wo.fingerprint, _tier_fp(tier)]))
    go = go.replace(fingerprint=go.fingerprint[:5])
    for a, b in zip(jax.tree.leaves((wc, ws, wl, wo)),
                    jax.tree.leaves((gc, gs, gl, go))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(gt), jax.tree.leaves(tier)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.any(swaps.out_ok) and not np.any(swaps.in_ok)


def test_swap_out_of_a_slot_outside_the_step_matches_the_host_model(recorded):
  """A live slot that a step does not run (a request whose prefill finished
  in an earlier step, dropped from this step's entries) swaps out in one
  step and back in the next; the host models predict both states."""
  runner, steps = recorded
  bucket, (cache, state, last, slots), x = next(
      s for s in steps if s[0].decode_only and np.sum(s[2].seq_ids >= 0) >= 2)
  victim = int(x.seq_ids[0])
  keep = x.seq_ids != victim
  q = np.asarray(x.q_lens)
  x = x.replace(seq_ids=np.where(keep, x.seq_ids, -1).astype(np.int32),
                q_lens=np.where(keep, q, 0).astype(np.int32),
                sample_slots=np.where(keep, x.sample_slots, -1).astype(np.int32))
  tier = host_tier.init(state, num_host_blocks=8)
  pool, tiers = HostPool(state), HostTierPool(tier)
  kw = dict(decode_only=bucket.decode_only, num_logprobs=runner.num_logprobs)
  args = (runner._model_def, runner._params)  # pylint: disable=protected-access
  for out_ids, in_ids in (([victim], []), ([], [victim])):
    s = swap_step.SwapInputs(
        swap_out=np.array(out_ids + [-1] * (S - len(out_ids)), np.int32),
        swap_in=np.array(in_ids + [-1] * (S - len(in_ids)), np.int32),
        drop=np.full(S, -1, np.int32))
    *_, res, _, out, back = tiers.bookkeeping(
        pool, *step_lib.bookkeeping_args(x), s.swap_out, s.swap_in, s.drop)
    cache, state, tier, last, outs, swaps = _swapping(*args, cache, state, tier,
                                                      last, slots, x, s, **kw)
    np.testing.assert_array_equal(swaps.out_ok, out.ok)
    np.testing.assert_array_equal(swaps.in_ok, back.ok)
    assert out.ok[0] or back.ok[0]
    np.testing.assert_array_equal(outs.ok, res.ok)
    np.testing.assert_array_equal(
        np.concatenate([pool.fingerprint(), tiers.fingerprint()]), outs.fingerprint)
    host_tier.check_invariants(tier, state)
  assert int(state.seq_lens[victim]) > 0 and int(tier.num_free) == 8
