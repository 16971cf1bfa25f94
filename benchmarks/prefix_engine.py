"""Prefix caching in the engine, on vs off: hit rate, prefill saved, TTFT,
output tokens/s, and the cost when nothing is shared.

Three workloads on the main job's tiny Llama (float32, CPU), the same engine
sizes on and off (block 16, batch 16, 128-token steps, 6 step shapes), all requests at once,
greedy with `ignore_eos` so both runs do the same decode work:

* `system-prompt`: every request is one shared system prompt plus its own
  question (vLLM's and SGLang's headline case);
* `mooncake`: the first requests of the real Mooncake conversation trace
  (`data/mooncake_conversation_first2000.jsonl`, Apache-2.0) scaled down as
  in `prefix_cache_trace.py` (each 512-token hash id a fixed run of 16
  token ids, outputs scaled the same way), in trace order; its ideal hit
  rate (unbounded cache, from the ids alone) is printed beside the engine's;
* `no-sharing`: random prompts of the system-prompt workload's lengths: a 0%
  hit rate, so on/off measures what caching costs (vLLM's goal: < 1%).

Each workload compiles both engines first, then runs off and on interleaved
(`--repeats` pairs, A B A B), and reports medians; greedy tokens are
compared between on and off.

  PYTHONPATH=. python -m benchmarks.prefix_engine [--quick] [--repeats N]
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks import common
from benchmarks import prefix_cache_trace as trace_lib
from paged_jax.models.llama import model as model_lib
from paged_jax.entrypoints import workload
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

SIZES = dict(block_size=16, max_batch=16, max_tokens_per_step=128,
             max_model_len=1024, min_bucket=8, bucket_midpoints=False)
NEVER = (-1,)  # ignore_eos: a stop id no step samples


def _greedy(n):
  return SamplingParams(max_new_tokens=n, eos_token_ids=NEVER)


def system_prompt(n, vocab, *, system_len=256, seed=0, shared=True):
  rng = np.random.default_rng(seed)
  system = rng.integers(3, vocab, system_len).tolist()
  out = []
  for i in range(n):
    q = rng.integers(3, vocab, int(rng.integers(16, 64))).tolist()
    p = (system if shared else rng.integers(3, vocab, system_len).tolist()) + q
    out.append(Request(i, p, _greedy(32)))
  return out


def mooncake(n, vocab, max_model_len):
  scaled = trace_lib.Scaled(trace_lib.load(limit=n), tokens_per_hash=16)
  out = []
  for i in range(n):
    new = min(scaled.output_len(i), 64)
    p = (scaled.prompt(i) % vocab).tolist()[:max_model_len - new]
    out.append(Request(i, p, _greedy(new)))
  return out


def ideal_hit_rate(requests, block_size) -> float:
  """Prompt tokens an unbounded cache would serve / prompt tokens, for these
  prompts in this order (the ceiling the engine's pool is measured against)."""
  seen: set = set()
  hits = sum(trace_lib.ideal_hits(r.prompt, block_size, seen) * block_size
             for r in requests)
  return hits / sum(len(r.prompt) for r in requests)


def _run(model, requests, kv_tokens, caching):
  stats, outs = workload.run_workload(
      "paged", model, requests, kv_tokens=kv_tokens, progress=False,
      enable_prefix_caching=caching, **SIZES)
  return stats, {o.request_id: [c.token_ids for c in o.completions] for o in outs}


def measure(name, model, requests, kv_tokens, repeats):
  runs = {False: [], True: []}
  tokens = {}
  for _ in range(repeats):
    for caching in (False, True):
      st, toks = _run(model, requests, kv_tokens, caching)
      runs[caching].append(st)
      tokens[caching] = toks
  med = lambda c, f: statistics.median(f(s) for s in runs[c])
  row = {"workload": name, "requests": len(requests),
         "prompt_tokens": sum(len(r.prompt) for r in requests),
         "same_greedy_tokens": tokens[False] == tokens[True]}
  for c, tag in ((False, "off"), (True, "on")):
    row[f"tokens_per_s_{tag}"] = med(c, lambda s: s["tokens_per_second"])
    row[f"ttft_p50_s_{tag}"] = med(c, lambda s: s["latency_seconds"]["ttft"]["p50"])
    row[f"ttft_mean_s_{tag}"] = med(c, lambda s: s["latency_seconds"]["ttft"]["mean"])
    row[f"computed_tokens_{tag}"] = runs[c][-1]["computed_tokens"]
    row[f"runs_{tag}"] = [s["tokens_per_second"] for s in runs[c]]
  on = runs[True][-1]
  row.update(hit_rate=on["prefix_cache_hit_rate"],
             prefill_tokens_saved=on["prefill_tokens_saved"],
             blocks_evicted=on["prefix_blocks_evicted"],
             throughput_ratio=row["tokens_per_s_on"] / row["tokens_per_s_off"],
             ttft_ratio=row["ttft_mean_s_on"] / row["ttft_mean_s_off"],
             computed_ratio=row["computed_tokens_on"] / row["computed_tokens_off"])
  print(f"{name}: {len(requests)} requests, {row['prompt_tokens']} prompt tokens;"
        f" hit rate {100 * row['hit_rate']:.1f}%, prefill saved"
        f" {row['prefill_tokens_saved']}; computed tokens x{row['computed_ratio']:.2f};"
        f" output tokens/s off {row['tokens_per_s_off']:.0f} on"
        f" {row['tokens_per_s_on']:.0f} (x{row['throughput_ratio']:.3f}); TTFT mean"
        f" off {row['ttft_mean_s_off']:.3f} s on {row['ttft_mean_s_on']:.3f} s"
        f" (x{row['ttft_ratio']:.2f}); same greedy tokens: {row['same_greedy_tokens']}",
        flush=True)
  return row


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--mooncake-requests", type=int, default=200)
  args = p.parse_args(argv)
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
  vocab = model.config.vocab_size
  n = 16 if args.quick else 64
  repeats = 1 if args.quick else args.repeats
  kv_tokens = 16 * 1024
  rows = [measure("system-prompt", model, system_prompt(n, vocab), kv_tokens, repeats),
          measure("no-sharing", model, system_prompt(n, vocab, shared=False),
                  kv_tokens, repeats)]
  reqs = mooncake(40 if args.quick else args.mooncake_requests, vocab,
                  SIZES["max_model_len"])
  row = measure("mooncake", model, reqs, kv_tokens, repeats)
  ideal = ideal_hit_rate(reqs, SIZES["block_size"])
  row["ideal_token_hit_rate"] = ideal
  row["of_ideal"] = row["hit_rate"] / ideal
  print(f"mooncake ideal (unbounded cache, the same prompts in the same order):"
        f" {100 * ideal:.1f}% of prompt tokens; engine {100 * row['hit_rate']:.1f}%"
        f" = {100 * row['of_ideal']:.0f}% of it")
  rows.append(row)
  path = common.write_json(args.out, "prefix_engine",
                           {"machine": common.machine(), "sizes": SIZES,
                            "kv_tokens": kv_tokens, "rows": rows}, quick=args.quick)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
