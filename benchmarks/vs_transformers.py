"""The real model through our engine against transformers' `generate`.

SmolLM2-135M-Instruct (the Q4_1 GGUF of `paged_jax.models.loader.load("smollm2")`),
the same weights on both sides: ours dequantised by `paged_jax.models.gguf`,
transformers' by its own GGUF reader (`load_gguf_checkpoint`, float32,
torch on the CPU). The same chat prompts, greedy, EOS ignored, the same number of
new tokens; batch 1 (one prompt) and batch 16 (sixteen prompts at once; transformers
pads them on the left with an attention mask, pad = EOS = 2, which SmolLM2's `generate` needs spelled out).
torch runs on `--threads` threads (default 2, `torch.set_num_threads`); XLA CPU
uses the machine's cores (2 on the 2-core container: the same). After one untimed run each, runs alternate ours, theirs per batch
size, and the medians of `--reps` runs are reported as output tokens/s. Our engine
compiles its step shapes in an untimed first run (compilation excluded); its KV pool
holds the batch's tokens.

  python benchmarks/vs_transformers.py            # ~3-5 min on a loaded 2-core CPU
  python benchmarks/vs_transformers.py --reps 1 --new-tokens 8   # smoke test

Skips (exit 0, one line) where torch, transformers or the model file are missing.
Writes benchmarks/results/vs_transformers.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

PAD = 2  # SmolLM2's EOS, <|im_end|>: transformers pads the batch with it
QUESTIONS = [
    "What is the capital of France?", "Give me three tips for a good night's sleep.",
    "Write a haiku about the sea.", "What is 12 + 7?", "Name a famous painter.",
    "Why is the sky blue?", "How do I boil an egg?", "What is a prime number?",
    "Tell me a fun fact about cats.", "What does a compiler do?",
    "Suggest a name for a goldfish.", "How far is the Moon?",
    "What is photosynthesis?", "Translate 'good morning' into French.",
    "What is the largest ocean?", "Give me a word that rhymes with 'tree'.",
]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--new-tokens", type=int, default=32)
  ap.add_argument("--batches", default="1,16")
  ap.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
  ap.add_argument("--output", default=str(pathlib.Path(__file__).parent / "results"
                                          / "vs_transformers.json"))
  args = ap.parse_args(argv)
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"skipped: torch and transformers are needed ({e})")
    return 0
  torch.set_num_threads(args.threads)
  import os  # pylint: disable=import-outside-toplevel
  load_before = os.getloadavg()
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  from paged_jax.models import loader  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.llm import LLM  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  try:
    path = loader.smollm2_path(fetch=False)
  except loader.ModelNotAvailable as e:
    print(f"skipped: the real model is not installed ({e})")
    return 0
  batches = [int(b) for b in args.batches.split(",")]
  t = time.perf_counter()
  ours = loader.load(str(path))
  load_ours = time.perf_counter() - t
  t = time.perf_counter()
  # As tests/paged_jax/models/test_gguf_transformers.py: transformers' GGUF
  # reader without `accelerate` (which `from_pretrained(gguf_file=)` wants).
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # pylint: disable=import-outside-toplevel
  cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
  hf = transformers.LlamaForCausalLM(cfg).float().eval()
  tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
  hf.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
  hf.tie_weights()
  load_hf = time.perf_counter() - t
  tok = ours.tokenizer
  prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                        add_special_tokens=False) for q in QUESTIONS]
  n_new = args.new_tokens
  longest = max(len(p) for p in prompts) + n_new
  block = 16
  llm = LLM(ours.model, num_blocks=max(batches) * (-(-longest // block)) + 4,
            block_size=block, max_batch=max(batches), max_tokens_per_step=256,
            max_model_len=-(-longest // block) * block,
            min_bucket=4, bucket_midpoints=False)  # the CLI's defaults for a real model
  params = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
  cpu, recompiled = [], []  # per run: process CPU seconds; our compile seconds

  def run_ours(ps):
    t0, c0 = time.perf_counter(), time.process_time()
    compiled = llm.engine.stats.compile_seconds
    outs = llm.generate(ps, params)
    wall = time.perf_counter() - t0
    cpu.append(time.process_time() - c0)
    recompiled.append(llm.engine.stats.compile_seconds - compiled)
    return wall, [o.completions[0].token_ids for o in outs]

  def run_hf(ps):
    width = max(len(p) for p in ps)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
      g = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                      do_sample=False, eos_token_id=None, pad_token_id=PAD)
    wall = time.perf_counter() - t0
    cpu.append(time.process_time() - c0)
    return wall, [row[width:].tolist() for row in g]

  results = {"model": ours.name, "file": str(path), "new_tokens": n_new,
             "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
             "started": started, "loadavg_before": load_before, "load_seconds_ours": load_ours,
             "load_seconds_transformers": load_hf, "machine": "2-core CPU container, loaded",
             "batches": {}}
  for b in batches:
    ps = prompts[:b]
    t = time.perf_counter()
    _, first = run_ours(ps)  # compiles the shapes this batch uses
    compile_s = time.perf_counter() - t
    run_hf(ps)  # torch's first call is slow too (allocator, kernels' first use)
    walls = {"ours": [], "transformers": []}
    cpus = {"ours": [], "transformers": []}
    recompiled.clear()
    same = None
    for _ in range(args.reps):
      for side, fn in (("ours", run_ours), ("transformers", run_hf)):
        cpu.clear()
        w, toks = fn(ps)
        walls[side].append(w)
        cpus[side].append(cpu[0])
        if side == "ours":
          got = toks
        else:
          same = sum(a == c for a, c in zip(got, toks))
    tps = {k: b * n_new / statistics.median(v) for k, v in walls.items()}
    ms_token = {k: 1e3 * statistics.median(v) / (b * n_new) for k, v in walls.items()}
    ms_step = {k: 1e3 * statistics.median(v) / n_new for k, v in walls.items()}
    results["batches"][b] = {
        "walls": walls, "process_cpu_seconds": cpus,
        "compile_seconds_in_timed_runs_ours": sum(recompiled), "tokens_per_s": tps,
        "ms_per_output_token": ms_token, "ms_per_decode_step": ms_step, "loadavg": os.getloadavg(),
        "ratio_ours_over_transformers":
        tps["ours"] / tps["transformers"], "first_run_seconds_ours": compile_s,
        "greedy_sequences_identical": f"{same}/{b}",
        "deterministic_ours": first == got}
    print(f"batch {b:>2}: ours {tps['ours']:7.1f} tok/s, transformers "
          f"{tps['transformers']:7.1f} tok/s (x{tps['ours'] / tps['transformers']:.2f}); ms/token "
          f"{ms_token['ours']:.1f} vs {ms_token['transformers']:.1f}; "
          f"greedy identical {same}/{b}; first run (compiling) {compile_s:.1f} s; CPU/wall "
          f"ours {statistics.median(cpus['ours']) / statistics.median(walls['ours']):.2f}, "
          f"transformers {statistics.median(cpus['transformers']) / statistics.median(walls['transformers']):.2f}",
          flush=True)
    results["loadavg_after"] = os.getloadavg()
    out = pathlib.Path(args.output)  # after each batch size: a cut run keeps its figures
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
