"""Compile time of the serving step against the model's depth: layers in a
Python loop (the baseline) vs stacked under `lax.scan` (this tree).

The model is SmolLM2-135M's shape (hidden 576, 9 query / 3 KV heads of 64,
intermediate 1536, vocab 49,152, tied embeddings, float32, seeded random
weights) at 2, 8 and 30 layers (30 is the real model). For each depth the
engine (block 16, batch 16, 256-token steps) lowers and compiles two of its
step shapes, the largest decode step (16 tokens) and the largest mixed step
(256 tokens), timing trace + lowering and XLA's compile separately; a second
measure that noise moves less is the process CPU time of the compile, and one
it does not move at all the size of the lowered and compiled programs (HLO
lines). The decode step's run time (the paged forward alone,
jitted with the cache donated, median of 20 calls) checks that the scan does
not cost at run time.

Each (code, depth, repeat) runs in a fresh process (no compile cache of any
kind), interleaved: baseline and scan alternate for each depth, repeat after
repeat; medians are reported. The baseline is another source tree of the
package, e.g. the commit before the scan:

  git archive 05239be paged_jax pallas_kernels | tar -x -C /tmp/before
  PYTHONPATH=. python -m benchmarks.compile_layers --baseline /tmp/before
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks import common

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True,
               max_position_embeddings=2048, eos_token_ids=(2,))
ENGINE = dict(num_blocks=256, block_size=16, max_batch=16,
              max_tokens_per_step=256, max_model_len=2048)


def child(num_layers: int, warmup: bool = False) -> dict:
  """Measures one depth in this process (the package on `sys.path`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from paged_jax import block_manager as bm  # pylint: disable=import-outside-toplevel
  from paged_jax import step_metadata  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel

  t0 = time.perf_counter()
  model = model_lib.init_model(
      model_lib.LlamaConfig(num_layers=num_layers, **SMOLLM2), seed=0)
  out = {"init_s": time.perf_counter() - t0}
  engine = Engine(model, EngineConfig(**ENGINE))
  if warmup:  # every step shape, compiled concurrently as the engine does
    t0, c0 = time.perf_counter(), time.process_time()
    engine.warmup()
    out["warmup"] = {"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                     "shapes": len(engine.config.buckets)}
    return out
  for kind, decode_only in (("decode", True), ("mixed", False)):
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = engine.lower_step(decode_only)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    out[kind] = {"lower_s": t1 - t0, "compile_s": t2 - t1,
                 "lower_cpu_s": c1 - c0, "compile_cpu_s": c2 - c1,
                 "hlo_lines": lowered.as_text().count("\n"),
                 "compiled_lines": compiled.as_text().count("\n")}

  # Run time of the paged forward of a decode step (16 sequences of 200 tokens).
  n, bs = ENGINE["max_batch"], ENGINE["block_size"]
  state = bm.init(num_blocks=ENGINE["num_blocks"], block_size=bs, max_seqs=n,
                  max_blocks_per_seq=16)
  seq_ids = jnp.arange(n, dtype=jnp.int32)
  state, _ = bm.reserve(state, seq_ids, jnp.full(n, 199, jnp.int32))
  state, _ = bm.reserve(state, seq_ids, jnp.ones(n, jnp.int32))
  meta = step_metadata.step_metadata(state, seq_ids, jnp.ones(n, jnp.int32),
                                     num_tokens=n, decode_only=True)
  graphdef, params = nnx.split(model)

  @jax.jit
  def fwd(params, cache, tokens, meta):
    m = nnx.merge(graphdef, params)
    hidden, cache = m.paged_forward(tokens, meta, cache)
    return m.logits(hidden), cache

  fwd = jax.jit(fwd.__wrapped__, donate_argnums=1)
  cache = model.make_cache(ENGINE["num_blocks"], bs)
  tokens = jnp.arange(n, dtype=jnp.int32)
  times = []
  for i in range(23):
    t0 = time.perf_counter()
    logits, cache = fwd(params, cache, tokens, meta)
    logits.block_until_ready()
    if i >= 3:
      times.append(time.perf_counter() - t0)
  out["decode_forward_ms"] = 1e3 * statistics.median(times)
  return out


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--baseline", type=pathlib.Path, required=False,
                 help="source tree of the baseline package (layers in a loop)")
  p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 30])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--warmup", action="store_true",
                 help="time the engine's whole warm-up (every step shape) instead")
  p.add_argument("--child", type=int, help=argparse_hidden())
  args = p.parse_args(argv)
  if args.child is not None:
    import paged_jax  # pylint: disable=import-outside-toplevel
    print("RESULT " + json.dumps({"package": paged_jax.__file__,
                                  **child(args.child, args.warmup)}))
    return 0
  here = pathlib.Path(__file__).resolve().parents[1]
  codes = {"scan": here}
  if args.baseline:
    codes = {"loop": args.baseline.resolve(), **codes}
  if args.quick:
    args.layers, args.repeats = [2], 1
  runs = {c: {n: [] for n in args.layers} for c in codes}
  for r in range(args.repeats):
    for n in args.layers:
      for code, src in codes.items():
        env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{here}",
               "JAX_ENABLE_COMPILATION_CACHE": "false"}
        # Run as a script from elsewhere: `-m` would put the current
        # directory ahead of PYTHONPATH, and with it this tree's package.
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(n)]
            + ["--warmup"] * args.warmup, cwd=here.parent,
            env=env, capture_output=True, text=True, check=False)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not line:
          sys.exit(f"{code} at {n} layers failed:\n{proc.stderr[-3000:]}")
        res = json.loads(line[0][7:])
        assert res["package"].startswith(str(src)), (res["package"], src)
        if args.warmup:
          runs[code][n].append(res)
          w = res["warmup"]
          print(f"repeat {r} {code:4s} {n:2d} layers: warm-up of {w['shapes']} "
                f"shapes {w['s']:.1f} s (CPU {w['cpu_s']:.1f} s)", flush=True)
          continue
        runs[code][n].append(res)
        d, m = res["decode"], res["mixed"]
        print(f"repeat {r} {code:4s} {n:2d} layers: decode lower "
              f"{d['lower_s']:.2f} s + compile {d['compile_s']:.2f} s (CPU "
              f"{d['compile_cpu_s']:.2f} s), mixed lower {m['lower_s']:.2f} s + "
              f"compile {m['compile_s']:.2f} s (CPU {m['compile_cpu_s']:.2f} s), "
              f"decode forward {res['decode_forward_ms']:.1f} ms", flush=True)

  if args.warmup:
    summary = {code: {n: {"warmup_s": statistics.median(x["warmup"]["s"] for x in rs),
                          "warmup_cpu_s": statistics.median(
                              x["warmup"]["cpu_s"] for x in rs),
                          "shapes": rs[0]["warmup"]["shapes"]}
                      for n, rs in per.items()} for code, per in runs.items()}
    print(json.dumps(summary, indent=1))
    path = common.write_json(args.out, "compile_layers_warmup", {
        "model": "SmolLM2-135M shape, float32, random weights", "engine": ENGINE,
        "layers": args.layers, "repeats": args.repeats,
        "conditions": "engine.warmup() (all step shapes, compiled on a thread "
                      "pool), fresh process each, loop and scan interleaved; "
                      "2 CPU cores shared with other jobs",
        "summary": summary, "runs": runs}, quick=args.quick)
    print(f"wrote {path}")
    return 0

  def med(rs, *keys):
    vals = []
    for x in rs:
      for k in keys:
        x = x[k]
      vals.append(x)
    return statistics.median(vals)

  summary = {
      code: {n: {f"{kind}_{m}": med(rs, kind, m) for kind in ("decode", "mixed")
                 for m in ("lower_s", "compile_s", "lower_cpu_s",
                           "compile_cpu_s", "hlo_lines", "compiled_lines")}
             | {"decode_forward_ms": med(rs, "decode_forward_ms"),
                "init_s": med(rs, "init_s")}
             for n, rs in per.items()}
      for code, per in runs.items()}
  for code, per in summary.items():
    for n, s in per.items():
      print(f"{code:4s} {n:2d} layers (median of {args.repeats}): decode "
            f"{s['decode_lower_s'] + s['decode_compile_s']:.2f} s (compile CPU "
            f"{s['decode_compile_cpu_s']:.2f} s, {s['decode_compiled_lines']} "
            f"compiled HLO lines), mixed "
            f"{s['mixed_lower_s'] + s['mixed_compile_s']:.2f} s (compile CPU "
            f"{s['mixed_compile_cpu_s']:.2f} s), decode forward "
            f"{s['decode_forward_ms']:.1f} ms")
  path = common.write_json(args.out, "compile_layers", {
      "model": "SmolLM2-135M shape, float32, random weights", "engine": ENGINE,
      "layers": args.layers, "repeats": args.repeats,
      "conditions": "each measure in a fresh process, loop and scan interleaved "
                    "per depth; 2 CPU cores shared with other jobs",
      "summary": summary, "runs": runs}, quick=args.quick)
  print(f"wrote {path}")
  return 0


def argparse_hidden():
  import argparse  # pylint: disable=import-outside-toplevel
  return argparse.SUPPRESS


if __name__ == "__main__":
  sys.exit(main())
