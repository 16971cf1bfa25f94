"""vLLM runs for `benchmarks/vllm_compare.py` (run with the vLLM venv's Python).

Standard library and vLLM only: it runs in vLLM's own virtual environment,
which has neither JAX nor paged-jax. It starts vLLM's offline engine once
(`LLM`, token-id prompts, greedy, EOS ignored) and then serves commands, one
JSON object a line on stdin:

  {"prompts": FILE, "out": FILE, "max_num_seqs": 32}

`prompts` is a JSON list of objects `{"prompt_ids": [...], "max_new_tokens":
n}`; every request is submitted at once to `LLM.generate`, and the generated
ids, the wall time and per-request latencies (from `RequestOutput.metrics`)
go to `out` as JSON. After each command it prints `@@done FILE` on stdout. A
command with another `max_num_seqs` rebuilds the engine. It builds the
`--max-num-seqs` engine first and prints `@@ready SECONDS` when it is up. Staying up between
commands keeps vLLM's start-up (minutes on a small CPU) out of every run, so
the driver can interleave paged-jax and vLLM runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True)
  p.add_argument("--enable-prefix-caching", action="store_true")
  p.add_argument("--block-size", type=int, default=32)
  p.add_argument("--kv-bytes", type=int, required=True)
  p.add_argument("--max-num-batched-tokens", type=int, default=256)
  p.add_argument("--max-model-len", type=int, default=256)
  p.add_argument("--max-num-seqs", type=int, default=32,
                 help="the engine built at start (then `@@ready` on stdout)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=0, help="0: off")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--warmup-requests", type=int, default=2,
                 help="requests served (and not timed) before each timed run")
  return p.parse_args(argv)


def _latencies(outputs) -> dict:
  """Median time to first token and time per output token (s), from the
  engine's own per-request timestamps; {} when vLLM does not report them."""
  ttft, tpot = [], []
  for o in outputs:
    m = getattr(o, "metrics", None)
    if m is None or not getattr(m, "first_token_latency", 0):
      return {}
    ttft.append(m.first_token_latency)
    n = len(o.outputs[0].token_ids)
    if n > 1 and m.last_token_ts > m.first_token_ts:
      tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1))
  out = {"ttft_p50_s": statistics.median(ttft)}
  if tpot:
    out["tpot_p50_s"] = statistics.median(tpot)
  return out


# vLLM's own counters (`LLM.get_metrics()`, Prometheus names), read before and
# after a timed run: its engine steps (the count of the per-step token
# histogram), the token rows those steps computed (its sum), and preemptions.
_COUNTERS = {"steps": ("vllm:iteration_tokens_total", "count"),
             "computed_tokens": ("vllm:iteration_tokens_total", "sum"),
             "preemptions": ("vllm:num_preemptions", "value")}


def _counters(llm) -> dict:
  """`_COUNTERS` now, {} where this vLLM does not report them."""
  try:
    metrics = {m.name: m for m in llm.get_metrics()}
  except Exception:  # pylint: disable=broad-except  # an older vLLM
    return {}
  out = {}
  for key, (name, field) in _COUNTERS.items():
    value = getattr(metrics.get(name), field, None)
    if isinstance(value, (int, float)):
      out[key] = value
  return out


class _Server:
  """One `vllm.LLM` at a time, rebuilt when `max_num_seqs` changes."""

  def __init__(self, args):
    import vllm  # pylint: disable=import-outside-toplevel
    self.vllm, self.args = vllm, args
    self.llm, self.max_num_seqs, self.startup = None, None, 0.0

  def engine(self, max_num_seqs: int):
    if self.max_num_seqs != max_num_seqs:
      if self.llm is not None:
        del self.llm
        self.llm = None
        gc.collect()
      t0 = time.perf_counter()
      a = self.args
      self.llm = self.vllm.LLM(
          model=a.checkpoint, skip_tokenizer_init=True, dtype="float32",
          block_size=a.block_size, kv_cache_memory_bytes=a.kv_bytes,
          max_num_seqs=max_num_seqs,
          max_num_batched_tokens=a.max_num_batched_tokens,
          max_model_len=a.max_model_len, seed=0, disable_log_stats=False,
          enable_prefix_caching=a.enable_prefix_caching)
      self.startup, self.max_num_seqs = time.perf_counter() - t0, max_num_seqs
    return self.llm

  def serve(self, command: dict) -> dict:
    llm = self.engine(int(command.get("max_num_seqs", 32)))
    with open(command["prompts"], encoding="utf-8") as f:
      entries = json.load(f)
    prompts = [{"prompt_token_ids": e["prompt_ids"]} for e in entries]
    a = self.args
    sampling = [self.vllm.SamplingParams(
        temperature=a.temperature, top_k=a.top_k or -1, top_p=a.top_p,
        max_tokens=e["max_new_tokens"], ignore_eos=True,
        detokenize=False) for e in entries]  # no per-request seed: its slower path
    k = min(self.args.warmup_requests, len(prompts))
    if k:
      llm.generate(prompts[:k], sampling[:k], use_tqdm=False)
    before = _counters(llm)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _counters(llm)
    counted = {k: int(after[k] - before[k]) for k in after if k in before}
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(t) for t in tokens)
    return {"engine": "vllm", "vllm_version": self.vllm.__version__,
            "max_num_seqs": self.max_num_seqs, "startup_seconds": self.startup,
            "wall_seconds": wall, "generated_tokens": generated,
            "tokens_per_second": generated / wall, "requests": len(outputs),
            "token_ids": tokens, **counted, **_latencies(outputs)}


def main(argv=None) -> int:
  args = _args(argv)
  os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
  server = _Server(args)
  server.engine(args.max_num_seqs)
  print(f"@@ready {server.startup:.1f}", flush=True)
  for line in sys.stdin:
    if not line.strip():
      continue
    command = json.loads(line)
    doc = server.serve(command)
    with open(command["out"], "w", encoding="utf-8") as f:
      json.dump(doc, f)
    print(f"vllm: {doc['generated_tokens']} tokens in {doc['wall_seconds']:.2f} s"
          f" = {doc['tokens_per_second']:.1f} tokens/s (max_num_seqs "
          f"{doc['max_num_seqs']}, start-up {doc['startup_seconds']:.1f} s)",
          file=sys.stderr)
    print(f"@@done {command['out']}", flush=True)
  return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
  sys.exit(main())
