"""Multi-step decode (`EngineConfig.num_scheduler_steps`): output tokens/s and
TPOT for K = 1, 2, 4, 8 decode steps per dispatch, at batch 1 and 32, on a
small random Llama.

Each case serves `batch` requests at once (16-token prompts, `--new` output
tokens each, EOS ignored, greedy) after warm-up (every shape compiled first,
K-step programs included), and reports output tokens/s over the whole run
(prefill included), the requests' median TPOT, dispatches and the host's
share (`EngineStats.host_share`) and the process's CPU time per output token
(all threads: the host's Python and XLA's; less sensitive than wall time to
other jobs on a shared machine). Cases are interleaved: round after round,
every (batch, K) once per round; medians over the rounds, and the median of
the per-round ratios to K = 1 (each from cases run back to back).

  PYTHONPATH=. python benchmarks/engine_multistep.py [--rounds 3] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from paged_jax.models.llama import model as model_lib
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=1024,
             num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
             max_position_embeddings=1024, eos_token_ids=(2,), dtype="float32")
PROMPT = 16
BLOCK_SIZE = 16


def make_engine(model, batch: int, k: int, new: int) -> Engine:
  tokens = batch * PROMPT
  per_seq = -(-(PROMPT + new) // BLOCK_SIZE)
  # One decode and one mixed shape: the prefill of every prompt in one step.
  return Engine(model, EngineConfig(
      num_blocks=batch * per_seq + 4, block_size=BLOCK_SIZE, max_batch=batch,
      max_tokens_per_step=tokens, max_model_len=PROMPT + new, min_bucket=tokens,
      bucket_midpoints=False, num_scheduler_steps=k))


def run_case(model, batch: int, k: int, new: int, seed: int) -> dict:
  engine = make_engine(model, batch, k, new)
  engine.warmup()
  vocab = model.config.vocab_size
  for i in range(batch):
    prompt = [(31 * (i + seed) + 7 * j) % (vocab - 3) + 3 for j in range(PROMPT)]
    engine.add_request(Request(i, prompt, SamplingParams(max_new_tokens=new,
                                                         ignore_eos=True)))
  t0, c0 = time.perf_counter(), time.process_time()
  outs = engine.run_until_done()
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  st = engine.stats
  assert st.compile_seconds == 0, "compiled while serving"
  tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
  return {"batch": batch, "k": k, "tokens_per_s": tokens / wall,
          "tpot_ms": 1e3 * statistics.median(o.tpot for o in outs),
          "dispatches": st.steps, "multisteps": st.multisteps,
          "host_share": st.host_share, "cpu_ms_per_token": 1e3 * cpu / tokens,
          "host_ms_per_token": 1e3 * st.host_seconds / tokens}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--ks", default="1,2,4,8")
  ap.add_argument("--batches", default="1,32")
  ap.add_argument("--json", default=None, help="append the medians to this file")
  args = ap.parse_args(argv)
  model = model_lib.init_model(model_lib.LlamaConfig(**MODEL), seed=0)
  ks = [int(k) for k in args.ks.split(",")]
  batches = [int(b) for b in args.batches.split(",")]
  runs: dict = {}
  for rnd in range(args.rounds):
    for batch in batches:
      for k in ks:
        r = run_case(model, batch, k, args.new, seed=rnd)
        runs.setdefault((batch, k), []).append(r)
        print(f"round {rnd} batch {batch:3d} K {k}: {r['tokens_per_s']:8.1f} tok/s, "
              f"TPOT {r['tpot_ms']:7.2f} ms, {r['dispatches']} dispatches "
              f"({r['multisteps']} multi-step), host share {r['host_share']:.2f}, "
              f"CPU {r['cpu_ms_per_token']:.2f} ms/token",
              flush=True)
  rows = []
  for batch in batches:
    for k in ks:
      rs = runs[batch, k]
      med = {f: statistics.median(r[f] for r in rs)
             for f in ("tokens_per_s", "tpot_ms", "host_share", "host_ms_per_token",
                       "cpu_ms_per_token")}
      row = {"batch": batch, "k": k, **med, "dispatches": rs[0]["dispatches"]}
      if 1 in ks:  # per-round ratios to K = 1, then their median
        base = runs[batch, 1]
        for f in ("tokens_per_s", "tpot_ms", "cpu_ms_per_token"):
          row[f + "_vs_k1"] = statistics.median(r[f] / b[f] for r, b in zip(rs, base))
      rows.append(row)
      vs = (f" ({row['tokens_per_s_vs_k1']:.2f}x K=1 tok/s, "
            f"{row['tpot_ms_vs_k1']:.2f}x TPOT, {row['cpu_ms_per_token_vs_k1']:.2f}x CPU)"
            if 1 in ks else "")
      print(f"median batch {batch:3d} K {k}: {med['tokens_per_s']:8.1f} tok/s, TPOT "
            f"{med['tpot_ms']:7.2f} ms, CPU {med['cpu_ms_per_token']:.2f} ms/token, "
            f"host share {med['host_share']:.2f}, {row['dispatches']} dispatches"
            + vs, flush=True)
  if args.json:
    with open(args.json, "a", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
