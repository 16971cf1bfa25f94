"""The engine's device step alone, and its compile time: what one device
pays for its step program (e.g. the 1x1 mesh of `step.device_step` against
an older one-device step).

Per case (a model, a batch, decode) it brings an engine to a steady decode
state (every row decoding), records the inputs of one decode step, then
replays that step `--reps` times through the runner (`Runner.dispatch`, each
call waited for with `block_until_ready`): every replay reserves one more
token per row, as a real decode step does. It reports the median wall and
process-CPU microseconds per step. `--compile` instead times compiling one
decode and one mixed bucket of a fresh engine (`Engine.warmup(buckets=...)`,
run it in a fresh process per measurement: compiled steps are shared within
a process).

Models: `tiny` (the random tiny Llama, `LlamaConfig.tiny()`) and `stub`
(`benchmarks/stub_model.py`: a forward that costs next to nothing).

It imports only the installed API, so the same file times any version of the
engine: run it interleaved against two checkouts, e.g.

  PYTHONPATH=/path/to/old python benchmarks/step_cost.py --tag old
  PYTHONPATH=/path/to/new python benchmarks/step_cost.py --tag new
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import stub_model  # noqa: E402  pylint: disable=wrong-import-position

from paged_jax.serving.engine import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.requests import Request  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
PROMPT = 8


def _model(name: str):
  if name == "stub":
    return stub_model.StubModel()
  from paged_jax.models.llama.model import LlamaConfig, init_model  # pylint: disable=import-outside-toplevel
  return init_model(LlamaConfig.tiny())


def _engine(model, batch: int) -> Engine:
  cfg = EngineConfig(num_blocks=batch * 24, block_size=BLOCK_SIZE,
                     max_batch=batch, max_tokens_per_step=2 * batch,
                     max_model_len=4096, min_bucket=batch // 2,
                     bucket_midpoints=False)
  return Engine(model, cfg)


def _vocab(model) -> int:
  return model.config.vocab_size


def device_step(model_name: str, batch: int, reps: int) -> dict:
  model = _model(model_name)
  engine = _engine(model, batch)
  engine.warmup()
  vocab = _vocab(model)
  for i in range(batch):
    prompt = [(7 * i + j) % (vocab - 1) + 1 for j in range(PROMPT)]
    engine.add_request(Request(str(i), prompt, SamplingParams(
        max_new_tokens=2_000, ignore_eos=True)))
  runner = engine._runner  # pylint: disable=protected-access
  seen = []
  dispatch = runner.dispatch

  def record(bucket, xs, *a, **k):
    seen.append((bucket, xs))
    return dispatch(bucket, xs, *a, **k)
  runner.dispatch = record
  for _ in range(12):  # admission, prefill, then decode
    engine.step()
  engine.drain()
  runner.dispatch = dispatch
  bucket, xs = seen[-1]
  assert bucket.decode_only, bucket
  for _ in range(3):  # warm
    jax.block_until_ready(runner.dispatch(bucket, xs))
  wall, cpu = [], []
  for _ in range(reps):
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(runner.dispatch(bucket, xs))
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  return {"model": model_name, "batch": batch, "bucket": str(bucket),
          "wall_us": 1e6 * statistics.median(wall),
          "cpu_us": 1e6 * statistics.median(cpu), "reps": reps}


def compile_time(model_name: str, batch: int) -> dict:
  model = _model(model_name)
  engine = _engine(model, batch)
  out = {"model": model_name, "batch": batch}
  engine._runner.compile_slot_writes()  # pylint: disable=protected-access  # apart
  for kind, decode in (("decode", True), ("mixed", False)):
    b = [x for x in engine.buckets if x.decode_only == decode][-1]
    c = time.process_time()
    out[f"{kind}_s"] = engine.warmup(buckets=(b,))
    out[f"{kind}_cpu_s"] = time.process_time() - c
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default="tiny,stub")
  ap.add_argument("--batches", default="32,256")
  ap.add_argument("--reps", type=int, default=50)
  ap.add_argument("--compile", action="store_true",
                  help="time compiling one decode and one mixed bucket instead")
  ap.add_argument("--tag", default="")
  ap.add_argument("--json", default=None, help="append results to this file")
  args = ap.parse_args(argv)
  for name in args.models.split(","):
    for batch in map(int, args.batches.split(",")):
      r = (compile_time(name, batch) if args.compile
           else device_step(name, batch, args.reps))
      r["tag"] = args.tag
      print(json.dumps(r), flush=True)
      if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
          f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
