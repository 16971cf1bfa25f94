"""Speculative decoding with n-gram prompt lookup
(`EngineConfig.speculative_config`), on vs off, on SmolLM2-135M-Instruct:
acceptance rate, mean accepted length, output tokens/s (per wall second
and per CPU second of this process: the machine is shared) and TPOT, at
batch 1, 4 and 16, greedy and sampled (`--temperatures`), on a copying
workload (repeat or lightly edit a given passage) and on plain chat.

Each case serves `batch` chat-templated requests at once (the prompts
cycled, request `i` seeded `i`, EOS ignored, `--new` output tokens each)
after warm-up, spec off and on back to back, round after round
(interleaved); medians over the rounds and the median of the per-round
on/off ratios. Outputs must be identical on and off, sampled ones too (the
verification draws with the plain step's keys; checked). The load average
is recorded per case.

  PYTHONPATH=. python benchmarks/engine_speculative.py [--rounds 2] [--new 48]
      [--batches 1,4,16] [--temperatures 0,0.8] [--workloads copying,chat]
      [--method ngram|draft_model] [--draft-layers 2] [--prefix-caching]
      [--steps 1,4] [--off-steps 1] [--step-shapes user|pinned]
      [--spec-configs '{"num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4};...']

`--steps`: the spec-on engines' `num_scheduler_steps` (K), one engine per
value, each in every round after the spec-off one (K > 1 with n-gram: up to
K verification iterations per dispatch, the drafts proposed on the device,
`serving.spec_loop`); `--off-steps`: the spec-off engines' K, the first the
baseline of every ratio. "steps" are dispatches; "verifying" the
verification iterations.

`--step-shapes`: the engines' compiled step shapes, spec on and off alike.
`user` (the default): what a user of `generate` or the server gets for this
model, `engine_args.STEP_SHAPE_DEFAULTS` (`--min-bucket`,
`--bucket-midpoints` left out: for SmolLM2 every power of two from 1 row and
the 1.5x midpoints), with the token budget `TOKENS` (every prompt's prefill
in one step): a batch-1 prefill of ~110 tokens computes 128 rows. `pinned`:
one decode and one mixed shape of `TOKENS` rows (`min_bucket=TOKENS`, no
midpoints; RESULTS 16e-16g measured this), where that prefill computes 512
rows, ~4.6x its own, and is ~40% of a spec-off run of 32 tokens. Warm-up
compiles every shape (untimed; JAX's persistent compilation cache is on,
as in `generate`, so a second process loads them); TTFT is reported.

`--spec-configs`: several n-gram configurations (k, lookup bounds) side by
side, each a spec-on engine in every round, interleaved with the others
and the spec-off one (one process: the same load for all); without it, k =
4 and lookup 2..4 (`SPEC`).

`--method draft_model`: the draft is SmolLM2 itself cut to its first
`--draft-layers` layers (`{"method": "draft_model", "draft_num_layers": n}`,
`serving.spec_draft`), proposing `num_speculative_tokens` on the device.

`--prefix-caching` turns on prefix caching in both engines and reports the
prefix-cache hit rate (prompt tokens served from the cache / prompt
tokens), spec on and off. The `questions` workload is made for it: several
questions about one passage (the chat template and the passage are a
shared prefix), then, once they are answered, a follow-up to each (its
prompt is the first prompt, the answer and a new question), so the second
wave's hits reach into the blocks that the first wave's decode (with
speculation: its verification steps) wrote; both waves are timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from paged_jax.entrypoints import engine_args
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
QUESTIONS = [f"Read the passage, then answer the question.\n\n{PASSAGE}\n\nQuestion: {q}"
             for q in ("Where does the river rise?", "Which bank are the towns on?",
                       "What do the farmers grow?", "Where do the birds gather?")]
FOLLOW_UP = "Now quote the sentence of the passage that says so."
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                         prompt_lookup_max=4)
BLOCK_SIZE = 16
TOKENS = 512  # every prompt's prefill in one step


def prompts(tokenizer, texts):
  return [tokenizer.encode(tokenizer.apply_chat_template(
      [{"role": "user", "content": t}]), add_special_tokens=False) for t in texts]


def follow_up_ids(tokenizer) -> list[int]:
  """The tokens that close an answer and ask `FOLLOW_UP` (chat template)."""
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
       {"role": "user", "content": FOLLOW_UP}])
  return tokenizer.encode(text[text.index("y") + 1:], add_special_tokens=False)


def shapes(model, step_shapes: str) -> tuple[int, bool]:
  """`(min_bucket, bucket_midpoints)` of `--step-shapes` for `model`."""
  if step_shapes == "pinned":  # one decode, one mixed shape
    return TOKENS, False
  if step_shapes != "user":
    raise ValueError(f"step_shapes must be 'user' or 'pinned', got {step_shapes!r}")
  return engine_args.STEP_SHAPE_DEFAULTS[engine_args.model_kind(model)]


def run_case(model, prompt_ids, batch: int, new: int, spec,
             temperature: float = 0.0, caching: bool = False,
             follow_up: list[int] | None = None, num_steps: int = 1,
             step_shapes: str = "user") -> dict:
  """One engine serving `batch` requests; `spec`: a `SpeculativeConfig`, or
  None (off). With `follow_up` (tokens), a second wave of `batch` requests,
  each the first wave's prompt, its answer and `follow_up`, once the first
  is done. `step_shapes`: "user" or "pinned" (the module docstring)."""
  prompt_ids = [prompt_ids[i % len(prompt_ids)] for i in range(batch)]
  waves = 2 if follow_up else 1
  longest = max(len(p) for p in prompt_ids) + waves * new + len(follow_up or ())
  min_bucket, midpoints = shapes(model, step_shapes)
  engine = Engine(model, EngineConfig(
      # every wave's blocks fit with the first wave's cached: no eviction
      num_blocks=waves * batch * -(-longest // BLOCK_SIZE) + 8, block_size=BLOCK_SIZE,
      max_batch=batch, max_tokens_per_step=TOKENS, max_model_len=longest,
      min_bucket=min_bucket, bucket_midpoints=midpoints,
      enable_prefix_caching=caching, speculative_config=spec or None,
      num_scheduler_steps=num_steps))
  engine.warmup()

  def params(i):
    return SamplingParams(max_new_tokens=new, ignore_eos=True,
                          temperature=temperature, seed=i)

  for i in range(batch):
    engine.add_request(Request(i, prompt_ids[i], params(i)))
  t0, c0 = time.perf_counter(), time.process_time()
  outs = engine.run_until_done()
  if follow_up:
    first = {o.request_id: o.completions[0].token_ids for o in outs}
    for i in range(batch):
      engine.add_request(Request(batch + i, prompt_ids[i] + first[i] + follow_up,
                                 params(batch + i)))
    outs += engine.run_until_done()
  cpu = time.process_time() - c0
  st = engine.stats
  # The verification step compiles on first use (once per process, shared
  # by later engines of equal sizes): timed apart, left out.
  wall = time.perf_counter() - t0 - st.compile_seconds
  tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
  return {"tokens_per_s": tokens / wall,
          # compiling on first use runs on this process's CPU too: a share of
          # it, as of the wall time, is left out
          "tokens_per_cpu_s": tokens / (cpu * wall / (wall + st.compile_seconds)),
          "spec_steps": st.spec_steps,
          "load_average": os.getloadavg()[0],
          "tpot_ms": 1e3 * statistics.median(o.tpot for o in outs),
          "ttft_ms": 1e3 * statistics.median(o.ttft for o in outs),
          "acceptance_rate": st.acceptance_rate,
          "mean_accepted_length": st.mean_accepted_length,
          "steps": st.steps, "compile_s": st.compile_seconds,
          "multisteps": st.multisteps, "cpu_s": cpu,
          "prefix_hit_rate": st.prefix_hit_tokens / max(st.prefix_queried_tokens, 1),
          # the second wave's alone: hits into the first wave's answers
          "follow_up_hit_rate": (sum(o.num_cached_tokens for o in outs[batch:])
                                 / max(sum(o.prompt_len for o in outs[batch:]), 1)),
          "outputs": {o.request_id: o.completions[0].token_ids for o in outs}}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--new", type=int, default=48)
  ap.add_argument("--batches", default="1,4,16")
  ap.add_argument("--temperatures", default="0,0.8")
  ap.add_argument("--workloads", default="copying,chat")
  ap.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
  ap.add_argument("--draft-layers", type=int, default=2,
                  help="draft_model: the target's first layers kept")
  ap.add_argument("--prefix-caching", action="store_true",
                  help="prefix caching in both engines; report the hit rates")
  ap.add_argument("--steps", default="1",
                  help="spec-on engines' num_scheduler_steps, one engine each")
  ap.add_argument("--off-steps", default="1",
                  help="spec-off engines' num_scheduler_steps (the first: baseline)")
  ap.add_argument("--step-shapes", default="user", choices=("user", "pinned"),
                  help="user: the step shapes generate/serve default to for "
                  "this model; pinned: one decode and one 512-row mixed shape")
  ap.add_argument("--compile-cache-dir", default=os.path.expanduser(
      "~/.cache/paged_jax/jax_cache"), help="JAX's persistent compilation "
                  "cache ('' : off)")
  ap.add_argument("--spec-configs", default=None,
                  help="n-gram only: ';'-separated speculative configs (vLLM's JSON, "
                  "e.g. '{\"num_speculative_tokens\": 8, \"prompt_lookup_min\": 1, "
                  "\"prompt_lookup_max\": 4}'), each a spec-on engine at every --steps, "
                  "interleaved in every round (default: k = 4, lookup 2..4)")
  ap.add_argument("--json", default=None, help="append the medians to this file")
  args = ap.parse_args(argv)
  if args.spec_configs and args.method != "ngram":
    ap.error(f"--spec-configs is for --method ngram, got --method {args.method}")
  spec = SPEC if args.method == "ngram" else SpeculativeConfig(
      method="draft_model", num_speculative_tokens=SPEC.num_speculative_tokens,
      draft_num_layers=args.draft_layers)
  if args.compile_cache_dir:  # as `generate` does by default
    engine_args.compile_cache(argparse.Namespace(
        no_compile_cache=False, compile_cache_dir=args.compile_cache_dir))
  loaded = loader.load("smollm2")
  work = {"copying": prompts(loaded.tokenizer, COPYING),
          "chat": prompts(loaded.tokenizer, CHAT),
          "questions": prompts(loaded.tokenizer, QUESTIONS)}
  follow = {"questions": follow_up_ids(loaded.tokenizer)}
  work = {w: work[w] for w in args.workloads.split(",")}
  batches = [int(b) for b in args.batches.split(",")]
  temps = [float(t) for t in args.temperatures.split(",")]
  specs = ([SpeculativeConfig.from_json(c) for c in args.spec_configs.split(";")]
           if args.spec_configs else [spec])
  configs = ([(None, int(k)) for k in args.off_steps.split(",")]
             + [(c, int(k)) for c in specs for k in args.steps.split(",")])
  names = [f"off K={k}" if c is None else f"on K={k}" + (
      f" k={c.num_speculative_tokens} n={c.prompt_lookup_min}..{c.prompt_lookup_max}"
      if len(specs) > 1 else "") for c, k in configs]
  runs: dict = {}
  for rnd in range(args.rounds):
    for name, ids in work.items():
      for batch in batches:
        for temp in temps:
          case = (loaded.model, ids, batch, args.new)
          kw = dict(caching=args.prefix_caching, follow_up=follow.get(name))
          res = [run_case(*case, c, temp, num_steps=k, step_shapes=args.step_shapes,
                          **kw) for c, k in configs]
          for r in res[1:]:
            assert r["outputs"] == res[0]["outputs"], (name, batch, temp, "outputs differ")
          runs.setdefault((name, batch, temp), []).append(res)
          for cname, r in zip(names, res):
            print(f"round {rnd} {name:8s} batch {batch:2d} T={temp} {cname:8s}: "
                  f"{r['tokens_per_s']:6.1f} tok/s {r['tokens_per_cpu_s']:6.1f} "
                  f"tok/cpu-s, TTFT {r['ttft_ms']:.0f} ms, TPOT {r['tpot_ms']:.1f} ms, "
                  f"{r['steps']} steps "
                  f"({r['multisteps']} multi, {r['spec_steps']} verifying), "
                  f"acceptance {r['acceptance_rate']:.2f}, mean accepted "
                  f"{r['mean_accepted_length']:.2f}, prefix hits "
                  f"{r['prefix_hit_rate']:.3f} (follow-ups "
                  f"{r['follow_up_hit_rate']:.3f}), load {r['load_average']:.1f}",
                  flush=True)
  rows = []
  for (name, batch, temp), rs in runs.items():
    for i in range(1, len(configs)):
      med = lambda f, j: statistics.median(r[j][f] for r in rs)  # noqa: E731
      ratio = lambda f, i=i: statistics.median(r[i][f] / r[0][f] for r in rs)  # noqa: E731
      row = {"workload": name, "batch": batch, "temperature": temp,
             "method": args.method, "prefix_caching": args.prefix_caching,
             "config": names[i], "baseline": names[0],
             "num_scheduler_steps": configs[i][1],
             "prefix_hit_rate_off": med("prefix_hit_rate", 0),
             "prefix_hit_rate_on": med("prefix_hit_rate", i),
             "follow_up_hit_rate_off": med("follow_up_hit_rate", 0),
             "follow_up_hit_rate_on": med("follow_up_hit_rate", i),
             "tokens_per_s_off": med("tokens_per_s", 0),
             "tokens_per_s_on": med("tokens_per_s", i),
             "tokens_per_cpu_s_off": med("tokens_per_cpu_s", 0),
             "tokens_per_cpu_s_on": med("tokens_per_cpu_s", i),
             "tpot_ms_off": med("tpot_ms", 0), "tpot_ms_on": med("tpot_ms", i),
             "ttft_ms_off": med("ttft_ms", 0), "ttft_ms_on": med("ttft_ms", i),
             "step_shapes": args.step_shapes,
             "speedup": ratio("tokens_per_s"),
             "speedup_per_cpu_s": ratio("tokens_per_cpu_s"),
             "acceptance_rate": med("acceptance_rate", i),
             "mean_accepted_length": med("mean_accepted_length", i),
             "steps_off": med("steps", 0), "steps_on": med("steps", i),
             "multisteps": med("multisteps", i), "spec_steps": med("spec_steps", i),
             "load_average": med("load_average", i)}
      rows.append(row)
      print(f"median {name:8s} batch {batch:2d} T={temp} {names[i]} vs {names[0]}: "
            f"{row['tokens_per_s_off']:.1f} -> {row['tokens_per_s_on']:.1f} tok/s "
            f"({row['speedup']:.2f}x; per CPU-s {row['speedup_per_cpu_s']:.2f}x), TPOT "
            f"{row['tpot_ms_off']:.1f} -> {row['tpot_ms_on']:.1f} ms, acceptance "
            f"{row['acceptance_rate']:.2f}, mean accepted "
            f"{row['mean_accepted_length']:.2f}, steps {row['steps_off']} -> "
            f"{row['steps_on']} ({row['multisteps']} multi, {row['spec_steps']} "
            f"verifying), prefix hits "
            f"{row['prefix_hit_rate_off']:.3f} -> {row['prefix_hit_rate_on']:.3f} "
            f"(follow-ups {row['follow_up_hit_rate_off']:.3f} -> "
            f"{row['follow_up_hit_rate_on']:.3f}), load {row['load_average']:.1f}",
            flush=True)
  if args.json:
    with open(args.json, "a", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
