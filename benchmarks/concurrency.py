"""Benchmark 2, concurrency: requests running at once in a fixed KV budget.

A trace arrives faster than it can be served, so the queue fills and memory
decides how many requests run at once. The paged run admits requests as the
real block manager's blocks allow (`benchmarks.sim`, block_size 16); the
baselines reserve contiguous memory per request: max_model_len slots (2048 or
8192) or, as an oracle, exactly prompt + output. Concurrency is the mean
number of running requests over the steps when requests are waiting.

Goal: >= 4x the max-length reservation (max_model_len 2048) on the
ShareGPT-like trace.

  PYTHONPATH=. python -m benchmarks.concurrency [--quick]
"""

from __future__ import annotations

import math

from benchmarks import common
from benchmarks import sim
from paged_jax import traces

BLOCK_SIZE = 16
GOAL = 4.0
# ShareGPT-like: 65536 token slots = 8 GiB of Llama-3.1-8B bf16 KV (the 24 GiB
# card of the capacity planner's example). Alpaca-like: 16384 slots (2 GiB).
SETUPS = {
    "sharegpt": dict(num_requests=1000, kv_budget_tokens=65536, max_seqs=512,
                     request_rate=50.0),
    "alpaca": dict(num_requests=2000, kv_budget_tokens=16384, max_seqs=512,
                   request_rate=500.0),
}
QUICK = {"sharegpt": dict(num_requests=100, kv_budget_tokens=8192),
         "alpaca": dict(num_requests=200, kv_budget_tokens=4096)}
SEED = 1
BASELINES = (("max_length_2048", dict(reservation="max_length", max_model_len=2048)),
             ("max_length_8192", dict(reservation="max_length", max_model_len=8192)),
             ("exact_length", dict(reservation="exact")))


def run_trace(name: str, setup: dict) -> tuple[dict, dict]:
  trace = traces.make_trace(name, setup["num_requests"],
                            request_rate=setup["request_rate"], seed=SEED)
  budget = setup["kv_budget_tokens"]
  runs = {"paged": sim.simulate_paged(
      trace, block_size=BLOCK_SIZE, num_blocks=budget // BLOCK_SIZE,
      max_seqs=setup["max_seqs"])}
  for label, kwargs in BASELINES:
    if kwargs.get("max_model_len", 0) <= budget:
      runs[label] = sim.simulate_contiguous(trace, kv_budget_tokens=budget, **kwargs)
  summary = {label: r.summary() for label, r in runs.items()}
  paged = summary["paged"]["mean_running_saturated"]
  ratios = {label: paged / s["mean_running_saturated"]
            for label, s in summary.items() if label != "paged"}
  for label, s in summary.items():
    print(f"  {name} {label}: {s['mean_running_saturated']:.1f} running "
          f"(max {s['max_running']}, {s['saturated_steps']} saturated steps, "
          f"utilisation {s['utilisation']:.3f})"
          + (f" -> paged is {ratios[label]:.2f}x" if label in ratios else ""),
          flush=True)
  if summary["paged"]["max_running"] >= setup["max_seqs"]:
    print(f"  note: paged concurrency hit max_seqs={setup['max_seqs']}")
  return ({"setup": setup | {"seed": SEED, "block_size": BLOCK_SIZE},
           "runs": summary, "paged_over": ratios}, runs)


def plot(results: dict, runs: dict, path) -> None:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
  for ax, (name, rs) in zip(axes[0], runs.items()):
    horizon = int(1.5 * rs["paged"].steps)  # the baselines run far longer
    for label, r in rs.items():
      mean = results[name]["runs"][label]["mean_running_saturated"]
      more = f", {r.steps} steps" if r.steps > horizon else ""
      ax.plot(r.running[:horizon], lw=1.2 if label == "paged" else 1,
              label=f"{label.replace('_', ' ')} (mean {mean:.0f}{more})")
    budget = results[name]["setup"]["kv_budget_tokens"]
    ax.set_title(f"{name}-like trace, {budget} KV token slots")
    ax.set_xlabel("step")
    ax.set_ylabel("requests running")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(quick: bool = False, out=common.RESULTS_DIR) -> dict:
  results, runs = {}, {}
  for name, setup in SETUPS.items():
    results[name], runs[name] = run_trace(name, setup | (QUICK[name] if quick else {}))
  ratio = results["sharegpt"]["paged_over"].get("max_length_2048", math.nan)
  data = {"goal": GOAL, "sharegpt_paged_over_max_length_2048": ratio,
          "goal_met": bool(ratio >= GOAL), "results": results}
  common.write_json(out, "concurrency", data, quick=quick)
  plot(results, runs, common.figure_path(out, "concurrency", quick=quick))
  print(f"concurrency, paged vs max-length 2048 (ShareGPT-like): {ratio:.2f}x "
        f"(goal >= {GOAL:g}x)")
  return data


def main(argv=None):
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  run(args.quick, args.out)


if __name__ == "__main__":
  main()
