"""Benchmark 1, utilisation: share of allocated KV slots that hold real tokens.

A synthetic trace runs through the real block manager (`benchmarks.sim`) at
block sizes 1 to 256, against two contiguous baselines in the same KV budget:
max-length reservation (every sequence reserves max_model_len slots; 2048 and
8192) and exact-length reservation (an oracle that knows each request's final
length). Utilisation = sum over steps of tokens held / sum of slots allocated.

Goal: >= 97% at block_size 16 on the ShareGPT-like trace.

  PYTHONPATH=. python -m benchmarks.utilisation [--quick]
"""

from __future__ import annotations

import math
import time

from benchmarks import common
from benchmarks import sim
from paged_jax import traces

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GOAL = 0.97
# Per trace: requests, KV budget in token slots, sequence slots, arrival rate.
# The budgets are 2 GiB and 0.5 GiB of Llama-3.1-8B bf16 KV (128 KiB a token).
# The sizes keep block_size 1 (a reserve call per sequence per step) affordable
# on 2 CPU cores; see RESULTS.md.
SETUPS = {
    "sharegpt": dict(num_requests=200, kv_budget_tokens=16384, max_seqs=96,
                     request_rate=20.0),
    "alpaca": dict(num_requests=300, kv_budget_tokens=4096, max_seqs=96,
                   request_rate=40.0),
}
QUICK = dict(num_requests=30)
MAX_MODEL_LEN = 2048  # table width; the traces are clipped at 2048 tokens
SEED = 0


def run_trace(name: str, setup: dict, block_sizes=BLOCK_SIZES) -> dict:
  trace = traces.make_trace(name, setup["num_requests"],
                            request_rate=setup["request_rate"], seed=SEED)
  budget = setup["kv_budget_tokens"]
  paged = {}
  for bs in block_sizes:
    t0 = time.perf_counter()
    r = sim.simulate_paged(trace, block_size=bs, num_blocks=budget // bs,
                           max_seqs=setup["max_seqs"], max_model_len=MAX_MODEL_LEN)
    paged[bs] = r.summary() | {"wall_s": time.perf_counter() - t0}
    print(f"  {name} block_size={bs:3d}: utilisation {r.utilisation():.4f} "
          f"({r.steps} steps, {r.preemptions} preemptions, "
          f"{paged[bs]['wall_s']:.1f}s)", flush=True)
  contiguous = {}
  for label, kwargs in (("max_length_2048", dict(reservation="max_length", max_model_len=2048)),
                        ("max_length_8192", dict(reservation="max_length", max_model_len=8192)),
                        ("exact_length", dict(reservation="exact"))):
    if kwargs.get("max_model_len", 0) > budget:
      continue  # A single max-length reservation does not fit the budget.
    r = sim.simulate_contiguous(trace, kv_budget_tokens=budget, **kwargs)
    contiguous[label] = r.summary()
    print(f"  {name} contiguous {label}: utilisation {r.utilisation():.4f}", flush=True)
  return {
      "setup": setup | {"seed": SEED, "max_model_len": MAX_MODEL_LEN},
      "trace_means": {"prompt": float(trace.prompt_lens.mean()),
                      "output": float(trace.output_lens.mean())},
      "paged": {str(bs): v for bs, v in paged.items()},
      "contiguous": contiguous,
  }


def plot(results: dict, path) -> None:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4),
                           squeeze=False)
  styles = {"exact_length": ":", "max_length_2048": "--", "max_length_8192": "-."}
  for ax, (name, res) in zip(axes[0], results.items()):
    bss = [int(b) for b in res["paged"]]
    ax.plot(bss, [100 * res["paged"][str(b)]["utilisation"] for b in bss], "o-",
            label="paged (block manager)")
    for label, r in res["contiguous"].items():
      ax.axhline(100 * r["utilisation"], ls=styles[label], color="gray",
                 label=f"contiguous {label.replace('_', ' ')}")
    ax.axhline(100 * GOAL, color="red", lw=0.8, label="goal 97% (block 16)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.set_ylim(0, 101)
    ax.set_xlabel("block_size (tokens)")
    ax.set_ylabel("KV slots holding tokens (%)")
    ax.set_title(f"{name}-like trace, {res['setup']['kv_budget_tokens']} token slots")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(quick: bool = False, out=common.RESULTS_DIR) -> dict:
  results = {}
  for name, setup in SETUPS.items():
    setup = setup | (QUICK if quick else {})
    results[name] = run_trace(name, setup,
                              block_sizes=(4, 16, 256) if quick else BLOCK_SIZES)
  u16 = results["sharegpt"]["paged"].get("16", {}).get("utilisation", math.nan)
  data = {"goal": GOAL, "sharegpt_block16_utilisation": u16,
          "goal_met": bool(u16 >= GOAL), "results": results}
  common.write_json(out, "utilisation", data, quick=quick)
  plot(results, common.figure_path(out, "utilisation", quick=quick))
  print(f"utilisation at block_size 16 (ShareGPT-like): {100 * u16:.2f}% "
        f"(goal >= {100 * GOAL:.0f}%)")
  return data


def main(argv=None):
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  run(args.quick, args.out)


if __name__ == "__main__":
  main()
