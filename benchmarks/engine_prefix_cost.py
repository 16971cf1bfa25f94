"""What prefix caching costs when nothing is shared: output tokens/s with it on
vs off at a 0% hit rate (issue #21's goal: on >= 0.99x off; vLLM V1
publishes < 1%).

A small random Llama (`LlamaConfig.tiny()`, float32), `batch` requests at
once, each with its own random prompt (40-72 tokens, so no block is ever
shared), 64 greedy output tokens with EOS ignored, a pool large enough that
nothing is preempted. The engine's batch is `batch` (32 and 256 by default),
its token budget `2 * batch`, its step shapes the powers of two from `batch`.
One engine per setting is built and compiled once and then serves every
repeat (new prompts each time, so nothing cached earlier hits); off and on
run interleaved (`--repeats` pairs after an untimed one, A B B A ...) and
the medians are compared, with the median of the pairwise ratios; greedy
tokens must be identical between them.

  PYTHONPATH=. python -m benchmarks.engine_prefix_cost [--quick] [--repeats N]
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from benchmarks import common
from paged_jax.models.llama import model as model_lib
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

BLOCK_SIZE = 16
OUTPUT = 64
NEVER = (-1,)  # ignore_eos: a stop id no step samples


def unique_prompts(n: int, vocab: int, seed: int = 0) -> list[Request]:
  """`n` requests with random prompts of 40-72 tokens (0% prefix hits)."""
  rng = np.random.default_rng(seed)
  return [Request(i, rng.integers(3, vocab, int(rng.integers(40, 73))).tolist(),
                  SamplingParams(max_new_tokens=OUTPUT, eos_token_ids=NEVER))
          for i in range(n)]


def _engine(model, batch: int, caching: bool) -> Engine:
  cfg = EngineConfig(num_blocks=batch * (72 + OUTPUT) // BLOCK_SIZE + 2 * batch,
                     block_size=BLOCK_SIZE, max_batch=batch,
                     max_tokens_per_step=2 * batch, max_model_len=256,
                     min_bucket=batch, bucket_midpoints=False,
                     enable_prefix_caching=caching)
  engine = Engine(model, cfg)
  engine.warmup()
  return engine


def _run(engine: Engine, requests) -> tuple[float, dict, float, float]:
  """Serves `requests` on the (idle, compiled) engine: `(output tokens/s,
  greedy tokens by request, host ms per step, output tokens per CPU second
  of the whole process)`. The CPU figure moves less than the wall one with
  the machine's load (time descheduled is not counted)."""
  st = engine.stats
  tokens0, host0, steps0 = st.generated_tokens, st.host_seconds, st.steps
  c0 = time.process_time()
  t0 = time.perf_counter()
  for r in requests:
    engine.add_request(r)
  outs = engine.run_until_done()
  jax.block_until_ready(engine.block_state.num_free)
  wall = time.perf_counter() - t0
  cpu = time.process_time() - c0
  if any(o.rejected for o in outs) or len(outs) != len(requests):
    raise RuntimeError("a request was not served")
  host_ms = 1e3 * (st.host_seconds - host0) / max(st.steps - steps0, 1)
  return ((st.generated_tokens - tokens0) / wall,
          {o.request_id: [c.token_ids for c in o.completions] for o in outs},
          host_ms, (st.generated_tokens - tokens0) / cpu)


def measure(model, batch: int, repeats: int) -> dict:
  engines = {c: _engine(model, batch, c) for c in (False, True)}
  tps = {False: [], True: []}
  host = {False: [], True: []}
  per_cpu = {False: [], True: []}
  same = True
  for k in range(repeats + 1):  # the first pair warms up, untimed
    # New prompts every repeat: a block cached by an earlier one never hits.
    requests = unique_prompts(batch, model.config.vocab_size, seed=1000 * batch + k)
    toks = {}
    for c in ((False, True) if k % 2 == 0 else (True, False)):
      t, toks[c], h, tc = _run(engines[c], requests)
      if k:
        tps[c].append(t)
        host[c].append(h)
        per_cpu[c].append(tc)
    same &= toks[False] == toks[True]
  st = engines[True].stats
  row = {"batch": batch, "requests": batch, "repeats": repeats,
         "tokens_per_s_off": statistics.median(tps[False]),
         "tokens_per_s_on": statistics.median(tps[True]),
         "runs_off": tps[False], "runs_on": tps[True],
         "host_ms_per_step_off": statistics.median(host[False]),
         "host_ms_per_step_on": statistics.median(host[True]),
         "hit_rate_on": st.prefix_cache_hit_rate,
         "preemptions": [engines[c].stats.preemptions for c in (False, True)],
         "same_greedy_tokens": same}
  row["ratio"] = row["tokens_per_s_on"] / row["tokens_per_s_off"]
  row["pairwise_ratios"] = [a / b for a, b in zip(tps[True], tps[False])]
  row["tokens_per_cpu_s_off"] = statistics.median(per_cpu[False])
  row["tokens_per_cpu_s_on"] = statistics.median(per_cpu[True])
  row["pairwise_cpu_ratios"] = [a / b for a, b in zip(per_cpu[True], per_cpu[False])]
  print(f"batch {batch:4d}: output tokens/s off {row['tokens_per_s_off']:.0f}"
        f" on {row['tokens_per_s_on']:.0f} (on/off x{row['ratio']:.3f}, median"
        f" of pairs x{statistics.median(row['pairwise_ratios']):.3f}; runs off"
        f" {[round(t) for t in tps[False]]} on {[round(t) for t in tps[True]]});"
        f" host ms/step off {row['host_ms_per_step_off']:.2f} on"
        f" {row['host_ms_per_step_on']:.2f}; hit rate {row['hit_rate_on']:.3f};"
        f" preemptions {row['preemptions']}; same greedy tokens: {same};"
        f" per CPU second: on/off median of pairs"
        f" x{statistics.median(row['pairwise_cpu_ratios']):.3f}"
        f" ({[round(r, 3) for r in row['pairwise_cpu_ratios']]})",
        flush=True)
  return row


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=6)
  p.add_argument("--batches", default="32,256")
  args = p.parse_args(argv)
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
  batches = [8] if args.quick else [int(b) for b in args.batches.split(",")]
  repeats = 1 if args.quick else args.repeats
  rows = [measure(model, b, repeats) for b in batches]
  path = common.write_json(args.out, "engine_prefix_cost",
                           {"machine": common.machine(), "output_tokens": OUTPUT,
                            "block_size": BLOCK_SIZE, "rows": rows},
                           quick=args.quick)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
