"""On-GPU correctness of every GPU attention kernel, before anything is timed.

    PYTHONPATH=. python benchmarks/gpu_check.py            # on a GPU
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run  # CPU, interpret mode

Every GPU backend in the attention API's registries (`paged_jax.attention.
DECODE_BACKENDS` and `RAGGED_BACKENDS`: `pallas_gpu`, and `pallas_mosaic_gpu`
where that backend is registered) runs a few NaN-poisoned cases from
`tests.cases` (ragged lengths, -1 table entries, GQA, soft cap, sliding window,
split-K, int8 / fp8 pages with scales) and is compared row by row with the
float32 reference (`tests.cases.assert_rows_close`). A case that a backend
refuses (`unsupported_reason`) is printed as SKIP with the reason; any other
failure is a FAIL. Exit status 1 if anything failed: `gpu_all.sh` then stops,
since timings of a wrong kernel mean nothing. JSON: gpu_check.json (under
`$OUT` too when set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention
from paged_jax import reference
from tests import cases

GPU_BACKENDS = ("pallas_gpu", "pallas_mosaic_gpu")  # names looked up, if registered
MOSAIC = "pallas_mosaic_gpu"

# (name, make_decode_case kwargs, call kwargs, quantised page dtype or None)
DECODE_CASES = [
    ("bf16 b8 32/8 d128 bs16 x64", dict(
        dtype=jnp.bfloat16, batch=8, num_q_heads=32, num_kv_heads=8,
        head_dim=128, block_size=16, max_blocks_per_seq=64), {}, None),
    ("f32 b6 8/8 d64 bs8 x40", dict(
        dtype=jnp.float32, batch=6, num_q_heads=8, num_kv_heads=8,
        head_dim=64, block_size=8, max_blocks_per_seq=40), {}, None),
    ("bf16 b6 16/2 d256 bs32 x16 cap+window", dict(
        dtype=jnp.bfloat16, batch=6, num_q_heads=16, num_kv_heads=2,
        head_dim=256, block_size=32, max_blocks_per_seq=16),
     dict(soft_cap=30.0, sliding_window=100), None),
    ("bf16 b2 32/8 d128 bs16 x1024 (split-K)", dict(
        dtype=jnp.bfloat16, batch=2, num_q_heads=32, num_kv_heads=8,
        head_dim=128, block_size=16, max_blocks_per_seq=1024), {}, None),
    ("f16 b8 32/8 d128 bs16 x64", dict(
        dtype=jnp.float16, batch=8, num_q_heads=32, num_kv_heads=8,
        head_dim=128, block_size=16, max_blocks_per_seq=64), {}, None),
    ("int8 pages bf16 b8 32/8 d128 bs16 x64", dict(
        dtype=jnp.bfloat16, batch=8, num_q_heads=32, num_kv_heads=8,
        head_dim=128, block_size=16, max_blocks_per_seq=64), {}, jnp.int8),
    ("fp8 pages bf16 b8 32/8 d128 bs16 x64", dict(
        dtype=jnp.bfloat16, batch=8, num_q_heads=32, num_kv_heads=8,
        head_dim=128, block_size=16, max_blocks_per_seq=64), {},
     jnp.float8_e4m3fn),
]
RAGGED_CASES = [
    ("ragged bf16", jnp.bfloat16, {}),
    ("ragged f32 cap+window", jnp.float32, dict(soft_cap=20.0,
                                                 sliding_window=64)),
]


def log(*a):
  print(*a, flush=True)


def registered(backends) -> dict:
  """{name: Backend} of the GPU backends present in a registry."""
  return {b.name: b for b in backends if b.name in GPU_BACKENDS}


def _shrink(spec: dict) -> dict:
  """Dry-run sizes: small batch, at most 4 blocks per sequence."""
  return dict(spec, batch=min(spec["batch"], 3),
              max_blocks_per_seq=min(spec["max_blocks_per_seq"], 4))


def _run(backend, fn, args, kw, expected, dtype, interpret) -> dict:
  why = backend.unsupported_reason(args[0], args[1], args[3],
                                   soft_cap=kw.get("soft_cap"),
                                   sliding_window=kw.get("sliding_window"),
                                   interpret=interpret)
  if why is not None:
    return dict(status="SKIP", reason=why)
  try:
    out = jax.block_until_ready(fn(*args, **kw))
    err = float(jnp.max(jnp.abs(jnp.asarray(out, jnp.float32) - expected)))
    cases.assert_rows_close(out, expected, dtype)
    return dict(status="PASS", max_abs_err=err)
  except Exception as e:  # pylint: disable=broad-except
    return dict(status="FAIL", error=f"{type(e).__name__}: {str(e)[:400]}")


def check_decode(interpret: bool) -> list[dict]:
  out = []
  backends = registered(attention.DECODE_BACKENDS)
  for name in GPU_BACKENDS:
    if name not in backends:
      log(f"  SKIP  decode {name}: not registered in paged_jax.attention")
  picked = [DECODE_CASES[0], DECODE_CASES[5]] if interpret else DECODE_CASES
  for title, spec, kw, qdtype in picked:
    spec = _shrink(spec) if interpret else spec
    c = cases.make_decode_case(np.random.default_rng(len(out)), **spec)
    if qdtype is not None:
      c = cases.quantize_case(c, qdtype)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
    # Quantised pages: against the reference on the dequantised pages.
    expected = reference.paged_attention_reference(*args, **c.scales(), **kw)
    for name, backend in backends.items():
      def fn(*a, name=name, **k):
        return attention.paged_attention(*a, implementation=name,
                                         interpret=interpret, **c.scales(),
                                         **k)
      rec = dict(kernel=f"decode {name}", case=title,
                 **_run(backend, fn, args, kw, expected, spec["dtype"],
                        interpret))
      out.append(rec)
      log(f"  {rec['status']}  {rec['kernel']}  {title}  "
          f"{rec.get('max_abs_err', rec.get('reason', rec.get('error', '')))}")
  return out


def check_ragged(interpret: bool) -> list[dict]:
  out = []
  backends = registered(attention.RAGGED_BACKENDS)
  q_lens, kv_lens, blocks = (300, 1, 0, 77, 1, 128, 1), (
      300, 900, 5, 1000, 1, 640, 17), 64
  if interpret:
    q_lens, kv_lens, blocks = (9, 1, 0), (9, 30, 2), 4
  for title, dtype, kw in RAGGED_CASES[:1] if interpret else RAGGED_CASES:
    c = cases.make_ragged_case(
        np.random.default_rng(7), q_lens=q_lens, kv_lens=kv_lens,
        num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        max_blocks_per_seq=blocks, max_num_seqs=len(q_lens) + 2,
        num_tokens=sum(q_lens) + 5, dtype=dtype)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
            c.cu_q_lens, c.num_seqs)
    expected = reference.ragged_paged_attention_reference(*args, **kw)
    for name, backend in backends.items():
      def fn(*a, name=name, **k):
        return attention.ragged_paged_attention(*a, implementation=name,
                                                interpret=interpret, **k)
      rec = dict(kernel=f"ragged {name}", case=f"{title} q_lens={list(q_lens)}",
                 **_run(backend, fn, args, kw, expected, dtype, interpret))
      out.append(rec)
      log(f"  {rec['status']}  {rec['kernel']}  {rec['case']}  "
          f"{rec.get('max_abs_err', rec.get('reason', rec.get('error', '')))}")
  return out


def write_json(result: dict, dry_run: bool) -> list[str]:
  name = "gpu_check_dry_run.json" if dry_run else "gpu_check.json"
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
                 help="tiny cases on CPU in interpret mode (checks the script)")
  args = p.parse_args(argv)
  if not args.dry_run and jax.default_backend() != "gpu":
    log(f"no GPU (default backend: {jax.default_backend()}); use --dry-run")
    return 2
  t0 = time.time()
  result = dict(benchmark="gpu_check", dry_run=args.dry_run,
                device=str(jax.devices()[0]),
                registered=dict(
                    decode=sorted(registered(attention.DECODE_BACKENDS)),
                    ragged=sorted(registered(attention.RAGGED_BACKENDS))))
  log(f"== correctness of every GPU kernel (vs float32 reference, "
      f"NaN-poisoned); registered: {result['registered']}")
  result["checks"] = check_decode(args.dry_run) + check_ragged(args.dry_run)
  result["seconds"] = time.time() - t0
  failed = [c for c in result["checks"] if c["status"] == "FAIL"]
  ran = [c for c in result["checks"] if c["status"] == "PASS"]
  result["ok"] = not failed and bool(ran)
  write_json(result, args.dry_run)
  log(f"== correctness: {len(ran)} pass, {len(failed)} fail, "
      f"{sum(c['status'] == 'SKIP' for c in result['checks'])} skipped "
      f"({result['seconds']:.0f} s)")
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
