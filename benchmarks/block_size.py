"""Benchmark 5, block size: decode attention time at block sizes 8 to 128.

The same sequences (same lengths, same K/V values, blocks scattered at random
over the pool) are laid out with block_size 8, 16, 32, 64 and 128, and
`paged_jax.attention.paged_attention` is timed at each; times are reported
relative to the fastest. Goal: within 10% of the best for block sizes 8-64.

On CPU (the default) this times the XLA path in float32 on a small shape. The
GPU run is the same script with `--gpu`: bfloat16, a Llama-3.1-8B-sized batch,
and every implementation that serves the call (xla, pallas_gpu):

  PYTHONPATH=. python -m benchmarks.block_size [--quick]
  PYTHONPATH=. python -m benchmarks.block_size --gpu      # on a GPU machine
  PYTHONPATH=. python -m benchmarks.block_size --gpu --dry-run  # CPU check

The sequences are drawn on the device and scattered into each layout's pages
there (the GPU shape's K/V are 0.8 GB: nothing that size is built on the
host). `--dry-run` runs the GPU path on the quick shape at two block sizes on
CPU (it checks the script, not speed): xla times, pallas_gpu is refused there
and says so.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from paged_jax import attention

BLOCK_SIZES = (8, 16, 32, 64, 128)
GOAL = 1.10  # time / best for block sizes 8..64
SHAPES = {
    # batch, query heads, KV heads, head_dim, mean kv_len (lengths vary +-50%).
    "cpu": dict(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128,
                mean_kv_len=1024, dtype="float32"),
    "quick": dict(batch=4, num_q_heads=8, num_kv_heads=2, head_dim=64,
                  mean_kv_len=256, dtype="float32"),
    "gpu": dict(batch=64, num_q_heads=32, num_kv_heads=8, head_dim=128,
                mean_kv_len=2048, dtype="bfloat16"),
}


@functools.lru_cache(maxsize=1)
def _sequences(shape_items: tuple, seed: int):
  """The random sequences, drawn once for all block sizes, on the device.

  Returns the lengths (host), q, k, v (device: `[num_kv_heads, batch,
  max_len, head_dim]` K/V in the shape's dtype) and the host generator's
  state after drawing the lengths, from which every block size draws the
  same page placement as before.
  """
  shape = dict(shape_items)
  rng = np.random.default_rng(seed)
  b, hq, hkv, d = (shape[k] for k in ("batch", "num_q_heads", "num_kv_heads", "head_dim"))
  mean = shape["mean_kv_len"]
  kv_lens = rng.integers(mean // 2, mean + mean // 2 + 1, size=b)
  max_len = int(-(-kv_lens.max() // 128) * 128)  # same token capacity for all sizes
  dtype = jnp.dtype(shape["dtype"])
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, hq, d), dtype)
  k = jax.random.normal(kk, (hkv, b, max_len, d), dtype)
  v = jax.random.normal(kv, (hkv, b, max_len, d), dtype)
  return kv_lens, q, k, v, rng.bit_generator.state


@functools.partial(jax.jit, static_argnums=(2,))
def _scatter(x, perm, block_size):
  """[kvh, b, max_len, d] tokens into pages: logical block i (row-major over
  sequences) goes to physical block perm[i]."""
  hkv, b, max_len, d = x.shape
  blocks = x.reshape(hkv, b * (max_len // block_size), block_size, d)
  return jnp.zeros_like(blocks).at[:, perm].set(blocks)


def make_inputs(shape: dict, block_size: int, seed: int = 0):
  """Paged K/V and tables for the same sequences at `block_size`."""
  kv_lens, q, k, v, state = _sequences(tuple(sorted(shape.items())), seed)
  rng = np.random.default_rng()
  rng.bit_generator.state = state
  _, b, max_len, _ = k.shape
  width = max_len // block_size
  perm = rng.permutation(b * width)  # physical block of (seq, logical block)
  tables = perm.reshape(b, width).astype(np.int32)
  used = -(-kv_lens // block_size)
  tables[np.arange(width)[None, :] >= used[:, None]] = -1  # NULL_BLOCK
  perm = jnp.asarray(perm, jnp.int32)
  return (q, _scatter(k, perm, block_size), _scatter(v, perm, block_size),
          jnp.asarray(tables), jnp.asarray(kv_lens.astype(np.int32)))


def time_block_sizes(shape: dict, implementation: str, *, repeats: int,
                     inputs: dict | None = None, block_sizes=BLOCK_SIZES,
                     interpret: bool = False) -> dict:
  """Median time per block size, timed in interleaved rounds.

  Each round calls every block size once, so load that comes and goes on a
  shared machine lands on all of them alike. `inputs` ({block_size:
  make_inputs(shape, block_size)}) may be shared between implementations.
  """
  fn = jax.jit(functools.partial(attention.paged_attention,
                                 implementation=implementation,
                                 interpret=interpret))
  if inputs is None:
    inputs = {bs: make_inputs(shape, bs) for bs in block_sizes}
  ref = None
  for bs in block_sizes:
    try:
      result = np.asarray(jax.block_until_ready(fn(*inputs[bs])), np.float32)
    except ValueError as e:  # this implementation cannot serve the call
      return {"error": str(e)}
    # Every layout holds the same sequences: the outputs must agree.
    ref = result if ref is None else ref
    np.testing.assert_allclose(result, ref, atol=2e-2, rtol=2e-2)
  times = {bs: [] for bs in block_sizes}
  for _ in range(repeats + 1):  # the first round warms up
    for bs in block_sizes:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*inputs[bs]))
      times[bs].append(time.perf_counter() - t0)
  out = {}
  for bs, t in times.items():
    q = statistics.quantiles(t[1:], n=4) if len(t) > 2 else t[1:] * 3
    out[str(bs)] = {"median_s": statistics.median(t[1:]), "min_s": min(t[1:]),
                    "p25_s": q[0], "p75_s": q[2], "repeats": repeats}
  best = min(t["median_s"] for t in out.values())
  for t in out.values():
    t["relative"] = t["median_s"] / best
  worst_small = max(out[str(bs)]["relative"] for bs in block_sizes if bs <= 64)
  return {"times": out, "worst_relative_8_to_64": worst_small,
          "goal_met": bool(worst_small <= GOAL)}


def plot(data: dict, path) -> None:
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for impl, res in data["implementations"].items():
    if "times" not in res:
      continue
    bss = [int(b) for b in res["times"]]
    ax.plot(bss, [res["times"][str(b)]["relative"] for b in bss], "o-",
            label=f"{impl} ({1e3 * min(t['median_s'] for t in res['times'].values()):.2f} ms best)")
  ax.axhline(GOAL, color="red", lw=0.8, label="goal: within 10% (8-64)")
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(BLOCK_SIZES), [str(b) for b in BLOCK_SIZES])
  ax.set_xlabel("block_size (tokens)")
  ax.set_ylabel("decode attention time / best")
  s = data["shape"]
  ax.set_title(f"{data['platform']}: batch {s['batch']}, {s['num_q_heads']}/"
               f"{s['num_kv_heads']} heads, d {s['head_dim']}, kv ~{s['mean_kv_len']}, "
               f"{s['dtype']}", fontsize=8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(quick: bool = False, out=common.RESULTS_DIR, gpu: bool = False,
        dry_run: bool = False) -> dict:
  shape = SHAPES["quick" if quick or dry_run else "gpu" if gpu else "cpu"]
  impls = ("xla", "pallas_gpu") if gpu or dry_run else ("xla",)
  block_sizes = (8, 16) if dry_run else BLOCK_SIZES
  inputs = {bs: make_inputs(shape, bs) for bs in block_sizes}
  results = {}
  for impl in impls:
    results[impl] = time_block_sizes(shape, impl, repeats=1 if dry_run else
                                     3 if quick else 30, inputs=inputs,
                                     block_sizes=block_sizes)
    res = results[impl]
    if "error" in res:
      print(f"  {impl}: not run ({res['error']})")
      continue
    rel = ", ".join(f"{b}: {t['relative']:.3f}" for b, t in res["times"].items())
    print(f"  {impl}: time / best at block sizes {rel}; worst of 8-64 "
          f"{res['worst_relative_8_to_64']:.3f} (goal <= {GOAL})", flush=True)
  name = "block_size_dry_run" if dry_run else "block_size_gpu" if gpu else "block_size"
  data = {"platform": jax.default_backend(), "shape": shape, "goal": GOAL,
          "implementations": results}
  common.write_json(out, name, data, quick=quick)
  plot(data, common.figure_path(out, name, quick=quick))
  return data


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--gpu", action="store_true",
                 help="GPU shape and implementations (run on a GPU machine)")
  p.add_argument("--dry-run", action="store_true",
                 help="the GPU path on tiny shapes on CPU (checks the script)")
  args = p.parse_args(argv)
  run(args.quick, args.out, gpu=args.gpu, dry_run=args.dry_run)


if __name__ == "__main__":
  main()
