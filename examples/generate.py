"""Batched generation with a paged KV cache: the first thing to run.

    python examples/generate.py

serves a seeded synthetic workload (a few dozen requests, ShareGPT-like
lengths) on the tiny random Llama on CPU, with continuous batching over a
paged KV cache, then serves the same workload with a contiguous max-length
cache of the same memory (static batching) and prints both, so you see what
paging buys. With `--checkpoint DIR` it loads a Hugging Face Llama checkpoint;
with `--prompt-ids FILE` it serves your prompts (a JSON list of token-id
lists). `--output FILE` writes every request's generated ids and finish
reason as JSON. Temperature 0 (the default) is deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _parse_mesh(text: str) -> tuple[int, int]:
  """"data=2,model=4" (either part may be left out) -> (2, 4)."""
  sizes = {"data": 1, "model": 1}
  for part in text.split(","):
    name, eq, value = part.partition("=")
    name = name.strip()
    if not eq or name not in sizes or not value.strip().isdigit() or int(value) < 1:
      raise ValueError(f"--mesh must look like data=2,model=4, got {text!r}")
    sizes[name] = int(value)
  return sizes["data"], sizes["model"]


def _simulate_host_devices(argv):
  """With --mesh on a CPU-only machine, JAX needs that many host devices (per
  process): ask for them before JAX starts (the flag only affects the CPU
  platform)."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--mesh")
  pre.add_argument("--num-processes", type=int, default=1)
  known, _ = pre.parse_known_args(argv)
  if not known.mesh:
    return
  try:
    data, model = _parse_mesh(known.mesh)
  except ValueError:
    return  # reported properly after parsing
  local = max(1, data * model // max(known.num_processes, 1))
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={local}").strip()


if __name__ == "__main__":
  _simulate_host_devices(sys.argv[1:])

# pylint: disable=wrong-import-position
from examples.llama import checkpoint as checkpoint_lib  # noqa: E402
from examples.llama import model as model_lib  # noqa: E402
from examples.llama import tensor_parallel  # noqa: E402
from examples.serving import workload  # noqa: E402
from paged_jax.serving.requests import Request  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402
from paged_jax import sharding  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  src = p.add_argument_group("model and prompts")
  src.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face Llama checkpoint (config.json + *.safetensors); "
                   "default: the tiny model with seeded random weights")
  src.add_argument("--model-seed", type=int, default=0,
                   help="seed of the tiny model's random weights")
  src.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="parameter/compute dtype (default: the checkpoint's)")
  src.add_argument("--prompt-ids", metavar="FILE",
                   help="JSON list of token-id lists; default: a synthetic workload")
  src.add_argument("--num-requests", type=int, default=48,
                   help="size of the synthetic workload")
  src.add_argument("--workload-seed", type=int, default=0)
  gen = p.add_argument_group("sampling")
  gen.add_argument("--max-new-tokens", type=int,
                   help="output budget per request (default: drawn per request "
                   "for the synthetic workload, 32 for --prompt-ids)")
  gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  gen.add_argument("--top-k", type=int, default=0, help="0 = off")
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--n", type=int, default=1, help="samples per prompt")
  gen.add_argument("--beam-width", type=int, default=1, help="> 1: beam search")
  gen.add_argument("--seed", type=int, default=0,
                   help="sampling seed (request i uses seed + i * n)")
  eng = p.add_argument_group("engine")
  eng.add_argument("--block-size", type=int, default=16)
  eng.add_argument("--num-blocks", type=int,
                   help="KV blocks in the pool (default: from --kv-budget-mb, "
                   "else 64)")
  eng.add_argument("--kv-budget-mb", type=float,
                   help="KV memory budget in MiB (alternative to --num-blocks)")
  eng.add_argument("--max-batch", type=int, default=16,
                   help="sequences per step (the compiled decode batch)")
  eng.add_argument("--max-tokens-per-step", type=int, default=128,
                   help="token budget of a prefill/mixed step")
  eng.add_argument("--max-model-len", type=int, default=256,
                   help="longest prompt + output")
  eng.add_argument("--mesh", metavar="data=D,model=M",
                   help="serve on a D x M device mesh: M-way tensor parallelism, "
                   "D data shards each with its own pool of --num-blocks "
                   "blocks and --max-batch sequences (on CPU, D * M host "
                   "devices are simulated)")
  eng.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several hosts: the address of process 0; every process "
                   "runs this same command with its own --process-id "
                   "(jax.distributed.initialize; see BUILD.md)")
  eng.add_argument("--num-processes", type=int, default=1,
                   help="processes (hosts) taking part, with --coordinator")
  eng.add_argument("--process-id", type=int, default=0,
                   help="this process' index, with --coordinator")
  eng.add_argument("--implementation", choices=["xla", "pallas_tpu", "pallas_gpu"],
                   help="attention backend (default: the best for the platform)")
  eng.add_argument("--request-rate", type=float, metavar="R",
                   help="requests per second, Poisson arrivals (seeded by "
                   "--workload-seed); default: all requests at once")
  eng.add_argument("--compile-cache-dir", metavar="DIR",
                   default=str(pathlib.Path.home() / ".cache" / "paged_jax" / "jax_cache"),
                   help="JAX's persistent compilation cache, so that a second run "
                   "does not recompile")
  eng.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent compilation cache")
  out = p.add_argument_group("output")
  out.add_argument("--output", metavar="FILE",
                   help="write requests' generated ids and finish reasons (JSON)")
  out.add_argument("--no-baseline", action="store_true",
                   help="skip the contiguous-cache comparison")
  out.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p.parse_args(argv)


def load_prompts(path: str) -> list[list[int]]:
  """Reads a JSON list of token-id lists.

  Raises:
    FileNotFoundError: missing file.
    ValueError: not JSON, or not a non-empty list of non-empty int lists.
  """
  f = pathlib.Path(path)
  if not f.is_file():
    raise FileNotFoundError(f"prompt file {path!r} not found")
  try:
    data = json.loads(f.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(data, list) or not data:
    raise ValueError(f"{path}: expected a non-empty JSON list of token-id lists")
  for i, prompt in enumerate(data):
    if (not isinstance(prompt, list) or not prompt or
        not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
      raise ValueError(f"{path}: prompt {i} must be a non-empty list of ints")
  return data


def check_vocab(prompts, vocab_size: int):
  for i, prompt in enumerate(prompts):
    for t in prompt:
      if not 0 <= t < vocab_size:
        raise ValueError(f"prompt {i}: token id {t} is outside the vocabulary "
                         f"[0, {vocab_size})")


def build(args):
  """Model, requests and KV budget from the arguments (raises ValueError)."""
  if args.checkpoint:
    model = checkpoint_lib.load_checkpoint(
        args.checkpoint, dtype=args.dtype, implementation=args.implementation)
  else:
    config = model_lib.LlamaConfig.tiny(dtype=args.dtype or "float32")
    model = model_lib.init_model(config, args.model_seed,
                                 implementation=args.implementation)
  cfg = model.config
  for name in ("block_size", "max_batch", "max_tokens_per_step", "max_model_len",
               "num_requests"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.max_model_len > cfg.max_position_embeddings:
    raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's "
                     f"max_position_embeddings {cfg.max_position_embeddings}")
  params = SamplingParams(
      max_new_tokens=args.max_new_tokens or 32, temperature=args.temperature,
      top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n,
      beam_width=args.beam_width)
  if args.prompt_ids:
    prompts = load_prompts(args.prompt_ids)
    check_vocab(prompts, cfg.vocab_size)
    requests = [Request(i, p, params) for i, p in enumerate(prompts)]
  else:
    requests = workload.synthetic_requests(
        args.num_requests, vocab_size=cfg.vocab_size,
        max_model_len=args.max_model_len, seed=args.workload_seed,
        params=params, exclude_ids=cfg.eos_token_ids)
    if args.max_new_tokens:
      requests = [Request(r.request_id, r.prompt, params) for r in requests]
  # Distinct seeds per request so that samples differ across requests.
  requests = [Request(r.request_id, r.prompt, _reseed(r.params, args.seed + i * args.n))
              for i, r in enumerate(requests)]
  per_token = cfg.kv_bytes_per_token()
  if args.num_blocks is not None and args.kv_budget_mb is not None:
    raise ValueError("give --num-blocks or --kv-budget-mb, not both")
  if args.kv_budget_mb is not None:
    if args.kv_budget_mb <= 0:
      raise ValueError(f"--kv-budget-mb must be positive, got {args.kv_budget_mb}")
    kv_tokens = int(args.kv_budget_mb * 2**20 // per_token)
  else:
    num_blocks = 64 if args.num_blocks is None else args.num_blocks
    if num_blocks < 1:
      raise ValueError(f"--num-blocks must be >= 1, got {num_blocks}")
    kv_tokens = num_blocks * args.block_size
  if kv_tokens < args.block_size:
    raise ValueError(f"the KV budget holds {kv_tokens} tokens, less than one "
                     f"block of {args.block_size}")
  mesh = None
  if args.mesh:
    data, tp = _parse_mesh(args.mesh)
    mesh = sharding.make_mesh(data, tp)
    tensor_parallel.check_model_axis(cfg, tp)
  return model, requests, kv_tokens, mesh


def _reseed(params: SamplingParams, seed: int) -> SamplingParams:
  d = {f: getattr(params, f) for f in params.__dataclass_fields__}
  d["seed"] = seed
  return SamplingParams(**d)


def _fmt_latency(lat: dict) -> list[str]:
  rows = []
  for name, label in (("ttft", "time to first token"), ("tpot", "time per output token"),
                      ("itl", "inter-token latency")):
    d = lat[name]
    rows.append(f"  {label:<22}mean {1e3 * d['mean']:.1f} ms, p50 {1e3 * d['p50']:.1f},"
                f" p90 {1e3 * d['p90']:.1f}, p99 {1e3 * d['p99']:.1f} ms")
  return rows


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
  """Seconds after the start at which each request arrives: exponential gaps
  of mean `1 / rate` (a Poisson process), the first request at 0.

  Raises:
    ValueError: if `rate` is not positive.
  """
  if not rate > 0:
    raise ValueError(f"--request-rate must be positive, got {rate}")
  import numpy as np  # pylint: disable=import-outside-toplevel
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
  gaps[0] = 0.0
  return np.cumsum(gaps).tolist()


def _compile_cache(args):
  """Turns on JAX's persistent compilation cache (unless --no-compile-cache)."""
  if args.no_compile_cache:
    return
  import jax  # pylint: disable=import-outside-toplevel
  pathlib.Path(args.compile_cache_dir).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", args.compile_cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _fmt(stats: dict) -> list[str]:
  return [
      f"  requests served     {stats['served']} of {stats['requests']}"
      f" ({stats['rejected']} rejected)",
      f"  tokens generated    {stats['generated_tokens']}",
      f"  wall time           {stats['wall_seconds']:.2f} s "
      f"(+ {stats['compile_seconds']:.1f} s compile)",
      f"  throughput          {stats['tokens_per_second']:.1f} tokens/s",
      *_fmt_latency(stats["latency_seconds"]),
      f"  KV blocks used      peak {stats['peak_blocks_used']}/{stats['num_blocks']}"
      f" ({100 * stats['peak_kv_fraction']:.0f}%), mean "
      f"{stats['mean_blocks_used']:.1f} ({100 * stats['mean_kv_fraction']:.0f}%)"
      f" of {stats['block_size']}-token blocks",
      f"  sequences at once   peak {stats['peak_running']}, mean "
      f"{stats['mean_running']:.1f} (batch limit {stats['max_batch']})",
      f"  KV memory           {stats['kv_bytes'] / 2**20:.2f} MiB, "
      f"{stats['kv_bytes_per_device'] / 2**20:.3f} MiB on each of "
      f"{stats['devices']} device(s)",
      f"  preemptions         {stats['preemptions']}",
      f"  steps               {stats['steps']} ({stats['decode_steps']} decode,"
      f" {stats['mixed_steps']} prefill/mixed); host "
      f"{stats['host_ms_per_step']:.2f} ms/step, device "
      f"{stats['device_ms_per_step']:.2f} ms/step",
      f"  rows computed       {stats['padded_rows']} for {stats['computed_tokens']} real"
      f" tokens ({stats['padding_ratio']:.2f}x) in {stats['buckets_compiled']}"
      f" step shapes",
  ]


def _start_distributed(args) -> bool:
  """Joins the other processes (`--coordinator`); True on process 0."""
  if not args.coordinator:
    return True
  if not 0 <= args.process_id < args.num_processes:
    raise ValueError(f"--process-id must be in [0, {args.num_processes}), "
                     f"got {args.process_id}")
  import jax  # pylint: disable=import-outside-toplevel
  # Cross-process collectives of the CPU backend (ignored by GPU and TPU).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes,
                             process_id=args.process_id)
  return jax.process_index() == 0


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    lead = _start_distributed(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not lead:  # every process runs the same schedule; process 0 reports
    args.no_progress, args.output = True, None
    sys.stdout = open(os.devnull, "w")  # pylint: disable=consider-using-with
  try:
    model, requests, kv_tokens, mesh = build(args)
    common = dict(kv_tokens=kv_tokens, block_size=args.block_size,
                  max_batch=args.max_batch,
                  max_tokens_per_step=args.max_tokens_per_step,
                  max_model_len=args.max_model_len,
                  max_beam_width=args.beam_width, progress=not args.no_progress,
                  mesh=mesh)
    sizes = {n: v for n, v in common.items() if n not in ("progress", "mesh")}
    if args.request_rate is not None:
      common["arrival_times"] = poisson_arrivals(
          len(requests), args.request_rate, args.workload_seed)
    _compile_cache(args)
    configs = {"paged": workload.engine_config("paged", **sizes)}
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  baseline_note = None
  if not args.no_baseline:
    try:
      configs["contiguous"] = workload.engine_config("contiguous", **sizes)
    except ValueError as e:
      baseline_note = f"contiguous baseline skipped: {e}"
  kinds = list(configs)

  cfg = model.config
  print(f"model: {'checkpoint ' + args.checkpoint if args.checkpoint else 'tiny random Llama'}"
        f" ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads /"
        f" {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {cfg.dtype})")
  print(f"workload: {len(requests)} requests, prompts "
        f"{min(len(r.prompt) for r in requests)}-{max(len(r.prompt) for r in requests)}"
        f" tokens, KV memory {kv_tokens} tokens "
        f"({kv_tokens * cfg.kv_bytes_per_token() / 2**20:.2f} MiB)"
        + (" per data shard" if mesh is not None else ""))
  shards = 1
  if mesh is not None:
    shards, tp = mesh.shape[sharding.DATA], mesh.shape[sharding.MODEL]
    heads = sharding.cache_kv_heads(cfg.num_kv_heads, tp)
    devices = mesh.devices.flat
    print(f"mesh: data={shards} x model={tp} on {mesh.size} "
          f"{next(iter(devices)).platform} devices; weights {tp}-way tensor "
          f"parallel, {shards} data shard(s) each with its own pool and up to "
          f"{args.max_batch} sequences; {heads // tp} KV head(s) per device"
          + (f" ({cfg.num_kv_heads} KV heads replicated {heads // cfg.num_kv_heads}x)"
             if heads > cfg.num_kv_heads else ""))
  results = {}
  t0 = time.perf_counter()
  for kind in kinds:
    stats, outputs = workload.run_workload(kind, model, requests, **common)
    results[kind] = (stats, outputs)

  stats, outputs = results["paged"]
  for o in outputs:
    if o.rejected:
      print(f"rejected request {o.request_id}: {o.rejected}", file=sys.stderr)
  c = configs["paged"]
  print(f"\npaged KV cache: {c.num_blocks} blocks x {c.block_size} tokens"
        + (f" in each of {shards} data shards" if shards > 1 else "")
        + ", continuous batching")
  print("\n".join(_fmt(stats)))
  if "contiguous" in results:
    base, base_outputs = results["contiguous"]
    cc = configs["contiguous"]
    print(f"\ncontiguous KV cache, same memory: {cc.num_blocks} slots x "
          f"{cc.block_size} tokens (max_model_len)"
          + (f" in each of {shards} data shards" if shards > 1 else "")
          + ", static batching")
    print("\n".join(_fmt(base)))
    reasons = [o.rejected for o in base_outputs if o.rejected]
    if reasons:
      print(f"  rejected            {len(reasons)}, e.g. {reasons[0]}")
    print(f"\npaging ran {stats['peak_running']} sequences at once where the "
          f"contiguous cache fits {shards * cc.num_blocks}", end="")
    if base["served"] == stats["served"] and base["tokens_per_second"] > 0:
      ratio = stats["tokens_per_second"] / base["tokens_per_second"]
      print(f"; throughput x{ratio:.2f}")
    else:
      print(f"; the contiguous cache served {base['served']} of the "
            f"{stats['served']} requests (see its rejections), no ratio")
    if args.temperature == 0 and args.beam_width == 1:
      same = sum(a.completions == b.completions for a, b in zip(outputs, base_outputs))
      print(f"greedy outputs identical in both engines: {same}/{len(outputs)}")
  if baseline_note:
    print(f"\n{baseline_note}")
  print(f"total time {time.perf_counter() - t0:.1f} s")

  if args.output:
    doc = {
        "requests": [{
            "request_id": o.request_id, "prompt_len": o.prompt_len,
            "rejected": o.rejected,
            "completions": [{"token_ids": comp.token_ids,
                             "finish_reason": comp.finish_reason,
                             **({"logprob": comp.logprob} if comp.logprob is not None else {})}
                            for comp in o.completions]}
                     for o in outputs],
        "stats": {k: v[0] for k, v in results.items()},
        # Per request, in seconds (apart from "requests": timings vary by run).
        "latency_seconds": [{"request_id": o.request_id, "ttft": o.ttft,
                             "tpot": o.tpot} for o in outputs],
    }
    pathlib.Path(args.output).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
