"""Sliding-window block reclamation in the engine, on vs off, same KV bytes (CPU).

    PYTHONPATH=. python benchmarks/hybrid_reclaim.py          # ~5-10 min, loaded CPU
    PYTHONPATH=. python benchmarks/hybrid_reclaim.py --quick  # smoke test
    PYTHONPATH=. python benchmarks/hybrid_reclaim.py --max-num-seqs 32  # batch no cap
    PYTHONPATH=. python benchmarks/hybrid_reclaim.py --prefix 384  # prefix caching
    PYTHONPATH=. python benchmarks/hybrid_reclaim.py --layers mistral --prefix 384

A Gemma-3-shaped random model (6 layers: 5 local of window 64 to 1 global;
hidden 64, 4 query / 2 KV heads of 16, float32) serves 24 greedy requests
(prompts 256-640 tokens, 32-64 new) with up to 16 sequences per step (`--max-num-seqs`), blocks
of 16, on the KV memory of 160 blocks of every layer (2,560 tokens: about 4
of the requests without reclamation). Reclamation on (`shared_pool`: one
pool shared by the layer groups, 960 blocks of one layer; and, without
`--prefix`, also `per_window`: `window_pool`'s pool per window, the same
layer-blocks split by `pool_sizes`) against off (one pool, every block
kept), `admission_headroom_steps=0`, each engine
warmed up (and one untimed run of 4 requests: the first run paid ~5 s of
one-off host costs in both modes), then interleaved runs (on, off, on, off, ...). Per mode: the
median wall, output tokens/s, peak and mean running sequences, preemptions,
token rows computed; the greedy outputs are checked equal. The ideal is
`hybrid_capacity.plan_hybrid`'s ratio at the requests' mean length. Results
in benchmarks/results/hybrid_reclaim.json.

Concurrency is reported three ways: the whole run's mean and peak running
sequences, and the mean over the *saturated phase*: the steps in which a
request waits, from the first step in which memory held one back (a
deferred admission, a refused reservation or a preemption) on. There the
number running is what the KV memory admits (unless `max_num_seqs` caps
it: `capped_steps` counts saturated steps at the cap). A closed workload's
ramp-up (admission limited by the token budget) and drain (nothing left to
admit) are outside it; `--num-requests` large makes it dominate.
`--admission-headroom-steps` (default 0, sections 15b-15e) and
`--max-tokens-per-step` (default max(256, max_num_seqs)) set both engines'.

`--layers mistral`: every layer local (window 64), one pool (Mistral's
shape) instead of the Gemma-3 pattern. Results get `_mistral` in the name.

`--prefix P`: both engines with `enable_prefix_caching=True`, and every
prompt of a run is one shared prefix of `P` tokens and a distinct tail of
64-256 tokens (a new prefix per run and for the warm-up, so no run hits
what an earlier one left); per mode also the hit rate (prompt tokens served
from the cache / prompt tokens). Results in hybrid_reclaim_prefix<P>.json.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

from benchmarks import common
from paged_jax import hybrid_capacity
from paged_jax.models.llama import model as model_lib
from paged_jax.serving import window_pool
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.stats import Gauge

WINDOW, BS, NUM_BLOCKS = 64, 16, 160
LAYERS = {"gemma3": ("sliding_attention",) * 5 + ("full_attention",),
          "mistral": ("sliding_attention",) * 6}


def _requests(rng, count, prompt=(256, 641)):
  return [(rng.integers(3, 500, size=int(rng.integers(*prompt))).tolist(),
           int(rng.integers(32, 65))) for _ in range(count)]


def _prefix_requests(rng, count, prefix_len):
  prefix = rng.integers(3, 500, size=prefix_len).tolist()
  return [(prefix + rng.integers(3, 500, size=int(rng.integers(64, 257))).tolist(),
           int(rng.integers(32, 65))) for _ in range(count)]


def _per_window_engine(model, config) -> Engine:
  """An engine of `config` with a KV pool per window: the layout
  `window_pool.layout` picks only with prefix caching, forced here (for this
  comparison only) by replacing the rule while the engine is built."""
  rule = window_pool.layout
  window_pool.layout = lambda config, pools: (False, "per window (benchmark)")
  try:
    return Engine(model, config)
  finally:
    window_pool.layout = rule


class StepTrace:
  """Per step of one engine: `(running, waiting, held)`, `held` the memory
  refusals so far (deferred admissions, refused reservations, preemptions).
  Wraps `stats.add_step` on the instance (the benchmark's instrument)."""

  def __init__(self, stats):
    self.rows: list[tuple[int, int, int]] = []
    add = stats.add_step

    def add_step(bucket, num_pools, used, cached, running, waiting):
      add(bucket, num_pools, used, cached, running, waiting)
      self.rows.append((running, waiting, stats.deferred_admissions
                        + stats.refused_reservations + stats.preemptions))
    stats.add_step = add_step

  def saturated(self, max_num_seqs: int) -> dict:
    """The saturated phase (module docstring): its steps, mean running
    sequences, and steps where `max_num_seqs` capped it."""
    rows = self.rows
    start = next((i for i, r in enumerate(rows) if r[2] > rows[0][2]), len(rows))
    sat = [r for r, w, _ in rows[start:] if w > 0]
    return {"saturated_steps": len(sat), "run_steps": len(rows),
            "saturated_mean_running": round(statistics.mean(sat), 2) if sat else 0.0,
            "capped_steps": sum(r >= max_num_seqs for r in sat)}


def main():
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--num-requests", type=int, default=24,
                 help="requests per run (more: a longer steady phase between the "
                 "ramp-up and the drain)")
  p.add_argument("--max-num-seqs", type=int, default=16,
                 help="max_batch of both engines (16: section 15b's runs, where it "
                 "capped the peak with reclamation on)")
  p.add_argument("--prefix", type=int, default=0,
                 help="shared-prefix tokens, with prefix caching on in both engines "
                 "(0: section 15b's workload, no caching)")
  p.add_argument("--layers", choices=sorted(LAYERS), default="gemma3",
                 help="the layer pattern: gemma3 (5 local : 1 global, a pool per "
                 "window) or mistral (every layer local, one pool)")
  p.add_argument("--admission-headroom-steps", type=int, default=0,
                 help="both engines' (0: sections 15b-15e, no block check at admission)")
  p.add_argument("--num-blocks", type=int, default=NUM_BLOCKS,
                 help="KV memory in blocks of every layer (160: sections 15b-15f)")
  p.add_argument("--max-tokens-per-step", type=int, default=0,
                 help="both engines' token budget (0: max(256, max_num_seqs))")
  args = p.parse_args()
  quick = args.quick
  cfg = model_lib.LlamaConfig.tiny(num_layers=6, sliding_window=WINDOW,
                                   layer_types=LAYERS[args.layers],
                                   max_position_embeddings=1024)
  model = model_lib.init_model(cfg, seed=0)
  count = 6 if quick else args.num_requests
  if args.prefix:
    runs = [_prefix_requests(np.random.default_rng(100 + r), count, args.prefix)
            for r in range(1 + (1 if quick else args.repeats))]
    warm, runs = runs[0][:4], runs[1:]
  else:
    reqs = _requests(np.random.default_rng(0), count)
    warm, runs = reqs[:4], [reqs] * (1 if quick else args.repeats)
  reqs = runs[0]
  base = dict(num_blocks=args.num_blocks, block_size=BS, max_batch=args.max_num_seqs,
              max_tokens_per_step=args.max_tokens_per_step or max(256, args.max_num_seqs),
              max_model_len=704, admission_headroom_steps=args.admission_headroom_steps,
              min_bucket=16, bucket_midpoints=False, enable_prefix_caching=bool(args.prefix))
  engines = {"on": Engine(model, EngineConfig(**base))}
  layer_blocks = {}
  if args.layers == "gemma3":
    assert engines["on"].reclamation.pools == (WINDOW, None)
    if not args.prefix:  # shared by default (`window_pool.layout`); also per window
      assert engines["on"].reclamation.layout == "shared"
      engines["per_window"] = _per_window_engine(model, EngineConfig(**base))
      layer_blocks["on"] = engines["on"].block_state.num_blocks  # blocks of G = 1 layer
    pw = "per_window" if "per_window" in engines else "on"
    pools = [s.num_blocks for s in engines[pw].block_state.states]
    layer_blocks[pw] = 5 * pools[0] + pools[1]
  else:
    assert engines["on"].block_state.window == WINDOW
    pools = [engines["on"].block_state.num_blocks]
    layer_blocks["on"] = 6 * pools[0]
  engines["off"] = Engine(model, EngineConfig(**base, sliding_window_reclamation=False))
  layer_blocks["off"] = args.num_blocks * 6
  for k, e in engines.items():
    e.warmup()
    common.serve_timed(e, warm, f"warm-{k}")  # first-run costs outside the timed runs
  walls = {k: [] for k in engines}
  counts, outputs = {}, {}
  fields = ("steps", "computed_tokens", "preemptions", "recomputed_tokens",
            "generated_tokens", "compile_seconds", "prefix_hit_tokens",
            "prefix_queried_tokens", "host_seconds", "exposed_host_seconds")
  for r, reqs in enumerate(runs):
    outputs = {}
    for k, e in engines.items():
      before = {f: getattr(e.stats, f) for f in fields}
      e.stats.running = Gauge()  # this run's gauge
      trace = StepTrace(e.stats)
      wall, outs = common.serve_timed(e, reqs, f"{r}")
      del e.stats.add_step  # (the class's again)
      walls[k].append(wall)
      counts[k] = {f: getattr(e.stats, f) - v for f, v in before.items()}
      counts[k].update(peak_running=e.stats.running.peak,
                       mean_running=round(e.stats.running.mean, 2),
                       **trace.saturated(args.max_num_seqs),
                       tokens_per_s=counts[k]["generated_tokens"] / wall,
                       host_us_per_step=round(1e6 * counts[k]["host_seconds"]
                                              / max(counts[k]["steps"], 1)),
                       hit_rate=round(counts[k]["prefix_hit_tokens"]
                                      / max(counts[k]["prefix_queried_tokens"], 1), 3))
      outputs[k] = outs
    for k in engines:
      assert outputs[k] == outputs["off"], f"greedy outputs differ ({k} vs off)"
  mean_len = int(np.mean([len(q) + n for q, n in reqs]))
  plan = hybrid_capacity.plan_hybrid(
      kv_pool_bytes=args.num_blocks * BS * hybrid_capacity.capacity.kv_head_token_bytes(
          "float32", cfg.head_dim) * 2 * cfg.num_kv_heads * cfg.num_layers,
      groups=hybrid_capacity.groups_from_windows([s.sliding_window for s in cfg.layer_specs]),
      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=BS,
      context=mean_len, kv_dtype="float32")
  out = {"model": ("gemma3-shaped tiny: 6 layers (5 local w=64 : 1 global)"
                   if args.layers == "gemma3" else
                   "mistral-shaped tiny: 6 layers, all local w=64")
                  + ", hidden 64, 2 KV heads x 16, f32",
         "requests": len(reqs), "config": base, "pools_per_window": pools,
         "layout_on": engines["on"].reclamation.layout,
         "layer_blocks": layer_blocks,
         "repeats": len(walls["on"]), "load_average": os.getloadavg(),
         "mean_request_len": mean_len,
         "ideal_ratio": plan.ratio, "ideal_max_seqs": [plan.max_seqs,
                                                       plan.max_seqs_without_reclamation]}
  for k in engines:
    med = statistics.median(walls[k])
    out[k] = {"wall_s": walls[k], "median_wall_s": med,
              "median_tokens_per_s": counts[k]["generated_tokens"] / med, **counts[k]}
  for e in (k for k in engines if k != "off"):
    sfx = "" if e == "on" else f"_{e}"
    out["tokens_per_s_ratio" + sfx] = (out[e]["median_tokens_per_s"]
                                       / out["off"]["median_tokens_per_s"])
    out["mean_running_ratio" + sfx] = out[e]["mean_running"] / out["off"]["mean_running"]
    out["saturated_mean_running_ratio" + sfx] = (
        out[e]["saturated_mean_running"] / max(out["off"]["saturated_mean_running"], 1e-9))
    for k in ("mean_running_ratio", "saturated_mean_running_ratio"):
      out[k.replace("_ratio", "_pct_of_ideal") + sfx] = round(100 * out[k + sfx] / plan.ratio, 1)
    print(f"{e} / off tokens/s:", round(out["tokens_per_s_ratio" + sfx], 3),
          "mean running ratio:", round(out["mean_running_ratio" + sfx], 3),
          "saturated:", round(out["saturated_mean_running_ratio" + sfx], 3),
          "ideal:", round(plan.ratio, 3))
  out["prefix_tokens"] = args.prefix
  print({k: (round(out[k]["median_wall_s"], 2), counts[k]) for k in engines})
  print("load:", os.getloadavg())
  name = "hybrid_reclaim" + ("" if args.layers == "gemma3" else f"_{args.layers}") + ("" if args.max_num_seqs == 16 else f"_b{args.max_num_seqs}") + (
      "" if args.num_requests == 24 else f"_n{args.num_requests}") + (
      f"_prefix{args.prefix}" if args.prefix else "") + (
      f"_h{args.admission_headroom_steps}" if args.admission_headroom_steps else "") + (
      f"_t{args.max_tokens_per_step}" if args.max_tokens_per_step else "") + (
      "" if args.num_blocks == NUM_BLOCKS else f"_k{args.num_blocks}")
  print("wrote", common.write_json(args.out, name, out, quick=quick))


if __name__ == "__main__":
  main()
