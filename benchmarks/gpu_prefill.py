"""GPU prefill benchmark: ragged paged attention against contiguous attention.

Run from the repository root on a machine with one NVIDIA GPU:

    PYTHONPATH=. python benchmarks/gpu_prefill.py            # ~1.5 min on an H200
    PYTHONPATH=. python benchmarks/gpu_prefill.py --dry-run  # tiny, CPU interpret mode

Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128), bfloat16,
block_size 16. The kernels' correctness on the GPU is checked first, by
`benchmarks/gpu_check.py` (gpu_all.sh stops if it fails); here every timed
row's output is still compared with a float32 reference. In one run it

  1. (with `--correctness` only) checks `ragged_paged_attention` (pallas_gpu
     and xla) against the float32 reference on a NaN-poisoned mixed batch;
  2. measures the two ceilings: the bf16 matmul rate (an 8192^3 `jnp.dot` on
     random data) and the device copy bandwidth;
  3. prefill: 8 prompts of 2048 tokens, no cached prefix. Paged rows:
     ragged_paged_attention with implementation "pallas_gpu" and "xla" over
     randomly placed pages. Contiguous rows, the same tokens on contiguous
     [batch, seq, heads, dim] K/V: `jax.nn.dot_product_attention(is_causal=True)`
     with implementation "cudnn" and "xla", JAX's Pallas Triton flash attention
     (`pallas.ops.gpu.attention.mha`; it has no GQA, so K/V are repeated to 32
     heads before timing) and JAX's Mosaic GPU (Hopper) flash attention
     (`pallas.ops.gpu.attention_mgpu`) in float16: its shared-memory scratch
     is hard-coded float16 (JAX 0.10-0.12), so bfloat16 inputs fail there; the
     row times the same tokens cast to float16 (same bytes and FLOPs). Every output is compared with a float32
     reference on sequence 0. Goals: >= 50% of the measured matmul rate, and
     paged / fastest contiguous <= 1.10;
  4. mixed batch, half the tokens each: 2 prefill chunks of 512 tokens (the
     last chunk of 2048-token prompts) and 1024 decode tokens (context 1024),
     in one ragged call; against the same two parts run separately by our
     kernel, and against contiguous attention run as two calls (chunks:
     dot_product_attention with a bottom-right causal mask; decodes: cuDNN or a
     dense einsum). Decode rows read their whole context, so this batch is
     bound by memory: it is reported against max(FLOPs / matmul rate, bytes /
     copy bandwidth).

FLOPs are counted honestly for causal attention: 4 * num_q_heads * head_dim *
(sum over queries of the keys each one sees). Timing: many calls per dispatch
in one jitted `lax.fori_loop` (`benchmarks.common.time_in_loop`: median over
repeats of (T(2n) - T(n)) / n, each call's queries depending on the last
output so XLA can neither hoist nor merge calls). These inputs are all larger
than the 60 MB L2, so nothing is rotated.

Prints a table and writes JSON to benchmarks/results/gpu_prefill.json (the dry
run to gpu_prefill_dry_run.json) and to $OUT/ when that variable is set; the
JSON is rewritten after every section, so a run cut short keeps what it
measured; `--budget-s` skips (and says so) a section that cannot start in time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time
import traceback
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks import gpu_decode
from paged_jax import attention

DTYPE = jnp.bfloat16
GOAL_FRAC_MATMUL = 0.50  # prefill TFLOP/s / measured bf16 matmul TFLOP/s
GOAL_PAGED_OVER_CONTIGUOUS = 1.10
BF16_REL_TOL = 2e-2  # ||out - ref|| / ||ref|| above this is wrong


@dataclasses.dataclass(frozen=True)
class Shapes:
  num_q_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int = 128
  block_size: int = 16
  prefill_seqs: int = 8
  prefill_len: int = 2048
  chunks: int = 2  # mixed batch: prefill chunks ...
  chunk_len: int = 512
  chunk_kv_len: int = 2048  # ... each the last chunk of a prompt this long
  decodes: int = 1024  # mixed batch: decode tokens ...
  decode_kv_len: int = 1024  # ... each with this context
  matmul_n: int = 8192


SMOKE = Shapes(num_q_heads=8, num_kv_heads=2, prefill_seqs=2, prefill_len=32,
               chunks=2, chunk_len=16, chunk_kv_len=48, decodes=16,
               decode_kv_len=32, matmul_n=256)

log = gpu_decode.log


# --------------------------------------------------------------------------
# FLOPs, bytes and timing


def causal_flops(q_lens, kv_lens, s: Shapes) -> float:
  """4 * heads * head_dim * sum over queries of the keys each one sees.

  Query i (0-based) of a sequence with q_len new tokens and kv_len in all sits
  at position kv_len - q_len + i and sees kv_len - q_len + i + 1 keys.
  """
  keys = sum(q * (kv - q) + q * (q + 1) // 2
             for q, kv in zip(q_lens, kv_lens))
  return 4.0 * s.num_q_heads * s.head_dim * keys


def min_bytes(num_tokens: int, kv_tokens: int, s: Shapes) -> int:
  """Each input read once, the output written once: Q, K, V, out."""
  item = jnp.dtype(DTYPE).itemsize
  return item * s.head_dim * (2 * num_tokens * s.num_q_heads
                              + 2 * kv_tokens * s.num_kv_heads)


def measure(fn, sets, *, runs: int):
  """Seconds per call of `fn(*sets[0])` (many calls per dispatch, median of
  `runs` repeats; `benchmarks.common.time_in_loop`) and its output."""
  m = common.time_in_loop(fn, tuple(sets[0]), repeats=runs, target_s=0.02)
  first = m.pop("out")
  return dict(m, runs=m["repeats"], unroll=m["calls"],
              first_call_s=m["first_s"]), first


def rel_err(out, ref) -> float:
  out = jnp.asarray(out, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@functools.partial(jax.jit, static_argnames=("q_offset",))
def reference_f32(q, k, v, *, q_offset: int):
  """Float32 causal attention of one sequence: q [T, Hq, D], k/v [S, Hkv, D].

  Query i sits at position q_offset + i. Runs on the device (the NumPy
  reference would take minutes at these sizes).
  """
  t, hq, d = q.shape
  s, hkv, _ = k.shape
  qg = q.astype(jnp.float32).reshape(t, hkv, hq // hkv, d)
  logits = jnp.einsum("thgd,shd->hgts", qg, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * d**-0.5
  visible = jnp.arange(s)[None, :] <= q_offset + jnp.arange(t)[:, None]
  p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
  o = jnp.einsum("hgts,shd->thgd", p, v.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)
  return o.reshape(t, hq, d)


# --------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class Batch:
  """A ragged batch on paged K/V plus, for each query set, its arguments."""
  qs: list  # distinct [num_tokens, num_q_heads, head_dim] query sets
  k_pages: jax.Array  # [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages: jax.Array
  block_tables: jax.Array  # i32[num_seqs, max_blocks_per_seq], -1 unused
  kv_lens: jax.Array  # i32[num_seqs]
  cu_q_lens: jax.Array  # i32[num_seqs + 1]
  q_lens: tuple
  kv_lens_host: tuple

  def args(self, i=0):
    return (self.qs[i], self.k_pages, self.v_pages, self.block_tables,
            self.kv_lens, self.cu_q_lens,
            jnp.array([len(self.q_lens)], jnp.int32))

  def sets(self):
    return [self.args(i) for i in range(len(self.qs))]

  def dense_kv(self, seqs: slice, kv_len: int):
    """Contiguous [n, kv_len, num_kv_heads, head_dim] K and V of `seqs`."""
    tables = self.block_tables[seqs, :-(-kv_len // self.k_pages.shape[2])]
    return (gpu_decode.to_dense(self.k_pages, tables)[:, :kv_len],
            gpu_decode.to_dense(self.v_pages, tables)[:, :kv_len])

  def sub_batch(self, seqs: slice) -> Batch:
    """The sequences `seqs` alone (same pages), for timing parts separately."""
    cu = np.concatenate([[0], np.cumsum(self.q_lens)])
    lo, hi = cu[seqs.start], cu[seqs.stop]
    q_lens = self.q_lens[seqs]
    return Batch(
        qs=[q[lo:hi] for q in self.qs], k_pages=self.k_pages,
        v_pages=self.v_pages, block_tables=self.block_tables[seqs],
        kv_lens=self.kv_lens[seqs],
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]),
                              jnp.int32),
        q_lens=q_lens, kv_lens_host=self.kv_lens_host[seqs])


def make_batch(key, q_lens, kv_lens, s: Shapes, *, num_q_sets: int) -> Batch:
  """Random K/V in randomly permuted pages; `num_q_sets` random query sets."""
  bs = s.block_size
  need = [-(-kv // bs) for kv in kv_lens]
  width = max(need)
  num_blocks = sum(need)
  kk, kv, kt, kq = jax.random.split(key, 4)
  shape = (s.num_kv_heads, num_blocks, bs, s.head_dim)
  perm = np.asarray(jax.random.permutation(kt, num_blocks), np.int32)
  tables = np.full((len(kv_lens), width), -1, np.int32)  # NULL_BLOCK
  start = 0
  for i, n in enumerate(need):
    tables[i, :n] = perm[start:start + n]
    start += n
  num_tokens = sum(q_lens)
  return Batch(
      qs=[jax.random.normal(jax.random.fold_in(kq, i),
                            (num_tokens, s.num_q_heads, s.head_dim), DTYPE)
          for i in range(num_q_sets)],
      k_pages=jax.random.normal(kk, shape, DTYPE),
      v_pages=jax.random.normal(kv, shape, DTYPE),
      block_tables=jnp.asarray(tables),
      kv_lens=jnp.asarray(kv_lens, jnp.int32),
      cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]),
                            jnp.int32),
      q_lens=tuple(q_lens), kv_lens_host=tuple(kv_lens))


# --------------------------------------------------------------------------
# Implementations: the functions one row times.


def paged_fn(implementation: str, interpret: bool):
  def fn(*args):
    return attention.ragged_paged_attention(
        *args, implementation=implementation, interpret=interpret)
  return fn


def sdpa_fn(implementation: str, *, causal: bool, mask=None):
  """jax.nn.dot_product_attention on [B, T, H, D] q and [B, S, Hkv, D] k/v."""
  def fn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        implementation=implementation)
  return fn


def triton_mha_fn(interpret: bool):
  """JAX's Pallas Triton flash attention; K/V must already have all q heads."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # pylint: disable=g-import-not-at-top
  def fn(q, k, v):
    return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1]**-0.5,
                                causal=True, interpret=interpret)
  return fn


def mosaic_fn(block_kv: int):
  """JAX's Mosaic GPU (Hopper, warp-specialised) flash attention."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=g-import-not-at-top
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv,
                                       max_concurrent_steps=2, causal=True)
  def fn(q, k, v):
    return attention_mgpu.attention(q, k, v, config)
  return fn


def bottom_right_mask(t: int, s: int):
  """bool[1, 1, t, s]: query i (at position s - t + i) sees keys <= its own."""
  visible = jnp.arange(s)[None, :] <= (s - t) + jnp.arange(t)[:, None]
  return visible[None, None]


# --------------------------------------------------------------------------
# Sections


def correctness(smoke: bool) -> list[dict]:
  """Both paged implementations vs the float32 reference, NaN-poisoned."""
  from paged_jax.reference import ragged_paged_attention_reference  # pylint: disable=g-import-not-at-top
  from tests.cases import assert_rows_close, make_ragged_case  # pylint: disable=g-import-not-at-top
  q_lens, kv_lens = (300, 1, 0, 77, 1, 128, 1), (300, 900, 5, 1000, 1, 640, 17)
  blocks = 64
  if smoke:
    q_lens, kv_lens, blocks = (9, 1, 0, 17), (9, 30, 2, 40), 4
  cases = [(jnp.bfloat16, {}, ("pallas_gpu", "xla")),
           (jnp.float32, dict(soft_cap=20.0, sliding_window=64),
            ("pallas_gpu",))]
  out = []
  for dtype, kw, impls in cases:
    c = make_ragged_case(
        np.random.default_rng(7), q_lens=q_lens, kv_lens=kv_lens,
        num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        max_blocks_per_seq=blocks, max_num_seqs=len(q_lens) + 2,
        num_tokens=sum(q_lens) + 5, dtype=dtype)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
            c.cu_q_lens, c.num_seqs)
    ref = ragged_paged_attention_reference(*args, **kw)
    for impl in impls:
      rec = dict(case=f"{impl} {jnp.dtype(dtype).name} q_lens={list(q_lens)}"
                 f" {kw or ''}".strip(), ok=False)
      try:
        got = attention.ragged_paged_attention(
            *args, implementation=impl, interpret=smoke, **kw)
        rec["rel_err"] = rel_err(got, ref)
        rec["max_abs_err"] = float(jnp.max(jnp.abs(
            jnp.asarray(got, jnp.float32) - ref)))
        assert_rows_close(got, ref, dtype)
        rec["ok"] = True
      except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"{type(e).__name__}: {e}"[:600]
      out.append(rec)
      log(f"  {'PASS' if rec['ok'] else 'FAIL'}  {rec['case']}  "
          + (f"rel {rec['rel_err']:.1e} max abs {rec['max_abs_err']:.1e}"
             if "max_abs_err" in rec else "") + f" {rec.get('error', '')}")
  return out


def ceilings(s: Shapes, smoke: bool) -> dict:
  """bf16 matmul TFLOP/s (median, random data) and copy bandwidth."""
  n = s.matmul_n
  keys = jax.random.split(jax.random.key(11), 5)
  b = jax.random.normal(keys[0], (n, n), DTYPE)
  sets = [(jax.random.normal(k, (n, n), DTYPE), b) for k in keys[1:]]
  m, _ = measure(jnp.dot, sets, runs=1 if smoke else 5)
  out = dict(matmul_n=n, matmul_s=m["s"],
             matmul_tflops=2.0 * n**3 / m["s"] / 1e12, matmul_runs=m["runs"])
  log(f"  bf16 matmul {n}^3: {out['matmul_tflops']:.0f} TFLOP/s "
      f"({m['s'] * 1e3:.3f} ms, median of {m['runs']} x {m['unroll']})")
  del sets, b
  out["copy"] = gpu_decode.copy_bandwidth(smoke)
  out["copy_gbps"] = out["copy"]["gbps"]
  log(f"  copy {out['copy_gbps']:.0f} GB/s (one fused read + write)")
  return out


@dataclasses.dataclass
class Impl:
  """One row: how to build the function, its inputs and its check.

  `make()` returns the function, or raises with the reason it cannot run;
  `sets` (or `sets()`) are argument tuples differing at least in the queries;
  `check(out)` gives the relative error of the output for `sets[0]`. `flops`
  and `nbytes` default to the section's (rows that do part of the batch give
  their own).
  """
  name: str
  kind: str  # "paged", "contiguous" or "part" (ours on part of the batch)
  make: Callable[[], Callable]
  sets: list | Callable[[], list]
  check: Callable | None
  note: str
  part: str | None = None  # the half of a mixed batch a row computes
  flops: float | None = None
  nbytes: int | None = None


# The dry run times one row of each kind, the paged rows on the XLA path
# (interpret-mode compiles of the kernels are slow; gpu_check.py's dry run
# runs them), and shows the GPU-only rows' refusals.
DRY_RUN_ROWS = ("ours xla", "dot_product_attention xla", "cudnn",
                "pallas mosaic (f16)", "chunks xla", "decodes dense")


def time_rows(impls, *, flops, nbytes, ceil, smoke, runs) -> list[dict]:
  """Times and checks every `Impl`; a failure becomes the row's `error`."""
  rows = []
  if smoke:
    impls = [i for i in impls if i.name in DRY_RUN_ROWS]
  for impl in impls:
    row = dict(name=impl.name, kind=impl.kind, note=impl.note, part=impl.part)
    f = impl.flops or flops
    b = impl.nbytes or nbytes
    try:
      fn = impl.make()
      sets = impl.sets() if callable(impl.sets) else impl.sets
      m, out = measure(fn, sets, runs=1 if smoke else runs)
      row.update(m, flops=f, bytes=b)
      row["tflops"] = f / m["s"] / 1e12
      row["frac_matmul"] = row["tflops"] / ceil["matmul_tflops"]
      row["gbps"] = b / m["s"] / 1e9
      row["frac_floor"] = max(f / (ceil["matmul_tflops"] * 1e12),
                              b / (ceil["copy_gbps"] * 1e9)) / m["s"]
      if impl.check is not None:
        row["rel_err"] = impl.check(out)
        row["correct"] = bool(row["rel_err"] < BF16_REL_TOL)
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {e}"[:600]
    rows.append(row)
    log(format_row(row))
  return rows


def best_contiguous(rows, part=None):
  """The fastest correct contiguous row (of one part of a mixed batch)."""
  ok = [r for r in rows if r["kind"] == "contiguous" and "s" in r
        and r.get("correct", True) and r.get("part") == part]
  return min(ok, key=lambda r: r["s"]) if ok else None


def gpu_only(make):
  """`make`, or a function that says why not when no GPU is attached."""
  if jax.default_backend() == "gpu":
    return make
  def refuse():
    raise RuntimeError("runs on GPU only")
  return refuse


def prefill(s: Shapes, ceil: dict, args) -> dict:
  """8 x 2048-token prompts, no cached prefix: paged vs contiguous."""
  smoke = args.smoke
  n, t = s.prefill_seqs, s.prefill_len
  group = s.num_q_heads // s.num_kv_heads
  batch = make_batch(jax.random.key(21), [t] * n, [t] * n, s, num_q_sets=4)
  flops = causal_flops(batch.q_lens, batch.kv_lens_host, s)
  nbytes = min_bytes(n * t, n * t, s)
  k, v = batch.dense_kv(slice(0, n), t)
  dense_q = [q.reshape(n, t, s.num_q_heads, s.head_dim) for q in batch.qs]
  dense = [(q, k, v) for q in dense_q]
  ref = reference_f32(batch.qs[0][:t], k[0], v[0], q_offset=0)

  def check_paged(out):  # [n * t, heads, dim]: sequence 0 first
    return rel_err(out[:t], ref)

  def check_dense(out):  # [n, t, heads, dim]
    return rel_err(out[0], ref)

  def mosaic_sets():  # float16: attention_mgpu's scratch is float16 only
    return [tuple(x.astype(jnp.float16) for x in d) for d in dense]

  def repeated_kv():  # the Triton mha has no GQA: one K/V head per q head
    kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return [(q, kr, vr) for q in dense_q]

  def mosaic():  # the largest KV tile that fits in shared memory
    for block_kv in (128, 64):
      fn = mosaic_fn(block_kv)
      try:
        jax.jit(fn).lower(*mosaic_sets()[0])
        return fn
      except Exception as e:  # pylint: disable=broad-except
        if block_kv == 64:
          raise
        log(f"    mosaic block_kv={block_kv}: {type(e).__name__}: "
            f"{str(e)[:200]}")

  impls = [
      Impl("ours pallas_gpu", "paged", lambda: paged_fn("pallas_gpu", smoke),
           batch.sets(), check_paged,
           "paged_jax.attention.ragged_paged_attention"),
      Impl("ours xla", "paged", lambda: paged_fn("xla", smoke), batch.sets(),
           check_paged, "paged_jax XLA path"),
      Impl("cudnn", "contiguous",
           gpu_only(lambda: sdpa_fn("cudnn", causal=True)), dense,
           check_dense, "jax.nn.dot_product_attention(is_causal=True)"),
      Impl("dot_product_attention xla", "contiguous",
           lambda: sdpa_fn("xla", causal=True), dense, check_dense,
           "jax.nn.dot_product_attention(is_causal=True): full score matrix"),
      Impl("pallas triton mha", "contiguous",
           lambda: triton_mha_fn(smoke), repeated_kv, check_dense,
           "pallas.ops.gpu.attention.mha, K/V repeated to all q heads"),
      Impl("pallas mosaic (f16)", "contiguous", gpu_only(mosaic), mosaic_sets,
           check_dense, "pallas.ops.gpu.attention_mgpu (Hopper), float16: its"
           " scratch is hard-coded float16, bf16 fails"),
  ]
  log(f"  {n} x {t} tokens, {flops / 1e9:.1f} GFLOP causal, "
      f"{nbytes / 1e6:.0f} MB minimum traffic")
  log(HEADER)
  rows = time_rows(impls, flops=flops, nbytes=nbytes, ceil=ceil, smoke=smoke,
                   runs=args.runs)
  out = dict(seqs=n, q_len=t, kv_len=t, flops=flops, min_bytes=nbytes,
             rows=rows)
  ours = rows[0]
  best = best_contiguous(rows)
  if "s" in ours:
    out["ours_s"] = ours["s"]
    out["ours_tflops"] = ours["tflops"]
    out["ours_frac_matmul"] = ours["frac_matmul"]
    out["ours_correct"] = ours.get("correct", False)
    out["goal_frac_matmul_met"] = bool(
        out["ours_correct"] and ours["frac_matmul"] >= GOAL_FRAC_MATMUL)
  if best is not None:
    out["best_contiguous"] = best["name"]
    out["contiguous_s"] = best["s"]
    if "s" in ours:
      out["paged_over_contiguous"] = ours["s"] / best["s"]
      out["goal_paged_over_contiguous_met"] = bool(
          out["ours_correct"]
          and out["paged_over_contiguous"] <= GOAL_PAGED_OVER_CONTIGUOUS)
  return out


def mixed(s: Shapes, ceil: dict, args) -> dict:
  """Half the tokens prefill chunks, half decodes, in one ragged call."""
  smoke = args.smoke
  nc, tc, sc = s.chunks, s.chunk_len, s.chunk_kv_len
  nd, sd = s.decodes, s.decode_kv_len
  q_lens = [tc] * nc + [1] * nd
  kv_lens = [sc] * nc + [sd] * nd
  batch = make_batch(jax.random.key(31), q_lens, kv_lens, s, num_q_sets=4)
  chunks = batch.sub_batch(slice(0, nc))
  decodes = batch.sub_batch(slice(nc, nc + nd))
  flops = causal_flops(q_lens, kv_lens, s)
  nbytes = min_bytes(sum(q_lens), sum(kv_lens), s)
  chunk_cost = dict(flops=causal_flops([tc] * nc, [sc] * nc, s),
                    nbytes=min_bytes(nc * tc, nc * sc, s))
  decode_cost = dict(flops=causal_flops([1] * nd, [sd] * nd, s),
                     nbytes=min_bytes(nd, nd * sd, s))
  ck, cv = batch.dense_kv(slice(0, nc), sc)
  dk, dv = batch.dense_kv(slice(nc, nc + nd), sd)
  chunk_sets = [(q[:nc * tc].reshape(nc, tc, s.num_q_heads, s.head_dim), ck,
                 cv) for q in batch.qs]
  decode_sets = [(q[nc * tc:], dk, dv) for q in batch.qs]
  mask = bottom_right_mask(tc, sc)

  # Float32 references: chunk 0, and the first (up to) 64 decode sequences.
  nref = min(nd, 64)
  ref_chunk = reference_f32(chunk_sets[0][0][0], ck[0], cv[0],
                            q_offset=sc - tc)
  with jax.default_matmul_precision("highest"):
    ref_dec = gpu_decode.dense_decode(
        *(x[:nref].astype(jnp.float32) for x in decode_sets[0]))

  def check_whole(out):  # [nc * tc + nd, heads, dim]
    return max(rel_err(out[:tc], ref_chunk),
               rel_err(out[nc * tc:nc * tc + nref], ref_dec))

  def check_chunks(out):  # paged [nc * tc, ...] or contiguous [nc, tc, ...]
    return rel_err(out[0] if out.ndim == 4 else out[:tc], ref_chunk)

  def check_decodes(out):  # [nd, heads, dim]
    return rel_err(out[:nref], ref_dec)

  def cudnn_decode():
    f = sdpa_fn("cudnn", causal=False)
    return lambda q, k, v: f(q[:, None], k, v)[:, 0]

  ours = lambda: paged_fn("pallas_gpu", smoke)  # pylint: disable=unnecessary-lambda-assignment
  impls = [
      Impl("ours pallas_gpu", "paged", ours, batch.sets(), check_whole,
           "one ragged call, whole batch"),
      Impl("ours xla", "paged", lambda: paged_fn("xla", smoke), batch.sets(),
           check_whole, "paged_jax XLA path, whole batch"),
      Impl("ours pallas_gpu chunks", "part", ours, chunks.sets(),
           check_chunks, "the prefill chunks alone", "chunks", **chunk_cost),
      Impl("ours pallas_gpu decodes", "part", ours, decodes.sets(),
           check_decodes, "the decodes alone", "decodes", **decode_cost),
      Impl("chunks cudnn", "contiguous",
           gpu_only(lambda: sdpa_fn("cudnn", causal=False, mask=mask)),
           chunk_sets, check_chunks,
           "dot_product_attention, bottom-right causal mask", "chunks",
           **chunk_cost),
      Impl("chunks xla", "contiguous",
           lambda: sdpa_fn("xla", causal=False, mask=mask), chunk_sets,
           check_chunks, "dot_product_attention, bottom-right causal mask",
           "chunks", **chunk_cost),
      Impl("decodes cudnn", "contiguous", gpu_only(cudnn_decode),
           decode_sets, check_decodes,
           "dot_product_attention, one query per sequence", "decodes",
           **decode_cost),
      Impl("decodes dense", "contiguous", lambda: gpu_decode.dense_decode,
           decode_sets, check_decodes, "einsum-softmax (as gpu_decode.py)",
           "decodes", **decode_cost),
  ]
  log(f"  {nc} chunks x {tc} tokens (kv {sc}) + {nd} decodes (kv {sd}): "
      f"{flops / 1e9:.1f} GFLOP, {nbytes / 1e9:.2f} GB minimum traffic")
  log(HEADER)
  rows = time_rows(impls, flops=flops, nbytes=nbytes, ceil=ceil, smoke=smoke,
                   runs=args.runs)
  out = dict(chunks=nc, chunk_len=tc, chunk_kv_len=sc, decodes=nd,
             decode_kv_len=sd, flops=flops, min_bytes=nbytes, rows=rows)
  whole = rows[0]
  parts = [r for r in rows if r["kind"] == "part"]
  if "s" in whole:
    out["ours_s"] = whole["s"]
    out["ours_frac_floor"] = whole["frac_floor"]
    out["ours_tflops"] = whole["tflops"]
    out["ours_gbps"] = whole["gbps"]
    if len(parts) == 2 and all("s" in p for p in parts):
      out["mixed_over_separate"] = whole["s"] / sum(p["s"] for p in parts)
  best = [best_contiguous(rows, "chunks"), best_contiguous(rows, "decodes")]
  if all(b is not None for b in best):
    out["best_contiguous"] = " + ".join(b["name"] for b in best)
    out["contiguous_s"] = sum(b["s"] for b in best)
    if "s" in whole:
      out["paged_over_contiguous"] = whole["s"] / out["contiguous_s"]
  return out


# --------------------------------------------------------------------------
# Output


HEADER = (f"  {'implementation':<26} {'kind':<10} | {'ms':>8} {'TFLOP/s':>8}"
          f" {'%mm':>5} {'GB/s':>6} {'%floor':>6} | {'rel err':>7} {'runs':>7}")


def format_row(r) -> str:
  head = f"  {r['name']:<26} {r['kind']:<10} |"
  if "s" not in r:
    return f"{head} {r.get('error', '?')[:150]}"
  err = f"{r['rel_err']:7.1e}" if "rel_err" in r else f"{'-':>7}"
  flag = "" if r.get("correct", True) else "  WRONG"
  return (f"{head} {r['s'] * 1e3:8.3f} {r['tflops']:8.1f}"
          f" {100 * r['frac_matmul']:5.1f} {r['gbps']:6.0f}"
          f" {100 * r['frac_floor']:6.1f} | {err} {r['runs']:>4}x{r['unroll']}"
          f"{flag}")


def summary_lines(result) -> list[str]:
  lines = []
  c = result.get("ceilings", {})
  if "matmul_tflops" in c:
    lines.append(f"ceilings: bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s, "
                 f"copy {c['copy_gbps']:.0f} GB/s")
  corr = result.get("correctness")
  if isinstance(corr, list):
    lines.append(f"correctness: {sum(x['ok'] for x in corr)}/{len(corr)} pass")
  p = result.get("prefill", {})
  if "ours_tflops" in p:
    lines.append(
        f"prefill {p['seqs']}x{p['q_len']}: ours {p['ours_tflops']:.0f} TFLOP/s"
        f" = {100 * p['ours_frac_matmul']:.0f}% of matmul (goal >= "
        f"{100 * GOAL_FRAC_MATMUL:.0f}%)")
  if "paged_over_contiguous" in p:
    lines.append(f"prefill paged / {p['best_contiguous']}: "
                 f"{p['paged_over_contiguous']:.2f} (goal <= "
                 f"{GOAL_PAGED_OVER_CONTIGUOUS})")
  m = result.get("mixed", {})
  if "ours_s" in m:
    lines.append(f"mixed: ours {m['ours_s'] * 1e3:.3f} ms = "
                 f"{100 * m['ours_frac_floor']:.0f}% of roofline floor, "
                 f"{m['ours_gbps']:.0f} GB/s"
                 + (f", mixed/separate {m['mixed_over_separate']:.2f}"
                    if "mixed_over_separate" in m else "")
                 + (f", paged/contiguous {m['paged_over_contiguous']:.2f}"
                    if "paged_over_contiguous" in m else ""))
  return lines


def write_json(result, smoke):
  name = "gpu_prefill_dry_run.json" if smoke else "gpu_prefill.json"
  paths = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        name)]
  if os.environ.get("OUT"):
    paths.append(os.path.join(os.environ["OUT"], name))
  for path in paths:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(result, f, indent=1, default=str)
  return paths


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dry-run", "--smoke", action="store_true", dest="smoke",
                 help="tiny shapes on CPU in Pallas interpret mode")
  p.add_argument("--runs", type=int, default=5,
                 help="timed repeats per row (median)")
  p.add_argument("--correctness", action="store_true",
                 help="also run the ragged correctness section (gpu_check.py"
                 " covers it)")
  p.add_argument("--budget-s", type=float, default=1e9,
                 help="skip sections that start after this many seconds")
  p.add_argument("--skip", nargs="*", default=(),
                 choices=("prefill", "mixed"), help="sections to leave out")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if not args.smoke and jax.default_backend() != "gpu":
    log(f"no GPU (default backend: {jax.default_backend()}); use --smoke")
    return 2
  shapes = SMOKE if args.smoke else Shapes()
  t_start = time.time()
  result = dict(
      benchmark="gpu_prefill", smoke=args.smoke,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      device=gpu_decode.device_info(), shapes=dataclasses.asdict(shapes),
      dtype=jnp.dtype(DTYPE).name,
      goals=dict(frac_matmul=GOAL_FRAC_MATMUL,
                 paged_over_contiguous=GOAL_PAGED_OVER_CONTIGUOUS))
  log(f"device: {result['device']}")

  def section(key, title, fn, *a):
    log(f"\n== {title}")
    if time.time() - t_start > args.budget_s - 10:
      log(f"  skipped: out of time ({args.budget_s:.0f} s budget)")
      result[key] = dict(error="skipped: out of time")
      return
    t0 = time.time()
    try:
      result[key] = fn(*a)
    except Exception:  # pylint: disable=broad-except
      tb = traceback.format_exc()
      log(tb)
      result[key] = dict(error=tb[-2000:])
    result.setdefault("section_s", {})[key] = time.time() - t0
    result["seconds"] = time.time() - t_start
    write_json(result, args.smoke)

  if args.correctness:
    section("correctness", "correctness (vs float32 reference, NaN-poisoned)",
            correctness, args.smoke)
  section("ceilings", "ceilings", ceilings, shapes, args.smoke)
  ceil = result["ceilings"]
  if "matmul_tflops" not in ceil:
    ceil = dict(matmul_tflops=float("nan"), copy_gbps=float("nan"))
  if "prefill" not in args.skip:
    section("prefill", f"prefill ({shapes.prefill_seqs} x "
            f"{shapes.prefill_len} tokens)", prefill, shapes, ceil, args)
  if "mixed" not in args.skip:
    section("mixed", "mixed batch (half prefill-chunk tokens, half decode)",
            mixed, shapes, ceil, args)
  log(f"\n== summary ({time.time() - t_start:.0f} s)")
  for line in summary_lines(result):
    log("  " + line)
  for path in write_json(result, args.smoke):
    log(f"wrote {path}")
  corr = result.get("correctness", [])
  return 0 if isinstance(corr, list) and all(c["ok"] for c in corr) else 1


if __name__ == "__main__":
  sys.exit(main())
