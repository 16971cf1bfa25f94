"""Preemptions against the admission policy, on the stub model.

With EOS ignored the engine's schedule does not depend on the tokens, so the
stub model (`benchmarks/stub_model.py`) reproduces exactly the preemptions,
recomputed tokens and steps a real model would get on the same workload and
pool. Pool: 4,096 KV tokens in blocks of 32, batch 32, 256-token budget, 96
requests at once (the shapes of issue #21's comparison):

* "long": prompts 100-400 tokens, outputs 10-60 (the preempting workload);
* "sharegpt": lognormal prompt and output lengths (ShareGPT-like).

For each `EngineConfig.admission_headroom_steps` it prints steps,
preemptions, recomputed tokens, computed tokens and deferred admissions.

  PYTHONPATH=. python benchmarks/engine_admission.py [--headroom 0,1,4,8,16,32]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stub_model  # noqa: E402  pylint: disable=wrong-import-position

from paged_jax.serving.engine import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.requests import Request  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402


def workload(kind: str, n: int = 96, seed: int = 0) -> list[Request]:
  rng = np.random.default_rng(seed)
  reqs = []
  for i in range(n):
    if kind == "long":
      p, o = int(rng.integers(100, 401)), int(rng.integers(10, 61))
    else:
      p = int(np.clip(rng.lognormal(5.0, 0.8), 8, 1000))
      o = int(np.clip(rng.lognormal(5.0, 0.7), 4, 500))
    reqs.append(Request(i, rng.integers(0, 64, p).tolist(),
                        SamplingParams(max_new_tokens=o)))
  return reqs


def run(model, kind: str, headroom: int) -> dict:
  engine = Engine(model, EngineConfig(
      num_blocks=128, block_size=32, max_batch=32, max_tokens_per_step=256,
      max_model_len=2048, min_bucket=16, bucket_midpoints=False,
      admission_headroom_steps=headroom))
  for r in workload(kind):
    assert engine.add_request(r) is None
  engine.run_until_done()
  st = engine.stats
  return {"workload": kind, "headroom_steps": headroom, "steps": st.steps,
          "preemptions": st.preemptions, "recomputed_tokens": st.recomputed_tokens,
          "computed_tokens": st.computed_tokens,
          "deferred_admissions": st.deferred_admissions,
          "mean_running": st.running.mean}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--headroom", default="0,1,4,8,16,32")
  args = ap.parse_args(argv)
  model = stub_model.StubModel()
  for kind in ("long", "sharegpt"):
    for h in [int(x) for x in args.headroom.split(",")]:
      r = run(model, kind, h)
      print(f"{kind:9s} headroom {h:3d} steps: steps {r['steps']}, preemptions "
            f"{r['preemptions']}, recomputed {r['recomputed_tokens']}, computed "
            f"{r['computed_tokens']}, deferred {r['deferred_admissions']}, mean "
            f"running {r['mean_running']:.1f}", flush=True)


if __name__ == "__main__":
  main()
