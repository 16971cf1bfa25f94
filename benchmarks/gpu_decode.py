"""GPU paged-decode benchmark: KV bandwidth against copy bandwidth and rivals.

    PYTHONPATH=. python benchmarks/gpu_decode.py              # on a GPU, ~2 min
    PYTHONPATH=. python benchmarks/gpu_decode.py --dry-run    # CPU, interpret

Shapes: Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128),
bfloat16, block_size 16; every sequence holds `context` tokens in randomly
placed pages (the K/V of every timed shape, >= 256 MiB, is far beyond the
60 MB L2). In order:

  1. copy bandwidth: one fused read + write of a 4 GiB array;
  2. per (batch, context), the issue's 64 x 4096 first, each implementation's
     time per call, as KV GB/s and % of copy bandwidth:
       triton      ours, `implementation="pallas_gpu"` (Pallas on Triton)
       mosaic      ours, `implementation="pallas_mosaic_gpu"`, when that
                   backend is registered in `paged_jax.attention` (else a
                   printed skip)
       jax         JAX's built-in `jax.experimental.pallas.ops.gpu.
                   paged_attention`
       <ours> contiguous   the same kernel over the same K/V laid out in
                   order, with identity block tables: the paging overhead
                   is the ratio of the two (outputs must agree)
       cudnn       `jax.nn.dot_product_attention(implementation="cudnn")`
                   with one query on contiguous K/V, if cuDNN takes it
       dense       einsum-softmax on contiguous K/V (XLA)
  3. a config sweep of the Triton kernel (K tile x stages 2-5, warps, splits)
     around its default at 64 x 4096 and 8 x 8192.

Timing (`benchmarks.common.time_in_loop`): many calls inside one jitted
`lax.fori_loop` per dispatch, a call's time the median over repeats of
(T(2n) - T(n)) / n, so dispatch never counts. `--budget-s` makes the script
skip what it cannot finish (each skip printed); the JSON (gpu_decode.json,
also under `$OUT`) is rewritten after every row, and the goal lines
(`goals` in the JSON) come last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import jaxlib

from benchmarks import common
from paged_jax import attention
from pallas_kernels.gpu import paged_decode as triton_decode

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
GOAL_SHAPE = (64, 4096)  # (batch, context) of the goals
SHAPES = (GOAL_SHAPE, (8, 8192), (1, 32768), (256, 4096), (64, 16384))
SWEEP_SHAPES = (GOAL_SHAPE, (8, 8192))
DRY_RUN_SHAPES = ((2, 64),)
GOAL_FRAC_COPY = 0.85
GOAL_SPEEDUP_VS_JAX = 1.5
GOAL_PAGED_OVER_CONTIGUOUS = 1.03
OURS = {"triton": "pallas_gpu", "mosaic": "pallas_mosaic_gpu"}


def log(*a):
  print(*a, flush=True)


@dataclasses.dataclass
class Inputs:
  q: jax.Array  # [batch, num_q_heads, head_dim]
  k_pages: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages: jax.Array
  block_tables: jax.Array  # i32[batch, context // block_size], a permutation
  kv_lens: jax.Array  # i32[batch]

  def paged(self):
    return (self.q, self.k_pages, self.v_pages, self.block_tables,
            self.kv_lens)

  def contiguous(self):
    """The same K/V in order (sequence b's pages at b * width ...) with
    identity tables: the same function, no scattered pages."""
    order = self.block_tables.reshape(-1)
    ident = jnp.arange(order.size, dtype=jnp.int32).reshape(
        self.block_tables.shape)
    return (self.q, self.k_pages[:, order], self.v_pages[:, order], ident,
            self.kv_lens)

  def dense(self):
    """q and [batch, context, num_kv_heads, head_dim] contiguous K, V."""
    return (self.q, to_dense(self.k_pages, self.block_tables),
            to_dense(self.v_pages, self.block_tables))


@jax.jit
def to_dense(pages, block_tables):
  """[batch, blocks * block_size, num_kv_heads, head_dim] copy of paged K/V."""
  x = pages[:, block_tables]  # [kvh, batch, blocks, bs, hd]
  kvh, b, n, bs, hd = x.shape
  return jnp.transpose(x, (1, 2, 3, 0, 4)).reshape(b, n * bs, kvh, hd)


def make_inputs(key, batch: int, context: int) -> Inputs:
  """Full sequences of `context` tokens in randomly permuted pages, built on
  the device."""
  width = context // BLOCK_SIZE
  kq, kk, kv, kt = jax.random.split(key, 4)
  shape = (NUM_KV_HEADS, batch * width, BLOCK_SIZE, HEAD_DIM)
  tables = jax.random.permutation(kt, batch * width).astype(jnp.int32)
  return Inputs(jax.random.normal(kq, (batch, NUM_Q_HEADS, HEAD_DIM), DTYPE),
                jax.random.normal(kk, shape, DTYPE),
                jax.random.normal(kv, shape, DTYPE),
                tables.reshape(batch, width),
                jnp.full((batch,), context, jnp.int32))


def kv_bytes(batch: int, context: int) -> int:
  return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(
      DTYPE).itemsize


def registered_ours() -> dict:
  """{row name: implementation} of our decode kernels in the registry."""
  names = {b.name for b in attention.DECODE_BACKENDS}
  return {row: impl for row, impl in OURS.items() if impl in names}


def ours_fn(implementation: str, interpret: bool, config=None):
  if config is not None:  # the Triton kernel under an explicit config
    return lambda *a: triton_decode.paged_decode(*a, config=config,
                                                 interpret=interpret)
  return lambda *a: attention.paged_attention(
      *a, implementation=implementation, interpret=interpret)


def jax_builtin_fn(blocks_per_seq: int, interpret: bool):
  """JAX's Pallas GPU paged_attention, 16 splits and 8 pages per block where
  they fit (its defaults are for TPU-sized tables)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import paged_attention as pa  # pylint: disable=g-import-not-at-top
  k_splits = 16
  while blocks_per_seq % k_splits:
    k_splits //= 2
  ppcb = max(1, min(8, blocks_per_seq // k_splits))
  return lambda q, k, v, t, lens: pa.paged_attention(
      q, k, v, t, lens, k_splits=k_splits, pages_per_compute_block=ppcb,
      interpret=interpret)


def dense_decode(q, k, v):
  """Contiguous decode attention: q [b, hq, d], k/v [b, t, hkv, d]."""
  b, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, d)
  s = jnp.einsum("bhgd,bthd->bhgt", qg, k, preferred_element_type=jnp.float32)
  p = jax.nn.softmax(s * d**-0.5, axis=-1)
  o = jnp.einsum("bhgt,bthd->bhgd", p.astype(v.dtype), v,
                 preferred_element_type=jnp.float32)
  return o.reshape(b, hq, d).astype(q.dtype)


def cudnn_decode(q, k, v):
  return jax.nn.dot_product_attention(q[:, None], k, v,
                                      implementation="cudnn")[:, 0]


class Clock:
  """The script's own deadline: parts that cannot start in time are skipped
  (and say so) before the caller's hard limit kills the process."""

  def __init__(self, budget_s: float):
    self.t0 = time.time()
    self.budget_s = budget_s

  def left(self) -> float:
    return self.budget_s - (time.time() - self.t0)


def device_info() -> dict:
  d = jax.devices()[0]
  return dict(device_kind=d.device_kind, num_sms=getattr(d, "core_count", None),
              jax=jax.__version__, jaxlib=jaxlib.__version__,
              python=sys.version.split()[0])


def copy_bandwidth(dry_run: bool, runs: int = 5) -> dict:
  """Device copy bandwidth: one fused read + write of a 4 GiB bf16 array
  (bytes read plus written per second)."""
  n = (1 << 16) if dry_run else (1 << 31)
  x = jax.random.normal(jax.random.key(0), (n,), DTYPE)
  m = common.time_in_loop(lambda a: a, (x,), repeats=1 if dry_run else runs,
                          keep_output=False)
  del x, m["out"]
  return dict(m, bytes=2 * 2 * n, gbps=2 * 2 * n / m["s"] / 1e9)


def timed(fn, args, runs: int, dry_run: bool) -> dict:
  m = common.time_in_loop(fn, args, repeats=1 if dry_run else runs)
  out = m.pop("out")
  return dict(m, out=out)


def bench_shape(batch, context, args, copy_gbps, clock) -> dict:
  nbytes = kv_bytes(batch, context)
  row = dict(batch=batch, context=context, kv_bytes=nbytes, times={})
  inp = make_inputs(jax.random.key(batch * 100_003 + context), batch, context)
  row["triton_config"] = dataclasses.asdict(triton_decode.default_config(
      inp.q, inp.k_pages, inp.block_tables))
  contiguous = inp.contiguous()
  dense = inp.dense()
  interpret = args.dry_run
  impls = []
  ours = registered_ours()
  for name, impl in OURS.items():
    if name not in ours:
      row.setdefault("skipped", {})[name] = (
          f"{impl!r} is not registered in paged_jax.attention")
      continue
    impls.append((name, ours_fn(impl, interpret), inp.paged()))
    impls.append((f"{name} contiguous", ours_fn(impl, interpret), contiguous))
  impls.append(("jax", jax_builtin_fn(context // BLOCK_SIZE, interpret),
                inp.paged()))
  if jax.default_backend() == "gpu":
    impls.append(("cudnn", cudnn_decode, dense))
  else:
    row.setdefault("skipped", {})["cudnn"] = "cuDNN needs a GPU"
  impls.append(("dense", dense_decode, dense))
  outs = {}
  for name, fn, fn_args in impls:
    if clock.left() < 10:
      row.setdefault("skipped", {})[name] = "out of time"
      continue
    try:
      m = timed(fn, fn_args, args.runs, args.dry_run)
      outs[name] = m.pop("out")
      m["gbps"] = nbytes / m["s"] / 1e9
      m["frac_copy"] = m["gbps"] / copy_gbps
      row["times"][name] = m
    except Exception as e:  # pylint: disable=broad-except
      row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
  for name in ours:  # paged and contiguous: the same function of the same K/V
    if name in outs and f"{name} contiguous" in outs:
      row.setdefault("paged_vs_contiguous_max_abs", {})[name] = float(
          jnp.max(jnp.abs(outs[name].astype(jnp.float32)
                          - outs[f"{name} contiguous"].astype(jnp.float32))))
  for name, text in row.get("skipped", {}).items():
    log(f"    skip {name}: {text}")
  for name, text in row.get("errors", {}).items():
    log(f"    {name} failed: {text}")
  return row


def config_sweep(args, clock, shapes) -> list[dict]:
  """The Triton kernel under configs around its default."""
  out = []
  for batch, context in shapes:
    inp = make_inputs(jax.random.key(7), batch, context)
    d = triton_decode.default_config(inp.q, inp.k_pages, inp.block_tables)
    if args.dry_run:
      configs = [dataclasses.replace(d, num_stages=4)]
    elif (batch, context) == GOAL_SHAPE:
      configs = [d] + [
          dataclasses.replace(d, pages_per_compute_block=p, num_stages=st)
          for p in (1, 2, 4) for st in (2, 3, 4, 5)] + [
              dataclasses.replace(d, num_warps=8),
              dataclasses.replace(d, pages_per_compute_block=4, num_warps=8)]
    else:
      configs = [d] + [dataclasses.replace(d, k_splits=k)
                       for k in (d.k_splits // 2, d.k_splits * 2) if k >= 1] + [
                           dataclasses.replace(d, num_stages=4)]
    seen = []
    for config in configs:
      if config in seen:
        continue
      seen.append(config)
      rec = dict(batch=batch, context=context, default=config == d,
                 config=dataclasses.asdict(config))
      if clock.left() < 10:
        rec["skipped"] = "out of time"
      else:
        try:
          m = timed(ours_fn("pallas_gpu", args.dry_run, config), inp.paged(),
                    args.runs, args.dry_run)
          m.pop("out")
          rec.update(m, gbps=kv_bytes(batch, context) / m["s"] / 1e9)
        except Exception as e:  # pylint: disable=broad-except
          rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      out.append(rec)
      c = config
      log(f"  b={batch:4d} ctx={context:6d} {'*' if rec['default'] else ' '} "
          f"ks={c.k_splits:3d} tile={c.pages_per_compute_block * BLOCK_SIZE:3d}"
          f" warps={c.num_warps} stages={c.num_stages}  "
          + (f"{rec['s'] * 1e6:9.1f} us {rec['gbps']:7.0f} GB/s" if "s" in rec
             else rec.get("error", rec.get("skipped", ""))))
    del inp
    gc.collect()
  return out


def goals(result) -> list[dict]:
  """One record per (our kernel, goal) at the issue's shape, with the line
  for RESULTS.md."""
  rows = [r for r in result.get("decode", [])
          if (r["batch"], r["context"]) == tuple(result["goal_shape"])]
  if not rows:
    return []
  t = rows[0]["times"]
  copy = result["copy"]["gbps"]
  b, c = result["goal_shape"]
  out = []
  for name in OURS:
    if name not in t:
      why = rows[0].get("skipped", {}).get(name) or rows[0].get(
          "errors", {}).get(name, "not timed")
      out.append(dict(kernel=name, goal="all", ok=None,
                      line=f"decode {b}x{c} {name}: no figure ({why})"))
      continue
    frac = t[name]["frac_copy"]
    out.append(dict(kernel=name, goal="frac_copy", measured=frac,
                    ok=frac >= GOAL_FRAC_COPY,
                    line=f"decode {b}x{c} {name}: {t[name]['gbps']:.0f} GB/s ="
                    f" {100 * frac:.1f}% of copy {copy:.0f} GB/s (goal >= "
                    f"{100 * GOAL_FRAC_COPY:.0f}%)"))
    if "jax" in t:
      x = t["jax"]["s"] / t[name]["s"]
      out.append(dict(kernel=name, goal="speedup_vs_jax", measured=x,
                      ok=x >= GOAL_SPEEDUP_VS_JAX,
                      line=f"decode {b}x{c} {name} vs JAX Pallas paged_attention:"
                      f" {x:.2f}x (goal >= {GOAL_SPEEDUP_VS_JAX}x)"))
    if f"{name} contiguous" in t:
      x = t[name]["s"] / t[f"{name} contiguous"]["s"]
      out.append(dict(kernel=name, goal="paged_over_contiguous", measured=x,
                      ok=x <= GOAL_PAGED_OVER_CONTIGUOUS,
                      line=f"decode {b}x{c} {name} paged / contiguous (same "
                      f"kernel, identity tables): {x:.3f} (goal <= "
                      f"{GOAL_PAGED_OVER_CONTIGUOUS})"))
  for rec in out:
    rec["line"] += {True: "  PASS", False: "  MISS", None: ""}[rec["ok"]]
  return out


def format_row(r) -> list[str]:
  lines = [f"  b={r['batch']} ctx={r['context']} "
           f"(K/V {r['kv_bytes'] / 2**20:.0f} MiB)"]
  for name, m in r["times"].items():
    lines.append(f"    {name:<20} {m['s'] * 1e6:9.1f} us {m['gbps']:7.0f} GB/s"
                 f" {100 * m['frac_copy']:5.1f}% copy  ({m['repeats']}x"
                 f"{m['calls']} calls, spread {100 * m['spread']:.0f}%)")
  return lines


def write_json(result, dry_run):
  name = "gpu_decode_dry_run.json" if dry_run else "gpu_decode.json"
  paths = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        name)]
  if os.environ.get("OUT"):
    paths.append(os.path.join(os.environ["OUT"], name))
  for path in paths:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(result, f, indent=1, default=str)
  return paths


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dry-run", "--smoke", action="store_true", dest="dry_run",
                 help="tiny shapes on CPU in interpret mode (checks the script)")
  p.add_argument("--runs", type=int, default=5, help="timed repeats (median)")
  p.add_argument("--budget-s", type=float, default=170.0,
                 help="stop starting new parts after this many seconds")
  p.add_argument("--no-sweep", action="store_true")
  args = p.parse_args(argv)
  if not args.dry_run and jax.default_backend() != "gpu":
    log(f"no GPU (default backend: {jax.default_backend()}); use --dry-run")
    return 2
  clock = Clock(args.budget_s)
  result = dict(benchmark="gpu_decode", dry_run=args.dry_run,
                device=device_info(),
                goal_shape=DRY_RUN_SHAPES[0] if args.dry_run else GOAL_SHAPE,
                ours=registered_ours(), decode=[])
  log(f"device: {result['device']}; ours: {result['ours']}")
  log("\n== copy bandwidth (one fused read + write)")
  result["copy"] = copy_bandwidth(args.dry_run, args.runs)
  log(f"  {result['copy']['gbps']:.0f} GB/s")
  write_json(result, args.dry_run)
  # The goal shape and its sweep first: what a cut-short run must keep.
  shapes = DRY_RUN_SHAPES if args.dry_run else SHAPES
  sweeps = DRY_RUN_SHAPES if args.dry_run else SWEEP_SHAPES
  result["config_sweep"] = []
  for i, (batch, context) in enumerate(shapes):
    log(f"\n== decode b={batch} ctx={context} (time per call, many calls per"
        " dispatch)")
    if clock.left() < 15:
      log("  skipped, out of time")
      continue
    result["decode"].append(bench_shape(batch, context, args,
                                        result["copy"]["gbps"], clock))
    for line in format_row(result["decode"][-1]):
      log(line)
    if i == 0:
      result["goals"] = goals(result)
      for g in result["goals"]:
        log("  " + g["line"])
    write_json(result, args.dry_run)
    gc.collect()
    if (batch, context) in sweeps and not args.no_sweep:
      log(f"\n== config sweep (triton) b={batch} ctx={context}")
      result["config_sweep"] += config_sweep(args, clock, [(batch, context)])
      write_json(result, args.dry_run)
  result["goals"] = goals(result)
  result["seconds"] = time.time() - clock.t0
  write_json(result, args.dry_run)
  log(f"\n== decode goals ({result['seconds']:.0f} s)")
  for g in result["goals"]:
    log("  " + g["line"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
