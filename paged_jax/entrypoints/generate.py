"""Batched generation with a paged KV cache: the first thing to run.

    python examples/generate.py

serves a seeded synthetic workload (a few dozen requests, ShareGPT-like
lengths) on the tiny random Llama on CPU, with continuous batching over a
paged KV cache, then serves the same workload with a contiguous max-length
cache of the same memory (static batching) and prints both, so you see what
paging buys. With `--checkpoint DIR` it loads a Hugging Face Llama checkpoint;
with `--prompt-ids FILE` it serves your prompts (a JSON list of token-id
lists, or of objects `{"prompt_ids": [...], "max_new_tokens": n}`).
`--output FILE` writes every request's generated ids and finish reason as
JSON. Temperature 0 (the default) is deterministic.

Every flag has a finite range, checked while parsing; a bad flag or input is
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


MAX_SIMULATED_DEVICES = 512


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


def _simulate_host_devices(argv):
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


from paged_jax.models.llama import checkpoint as checkpoint_lib
from paged_jax.models.llama import model as model_lib
from paged_jax.models.llama import tensor_parallel
from paged_jax.entrypoints import workload
from paged_jax import _cli
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.serving.tokenizer import load_tokenizer
from paged_jax import sharding


# Sane, finite ranges of the flags, checked while parsing (one line, exit 2).
INT31 = 2**31 - 1
MAX_SEQS = 2**16            # --max-batch, --n, --beam-width
MAX_TOKENS_PER_STEP = 2**20
MAX_MODEL_LEN = 2**24
MAX_BLOCK_SIZE = 2**20
MAX_REQUESTS = 10**5
MAX_KV_MB = 2**30           # 1 PiB
DEFAULT_KV_TOKENS = 1024    # the KV memory when no budget is given: 64 x 16
# vLLM's --kv-cache-dtype choices that paged-jax allocates (fp8 = e4m3).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
NEVER_SAMPLED = (-1,)       # --ignore-eos: a stop token no step can produce


def add_engine_flags(p: argparse.ArgumentParser):
  """The model and engine flags, shared by generate.py and serve.py (one
  definition); returns the "engine" argument group."""
  count = _cli.int_in
  src = p.add_argument_group("model")
  src.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face Llama checkpoint (config.json + *.safetensors); "
                   "default: the tiny model with seeded random weights")
  src.add_argument("--model-seed", type=count(0, 2**63 - 1), default=0,
                   help="seed of the tiny model's random weights")
  src.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="parameter/compute dtype (default: the checkpoint's)")
  eng = p.add_argument_group("engine")
  eng.add_argument("--block-size", type=count(1, MAX_BLOCK_SIZE), default=16,
                   help="tokens per KV block; the KV memory stays the same "
                   "(the number of blocks follows) unless --num-blocks is given")
  eng.add_argument("--num-blocks", type=count(1, INT31),
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
                   type=count(1, MAX_SEQS), default=16, action=_cli.TypedFlag,
                   help="sequences per step (the compiled decode batch)")
  eng.add_argument("--max-tokens-per-step", "--max-num-batched-tokens",
                   dest="max_tokens_per_step", action=_cli.TypedFlag,
                   type=count(1, MAX_TOKENS_PER_STEP), default=128,
                   help="token budget of a prefill/mixed step")
  eng.add_argument("--min-bucket", type=count(1, MAX_TOKENS_PER_STEP), default=1,
                   help="smallest compiled step shape: steps are padded to the "
                   "powers of two (and 1.5x midpoints) from it up to --max-batch "
                   "(decode) and --max-tokens-per-step (mixed); larger means "
                   "fewer shapes to compile, more padding")
  eng.add_argument("--no-bucket-midpoints", action="store_true",
                   help="powers of two only (fewer shapes, up to 2x padding)")
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
  eng.add_argument("--max-model-len", type=count(2, MAX_MODEL_LEN), default=256,
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


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, each range-checked while parsing (one `error:` line, exit 2).

  Where vLLM has a flag of the same meaning its name is an alias
  (`--max-num-seqs`, `--max-num-batched-tokens`); messages name the one typed.
  """
  p = _cli.OneLineParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  count = _cli.int_in
  eng = add_engine_flags(p)
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
  src.add_argument("--num-requests", type=count(1, MAX_REQUESTS), default=48,
                   help="size of the synthetic workload")
  src.add_argument("--workload-seed", type=count(0, 2**63 - 1), default=0)
  gen = p.add_argument_group("sampling")
  gen.add_argument("--max-new-tokens", type=count(1, MAX_MODEL_LEN),
                   help="output budget per request (default: drawn per request "
                   "for the synthetic workload; for --prompt-ids, the entry's "
                   "max_new_tokens, else 32)")
  gen.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the output budget: stop tokens do "
                   "not end a sequence (fixed output lengths, for benchmarks)")
  gen.add_argument("--temperature", type=_cli.number_in(0, 10**6), default=0.0,
                   help="0 = greedy")
  gen.add_argument("--top-k", type=count(0, INT31), default=0, help="0 = off")
  gen.add_argument("--top-p", type=_cli.number_in(0, 1, lo_open=True), default=1.0)
  gen.add_argument("--n", type=count(1, MAX_SEQS), default=1, help="samples per prompt")
  gen.add_argument("--beam-width", type=count(1, MAX_SEQS), default=1,
                   help="> 1: beam search")
  gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable; text prompts): the text ends "
                   "before it")
  gen.add_argument("--stop-token-ids", type=_token_ids, default=(), metavar="IDS",
                   help="comma-separated token ids that also end a sequence")
  gen.add_argument("--min-tokens", type=count(0, MAX_MODEL_LEN), default=0,
                   help="no EOS or stop token before this many tokens")
  gen.add_argument("--seed", type=count(0, INT31), default=0,
                   help="sampling seed (request i uses seed + i * n, wrapped to "
                   "stay within int32)")
  eng.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several hosts: the address of process 0; every process "
                   "runs this same command with its own --process-id "
                   "(jax.distributed.initialize; see BUILD.md)")
  eng.add_argument("--num-processes", type=count(1, MAX_SEQS), default=1,
                   help="processes (hosts) taking part, with --coordinator")
  eng.add_argument("--process-id", type=count(0, MAX_SEQS), default=0,
                   help="this process' index, with --coordinator")
  eng.add_argument("--request-rate", type=_cli.number_in(0, 10**9, lo_open=True),
                   metavar="R",
                   help="requests per second, Poisson arrivals (seeded by "
                   "--workload-seed); default: all requests at once")
  out = p.add_argument_group("output")
  out.add_argument("--output", metavar="FILE",
                   help="write requests' generated ids and finish reasons (JSON)")
  out.add_argument("--no-baseline", action="store_true",
                   help="skip the contiguous-cache comparison")
  out.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p.parse_args(argv)


def _token_ids(text: str) -> tuple[int, ...]:
  parts = [t.strip() for t in text.split(",") if t.strip()]
  if not parts or not all(t.isascii() and t.isdigit() and len(t) < 10 for t in parts):
    raise argparse.ArgumentTypeError(
        f"expected comma-separated token ids, got {_cli.shown(text)}")
  return tuple(int(t) for t in parts)


def load_text_prompts(path: str) -> list[tuple[str, int | None]]:
  """Text prompts of `--prompts-file`: a JSONL file (every non-empty line an
  object with "prompt", optionally "max_new_tokens") or plain text (one
  prompt a line); `(prompt, max_new_tokens or None)` each.

  Raises:
    FileNotFoundError: missing file.
    ValueError: unreadable, empty, or a JSONL line without a "prompt" string.
  """
  f = pathlib.Path(path)
  if not f.is_file():
    raise FileNotFoundError(f"prompts file {_cli.shown(path)} not found")
  try:
    lines = [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
  except (ValueError, OSError) as e:
    raise ValueError(f"{path}: cannot read it ({e})") from None
  if not lines:
    raise ValueError(f"{path}: no prompts (expected one a line, or JSONL)")
  if not lines[0].lstrip().startswith("{"):
    return [(ln, None) for ln in lines]
  out = []
  for i, ln in enumerate(lines):
    try:
      d = json.loads(ln)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: line {i + 1}: not valid JSON ({e})") from None
    new = d.get("max_new_tokens") if isinstance(d, dict) else None
    if (not isinstance(d, dict) or not isinstance(d.get("prompt"), str)
        or new is not None and (not _is_int(new) or new < 1)):
      raise ValueError(f"{path}: line {i + 1}: expected an object with a "
                       '"prompt" string and optionally "max_new_tokens" >= 1')
    out.append((d["prompt"], new))
  return out


def _flag(args, dest: str) -> str:
  """The flag the user typed for `dest` (an alias if that is what was typed)."""
  return _cli.typed_flag(args, dest, "--" + dest.replace("_", "-"))


def check_args(args) -> None:
  """Checks between flags that need no model; ValueError naming the flags."""
  check_engine_args(args)
  batch = _flag(args, "max_batch")
  if args.max_new_tokens is not None and args.max_new_tokens >= args.max_model_len:
    raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be < "
                     f"--max-model-len {args.max_model_len} (room for a prompt)")
  if args.n > 1 and args.beam_width > 1:
    raise ValueError(f"give --n or --beam-width, not both (got --n {args.n}, "
                     f"--beam-width {args.beam_width})")
  for name in ("n", "beam_width"):
    if getattr(args, name) > args.max_batch:
      raise ValueError(f"{_flag(args, name)} {getattr(args, name)} must be <= "
                       f"{batch} {args.max_batch} (a request's sequences run "
                       "in one batch)")
  span = max(args.n, args.beam_width)
  if args.seed > 2**31 - span:
    raise ValueError(f"--seed {args.seed} must be <= {2**31 - span} (sample i "
                     "of a request uses its seed + i, an int32)")
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
  if args.max_new_tokens is not None and args.min_tokens > args.max_new_tokens:
    raise ValueError(f"--min-tokens {args.min_tokens} must be <= "
                     f"--max-new-tokens {args.max_new_tokens}")


def check_engine_args(args) -> None:
  """Checks between the `add_engine_flags` flags; ValueError naming them."""
  batch, step = _flag(args, "max_batch"), _flag(args, "max_tokens_per_step")
  if args.max_tokens_per_step < args.max_batch:
    raise ValueError(f"{step} {args.max_tokens_per_step} must be >= {batch} "
                     f"{args.max_batch} (every decode must fit one step)")
  if args.block_size > args.max_model_len:
    raise ValueError(f"--block-size {args.block_size} must be <= "
                     f"--max-model-len {args.max_model_len}")
  if args.num_blocks is not None and args.kv_budget_mb is not None:
    raise ValueError("give --num-blocks or --kv-budget-mb, not both")
  if args.mesh:
    _parse_mesh(args.mesh)


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


def load_prompts(path: str) -> list[tuple[list[int], int | None]]:
  """Reads a JSON list of prompts: token-id lists, or objects
  `{"prompt_ids": [...], "max_new_tokens": n}` (`max_new_tokens` optional).

  Returns:
    `(prompt_ids, max_new_tokens or None)` per prompt.

  Raises:
    FileNotFoundError: missing file.
    ValueError: unreadable, not JSON, nested too deeply, or not a non-empty
      list of prompts as above (a float or bool token id is a type error).
  """
  f = pathlib.Path(path)
  if not f.is_file():
    raise FileNotFoundError(f"prompt file {_cli.shown(path)} not found")
  try:
    data = json.loads(f.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  except RecursionError:
    raise ValueError(f"{path}: JSON nested too deeply (expected a list of "
                     "token-id lists)") from None
  except (ValueError, OSError) as e:  # bad UTF-8, > 4300-digit ints, unreadable
    raise ValueError(f"{path}: cannot read it ({e})") from None
  if not isinstance(data, list) or not data:
    raise ValueError(f"{path}: expected a non-empty JSON list of prompts "
                     "(token-id lists or objects with prompt_ids)")
  return [_prompt_entry(path, i, entry) for i, entry in enumerate(data)]


def _prompt_entry(path, i, entry) -> tuple[list[int], int | None]:
  max_new = None
  if isinstance(entry, dict):
    unknown = sorted(set(entry) - {"prompt_ids", "max_new_tokens"})
    if unknown or "prompt_ids" not in entry:
      raise ValueError(f"{path}: prompt {i}: expected keys prompt_ids and "
                       f"optionally max_new_tokens, got {sorted(entry)}")
    max_new = entry.get("max_new_tokens")
    if max_new is not None and (not _is_int(max_new) or max_new < 1):
      raise ValueError(f"{path}: prompt {i}: max_new_tokens must be an int "
                       f">= 1, got {max_new!r}")
    entry = entry["prompt_ids"]
  if not isinstance(entry, list) or not entry:
    raise ValueError(f"{path}: prompt {i} must be a non-empty list of ints")
  for j, t in enumerate(entry):
    if not _is_int(t):
      raise ValueError(f"{path}: prompt {i}, token {j}: expected an int "
                       f"token id, got {_cli.one_line(repr(t), 40)} "
                       f"({type(t).__name__})")
  return entry, max_new


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def check_vocab(prompts, vocab_size: int):
  for i, prompt in enumerate(prompts):
    for t in prompt:
      if not 0 <= t < vocab_size:
        raise ValueError(f"prompt {i}: token id {t} is outside the vocabulary "
                         f"[0, {vocab_size})")


def sampling_params(args, max_new_tokens: int) -> SamplingParams:
  """The request parameters the flags give (the seed is set per request)."""
  return SamplingParams(
      max_new_tokens=max_new_tokens, temperature=args.temperature,
      top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n,
      beam_width=args.beam_width,
      eos_token_ids=NEVER_SAMPLED if args.ignore_eos else (),
      stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
      min_tokens=min(args.min_tokens, max_new_tokens))


def request_seed(args, i: int) -> int:
  """Request i's seed: `--seed + i * --n`, wrapped so that every sample's
  seed (`+ lane`) stays an int32."""
  span = max(args.n, args.beam_width)
  return (args.seed + i * args.n) % (2**31 - span + 1)


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


def free_memory_bytes(device) -> tuple[int, str]:
  """Bytes free on `device` (its allocator's limit less what is in use), or
  the host's available memory where the device does not report it (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # not every backend has it
    stats = None
  if stats and stats.get("bytes_limit"):
    return (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
            f"{device.platform} device {device.id}")
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024, "host memory available"
  except OSError:
    pass
  return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
          "host memory free")


def check_kv_memory(kv_bytes_per_device: int, total_kv_bytes: int, source: str,
                    devices) -> None:
  """The KV pool must fit in the memory left on its devices (all of them
  share the host's memory on CPU), checked before anything is allocated."""
  device = devices[0]
  free, where = free_memory_bytes(device)
  need = total_kv_bytes if device.platform == "cpu" else kv_bytes_per_device
  if need > free:
    raise ValueError(f"{source} needs {_size(need)} of KV memory"
                     + ("" if device.platform == "cpu" else " per device")
                     + f", more than the {_size(free)} of {where}")


def _size(n: int) -> str:
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{n} bytes"


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


def load_model(args):
  """The model the `add_engine_flags` flags name, checked against them
  (raises ValueError)."""
  if args.checkpoint:
    model = checkpoint_lib.load_checkpoint(
        args.checkpoint, dtype=args.dtype, implementation=args.implementation)
  else:
    config = model_lib.LlamaConfig.tiny(dtype=args.dtype or "float32")
    model = model_lib.init_model(config, args.model_seed,
                                 implementation=args.implementation)
  cfg = model.config
  if args.max_model_len > cfg.max_position_embeddings:
    raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's "
                     f"max_position_embeddings {cfg.max_position_embeddings}")
  check_implementation(args.implementation, cfg, args.block_size)
  return model


def engine_memory(args, cfg):
  """`(kv_tokens per data shard, mesh or None)` from the engine flags, the
  KV pool checked against the devices' free memory (raises ValueError)."""
  per_token = cfg.kv_bytes_per_token(args.kv_cache_dtype)
  kv_tokens, source = kv_tokens_from_args(args, per_token)
  mesh = None
  shards, tp = 1, 1
  if args.mesh:
    data, tp = _parse_mesh(args.mesh)
    mesh = sharding.make_mesh(data, tp)
    tensor_parallel.check_model_axis(cfg, tp)
    shards = data
  import jax  # pylint: disable=import-outside-toplevel
  heads = sharding.cache_kv_heads(cfg.num_kv_heads, tp)
  pool_bytes = (kv_tokens // args.block_size) * args.block_size * per_token
  stored = pool_bytes * heads // cfg.num_kv_heads  # with replicated heads
  devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()
  check_kv_memory(stored // tp, stored * shards, source, devices)
  return kv_tokens, mesh


def build(args):
  """Model, requests and KV budget from the arguments (raises ValueError)."""
  model = load_model(args)
  cfg = model.config
  default_new = args.max_new_tokens or 32
  if args.prompt or args.prompts_file:
    tokenizer = load_tokenizer(args.checkpoint)
    entries = ([(t, None) for t in args.prompt] if args.prompt
               else load_text_prompts(args.prompts_file))
    requests = [Request(i, tokenizer.encode(text), sampling_params(args, new or default_new))
                for i, (text, new) in enumerate(entries)]
  elif args.prompt_ids:
    entries = load_prompts(args.prompt_ids)
    check_vocab([ids for ids, _ in entries], cfg.vocab_size)
    requests = [Request(i, ids, sampling_params(args, new or default_new))
                for i, (ids, new) in enumerate(entries)]
  else:
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
  try:
    pathlib.Path(args.compile_cache_dir).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--compile-cache-dir {_cli.shown(args.compile_cache_dir)}: "
                     f"cannot create it ({e.strerror}); pass --no-compile-cache "
                     "to run without it") from None
  jax.config.update("jax_compilation_cache_dir", args.compile_cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def kv_cache_line(kv: dict) -> str:
  """The KV cache the engine allocated, as read from its arrays
  (`workload.allocated_cache`): a requested dtype that was not allocated
  shows here."""
  return (f"  KV cache allocated  {kv['dtype']}"
          + (" + float32 scales" if kv["scales"] else "")
          + f", {kv['bytes_per_token']} bytes per token, {kv['bytes']} bytes")


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
      f"{stats['host_ms_per_step']:.2f} ms/step"
      + (f" ({stats['exposed_host_ms_per_step']:.2f} not overlapped)"
         if stats["async_scheduling"] else "")
      + f", waiting {stats['wait_ms_per_step']:.2f} ms/step: host share "
      f"{100 * stats['host_share']:.1f}%",
      f"  rows computed       {stats['padded_rows']} for {stats['computed_tokens']} real"
      f" tokens ({stats['padding_ratio']:.2f}x) in {stats['buckets_compiled']}"
      f" step shapes",
      *_fmt_prefix(stats),
  ]


def _fmt_prefix(stats: dict) -> list[str]:
  if not stats["prefix_caching"]:
    return ["  prefix cache        off"] if stats["kind"] == "paged" else []
  return [
      f"  prefix cache        hit rate {100 * stats['prefix_cache_hit_rate']:.1f}%"
      f" ({stats['prefix_hit_tokens']} of {stats['prefix_queried_tokens']} prompt"
      f" tokens), {stats['prefill_tokens_saved']} prefill tokens saved; blocks"
      f" cached {stats['prefix_blocks_registered']}, evicted"
      f" {stats['prefix_blocks_evicted']}, {stats['blocks_cached']} held at the end"]


def _short(text: str, limit: int) -> str:
  text = text.replace("\n", "\\n")
  return text if len(text) <= limit else text[:limit - 1] + "…"


def run_text(model, requests, config, mesh, tokenizer):
  """Serves text requests (stop strings applied), printing each request's
  text: streamed as it arrives for one request, else each request's (cut to
  fit a line for many) when it finishes. Returns `(stats, outputs, texts)`,
  `texts[request_id]` the completions' texts."""
  from paged_jax.serving.engine import Engine  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.text import TextEngine  # pylint: disable=import-outside-toplevel
  engine = Engine(model, config, mesh=mesh)
  compile_s = workload.warmup(engine)
  te = TextEngine(engine, tokenizer)
  limit = 200 if len(requests) <= 16 else 72
  single = len(requests) == 1
  t0 = time.perf_counter()
  for r in requests:
    te.add_request(r)
  outputs, texts = [], {}
  if single:
    print(f"[{requests[0].request_id}] ", end="", flush=True)
  while te.has_unfinished():
    for d in te.step():
      if d.output is None:
        if single and d.text:
          print(d.text, end="", flush=True)
        continue
      outputs.append(d.output)
      texts[d.request_id] = [c.text for c in d.completions]
      if d.output.rejected:
        continue
      for i, c in enumerate(d.completions):
        tag = f"[{d.request_id}]" if len(d.completions) == 1 else f"[{d.request_id}.{i}]"
        if single:
          print(f"  ({c.finish_reason}, {len(c.token_ids)} tokens)")
        else:
          print(f"{tag} {_short(c.text, limit)!r} ({c.finish_reason}, "
                f"{len(c.token_ids)} tokens)")
  engine.flush()
  wall = time.perf_counter() - t0
  order = {r.request_id: i for i, r in enumerate(requests)}
  outputs.sort(key=lambda o: order[o.request_id])
  return (workload.workload_stats("paged", engine, len(requests), wall, compile_s),
          outputs, texts)


def _start_distributed(args) -> bool:
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


def main(argv=None) -> int:
  """Runs the command line; 2 on a bad flag or input (before any work), 1
  when every request was rejected (after the report), else 0."""
  _simulate_host_devices(sys.argv[1:] if argv is None else argv)
  try:
    args = parse_and_check(argv)
  except SystemExit as e:
    return e.code
  try:
    lead = _start_distributed(args)
  except Exception as e:  # pylint: disable=broad-except  # JAX's own errors
    print(f"error: --coordinator {args.coordinator}: cannot join the other "
          f"processes ({_cli.one_line(e, 300)})", file=sys.stderr)
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
                  mesh=mesh, cache_dtype=args.kv_cache_dtype)
    # The step shapes (`buckets.py`) go to the engines that run, and to the
    # configs printed here: one dict, so the two cannot disagree.
    common.update(min_bucket=args.min_bucket,
                  bucket_midpoints=not args.no_bucket_midpoints,
                  async_scheduling=args.async_scheduling,
                  enable_prefix_caching=args.enable_prefix_caching)
    sizes = {n: v for n, v in common.items() if n not in ("progress", "mesh")}
    if args.request_rate is not None:
      common["arrival_times"] = poisson_arrivals(
          len(requests), args.request_rate, args.workload_seed)
    _compile_cache(args)
    configs = {"paged": workload.engine_config("paged", **sizes)}
  except (ValueError, FileNotFoundError) as e:
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
  print(f"model: {'checkpoint ' + args.checkpoint if args.checkpoint else 'tiny random Llama'}"
        f" ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads /"
        f" {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, {cfg.dtype})")
  paged = configs["paged"]
  allocated = (paged.num_blocks * paged.block_size
               * cfg.kv_bytes_per_token(args.kv_cache_dtype))
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
  if args.prompt or args.prompts_file:  # text: streamed, no baseline
    kinds = ["paged"]
    stats, outputs, texts = run_text(model, requests, configs["paged"], mesh,
                                     load_tokenizer(args.checkpoint))
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
  print("\n".join(_fmt(stats)))
  print(kv_cache_line(stats["kv_cache"]))
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
