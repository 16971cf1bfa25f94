"""The engine's host cost per step, alone: a stub model whose forward costs
next to nothing (`benchmarks/stub_model.py`), so a step's wall time is the
host's scheduling, input building, dispatch and applying of results.

Cases: batch 32 and 256, "decode" (every row decodes) and "mixed" (every step
also admits a 32-token prompt that finishes after one token). Per case it
reports the median over the timed steps of

* `host_us`: the host's own work per step -- `EngineStats.host_seconds`
  (step wall time minus waiting for results) minus the time spent inside the
  compiled step's call (`Runner.dispatch`). That call is left out because on
  the CPU backend XLA runs a cheap program (the stub's whole step) inline in
  the caller's thread, so its time is the device step's, not the host's;
* `dispatch_us`: the time inside `Runner.dispatch` (on CPU with the stub:
  mostly the device step itself, run inline);
* `wall_us`: the step's wall time.

Goal (issue #21): host <= 200 us at batch 32, <= 1 ms at batch 256.

`--phases` also prints, per case, the median main-thread CPU (`time.thread_time`)
of each host phase (`Scheduler.begin_step`, `build_step`, `resolve`, the
runner's `dispatch` and `fetch`), the CPU the process's other threads (XLA's)
used per step, and the bucket each timed step ran: CPU time, unlike `host_us`,
hardly moves with the machine's load, and a different shape per step shows.

It imports only the installed API, so the same file times any version of the
engine: run it interleaved against two checkouts, e.g.

  PYTHONPATH=/path/to/old python benchmarks/engine_host_cost.py --tag old
  PYTHONPATH=/path/to/new python benchmarks/engine_host_cost.py --tag new
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stub_model  # noqa: E402  pylint: disable=wrong-import-position

from paged_jax.serving.engine import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.requests import Request  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
PROMPT = 8
MIXED_PROMPT = 32


def _engine(model, batch: int, caching: bool) -> Engine:
  cfg = EngineConfig(num_blocks=batch * 24, block_size=BLOCK_SIZE,
                     max_batch=batch, max_tokens_per_step=2 * batch,
                     max_model_len=4096, min_bucket=batch // 2,
                     bucket_midpoints=False, enable_prefix_caching=caching)
  return Engine(model, cfg)


_PHASES = ("begin_step", "build_step", "resolve", "dispatch", "fetch")


def _watch_phases(engine, cpu: dict):
  """Wraps the engine's host phases to add their main-thread CPU to `cpu`."""
  def wrap(obj, name):
    f = getattr(obj, name)

    def timed(*a, **k):
      t = time.thread_time()
      try:
        return f(*a, **k)
      finally:
        cpu[name] = cpu.get(name, 0.0) + time.thread_time() - t
    setattr(obj, name, timed)
  for p in engine._pools:  # pylint: disable=protected-access
    for name in ("begin_step", "build_step", "resolve"):
      wrap(p, name)
  for name in ("dispatch", "fetch"):
    wrap(engine._runner, name)  # pylint: disable=protected-access


def run_case(model, batch: int, kind: str, steps: int, caching: bool,
             phases: bool = False) -> dict:
  engine = _engine(model, batch, caching)
  cpu: dict = {}
  per_step: list[dict] = []
  shapes: collections.Counter = collections.Counter()
  if phases:
    _watch_phases(engine, cpu)
  vocab = model.config.vocab_size
  decoders = batch - 2 if kind == "mixed" else batch
  for i in range(decoders):
    prompt = [(7 * i + j) % vocab for j in range(PROMPT)]
    engine.add_request(Request(f"d{i}", prompt, SamplingParams(max_new_tokens=2_000)))
  host, wall, disp = [], [], []
  warm = 6
  runner = engine._runner  # pylint: disable=protected-access
  dispatch = runner.dispatch
  spent = [0.0]

  def timed_dispatch(*a, **k):
    t = time.perf_counter()
    try:
      return dispatch(*a, **k)
    finally:
      spent[0] += time.perf_counter() - t
  runner.dispatch = timed_dispatch
  for k in range(warm + steps):
    if kind == "mixed":
      prompt = [(11 * k + j) % vocab for j in range(MIXED_PROMPT)]
      engine.add_request(Request(f"m{k}", prompt, SamplingParams(max_new_tokens=1)))
    h0 = engine.stats.host_seconds
    c0 = engine.stats.compile_seconds
    spent[0] = 0.0
    buckets0 = dict(engine.stats.buckets)
    cpu.clear()
    p0, m0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    if k >= warm and engine.stats.compile_seconds == c0:
      host.append(engine.stats.host_seconds - h0 - spent[0])
      disp.append(spent[0])
      wall.append(t1 - t0)
      if phases:
        main = time.thread_time() - m0
        per_step.append(dict(cpu, main=main, others=time.process_time() - p0 - main))
        shapes.update(b for b, n in engine.stats.buckets.items()
                      if n != buckets0.get(b, 0))
  for r in range(decoders):
    engine.abort_request(f"d{r}")
  engine.run_until_done()
  return {"batch": batch, "kind": kind, "caching": caching, "steps": len(host),
          "host_us": 1e6 * statistics.median(host),
          "dispatch_us": 1e6 * statistics.median(disp),
          "wall_us": 1e6 * statistics.median(wall),
          "preemptions": engine.stats.preemptions,
          **({"cpu_us": {name: 1e6 * statistics.median(r.get(name, 0.0) for r in per_step)
                         for name in ("main", "others") + _PHASES},
              "shapes": {str(b): n for b, n in shapes.items()}} if phases else {})}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--batches", default="32,256")
  ap.add_argument("--kinds", default="decode,mixed")
  ap.add_argument("--caching", action="store_true")
  ap.add_argument("--tag", default="")
  ap.add_argument("--phases", action="store_true",
                  help="also the main-thread CPU per phase and the shapes run")
  ap.add_argument("--json", default=None, help="append results to this file")
  args = ap.parse_args(argv)
  model = stub_model.StubModel()
  rows = []
  for batch in [int(b) for b in args.batches.split(",")]:
    for kind in args.kinds.split(","):
      r = run_case(model, batch, kind, args.steps, args.caching,
                   args.phases) | {"tag": args.tag}
      rows.append(r)
      print(f"{args.tag:>6} batch {batch:4d} {kind:6s} caching={args.caching}: "
            f"host {r['host_us']:7.0f} us/step, dispatch {r['dispatch_us']:7.0f}, "
            f"wall {r['wall_us']:7.0f} us/step "
            f"({r['steps']} steps)", flush=True)
      if args.phases:
        print(f"{args.tag:>6}   CPU us/step (medians): "
              + ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us"].items())
              + f"; shapes (tokens, seqs, decode): {r['shapes']}", flush=True)
  if args.json:
    with open(args.json, "a", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
