"""GPU paged-decode benchmark: correctness, copy bandwidth, kernel timings.

Run from the repository root on a machine with one NVIDIA GPU:

    PYTHONPATH=. python benchmarks/gpu_decode.py            # a few minutes on an H200
    PYTHONPATH=. python benchmarks/gpu_decode.py --smoke    # tiny, CPU interpret mode

In one run it
  1. checks our kernel against the float32 reference on a few NaN-poisoned
     shapes (ragged lengths, -1 table entries, soft cap, sliding window);
  2. measures device-to-device copy bandwidth (bytes read + written / time);
  3. times, per (batch, context), after warm-up, the median of many runs of
       ours      pallas_kernels.gpu.paged_decode (Pallas, Triton lowering)
       jax       JAX's built-in jax.experimental.pallas.ops.gpu.paged_attention
       xla       paged_jax.attention.paged_attention(..., implementation="xla")
       dense     jnp einsum-softmax over contiguous [batch, kv_len, heads, dim]
     Every sequence holds `context` tokens in randomly placed pages. Small
     shapes rotate among up to 64 input sets (256 MiB of K/V, beyond L2), 8
     calls unrolled per jitted function, so neither L2 hits nor dispatch
     overhead flatter them;
  4. sweeps a few configs of our kernel on three shapes (the heuristic's check);
  5. times the ragged (prefill + decode) kernel if it exists.

Prints a table and writes JSON to benchmarks/results/gpu_decode.json (the smoke
run to gpu_decode_smoke.json) and to $OUT/ when that variable is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gpu import paged_decode as gpu_decode

NUM_Q_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = jnp.bfloat16
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
ROTATION_BYTES = 256 << 20  # rotate inputs until this many K/V bytes (> L2)
MAX_SETS = 64
UNROLL = 8  # calls per jitted function when rotating input sets


def log(*a):
  print(*a, flush=True)


# --------------------------------------------------------------------------
# Timing


def time_call(fn, args, *, runs: int, warmup: int = 2) -> float:
  """Median seconds of `fn(*args)` (blocked), after warm-up/compilation."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def time_per_call(fn, sets, *, runs: int, unroll: int = UNROLL) -> float:
  """Seconds per `fn` call, rotating over `sets` (tuples of arguments).

  `unroll` calls on distinct sets run inside one jitted function (so dispatch
  overhead does not dominate microsecond kernels) and the groups of `unroll`
  sets are dispatched back to back before blocking once.
  """
  unroll = min(unroll, len(sets))
  groups = [tuple(sets[i:i + unroll])
            for i in range(0, len(sets) - unroll + 1, unroll)]
  many = jax.jit(lambda group: [fn(*s) for s in group])
  def run_all():
    return [many(g) for g in groups]
  return time_call(run_all, (), runs=runs) / (unroll * len(groups))


# --------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class DecodeInputs:
  q: jax.Array  # [batch, num_q_heads, head_dim]
  k_pages: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages: jax.Array
  block_tables: jax.Array  # i32[batch, context // block_size]
  kv_lens: jax.Array  # i32[batch]

  def args(self):
    return (self.q, self.k_pages, self.v_pages, self.block_tables, self.kv_lens)


def make_inputs(key, *, batch, context, num_q_heads=NUM_Q_HEADS,
                num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE, dtype=DTYPE) -> DecodeInputs:
  """Full sequences of `context` tokens in randomly permuted pages."""
  blocks_per_seq = context // block_size
  num_blocks = batch * blocks_per_seq
  kq, kk, kv, kt = jax.random.split(key, 4)
  shape = (num_kv_heads, num_blocks, block_size, head_dim)
  tables = jax.random.permutation(kt, num_blocks).astype(jnp.int32)
  return DecodeInputs(
      q=jax.random.normal(kq, (batch, num_q_heads, head_dim), dtype),
      k_pages=jax.random.normal(kk, shape, dtype),
      v_pages=jax.random.normal(kv, shape, dtype),
      block_tables=tables.reshape(batch, blocks_per_seq),
      kv_lens=jnp.full((batch,), context, jnp.int32))


@jax.jit
def to_dense(pages, block_tables):
  """[batch, context, num_kv_heads, head_dim] copy of the paged K or V."""
  x = pages[:, block_tables]  # [kvh, batch, blocks, bs, hd]
  kvh, batch, blocks, bs, hd = x.shape
  return jnp.transpose(x, (1, 2, 3, 0, 4)).reshape(batch, blocks * bs, kvh, hd)


def num_sets_for(nbytes: int) -> int:
  """Input sets to rotate so that ROTATION_BYTES of K/V are touched."""
  n = max(1, min(MAX_SETS, math.ceil(ROTATION_BYTES / nbytes)))
  return n if n <= UNROLL else UNROLL * math.ceil(n / UNROLL)


def kv_bytes(batch, context, dtype=DTYPE):
  return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize


# --------------------------------------------------------------------------
# Implementations


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


def jax_builtin_fn(blocks_per_seq, interpret):
  """JAX's Pallas GPU paged_attention with its defaults where they fit."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import paged_attention as pa  # pylint: disable=g-import-not-at-top
  k_splits = 16
  while blocks_per_seq % k_splits:
    k_splits //= 2
  ppcb = min(8, blocks_per_seq // k_splits)
  def fn(q, k, v, tables, lens):
    return pa.paged_attention(q, k, v, tables, lens, k_splits=k_splits,
                              pages_per_compute_block=ppcb, interpret=interpret)
  return fn, dict(k_splits=k_splits, pages_per_compute_block=ppcb)


def xla_fn():
  """Our XLA path, or the reason it cannot be imported."""
  try:
    attention = importlib.import_module("paged_jax.attention")
  except Exception as e:  # pylint: disable=broad-except
    return None, f"paged_jax.attention not importable ({type(e).__name__}: {e})"
  def fn(q, k, v, tables, lens):
    return attention.paged_attention(q, k, v, tables, lens,
                                     implementation="xla")
  return fn, None


def ours_fn(interpret, config=None):
  def fn(q, k, v, tables, lens):
    return gpu_decode.paged_decode(q, k, v, tables, lens, config=config,
                                   interpret=interpret)
  return fn


# --------------------------------------------------------------------------
# Sections


def copy_bandwidth(smoke: bool) -> dict:
  """Device-to-device copy bandwidth: bytes read + written per second."""
  n = (1 << 20) if smoke else (1 << 30)  # float32 elements: 4 MiB / 4 GiB
  x = jnp.arange(n, dtype=jnp.float32)
  runs = 3 if smoke else 20
  out = {"bytes": 2 * 4 * n}
  for name, f in (("copy", jax.jit(lambda a: a.copy())),
                  ("add", jax.jit(lambda a: a + 1.0))):
    t = time_call(f, (x,), runs=runs)
    out[f"{name}_gbps"] = out["bytes"] / t / 1e9
  out["gbps"] = max(out["copy_gbps"], out["add_gbps"])
  del x
  return out


def correctness(interpret: bool) -> list[dict]:
  """Ours vs the float32 reference on NaN-poisoned ragged cases."""
  from paged_jax.reference import paged_attention_reference  # pylint: disable=g-import-not-at-top
  from tests.cases import assert_rows_close, make_decode_case  # pylint: disable=g-import-not-at-top
  cases = [
      dict(dtype=jnp.bfloat16, batch=8, num_q_heads=32, num_kv_heads=8,
           head_dim=128, block_size=16, max_blocks_per_seq=64),
      dict(dtype=jnp.float32, batch=6, num_q_heads=8, num_kv_heads=8,
           head_dim=64, block_size=8, max_blocks_per_seq=40),
      dict(dtype=jnp.bfloat16, batch=6, num_q_heads=16, num_kv_heads=2,
           head_dim=256, block_size=32, max_blocks_per_seq=16,
           kw=dict(soft_cap=30.0, sliding_window=100)),
      dict(dtype=jnp.bfloat16, batch=2, num_q_heads=32, num_kv_heads=8,
           head_dim=128, block_size=16, max_blocks_per_seq=1024,
           config=gpu_decode.PagedDecodeConfig(k_splits=16,
                                               pages_per_compute_block=4)),
  ]
  if interpret:
    cases = [dict(c, max_blocks_per_seq=min(c["max_blocks_per_seq"], 4))
             for c in cases[1:3]]
  results = []
  rng = np.random.default_rng(0)
  for spec in cases:
    spec = dict(spec)
    kw = spec.pop("kw", {})
    config = spec.pop("config", None)
    name = (f"{jnp.dtype(spec['dtype']).name} b{spec['batch']} "
            f"h{spec['num_q_heads']}/{spec['num_kv_heads']} "
            f"d{spec['head_dim']} bs{spec['block_size']} "
            f"blocks{spec['max_blocks_per_seq']} {kw or ''}")
    try:
      c = make_decode_case(rng, **spec)
      args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
      out = gpu_decode.paged_decode(*args, config=config, interpret=interpret,
                                    **kw)
      ref = paged_attention_reference(*args, **kw)
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
      assert_rows_close(out, ref, spec["dtype"])
      results.append(dict(case=name, ok=True, max_abs_err=err))
    except Exception as e:  # pylint: disable=broad-except
      results.append(dict(case=name, ok=False, error=f"{type(e).__name__}: "
                          f"{str(e)[:500]}"))
    log(f"  {'PASS' if results[-1]['ok'] else 'FAIL'}  {name}  "
        f"{results[-1].get('max_abs_err', results[-1].get('error'))}")
  results += ragged_correctness(interpret)
  return results


def ragged_correctness(interpret: bool) -> list[dict]:
  """The ragged kernel (if present) vs the float32 reference, mixed batch."""
  try:
    ragged = importlib.import_module("pallas_kernels.gpu.ragged_attention")
  except ImportError:
    return []
  from paged_jax.reference import ragged_paged_attention_reference  # pylint: disable=g-import-not-at-top
  from tests.cases import assert_rows_close, make_ragged_case  # pylint: disable=g-import-not-at-top
  q_lens, kv_lens = (300, 1, 0, 77, 1), (300, 900, 5, 1000, 1)
  if interpret:
    q_lens, kv_lens = (9, 1, 0), (9, 30, 2)
  results = []
  for dtype, kw in ((jnp.bfloat16, {}),
                    (jnp.float32, dict(soft_cap=20.0, sliding_window=64))):
    name = f"ragged {jnp.dtype(dtype).name} q{list(q_lens)} {kw or ''}"
    try:
      c = make_ragged_case(
          np.random.default_rng(1), q_lens=q_lens, kv_lens=kv_lens,
          num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
          max_blocks_per_seq=64, max_num_seqs=len(q_lens) + 2,
          num_tokens=sum(q_lens) + 5, dtype=dtype)
      args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
              c.cu_q_lens, c.num_seqs)
      out = ragged.ragged_paged_attention(*args, interpret=interpret, **kw)
      ref = ragged_paged_attention_reference(*args, **kw)
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
      assert_rows_close(out, ref, dtype)
      results.append(dict(case=name, ok=True, max_abs_err=err))
    except Exception as e:  # pylint: disable=broad-except
      results.append(dict(case=name, ok=False, error=f"{type(e).__name__}: "
                          f"{str(e)[:500]}"))
    log(f"  {'PASS' if results[-1]['ok'] else 'FAIL'}  {name}  "
        f"{results[-1].get('max_abs_err', results[-1].get('error'))}")
  return results


def bench_decode(args, copy_gbps: float) -> list[dict]:
  interpret = args.smoke
  runs = 3 if args.smoke else args.runs
  xla, xla_note = xla_fn()
  if xla is None:
    log(f"  note: skipping the xla row: {xla_note}")
  rows = []
  key = jax.random.key(0)
  for batch in args.batches:
    for context in args.contexts:
      nbytes = kv_bytes(batch, context)
      row = dict(batch=batch, context=context, kv_bytes=nbytes)
      if nbytes > args.budget_gib * (1 << 30):
        row["skipped"] = f"K/V {nbytes / 2**30:.1f} GiB > {args.budget_gib} GiB"
        rows.append(row)
        log(f"  b={batch:4d} ctx={context:6d}  skipped ({row['skipped']})")
        continue
      num_sets = num_sets_for(nbytes)
      if args.smoke:
        num_sets = 2
      row["num_sets"] = num_sets
      sets = [make_inputs(jax.random.fold_in(key, i), batch=batch,
                          context=context) for i in range(num_sets)]
      paged = [s.args() for s in sets]
      row["our_config"] = dataclasses.asdict(gpu_decode.default_config(
          sets[0].q, sets[0].k_pages, sets[0].block_tables))
      impls = {"ours": ours_fn(interpret)}
      builtin, row["jax_config"] = jax_builtin_fn(context // BLOCK_SIZE,
                                                  interpret)
      impls["jax"] = builtin
      if xla is not None:
        impls["xla"] = xla
      for name, fn in impls.items():
        try:
          row[f"{name}_s"] = time_per_call(fn, paged, runs=runs)
        except Exception as e:  # pylint: disable=broad-except
          row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
          log(f"    {name} failed: {row[f'{name}_error']}")
      dense = [(s.q, to_dense(s.k_pages, s.block_tables),
                to_dense(s.v_pages, s.block_tables)) for s in sets]
      try:
        row["dense_s"] = time_per_call(dense_decode, dense, runs=runs)
      except Exception as e:  # pylint: disable=broad-except
        row["dense_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      if "ours_s" in row and "dense_s" in row:
        ours = gpu_decode.paged_decode(*paged[0], interpret=interpret)
        ref = dense_decode(*dense[0])
        row["ours_vs_dense_max_abs"] = float(jnp.max(jnp.abs(
            ours.astype(jnp.float32) - ref.astype(jnp.float32))))
      for name in ("ours", "jax", "xla", "dense"):
        if f"{name}_s" in row:
          row[f"{name}_gbps"] = nbytes / row[f"{name}_s"] / 1e9
          row[f"{name}_frac_copy"] = row[f"{name}_gbps"] / copy_gbps
      if "ours_s" in row and "dense_s" in row:
        row["paged_over_dense"] = row["ours_s"] / row["dense_s"]
      if "ours_s" in row and "jax_s" in row:
        row["speedup_vs_jax"] = row["jax_s"] / row["ours_s"]
      rows.append(row)
      log(format_row(row))
      del sets, paged, dense
      gc.collect()
  return rows


def config_sweep(args) -> list[dict]:
  """Our kernel under a few configs around the default, on three shapes."""
  interpret = args.smoke
  runs = 3 if args.smoke else args.runs
  shapes = ([(1, 128)] if args.smoke
            else [(1, 32768), (8, 8192), (64, 2048)])
  out = []
  for batch, context in shapes:
    s = make_inputs(jax.random.key(1), batch=batch, context=context)
    nbytes = kv_bytes(batch, context)
    num_sets = 1 if args.smoke else num_sets_for(nbytes)
    sets = [s.args()] + [
        make_inputs(jax.random.key(2 + i), batch=batch, context=context).args()
        for i in range(num_sets - 1)]
    d = gpu_decode.default_config(s.q, s.k_pages, s.block_tables)
    configs = {d}
    for k in (d.k_splits // 4, d.k_splits // 2, d.k_splits * 2,
              d.k_splits * 4):
      if k >= 1:
        configs.add(dataclasses.replace(d, k_splits=k))
    for block_k in (32, 128):
      configs.add(dataclasses.replace(
          d, pages_per_compute_block=block_k // BLOCK_SIZE))
    configs.add(dataclasses.replace(d, num_warps=8))
    configs.add(dataclasses.replace(d, num_stages=3))
    if args.smoke:
      configs = {d, dataclasses.replace(d, k_splits=2 * d.k_splits)}
    for config in sorted(configs, key=str):
      rec = dict(batch=batch, context=context, config=dataclasses.asdict(config),
                 default=config == d)
      try:
        rec["s"] = time_per_call(ours_fn(interpret, config), sets, runs=runs)
        rec["gbps"] = nbytes / rec["s"] / 1e9
      except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      out.append(rec)
      log(f"  b={batch:4d} ctx={context:6d} {'*' if rec['default'] else ' '} "
          f"ks={config.k_splits:3d} ppcb={config.pages_per_compute_block:2d} "
          f"warps={config.num_warps} stages={config.num_stages}  "
          + (f"{rec['s'] * 1e6:9.1f} us {rec['gbps']:7.0f} GB/s" if "s" in rec
             else rec["error"]))
    del sets
    gc.collect()
  return out


def ragged_section(args) -> dict:
  """Times `pallas_kernels.gpu.ragged_attention` on a few batch mixes, if any."""
  try:
    ragged = importlib.import_module("pallas_kernels.gpu.ragged_attention")
  except ImportError as e:
    log(f"  skipped: pallas_kernels.gpu.ragged_attention not available ({e})")
    return dict(skipped=str(e))
  interpret = args.smoke
  runs = 3 if args.smoke else args.runs
  # (prefill q_len, number of prefills, number of decodes, context)
  mixes = ([(16, 1, 2, 64)] if args.smoke else
           [(512, 4, 0, 2048), (512, 2, 60, 2048), (0, 0, 64, 4096),
            (2048, 1, 0, 8192)])
  out = []
  for q_len, n_prefill, n_decode, context in mixes:
    n = n_prefill + n_decode
    q_lens = np.array([q_len] * n_prefill + [1] * n_decode, np.int32)
    blocks = context // BLOCK_SIZE
    key = jax.random.key(3)
    inp = make_inputs(key, batch=n, context=context)
    num_tokens = int(q_lens.sum())
    cu = np.zeros(n + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    q = jax.random.normal(key, (num_tokens, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    a = (q, inp.k_pages, inp.v_pages, inp.block_tables, inp.kv_lens,
         jnp.asarray(cu), jnp.array([n], jnp.int32))
    rec = dict(q_len=q_len, prefills=n_prefill, decodes=n_decode,
               context=context, blocks_per_seq=blocks)
    try:
      f = jax.jit(lambda *x: ragged.ragged_paged_attention(
          *x, interpret=interpret))
      rec["s"] = time_call(f, a, runs=runs)
      rec["kv_gbps"] = kv_bytes(n, context) / rec["s"] / 1e9
      flops = 4 * NUM_Q_HEADS * HEAD_DIM * float(
          sum(ql * context for ql in q_lens))
      rec["tflops_upper_bound"] = flops / rec["s"] / 1e12
    except Exception as e:  # pylint: disable=broad-except
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    out.append(rec)
    log(f"  prefill {n_prefill}x{q_len} + decode {n_decode}, ctx {context}: "
        + (f"{rec['s'] * 1e6:9.1f} us" if "s" in rec else rec["error"]))
  return dict(mixes=out)


# --------------------------------------------------------------------------
# Output


HEADER = (f"{'batch':>5} {'ctx':>6} | {'ours us':>9} {'GB/s':>6} {'%copy':>5} |"
          f" {'jax us':>9} {'xla us':>9} {'dense us':>9} | {'paged/dense':>11}"
          f" {'ours/jax x':>10}")


def format_row(r):
  def us(name):
    return f"{r[name + '_s'] * 1e6:9.1f}" if name + "_s" in r else f"{'-':>9}"
  if "skipped" in r:
    return f"{r['batch']:5d} {r['context']:6d} | skipped: {r['skipped']}"
  gbps = f"{r['ours_gbps']:6.0f}" if "ours_gbps" in r else f"{'-':>6}"
  frac = (f"{100 * r['ours_frac_copy']:5.1f}" if "ours_frac_copy" in r
          else f"{'-':>5}")
  ratio = (f"{r['paged_over_dense']:11.2f}" if "paged_over_dense" in r
           else f"{'-':>11}")
  speed = (f"{r['speedup_vs_jax']:10.2f}" if "speedup_vs_jax" in r
           else f"{'-':>10}")
  return (f"{r['batch']:5d} {r['context']:6d} | {us('ours')} {gbps} {frac} |"
          f" {us('jax')} {us('xla')} {us('dense')} | {ratio} {speed}")


def device_info():
  d = jax.devices()[0]
  return dict(platform=d.platform, device_kind=d.device_kind,
              num_sms=getattr(d, "core_count", None),
              jax=jax.__version__,
              jaxlib=importlib.import_module("jaxlib").__version__,
              python=sys.version.split()[0])


def write_json(result, smoke):
  name = "gpu_decode_smoke.json" if smoke else "gpu_decode.json"
  paths = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        name)]
  if os.environ.get("OUT"):
    paths.append(os.path.join(os.environ["OUT"], name))
  for path in paths:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(result, f, indent=1, default=str)
    log(f"wrote {path}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes on CPU in Pallas interpret mode")
  p.add_argument("--batches", type=int, nargs="+", default=BATCHES)
  p.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
  p.add_argument("--runs", type=int, default=30, help="timed runs (median)")
  p.add_argument("--budget-gib", type=float, default=10.0,
                 help="skip shapes whose K/V exceed this many GiB")
  p.add_argument("--no-sweep", action="store_true",
                 help="skip the config sweep")
  args = p.parse_args(argv)
  if args.smoke:
    args.batches, args.contexts = (1, 2), (64, 128)
  return args


def main(argv=None):
  args = parse_args(argv)
  if not args.smoke and jax.default_backend() != "gpu":
    log(f"no GPU (default backend: {jax.default_backend()}); use --smoke")
    return 2
  t_start = time.time()
  result = dict(
      benchmark="gpu_decode", smoke=args.smoke,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      device=device_info(),
      shapes=dict(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                  head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                  dtype=jnp.dtype(DTYPE).name))
  log(f"device: {result['device']}")

  def section(name, fn, *a):
    if name:
      log(f"\n== {name}")
    try:
      return fn(*a)
    except Exception:  # pylint: disable=broad-except
      tb = traceback.format_exc()
      log(tb)
      return dict(error=tb[-2000:])

  result["correctness"] = section("correctness (ours vs float32 reference)",
                                  correctness, args.smoke)
  result["copy"] = section("device copy bandwidth", copy_bandwidth, args.smoke)
  copy_gbps = result["copy"].get("gbps", float("nan"))
  log(f"  copy {result['copy'].get('copy_gbps', 0):.0f} GB/s, "
      f"elementwise {result['copy'].get('add_gbps', 0):.0f} GB/s")
  log(f"\n== decode timings (median of {args.runs if not args.smoke else 3})")
  log(HEADER)
  result["decode"] = section("", bench_decode, args, copy_gbps)
  if not args.no_sweep:
    result["config_sweep"] = section("config sweep (ours)", config_sweep, args)
  result["ragged"] = section("ragged / prefill", ragged_section, args)
  result["seconds"] = time.time() - t_start
  log(f"\n== summary ({result['seconds']:.0f} s)")
  log(HEADER)
  for r in result["decode"] if isinstance(result["decode"], list) else []:
    log(format_row(r))
  write_json(result, args.smoke)
  ok = all(c.get("ok") for c in result["correctness"]) if isinstance(
      result["correctness"], list) else False
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
