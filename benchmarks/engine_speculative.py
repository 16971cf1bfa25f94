"""Speculative decoding with n-gram prompt lookup
(`EngineConfig.speculative_config`), on vs off, on SmolLM2-135M-Instruct:
acceptance rate, mean accepted length, output tokens/s and TPOT, at batch 1
and 4, on a copying workload (repeat or lightly edit a given passage) and on
plain chat.

Each case serves `batch` chat-templated requests at once (greedy, EOS
ignored, `--new` output tokens each) after warm-up, spec off and on back to
back, round after round (interleaved); medians over the rounds and the
median of the per-round on/off ratios. Greedy outputs must be identical on
and off (checked).

  PYTHONPATH=. python benchmarks/engine_speculative.py [--rounds 2] [--new 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from paged_jax.models import loader
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.speculative import SpeculativeConfig

PASSAGE = ("The river rises in the northern hills and runs south for two hundred "
           "miles. It passes three towns, each built on its eastern bank, and joins "
           "the sea at a wide, shallow estuary where birds gather in winter. Farmers "
           "along its course grow wheat and barley, and the old mills that once "
           "ground their grain still stand beside the water.")
COPYING = [f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}",
           f"Rewrite the following passage, replacing 'river' with 'stream'.\n\n{PASSAGE}",
           f"Copy this text out again:\n\n{PASSAGE}",
           f"Repeat the passage below twice.\n\n{PASSAGE}"]
CHAT = ["What are three good habits for staying healthy?",
        "Write a short poem about the autumn.",
        "Explain what a computer network is to a child.",
        "Give me some ideas for a weekend trip."]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                         prompt_lookup_max=4)
BLOCK_SIZE = 16
TOKENS = 512  # every prompt's prefill in one step


def prompts(tokenizer, texts):
  return [tokenizer.encode(tokenizer.apply_chat_template(
      [{"role": "user", "content": t}]), add_special_tokens=False) for t in texts]


def run_case(model, prompt_ids, batch: int, new: int, spec: bool) -> dict:
  longest = max(len(p) for p in prompt_ids[:batch]) + new
  engine = Engine(model, EngineConfig(
      num_blocks=batch * -(-longest // BLOCK_SIZE) + 8, block_size=BLOCK_SIZE,
      max_batch=batch, max_tokens_per_step=TOKENS, max_model_len=longest,
      min_bucket=TOKENS, bucket_midpoints=False,  # one decode, one mixed shape
      speculative_config=SPEC if spec else None))
  engine.warmup()
  for i in range(batch):
    engine.add_request(Request(i, prompt_ids[i], SamplingParams(
        max_new_tokens=new, ignore_eos=True)))
  t0 = time.perf_counter()
  outs = engine.run_until_done()
  st = engine.stats
  # The verification step compiles on first use (once per process, shared
  # by later engines of equal sizes): timed apart, left out.
  wall = time.perf_counter() - t0 - st.compile_seconds
  tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
  return {"tokens_per_s": tokens / wall,
          "tpot_ms": 1e3 * statistics.median(o.tpot for o in outs),
          "acceptance_rate": st.acceptance_rate,
          "mean_accepted_length": st.mean_accepted_length,
          "steps": st.steps, "compile_s": st.compile_seconds,
          "outputs": {o.request_id: o.completions[0].token_ids for o in outs}}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--new", type=int, default=48)
  ap.add_argument("--batches", default="1,4")
  ap.add_argument("--json", default=None, help="append the medians to this file")
  args = ap.parse_args(argv)
  loaded = loader.load("smollm2")
  work = {"copying": prompts(loaded.tokenizer, COPYING),
          "chat": prompts(loaded.tokenizer, CHAT)}
  batches = [int(b) for b in args.batches.split(",")]
  runs: dict = {}
  for rnd in range(args.rounds):
    for name, ids in work.items():
      for batch in batches:
        off = run_case(loaded.model, ids, batch, args.new, spec=False)
        on = run_case(loaded.model, ids, batch, args.new, spec=True)
        assert on["outputs"] == off["outputs"], (name, batch, "outputs differ")
        runs.setdefault((name, batch), []).append((off, on))
        print(f"round {rnd} {name:8s} batch {batch}: off {off['tokens_per_s']:6.1f} "
              f"tok/s ({off['steps']} steps), on {on['tokens_per_s']:6.1f} tok/s "
              f"({on['steps']} steps), acceptance {on['acceptance_rate']:.2f}, "
              f"mean accepted {on['mean_accepted_length']:.2f}, first-use compile "
              f"{on['compile_s']:.1f} s", flush=True)
  rows = []
  for (name, batch), rs in runs.items():
    med = lambda f, i: statistics.median(r[i][f] for r in rs)  # noqa: E731
    row = {"workload": name, "batch": batch,
           "tokens_per_s_off": med("tokens_per_s", 0),
           "tokens_per_s_on": med("tokens_per_s", 1),
           "tpot_ms_off": med("tpot_ms", 0), "tpot_ms_on": med("tpot_ms", 1),
           "speedup": statistics.median(r[1]["tokens_per_s"] / r[0]["tokens_per_s"]
                                        for r in rs),
           "acceptance_rate": med("acceptance_rate", 1),
           "mean_accepted_length": med("mean_accepted_length", 1)}
    rows.append(row)
    print(f"median {name:8s} batch {batch}: {row['tokens_per_s_off']:.1f} -> "
          f"{row['tokens_per_s_on']:.1f} tok/s ({row['speedup']:.2f}x), TPOT "
          f"{row['tpot_ms_off']:.1f} -> {row['tpot_ms_on']:.1f} ms, acceptance "
          f"{row['acceptance_rate']:.2f}, mean accepted "
          f"{row['mean_accepted_length']:.2f}", flush=True)
  if args.json:
    with open(args.json, "a", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
