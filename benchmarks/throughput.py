"""Benchmark 3, throughput: the Flax decoder's serving loop, paged vs contiguous.

The tiny Llama (`paged_jax.models.llama`, seeded random weights) serves the same
seeded ShareGPT-like workload (lengths scaled down for a CPU) twice, on the
same KV memory:

* paged: blocks of 16 tokens, continuous batching, preemption by recompute;
* contiguous: every sequence reserves `max_model_len` slots up front, static
  batching (the next batch starts when the previous one has finished).

Reported: generated tokens/s of each and their ratio (goal >= 3x), mean
latency per output token (a request's time from arrival to finish over its
output tokens; engine steps converted to seconds with the run's mean step
time), and the host share of step time (scheduling, block management and
input building against device time; goal <= 5%). Both runs produce the same
greedy tokens for every request, which is checked.

  PYTHONPATH=. python -m benchmarks.throughput [--quick]
"""

from __future__ import annotations

import numpy as np

from benchmarks import common

KV_TOKENS = 2048
MAX_MODEL_LEN = 384  # the scaled analogue of 2048 (lengths are scaled by 1/6)
MAX_BATCH = 32


def _latency_per_token(stats: dict, outputs) -> float:
  """Mean over requests of (finish - arrival) seconds / output tokens."""
  step_s = stats["wall_seconds"] / max(stats["steps"], 1)
  vals = []
  for o in outputs:
    n = sum(len(c.token_ids) for c in o.completions)
    if n and o.finish_step is not None:
      vals.append((o.finish_step - o.arrival_step) * step_s / n)
  return float(np.mean(vals)) if vals else float("nan")


def run(quick: bool = False, out=common.RESULTS_DIR) -> dict:
  # Imported here: the examples pull in flax and the model code.
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.entrypoints import workload  # pylint: disable=import-outside-toplevel

  model = model_lib.init_model(model_lib.LlamaConfig.tiny(dtype="float32"), 0)
  num_requests = 24 if quick else 160
  requests = workload.synthetic_requests(
      num_requests, vocab_size=model.config.vocab_size,
      max_model_len=MAX_MODEL_LEN, seed=0,
      exclude_ids=model.config.eos_token_ids)
  results, outputs = {}, {}
  for kind in workload.KINDS:
    stats, outs = workload.run_workload(
        kind, model, requests, kv_tokens=KV_TOKENS, block_size=16,
        max_batch=MAX_BATCH, max_model_len=MAX_MODEL_LEN, progress=False)
    stats["latency_per_output_token_ms"] = 1e3 * _latency_per_token(stats, outs)
    stats["host_share"] = stats["host_ms_per_step"] / (
        stats["host_ms_per_step"] + stats["device_ms_per_step"])
    results[kind], outputs[kind] = stats, outs
    print(f"  {kind:>10}: {stats['tokens_per_second']:8.1f} tokens/s, "
          f"{stats['latency_per_output_token_ms']:6.2f} ms per output token, "
          f"{stats['mean_running']:5.1f} running on average (peak "
          f"{stats['peak_running']}), host {100 * stats['host_share']:.1f}% of "
          f"step time, {stats['preemptions']} preemptions", flush=True)
  same = sum(
      [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
      for a, b in zip(outputs["paged"], outputs["contiguous"]))
  paged, contiguous = results["paged"], results["contiguous"]
  ratio = paged["tokens_per_second"] / contiguous["tokens_per_second"]
  print(f"  tokens/s paged / contiguous: {ratio:.2f}x; identical greedy outputs "
        f"{same}/{len(requests)}")
  data = dict(
      requests=num_requests, kv_tokens=KV_TOKENS,
      max_model_len=MAX_MODEL_LEN, max_batch=MAX_BATCH, model="tiny Llama "
      "(2 layers, hidden 64, 4 heads / 2 KV heads), float32, seeded weights",
      paged=paged, contiguous=contiguous, tokens_per_second_ratio=ratio,
      identical_outputs=same)
  common.write_json(out, "throughput", data, quick=quick)
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
  kinds = ["paged", "contiguous"]
  axes[0].bar(kinds, [results[k]["tokens_per_second"] for k in kinds],
              color=["tab:blue", "tab:gray"])
  axes[0].set_ylabel("generated tokens / s")
  axes[0].set_title(f"throughput ({ratio:.1f}x)")
  axes[1].bar(kinds, [results[k]["latency_per_output_token_ms"] for k in kinds],
              color=["tab:blue", "tab:gray"])
  axes[1].set_ylabel("ms per output token")
  axes[1].set_title("mean latency per output token")
  fig.suptitle(f"tiny Llama on CPU, {num_requests} requests, same KV memory "
               f"({KV_TOKENS} tokens)", fontsize=9)
  fig.tight_layout()
  fig.savefig(common.figure_path(out, "throughput", quick=quick), dpi=120)
  plt.close(fig)
  return data


def main(argv=None):
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  run(args.quick, args.out)


if __name__ == "__main__":
  main()
