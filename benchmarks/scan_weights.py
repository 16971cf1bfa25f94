"""Stacked layers under `lax.scan` against separate layers unrolled
(`LlamaConfig.scan_layers`): the per-layer weight slices, compile time, step
time.

The model is SmolLM2-135M's shape (`benchmarks.compile_layers.SMOLLM2`,
float32, seeded random weights). The measured call is the paged forward plus
logits of a decode step of 16 sequences of 200 tokens, jitted with the cache
donated (as `benchmarks.scan_runtime`). Per form: the compile time (wall and
process CPU), the compiled program's lines, and its ops that produce a
weight-sized array out of the parameters (a `dynamic-slice`, `slice`, `copy`
or fusion whose result has the shape of one layer's kernel: per-step copies
of the weights), with their bytes per step; then calls interleaved (stacked,
separate, stacked, ...) after 2 warm-up calls each, medians of the wall and
process CPU time per call. The first calls' logits are compared.

  PYTHONPATH=. python -m benchmarks.scan_weights [--layers 30] [--calls 15]
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time

from benchmarks import common
from benchmarks.compile_layers import SMOLLM2

_OP = re.compile(r"= f32\[([0-9,]*)\]\{[^}]*\} (dynamic-slice|slice|copy|fusion)\(")


def weight_copies(hlo: str, kernel_shapes, loop_trips: int) -> dict:
  """The ops of `hlo` whose result is a kernel-sized f32 array (a leading 1
  allowed): count in the program, and MB per step (ops inside the scan's
  while body counted `loop_trips` times; fusions' inner ops not counted
  twice: only ops of computations that are not fusion bodies; an op outside
  ENTRY is taken to be in the loop)."""
  shapes = {tuple(s) for s in kernel_shapes} | {(1,) + tuple(s) for s in kernel_shapes}
  count, per_step, comp, fused = 0, 0.0, "", False
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      comp = line.split()[0] if not line.startswith("ENTRY") else "ENTRY"
      fused = "fused" in comp or "wrapped" in comp
      continue
    m = _OP.search(line)
    if not m or fused:
      continue
    shape = tuple(int(d) for d in m.group(1).split(",") if d)
    if shape in shapes:
      n = 1
      for d in shape:
        n *= d
      count += 1
      per_step += 4 * n * (1 if comp == "ENTRY" else loop_trips)
  return {"ops": count, "mb_per_step": per_step / 1e6}


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=30)
  p.add_argument("--blocks", type=int, default=256)
  p.add_argument("--calls", type=int, default=15)
  args = p.parse_args(argv)
  if args.quick:
    args.layers, args.calls = 2, 3
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from paged_jax import block_manager as bm  # pylint: disable=import-outside-toplevel
  from paged_jax import step_metadata  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel

  config = model_lib.LlamaConfig(num_layers=args.layers, **SMOLLM2)
  stacked = model_lib.init_model(config, seed=0)
  separate = checkpoint.from_tensors(
      dataclasses.replace(config, scan_layers=False), checkpoint.to_tensors(stacked))
  h, m = config.hidden_size, config.intermediate_size
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  kernels = [(h, q), (h, kv), (q, h), (h, m), (m, h)]
  n, bs = 16, 16
  state = bm.init(num_blocks=args.blocks, block_size=bs, max_seqs=n,
                  max_blocks_per_seq=16)
  seq_ids = jnp.arange(n, dtype=jnp.int32)
  state, _ = bm.reserve(state, seq_ids, jnp.full(n, 199, jnp.int32))
  state, _ = bm.reserve(state, seq_ids, jnp.ones(n, jnp.int32))
  meta = step_metadata.step_metadata(state, seq_ids, jnp.ones(n, jnp.int32),
                                     num_tokens=n, decode_only=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, n),
                       jnp.int32)
  forms, info, first = {}, {}, {}
  for name, model in (("stacked_scan", stacked), ("separate_unrolled", separate)):
    graphdef, params = nnx.split(model)

    def fwd(params, cache, tokens, meta, graphdef=graphdef):
      mdl = nnx.merge(graphdef, params)
      hidden, cache = mdl.paged_forward(tokens, meta, cache)
      return mdl.logits(hidden), cache

    cache = model.make_cache(args.blocks, bs)
    t0, c0 = time.perf_counter(), time.process_time()
    compiled = jax.jit(fwd, donate_argnums=1).lower(params, cache, tokens, meta).compile()
    info[name] = {"compile_wall_s": time.perf_counter() - t0,
                  "compile_cpu_s": time.process_time() - c0}
    hlo = compiled.as_text()
    info[name]["hlo_lines"] = len(hlo.splitlines())
    info[name]["weight_copies"] = weight_copies(hlo, kernels, args.layers)
    logits, cache = compiled(params, cache, tokens, meta)
    first[name] = np.asarray(logits)
    forms[name] = [compiled, params, cache]
    print(f"  {name}: {info[name]}", flush=True)
  a, b = first.values()
  diff = float(np.abs(a - b).max())
  same_argmax = bool((a.argmax(-1) == b.argmax(-1)).all())
  times = {name: {"wall_ms": [], "cpu_ms": []} for name in forms}
  for i in range(args.calls + 2):
    for name, f in forms.items():
      compiled, params, cache = f
      t0, c0 = time.perf_counter(), time.process_time()
      logits, f[2] = compiled(params, cache, tokens, meta)
      logits.block_until_ready()
      if i >= 2:
        times[name]["wall_ms"].append(1e3 * (time.perf_counter() - t0))
        times[name]["cpu_ms"].append(1e3 * (time.process_time() - c0))
  median = {name: {k: statistics.median(v) for k, v in t.items()}
            for name, t in times.items()}
  print(f"logits max |diff| {diff:.3g}, same argmax {same_argmax}; " + ", ".join(
      f"{k} {v['wall_ms']:.0f} ms (CPU {v['cpu_ms']:.0f} ms)" for k, v in median.items()))
  path = common.write_json(args.out, "scan_weights", {
      "model": "SmolLM2-135M shape, float32, random weights",
      "layers": args.layers, "blocks": args.blocks, "block_size": bs,
      "batch": n, "calls": args.calls, "logits_max_abs_diff": diff,
      "same_argmax": same_argmax, "forms": info, "median": median, "times": times},
      quick=args.quick)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
