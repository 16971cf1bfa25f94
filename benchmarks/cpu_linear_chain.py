"""The linear layers of vllm_compare's random model on CPU, alone: XLA's own
dots (the engine's decode steps, `compiler.CPU_COMPILER_OPTIONS`) against
torch's `linear` and vLLM's CPU GEMM (`onednn_mm`, oneDNN with the weights
prepacked once, what vLLM's CPU backend runs on this machine) (RESULTS 7n).

8 layers of hidden 512, 8 query / 2 KV heads of 64, intermediate 2048
(`benchmarks.vllm_compare`'s checkpoint), distinct seeded random float32
weights per layer, so every weight is read from memory once per call, as in
a decode step: per layer q, k, v, o and a SwiGLU MLP, residual adds, no
attention or norms. Each form is called `--calls` times after two warm-up
calls, medians, per row count.

Run it with each interpreter: `--engine xla` needs JAX (this project's
environment), `--engine onednn,torch` vLLM's CPU build (its own
environment, no JAX):

  PYTHONPATH=. python -m benchmarks.cpu_linear_chain --engine xla
  $VLLM_PYTHON benchmarks/cpu_linear_chain.py --engine onednn,torch --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

LAYERS, HIDDEN, KV, INTER, GROUP = 8, 512, 128, 2048, 4
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV),
          "o": (HIDDEN, HIDDEN), "g": (HIDDEN, INTER), "u": (HIDDEN, INTER),
          "d": (INTER, HIDDEN)}  # [in, out]


def weights(seed: int = 0) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(seed)
  return [{n: (rng.standard_normal(s) * 0.02).astype(np.float32)
           for n, s in SHAPES.items()} for _ in range(LAYERS)]


def chain(x, ws, linear, silu, tile):
  """The layers' matmuls: `linear(x, layer, name)` is `x @ layer[name]`."""
  for w in ws:
    q, k, v = linear(x, w, "q"), linear(x, w, "k"), linear(x, w, "v")
    x = x + linear(q + tile(k) + tile(v), w, "o")
    x = x + linear(silu(linear(x, w, "g")) * linear(x, w, "u"), w, "d")
  return x


def _xla(ws, rows):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from paged_jax.serving import compiler  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(jnp.asarray, ws)
  f = jax.jit(lambda x, p: chain(x, p, lambda a, w, n: a @ w[n], jax.nn.silu,
                                 lambda a: jnp.tile(a, (1, GROUP))))
  x = jnp.ones((rows, HIDDEN), jnp.float32)
  exe = f.trace(x, params).lower().compile(compiler.compiler_options(rows))
  return lambda: jax.block_until_ready(exe(x, params))


def _torch(ws, rows, onednn: bool):
  import torch  # pylint: disable=import-outside-toplevel
  layers = [{n: torch.from_numpy(np.ascontiguousarray(a.T)) for n, a in w.items()}
            for w in ws]  # [out, in], as torch and vLLM keep them
  if onednn:
    from vllm import _custom_ops as ops  # pylint: disable=import-outside-toplevel
    handles = [{n: ops.create_onednn_mm(a.t(), 32) for n, a in w.items()} for w in layers]
    for layer, h in zip(layers, handles):
      layer["_h"] = h
    linear = lambda a, w, n: ops.onednn_mm(w["_h"][n], a, None)  # noqa: E731
  else:
    linear = lambda a, w, n: torch.nn.functional.linear(a, w[n])  # noqa: E731
  x = torch.ones((rows, HIDDEN), dtype=torch.float32)
  def run():
    with torch.no_grad():
      return chain(x, layers, linear, torch.nn.functional.silu,
                   lambda a: a.repeat(1, GROUP))
  return run


def positive(text: str) -> int:
  """An int >= 1 (argparse's `type`: one clear error otherwise)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
  return value


def row_counts(text: str) -> list[int]:
  """A comma-separated list of ints >= 1."""
  return [positive(t) for t in text.split(",")]


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--engine", default="xla", help="xla, or onednn and/or torch")
  p.add_argument("--rows", type=row_counts, default="1,32,256")
  p.add_argument("--threads", type=positive, default=2, help="torch's threads")
  p.add_argument("--calls", type=positive, default=30)
  args = p.parse_args(argv)
  engines = args.engine.split(",")
  if not engines or set(engines) - {"xla", "onednn", "torch"}:
    p.error(f"--engine: expected xla, onednn and/or torch, got {args.engine!r}")
  if set(engines) - {"xla"}:
    import torch  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(args.threads)
  ws, out = weights(), {}
  for rows in args.rows:
    forms = {e: (_xla(ws, rows) if e == "xla" else _torch(ws, rows, e == "onednn"))
             for e in engines}
    times = {e: [] for e in forms}
    for f in forms.values():
      f()
      f()
    for _ in range(args.calls):
      for e, f in forms.items():
        t = time.perf_counter()
        f()
        times[e].append(time.perf_counter() - t)
    out[rows] = {e: 1e3 * statistics.median(v) for e, v in times.items()}
    print(f"rows {rows:>3}: " + "  ".join(f"{e} {ms:7.2f} ms" for e, ms in out[rows].items()),
          flush=True)
  return out


if __name__ == "__main__":
  main()
