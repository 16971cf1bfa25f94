"""Preemption by swap against recompute on a workload that preempts (CPU).

    PYTHONPATH=. python benchmarks/swap_preemption.py          # ~2-4 min, loaded CPU
    PYTHONPATH=. python benchmarks/swap_preemption.py --quick  # smoke test

A small Llama (random weights: hidden 128, 4 layers, 4 KV heads of 32, float32)
serves 24 greedy requests (prompts 32-96 tokens, 32-64 new) with 8 sequences
per step on a pool of 40 blocks of 16 (640 tokens, about two thirds of what
the batch would hold), `admission_headroom_steps=0` so that growth preempts.
`preemption_mode="recompute"` against `"swap"` with 64 host blocks, each
engine compiled first (`warmup`), then runs interleaved (recompute, swap,
recompute, ...); per mode the median wall, and the engine's counts (steps,
token rows computed, preemptions, swaps). The greedy outputs are checked
equal. Results in benchmarks/results/swap_preemption.json.
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks import common
from paged_jax.models.llama import model as model_lib
from paged_jax.serving.engine import Engine, EngineConfig


def _requests(rng, count):
  return [(rng.integers(3, 500, size=int(rng.integers(32, 97))).tolist(),
           int(rng.integers(32, 65))) for _ in range(count)]


def main():
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  quick = args.quick
  cfg = model_lib.LlamaConfig.tiny(hidden_size=128, intermediate_size=384,
                                   num_layers=4, num_heads=4, num_kv_heads=4,
                                   head_dim=32, max_position_embeddings=256)
  model = model_lib.init_model(cfg, seed=0)
  reqs = _requests(np.random.default_rng(0), 6 if quick else 24)
  base = dict(num_blocks=40, block_size=16, max_batch=8, max_tokens_per_step=128,
              max_model_len=192, admission_headroom_steps=0, min_bucket=4,
              bucket_midpoints=False)
  engines = {"recompute": Engine(model, EngineConfig(**base)),
             "swap": Engine(model, EngineConfig(**base, preemption_mode="swap",
                                                swap_space_blocks=64))}
  for e in engines.values():
    e.warmup()
  walls = {k: [] for k in engines}
  counts, outputs = {}, {}
  for r in range(1 if quick else args.repeats):
    for k, e in engines.items():
      before = {f: getattr(e.stats, f) for f in (
          "steps", "computed_tokens", "preemptions", "recomputed_tokens",
          "swapped_out", "swapped_in", "swap_blocks_out", "compile_seconds")}
      wall, outs = common.serve_timed(e, reqs, f"{r}")
      walls[k].append(wall)
      counts[k] = {f: getattr(e.stats, f) - v for f, v in before.items()}
      outputs.setdefault(k, outs)
  assert outputs["swap"] == outputs["recompute"], "greedy outputs differ"
  out = {"model": "llama tiny: hidden 128, 4 layers, 4 KV heads x 32, f32",
         "requests": len(reqs), "config": base, "swap_space_blocks": 64,
         "repeats": len(walls["swap"])}
  for k in engines:
    out[k] = {"wall_s": walls[k], "median_wall_s": statistics.median(walls[k]),
              **counts[k]}
  out["swap_over_recompute_wall"] = (out["swap"]["median_wall_s"]
                                     / out["recompute"]["median_wall_s"])
  print({k: (round(out[k]["median_wall_s"], 2), counts[k]) for k in engines})
  print("swap / recompute wall:", round(out["swap_over_recompute_wall"], 3))
  print("wrote", common.write_json(args.out, "swap_preemption", out, quick=quick))


if __name__ == "__main__":
  main()
