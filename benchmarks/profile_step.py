"""The real model's engine step, profiled: a `jax.profiler` trace of decode
steps, broken down into host and device time and the device program into op
categories (issue #21).

SmolLM2-135M-Instruct (`paged_jax.models.loader.load("smollm2")`, the GGUF in
`~/.cache/paged_jax`; nothing is fetched: `PAGED_JAX_NO_FETCH` is set), float32,
`--batch` greedy requests (EOS ignored) with 32-token prompts. The engine
prefills them, runs a few decode steps untimed, then traces `--steps` decode
steps (`jax.profiler.trace`, a Perfetto JSON trace).

From the trace:

* **host vs device**: the steps' wall time; the device program's busy time
  (the union of the events of the compiled step's HLO ops, on whatever
  threads or streams ran them); exposed host time = wall - device busy;
* **op categories**: each op event's self time (its own duration minus its
  nested op events'), its category read from the op's HLO metadata (the
  source file and op name that `as_text()` of the compiled step records):
  attention (`xla_attention.py` / Pallas), KV write and copies
  (`kv_cache.py`), matmuls (a `dot_general` in the model), other model ops
  (norms, RoPE, activations, embedding), sampling (`sampling.py`: argmax,
  top-k/top-p, log-probs), block bookkeeping and step metadata
  (`block_manager.py`, `step_metadata.py`), step glue (`step.py`: input
  tokens, logits gather, fingerprint) and the rest.

It runs on CPU in a few minutes and on GPU unchanged (there the op events are
the kernels, named after their HLO fusions).

  PYTHONPATH=. python -m benchmarks.profile_step [--batch 16] [--steps 50]
      [--logprobs N] [--temperature T --top-k K --top-p P]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

os.environ.setdefault("PAGED_JAX_NO_FETCH", "1")

import jax  # noqa: E402  pylint: disable=wrong-import-position

from benchmarks import common  # noqa: E402
from paged_jax.models import loader  # noqa: E402
from paged_jax.serving.engine import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.requests import Request  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402

PROMPT = 32
CATEGORIES = ("matmul", "attention", "kv write / copy", "sampling",
              "model other", "bookkeeping + metadata", "step glue", "other")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_META = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")
# (category, source files any frame of whose call stack puts an op there), in
# order of precedence: attention is called from the model, so it goes first.
_BY_FILE = (("attention", ("xla_attention.py", "attention.py", "flax_attention.py",
                           "pallas_kernels")),
            ("kv write / copy", ("kv_cache.py",)),
            ("sampling", ("sampling.py", "beam.py")),
            ("bookkeeping + metadata", ("block_manager.py", "step_metadata.py")))


def categorize(op_name: str, files: tuple[str, ...]) -> str:
  """An HLO op's category from its metadata: `op_name` and the source files
  of its call stack (innermost last)."""
  for cat, names in _BY_FILE:
    if any(any(f.endswith(n) or n in f for n in names) for f in files):
      return cat
  if "paged_attention" in op_name:
    return "attention"
  if "dot_general" in op_name:
    return "matmul"
  if any("/models/" in f or f.endswith("rope.py") for f in files):
    return "model other"
  if any(f.endswith("step.py") for f in files):
    return "step glue"
  return "other"


def _tables(text: str) -> dict[str, dict[int, str]]:
  """The module's `FileNames`, `FileLocations` and `StackFrames` tables."""
  out, cur = {}, None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      cur = out.setdefault(line, {})
      continue
    m = _ROW.match(line) if cur is not None else None
    if m:
      cur[int(m.group(1))] = m.group(2)
    elif cur is not None and line.strip():
      cur = None
  return out


def op_table(texts: list[str]) -> dict[str, str]:
  """HLO instruction name -> category, over the compiled programs' module
  texts (`HloModule.to_string()`, with their stack-frame tables)."""
  out = {}
  for text in texts:
    t = _tables(text)
    files = {k: v.strip('"') for k, v in t.get("FileNames", {}).items()}
    loc_file = {k: int(dict(_FIELD.findall(v)).get("file_name_id", 0))
                for k, v in t.get("FileLocations", {}).items()}
    frames = {k: {a: int(b) for a, b in _FIELD.findall(v)}
              for k, v in t.get("StackFrames", {}).items()}

    def stack(fid, frames=frames, loc_file=loc_file, files=files):
      chain, seen = [], set()
      while fid in frames and fid not in seen:
        seen.add(fid)
        chain.append(files.get(loc_file.get(frames[fid].get("file_location_id")), ""))
        fid = frames[fid].get("parent_frame_id", 0)
      return tuple(reversed(chain))

    for line in text.splitlines():
      m = _INSTR.match(line)
      if not m:
        continue
      name, rest = m.groups()
      meta = _META.search(rest)
      frame = _FRAME.search(rest)
      out.setdefault(name, categorize(meta.group(1) if meta else "",
                                      stack(int(frame.group(1))) if frame else ()))
  return out


def _union(intervals) -> float:
  total, end = 0.0, -float("inf")
  for a, b in sorted(intervals):
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def summarize(trace_file: str, ops: dict[str, str]) -> dict:
  """Device busy time and per-category self times (microseconds) of the op
  events in a Perfetto JSON trace."""
  with gzip.open(trace_file, "rt", encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("name") in ops and "dur" in e:
      by_thread[(e.get("pid"), e.get("tid"))].append(e)
  self_us = collections.Counter()
  count = collections.Counter()
  intervals = []
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # [end, event, children's time]
    for e in evs:
      start, end = e["ts"], e["ts"] + e["dur"]
      while stack and stack[-1][0] <= start:
        _, done, child = stack.pop()
        self_us[ops[done["name"]]] += max(done["dur"] - child, 0.0)
      if stack:
        stack[-1][2] += e["dur"]
      else:
        intervals.append((start, end))
      stack.append([end, e, 0.0])
      count[ops[e["name"]]] += 1
    for _, done, child in stack:
      self_us[ops[done["name"]]] += max(done["dur"] - child, 0.0)
  return {"device_busy_us": _union(intervals), "self_us": dict(self_us),
          "op_events": dict(count)}


def run(args) -> dict:
  loaded = loader.load(args.model, scan_layers=args.scan_layers)
  model = loaded.model
  batch = args.batch
  max_len = PROMPT + args.warm_steps + args.steps + 16
  cfg = EngineConfig(num_blocks=batch * (-(-max_len // 16) + 1) + 8,
                     block_size=16, max_batch=batch,
                     max_tokens_per_step=max(PROMPT * batch, 64),
                     max_model_len=max_len, min_bucket=batch,
                     bucket_midpoints=False, max_logprobs=max(args.logprobs, 1))
  engine = Engine(model, cfg)
  t = time.perf_counter()
  engine.warmup()
  compile_s = time.perf_counter() - t
  vocab = model.config.vocab_size
  params = SamplingParams(
      max_new_tokens=args.warm_steps + args.steps + 8, ignore_eos=True,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      seed=1, logprobs=args.logprobs or None)
  for i in range(batch):
    prompt = [(97 * i + 13 * j + 5) % vocab for j in range(PROMPT)]
    engine.add_request(Request(i, prompt, params))
  while engine.stats.decode_steps < args.warm_steps:  # prefill, then decode
    engine.step()
  walls = []
  trace_dir = tempfile.mkdtemp(prefix="profile_step_")
  decode0 = engine.stats.decode_steps
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(args.steps):
      t = time.perf_counter()
      engine.step()
      walls.append(time.perf_counter() - t)
    jax.block_until_ready(engine.block_state.num_free)
  decode_steps = engine.stats.decode_steps - decode0
  engine.run_until_done()
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                    recursive=True)
  if not files:
    raise RuntimeError(f"no Perfetto trace written under {trace_dir}")
  texts = [m.to_string() for exe in engine._runner._steps.values()  # pylint: disable=protected-access
           for m in exe.runtime_executable().hlo_modules()]
  s = summarize(max(files, key=os.path.getmtime), op_table(texts))
  wall_us = 1e6 * sum(walls)
  busy = s["device_busy_us"]
  total_self = sum(s["self_us"].values()) or 1.0
  return {
      "model": loaded.name, "batch": batch, "steps": args.steps,
      "decode_steps": decode_steps, "backend": jax.default_backend(),
      "logprobs": args.logprobs, "temperature": args.temperature,
      "top_k": args.top_k, "top_p": args.top_p, "compile_s": compile_s,
      "wall_ms_per_step": wall_us / 1e3 / args.steps,
      "wall_ms_per_step_median": 1e3 * statistics.median(walls),
      "device_ms_per_step": busy / 1e3 / args.steps,
      "exposed_host_ms_per_step": (wall_us - busy) / 1e3 / args.steps,
      "exposed_host_share": (wall_us - busy) / wall_us,
      "categories_ms_per_step": {c: s["self_us"].get(c, 0.0) / 1e3 / args.steps
                                 for c in CATEGORIES},
      "categories_share": {c: s["self_us"].get(c, 0.0) / total_self
                           for c in CATEGORIES},
      "trace_dir": trace_dir}


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--model", default="smollm2")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                 help="stacked layers under lax.scan (default) or separate, unrolled")
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--warm-steps", type=int, default=4)
  p.add_argument("--logprobs", type=int, default=0,
                 help="top log-probs every request asks for (0: none)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--tag", default="")
  args = p.parse_args(argv)
  if args.quick:
    args.model, args.steps, args.batch = "tiny", 5, 4
  r = run(args) | {"tag": args.tag}
  print(f"{r['model']} batch {r['batch']}, {r['steps']} steps ({r['decode_steps']}"
        f" decode), {r['backend']}, logprobs {r['logprobs']}, temperature"
        f" {r['temperature']}: wall {r['wall_ms_per_step']:.2f} ms/step (median"
        f" {r['wall_ms_per_step_median']:.2f}), device {r['device_ms_per_step']:.2f},"
        f" exposed host {r['exposed_host_ms_per_step']:.2f}"
        f" ({100 * r['exposed_host_share']:.1f}%)")
  print(f"  {'category':24s} {'ms/step':>8s} {'share':>6s}")
  for c in CATEGORIES:
    print(f"  {c:24s} {r['categories_ms_per_step'][c]:8.3f}"
          f" {100 * r['categories_share'][c]:5.1f}%")
  path = common.write_json(args.out, f"profile_step{'_' + args.tag if args.tag else ''}",
                           {"machine": common.machine(), "result": r},
                           quick=args.quick)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
