"""Planning never waits for the running step: with a slow device step (the
stub model with a chain of matmuls in every step), the next step is
scheduled, its inputs built and it is dispatched while the previous step
still runs.

(The stub's other slow step, a host callback that sleeps, cannot show this on
the CPU backend: there a program with a host callback runs synchronously
inside its own dispatch; see `benchmarks/stub_model.py`.)
"""

from __future__ import annotations

from benchmarks import stub_model
from paged_jax.serving import out_pack
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

SPIN = 40  # matmuls per step: a step of ~0.1-0.5 s on a shared CPU core


def _engine(spin, caching=False) -> Engine:
  model = stub_model.StubModel(stub_model.StubConfig(spin=spin))
  return Engine(model, EngineConfig(
      num_blocks=64, block_size=4, max_batch=4, max_tokens_per_step=16,
      max_model_len=64, min_bucket=16, bucket_midpoints=False,  # decode 4, mixed 16
      enable_prefix_caching=caching))


def _serve(engine, requests):
  for r in requests:
    assert engine.add_request(r) is None
  return {o.request_id: [c.token_ids for c in o.completions]
          for o in engine.run_until_done()}


def _requests():
  return [Request(i, [3 + i, 5, 7, 9, 11][:2 + i], SamplingParams(max_new_tokens=6))
          for i in range(3)]


def test_next_step_is_dispatched_before_the_running_step_ends():
  want = _serve(_engine(0), _requests())  # the stub's tokens: with or without caching
  for caching in (False, True):
    engine = _engine(SPIN, caching)
    engine.warmup()  # no compiling while stepping
    runner = engine._runner  # pylint: disable=protected-access
    overlapped = []  # per dispatch after the first: was the previous step still running?
    dispatch = runner.dispatch

    def watched(*args, dispatch=dispatch, overlapped=overlapped, engine=engine):
      previous = engine._pending  # pylint: disable=protected-access
      out = dispatch(*args)
      if previous is not None:
        overlapped.append(not out_pack.is_ready(previous.out))
      return out
    runner.dispatch = watched
    got = _serve(engine, _requests())
    assert got == want  # the slow step changes nothing but time
    # Every step that followed a running one was planned, built and
    # dispatched before that step ended: nothing in planning waited for the
    # device. One miss is tolerated: on a loaded shared CPU the host's few
    # milliseconds can be starved past a step. (The jitted mirror before
    # #21 overlapped none: it queued behind the running step.) The last
    # step, which only releases, runs no model: it is not a dispatch here.
    assert len(overlapped) >= 5
    assert sum(overlapped) >= len(overlapped) - 1, (caching, overlapped)


def test_planning_modules_do_not_touch_the_device():
  """The scheduler's modules plan with NumPy only: no jax import, so no
  dispatch or transfer that could queue behind the running step."""
  import sys  # pylint: disable=import-outside-toplevel
  from paged_jax.serving import (host_pool, multistep_host, packing, prefix,  # pylint: disable=import-outside-toplevel,unused-import
                                 results, scheduler)
  for name in ("host_pool", "multistep_host", "packing", "prefix", "results",
               "scheduler"):
    module = sys.modules[f"paged_jax.serving.{name}"]
    assert "jax" not in vars(module) and "jnp" not in vars(module), name
