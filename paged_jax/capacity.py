"""Capacity planning for a paged KV cache, as a library and a command line.

How many sequences fit in a device's memory once the weights are loaded, with
a paged KV cache (each sequence holds only the blocks its tokens fill) against
a contiguous cache that reserves `max_model_len` slots for every sequence:

  kv_pool_bytes   = mem_bytes * util - weight_bytes - workspace_bytes
  bytes_per_block = 2 (K and V) * num_layers * block_size * num_kv_heads
                    * head_dim * kv dtype bytes
  num_blocks      = kv_pool_bytes // bytes_per_block
  blocks_per_seq  = ceil(avg_tokens / block_size)
  paged           = num_blocks // blocks_per_seq
  contiguous      = kv_pool_bytes // (max_model_len * bytes_per_token)

On several devices (`--tp`, `--dp`; memory flags stay per device) each device
holds 1/tp of the weights and `cache_kv_heads(num_kv_heads, tp) / tp` KV
heads (`paged_jax.sharding`), so its blocks are that much smaller, and the
`dp` replicas each serve their own pool.

All arithmetic is exact (integers and fractions), so the worked example below
reproduces to the byte. Command line:

  python -m paged_jax.capacity --model llama-3.1-8b --mem-gib 80 --util 0.9 \
      --weights-gib 16 --avg-tokens 512 --max-model-len 8192

  2 MiB per block, 28672 blocks, 896 paged sequences of 512 tokens against 56
  contiguous sequences of 8192 tokens: 16x.
"""

from __future__ import annotations

import argparse
import dataclasses
import fractions
import json
import math
import os
import sys
from typing import Sequence

from paged_jax import _cli

GIB = 2**30
MIB = 2**20

# Bytes per element. Weight dtypes may be sub-byte (int4); KV dtypes may not.
DTYPE_BYTES: dict[str, fractions.Fraction] = {
    "float32": fractions.Fraction(4),
    "bfloat16": fractions.Fraction(2),
    "float16": fractions.Fraction(2),
    "float8_e4m3fn": fractions.Fraction(1),
    "float8_e5m2": fractions.Fraction(1),
    "int8": fractions.Fraction(1),
    "int4": fractions.Fraction(1, 2),
}
DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "bf16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The parts of a model's shape that size its KV cache.

  Attributes:
    num_layers: decoder layers, each with its own K and V.
    num_kv_heads: key/value heads per layer (after GQA/MQA grouping).
    head_dim: size of one head.
    num_params: parameter count, to size the weights when no weight size is
      given.
  """
  num_layers: int
  num_kv_heads: int
  head_dim: int
  num_params: int


# Shapes from each model's published config.json.
PRESETS: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(32, 32, 128, 6_738_415_616),
    "llama-3.1-8b": ModelShape(32, 8, 128, 8_030_261_248),
    "llama-3.1-70b": ModelShape(80, 8, 128, 70_553_706_496),
    "mistral-7b": ModelShape(32, 8, 128, 7_241_732_096),
    "qwen2.5-7b": ModelShape(28, 4, 128, 7_615_616_512),
    "gemma-2-9b": ModelShape(42, 8, 256, 9_241_705_984),
}


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  """What a KV pool holds. Built by `plan`; every field is exact.

  Attributes:
    kv_pool_bytes: bytes given to the KV cache.
    bytes_per_block: bytes of one block across all layers, K and V.
    num_blocks: whole blocks in the pool.
    blocks_per_seq: blocks one sequence of `avg_tokens` tokens holds.
    max_concurrency_paged: sequences of `avg_tokens` that fit, paged.
    max_concurrency_contiguous: sequences that fit when each reserves
      `max_model_len` contiguous slots.
    concurrency_ratio: paged / contiguous; None when no contiguous sequence
      fits.
    block_size, avg_tokens, max_model_len: the inputs these follow from.
  """
  kv_pool_bytes: int
  bytes_per_block: int
  num_blocks: int
  blocks_per_seq: int
  max_concurrency_paged: int
  max_concurrency_contiguous: int
  concurrency_ratio: float | None
  block_size: int
  avg_tokens: int
  max_model_len: int

  @property
  def bytes_per_token(self) -> int:
    return self.bytes_per_block // self.block_size

  def blocks_for_concurrency(self, num_seqs: int) -> int:
    """Blocks needed for `num_seqs` sequences of `avg_tokens` tokens each."""
    _check_positive(num_seqs=num_seqs)
    return num_seqs * self.blocks_per_seq

  def max_model_len_for_concurrency(self, num_seqs: int) -> int:
    """Largest max_model_len at which `num_seqs` sequences all fit at full length.

    Every sequence may grow to max_model_len without preemption, so each gets
    `num_blocks // num_seqs` blocks. Returns 0 when `num_seqs` exceeds the
    number of blocks.
    """
    _check_positive(num_seqs=num_seqs)
    return (self.num_blocks // num_seqs) * self.block_size

  def to_json_dict(self) -> dict:
    return dataclasses.asdict(self) | {"bytes_per_token": self.bytes_per_token}


def _check_positive(**values) -> None:
  for name, value in values.items():
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"{name}={value!r} must be a positive integer")


def _exact(x: float | int | str | fractions.Fraction) -> fractions.Fraction:
  # str() of a float is its shortest round-trip decimal, so 0.9 -> 9/10.
  if isinstance(x, float):
    return fractions.Fraction(str(x))
  return fractions.Fraction(x)


def dtype_bytes(dtype: str, *, allow_subbyte: bool = False) -> fractions.Fraction:
  """Bytes per element of a dtype name ("bfloat16", "bf16", "fp8", "int4", ...).

  Raises:
    ValueError: the name is unknown, or sub-byte where `allow_subbyte` is off.
  """
  name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
  if name not in DTYPE_BYTES:
    known = ", ".join(sorted(DTYPE_BYTES))
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {known}")
  size = DTYPE_BYTES[name]
  if size.denominator != 1 and not allow_subbyte:
    raise ValueError(f"dtype {dtype!r} is sub-byte; the KV cache needs whole bytes")
  return size


def weight_bytes(num_params: int, dtype: str = "bfloat16") -> int:
  """Bytes of `num_params` weights stored as `dtype` (rounded up)."""
  _check_positive(num_params=num_params)
  return math.ceil(num_params * dtype_bytes(dtype, allow_subbyte=True))


def kv_pool_bytes(mem_bytes: int, util: float, weight_bytes: int,
                  workspace_bytes: int = 0) -> int:
  """Bytes left for the KV cache: `mem_bytes * util - weights - workspace`.

  Args:
    mem_bytes: device memory.
    util: fraction of it the server may use, in (0, 1].
    weight_bytes: model weights.
    workspace_bytes: activations and other scratch.

  Raises:
    ValueError: `util` outside (0, 1], a negative size, or nothing left.
  """
  util = _exact(util)
  if not 0 < util <= 1:
    raise ValueError(f"util={float(util)} must be in (0, 1]")
  if mem_bytes <= 0:
    raise ValueError(f"mem_bytes={mem_bytes} must be positive")
  if weight_bytes < 0 or workspace_bytes < 0:
    raise ValueError(f"{weight_bytes=} and {workspace_bytes=} must be >= 0")
  usable = math.floor(mem_bytes * util)
  pool = usable - weight_bytes - workspace_bytes
  if pool <= 0:
    raise ValueError(
        f"no memory left for the KV cache: {mem_bytes / GIB:g} GiB x {float(util):g}"
        f" = {usable / GIB:g} GiB, weights {weight_bytes / GIB:g} GiB, workspace"
        f" {workspace_bytes / GIB:g} GiB")
  return pool


# KV dtypes that paged-jax stores with a float32 scale per token and KV head
# (`pallas_kernels.quantization`): their blocks also hold the scales.
SCALED_KV_DTYPES = ("int8", "float8_e4m3fn")
SCALE_BYTES = 4


def kv_scale_bytes(kv_dtype: str) -> int:
  """Bytes of scale per token and KV head (K or V): 4 for int8 / fp8 (e4m3),
  0 for float dtypes."""
  name = DTYPE_ALIASES.get(str(kv_dtype).lower(), str(kv_dtype).lower())
  return SCALE_BYTES if name in SCALED_KV_DTYPES else 0


def kv_head_token_bytes(kv_dtype: str, head_dim: int) -> int:
  """Bytes one token of one KV head takes in K (or in V): `head_dim` values
  of `kv_dtype`, plus the float32 scale of int8 / fp8 pages. The one KV size
  rule: `kv_cache.token_bytes` and `bytes_per_block` are this."""
  return int(head_dim * dtype_bytes(kv_dtype) + kv_scale_bytes(kv_dtype))


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int,
                    block_size: int, kv_dtype: str = "bfloat16") -> int:
  """2 (K and V) x layers x block_size x kv_heads x `kv_head_token_bytes`
  (head_dim x dtype bytes + 4 bytes of scale for int8 / fp8)."""
  _check_positive(num_layers=num_layers, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_size=block_size)
  return 2 * num_layers * block_size * num_kv_heads * kv_head_token_bytes(
      kv_dtype, head_dim)


def plan(*, kv_pool_bytes: int, num_layers: int, num_kv_heads: int,
         head_dim: int, block_size: int, avg_tokens: int, max_model_len: int,
         kv_dtype: str = "bfloat16") -> CapacityPlan:
  """Sizes a KV pool and compares paged with contiguous max-length reservation.

  Args:
    kv_pool_bytes: bytes for the KV cache (see `kv_pool_bytes`).
    num_layers, num_kv_heads, head_dim: the model's KV shape.
    block_size: tokens per block.
    avg_tokens: tokens per request (prompt + output), on average.
    max_model_len: the longest sequence the server accepts; a contiguous cache
      reserves this many slots per sequence.
    kv_dtype: the KV cache's dtype name.

  Returns:
    A `CapacityPlan`.

  Raises:
    ValueError: a non-positive size, `avg_tokens > max_model_len`, or a pool
      smaller than one block.

  Example:
    >>> p = plan(kv_pool_bytes=56 * GIB, num_layers=32, num_kv_heads=8,
    ...          head_dim=128, block_size=16, avg_tokens=512, max_model_len=8192)
    >>> p.num_blocks, p.max_concurrency_paged, p.max_concurrency_contiguous
    (28672, 896, 56)
  """
  _check_positive(kv_pool_bytes=kv_pool_bytes, avg_tokens=avg_tokens,
                  max_model_len=max_model_len)
  if avg_tokens > max_model_len:
    raise ValueError(f"{avg_tokens=} must be <= {max_model_len=}")
  block_bytes = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size,
                                kv_dtype)
  num_blocks = kv_pool_bytes // block_bytes
  if num_blocks == 0:
    raise ValueError(
        f"{kv_pool_bytes=} holds no block of {block_bytes} bytes")
  blocks_per_seq = -(-avg_tokens // block_size)
  paged = num_blocks // blocks_per_seq
  contiguous = kv_pool_bytes // (max_model_len * (block_bytes // block_size))
  return CapacityPlan(
      kv_pool_bytes=kv_pool_bytes, bytes_per_block=block_bytes,
      num_blocks=num_blocks, blocks_per_seq=blocks_per_seq,
      max_concurrency_paged=paged, max_concurrency_contiguous=contiguous,
      concurrency_ratio=paged / contiguous if contiguous else None,
      block_size=block_size, avg_tokens=avg_tokens, max_model_len=max_model_len)


# ----------------------------------------------------------------------------
# Command line.


# Sane, finite ranges for every flag (checked while parsing, before any
# arithmetic): sizes up to 1 PiB per device, counts up to int32.
MAX_GIB = 2**20
MAX_COUNT = 2**31 - 1
MAX_DEVICES = 2**20
MAX_PARAMS = 10**15


def _parser() -> argparse.ArgumentParser:
  p = _cli.OneLineParser(
      prog="python -m paged_jax.capacity",
      error_prefix="python -m paged_jax.capacity: error: ",
      description="Plan KV-cache capacity: paged blocks vs contiguous "
      "max-length reservation.")
  gib = _cli.number_in(0, MAX_GIB, lo_open=True, exact=True)
  gib_or_0 = _cli.number_in(0, MAX_GIB, exact=True)
  count = _cli.int_in(1, MAX_COUNT)
  devices = _cli.int_in(1, MAX_DEVICES)
  p.add_argument("--model", choices=sorted(PRESETS),
                 help="preset shape (layers, KV heads, head_dim, params); "
                 "explicit flags override it")
  mem = p.add_argument_group("memory")
  mem.add_argument("--mem-gib", type=gib, help="device memory, GiB")
  mem.add_argument("--util", type=_cli.number_in(0, 1, lo_open=True, exact=True),
                   help="fraction of memory to use (default 0.9; 1 when "
                   "--kv-pool-gib is given)")
  mem.add_argument("--weights-gib", type=gib_or_0,
                   help="weight bytes, GiB")
  mem.add_argument("--params", type=_cli.number_in(1, MAX_PARAMS, exact=True),
                   help="parameter count (e.g. 8.03e9), instead of --weights-gib")
  mem.add_argument("--weight-dtype", default="bfloat16",
                   help="dtype of the weights with --params (default bfloat16)")
  mem.add_argument("--workspace-gib", type=gib_or_0, default=0,
                   help="activations/scratch, GiB (default 0)")
  mem.add_argument("--kv-pool-gib", type=gib,
                   help="KV pool size, GiB, instead of deriving it from memory")
  shape = p.add_argument_group("model")
  shape.add_argument("--layers", type=count)
  shape.add_argument("--kv-heads", type=count)
  shape.add_argument("--head-dim", type=count)
  shape.add_argument("--kv-dtype", default="bfloat16",
                     help="KV cache dtype (default bfloat16)")
  work = p.add_argument_group("workload")
  work.add_argument("--block-size", type=count, default=16,
                    help="tokens per block (default 16)")
  work.add_argument("--avg-tokens", type=count, required=True,
                    help="tokens per request (prompt + output), on average")
  work.add_argument("--max-model-len", type=count, required=True,
                    help="longest sequence; contiguous reservation size")
  work.add_argument("--target-concurrency", type=count,
                    help="also answer: blocks needed for this many sequences, "
                    "and the largest max_model_len at which they all fit")
  par = p.add_argument_group(
      "several devices (memory flags are per device)")
  par.add_argument("--tp", type=devices, default=1,
                   help="tensor-parallel devices per replica (the model axis): "
                   "weights and KV heads split over them, KV heads replicated "
                   "when fewer than --tp (default 1)")
  par.add_argument("--dp", type=devices, default=1,
                   help="data-parallel replicas (the data axis), each with its "
                   "own pool (default 1)")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  return p


def _gib_bytes(flag: str, gib: fractions.Fraction) -> int:
  """Whole bytes of a positive GiB flag; ValueError naming the flag when that
  is less than one byte."""
  n = math.floor(gib * GIB)
  if n < 1:
    raise ValueError(f"{flag} {float(gib):g} is less than one byte")
  return n


def _resolve_pool(args, shape: ModelShape | None) -> int:
  """KV pool bytes of one device from the flags (the weights split over
  `--tp` devices); ValueError with a one-line message."""
  derive = args.mem_gib is not None
  if args.weights_gib is not None and args.params is not None:
    raise ValueError("give --weights-gib or --params, not both")
  if args.params is not None:
    weights = weight_bytes(int(args.params), args.weight_dtype)
  elif args.weights_gib is not None:
    weights = math.ceil(args.weights_gib * GIB)
  elif shape is not None and derive:
    weights = weight_bytes(shape.num_params, args.weight_dtype)
  elif derive:
    raise ValueError("--mem-gib needs --weights-gib, --params or --model")
  else:
    weights = 0
  weights = -(-weights // args.tp)  # each device holds 1/tp of the weights
  workspace = math.ceil(args.workspace_gib * GIB)

  if args.kv_pool_gib is not None:
    pool = _gib_bytes("--kv-pool-gib", args.kv_pool_gib)
    if derive:  # Check that the given pool fits next to the weights.
      util = args.util if args.util is not None else 1
      room = kv_pool_bytes(_gib_bytes("--mem-gib", args.mem_gib), util,
                           weights, workspace)
      if pool > room:
        raise ValueError(
            f"--kv-pool-gib {float(args.kv_pool_gib):g} does not fit: "
            f"{room / GIB:g} GiB left after weights and workspace")
    return pool
  if not derive:
    raise ValueError("give --mem-gib (with weights) or --kv-pool-gib")
  util = args.util if args.util is not None else fractions.Fraction(9, 10)
  return kv_pool_bytes(_gib_bytes("--mem-gib", args.mem_gib), util, weights,
                       workspace)


def plan_from_args(args: argparse.Namespace) -> dict:
  """The plan for parsed command-line flags, as a JSON-able dict.

  Raises:
    ValueError: on values the planner rejects (message is one line).
  """
  shape = PRESETS[args.model] if args.model else None
  layers = args.layers or (shape and shape.num_layers)
  kv_heads = args.kv_heads or (shape and shape.num_kv_heads)
  head_dim = args.head_dim or (shape and shape.head_dim)
  missing = [flag for flag, v in (("--layers", layers), ("--kv-heads", kv_heads),
                                  ("--head-dim", head_dim)) if not v]
  if missing:
    raise ValueError(f"missing {', '.join(missing)} (or give --model)")
  if args.util is not None and not 0 < args.util <= 1:
    raise ValueError(f"--util {float(args.util):g} must be in (0, 1]")
  dtype_bytes(args.kv_dtype)  # Validate before sizing anything.
  dtype_bytes(args.weight_dtype, allow_subbyte=True)
  # Tensor parallelism: each device stores its share of the KV heads (each
  # head replicated tp / kv_heads times when there are fewer heads than tp),
  # so a block's bytes on one device shrink by that share.
  try:
    from paged_jax import sharding  # pylint: disable=import-outside-toplevel  # jax, for --tp only
    stored_heads = sharding.cache_kv_heads(kv_heads, args.tp)
  except ValueError:
    raise ValueError(f"--kv-heads {kv_heads} and --tp {args.tp} must divide "
                     "one another") from None
  if args.avg_tokens > args.max_model_len:
    raise ValueError(f"--avg-tokens {args.avg_tokens} must be <= "
                     f"--max-model-len {args.max_model_len}")
  pool = _resolve_pool(args, shape)
  block = bytes_per_block(layers, stored_heads // args.tp, head_dim,
                          args.block_size, args.kv_dtype)
  if pool < block:
    source = "--kv-pool-gib" if args.kv_pool_gib is not None else "--mem-gib"
    raise ValueError(f"the KV pool from {source} ({_size(pool)}) holds no "
                     f"block of {_size(block)} (--block-size {args.block_size})")
  p = plan(kv_pool_bytes=pool, num_layers=layers,
           num_kv_heads=stored_heads // args.tp, head_dim=head_dim,
           block_size=args.block_size, avg_tokens=args.avg_tokens,
           max_model_len=args.max_model_len, kv_dtype=args.kv_dtype)
  out = p.to_json_dict()
  name = str(args.kv_dtype).lower()
  out.update(kv_dtype=DTYPE_ALIASES.get(name, name),
             kv_scale_bytes_per_token=(2 * layers * (stored_heads // args.tp)
                                       * kv_scale_bytes(args.kv_dtype)))
  if args.tp * args.dp > 1:
    out.update(
        tp=args.tp, dp=args.dp, devices=args.tp * args.dp,
        kv_heads_per_device=stored_heads // args.tp,
        kv_head_replication=stored_heads // kv_heads,
        max_concurrency_paged_total=args.dp * p.max_concurrency_paged,
        max_concurrency_contiguous_total=args.dp * p.max_concurrency_contiguous)
  if args.target_concurrency:
    n = args.target_concurrency
    out["target_concurrency"] = n
    out["blocks_for_target"] = p.blocks_for_concurrency(n)
    out["kv_pool_bytes_for_target"] = p.blocks_for_concurrency(n) * p.bytes_per_block
    out["max_model_len_for_target"] = p.max_model_len_for_concurrency(n)
  return out


def _size(n: int) -> str:
  for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
    if n >= scale:
      return f"{n / scale:g} {unit}"
  return f"{n} B"


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
    raise ValueError(f"{source} needs {_size3(need)} of KV memory"
                     + ("" if device.platform == "cpu" else " per device")
                     + f", more than the {_size3(free)} of {where}")


def _size3(n: int) -> str:
  """`n` bytes to 3 significant figures ("763 GiB")."""
  for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{n} bytes"


def format_report(out: dict) -> str:
  """Human-readable lines for the dict `run` returns."""
  ratio = out["concurrency_ratio"]
  lines = [
      f"KV pool:          {_size(out['kv_pool_bytes'])} ({out['kv_pool_bytes']} bytes)",
      f"bytes per block:  {_size(out['bytes_per_block'])} "
      f"({out['block_size']} tokens, {_size(out['bytes_per_token'])} per token)",
      f"KV dtype:         {out['kv_dtype']}"
      + (f" (+{_size(out['kv_scale_bytes_per_token'])} of float32 scales per "
         "token, counted above)" if out["kv_scale_bytes_per_token"] else ""),
      f"blocks:           {out['num_blocks']}",
      f"blocks per seq:   {out['blocks_per_seq']} ({out['avg_tokens']} tokens)",
      f"max concurrency:  {out['max_concurrency_paged']} paged vs "
      f"{out['max_concurrency_contiguous']} contiguous at max_model_len "
      f"{out['max_model_len']} -> "
      + (f"{ratio:g}x" if ratio is not None else "n/a (no max-length sequence fits)"),
  ]
  if "devices" in out:
    lines += [
        f"devices:          {out['devices']} (dp {out['dp']} x tp {out['tp']}); "
        f"the figures above are per device / per replica; "
        f"{out['kv_heads_per_device']} KV head(s) per device"
        + (f", each replicated {out['kv_head_replication']}x"
           if out["kv_head_replication"] > 1 else ""),
        f"all replicas:     {out['max_concurrency_paged_total']} paged vs "
        f"{out['max_concurrency_contiguous_total']} contiguous sequences",
    ]
  if "target_concurrency" in out:
    n = out["target_concurrency"]
    lines += [
        f"for {n} seqs:      {out['blocks_for_target']} blocks "
        f"({_size(out['kv_pool_bytes_for_target'])}) of {out['avg_tokens']} tokens",
        f"                  max_model_len {out['max_model_len_for_target']} "
        "if every one may reach it",
    ]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Command-line entry point; returns the exit status (2 on a bad value).

  Argument errors exit through argparse (SystemExit(2)); both kinds print one
  line on stderr.
  """
  args = _parser().parse_args(argv)
  try:
    out = plan_from_args(args)
  except ValueError as e:
    print(f"python -m paged_jax.capacity: error: {_cli.one_line(e)}", file=sys.stderr)
    return 2
  print(json.dumps(out, indent=2) if args.json else format_report(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
