"""Shared plumbing for the benchmarks: flags, metadata, JSON and figures."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import time
from typing import Callable

RESULTS_DIR = pathlib.Path(__file__).parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--quick", action="store_true",
                 help="small sizes for a smoke test (numbers not meaningful)")
  p.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR,
                 help=f"where JSON and PNG go (default {RESULTS_DIR})")
  return p


def machine() -> dict:
  """Where and with what the numbers were measured."""
  import jax
  import jaxlib
  import numpy as np
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M UTC"),
      "cpu": cpu,
      "cpu_count": os.cpu_count(),
      "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "devices": [str(d) for d in jax.devices()],
      "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "numpy": np.__version__,
  }


def write_json(out_dir: pathlib.Path, name: str, data: dict, *, quick: bool) -> pathlib.Path:
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{name}{'_quick' if quick else ''}.json"
  payload = {"benchmark": name, "quick": quick, "machine": machine(), **data}
  path.write_text(json.dumps(payload, indent=2) + "\n")
  return path


def figure_path(out_dir: pathlib.Path, name: str, *, quick: bool) -> pathlib.Path:
  out_dir.mkdir(parents=True, exist_ok=True)
  return out_dir / f"{name}{'_quick' if quick else ''}.png"


def pyplot():
  """matplotlib.pyplot on the non-interactive Agg backend."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def time_calls(fn: Callable[[], object], *, repeats: int, warmup: int = 2) -> dict:
  """Median and quartiles of `fn()` wall time in seconds; `fn` must block."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
  return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2],
          "repeats": repeats}


def time_in_loop(fn: Callable, args: tuple, *, repeats: int = 5,
                 target_s: float = 0.01, max_calls: int = 200,
                 keep_output: bool = True) -> dict:
  """Device seconds per call of `fn(*args)`, many calls per dispatch.

  One jitted `lax.fori_loop` runs `n` calls back to back on the device; it is
  timed at `n` and `2 n` calls (the trip count is an argument: one
  compilation), and a call costs `median(T(2n) - T(n)) / n` over `repeats`
  pairs, so dispatch and the host's sync cancel out. `n` is chosen so that
  `n` calls take about `target_s`. Each call's first argument is the previous
  one's plus 1e-6 x its output (which must have the first argument's shape),
  so XLA can neither hoist a call out of the loop nor merge two; that adds one
  elementwise pass over the first argument (the queries) per call. The last
  output is carried out of the loop unless `keep_output` is False (then
  `out` is None: for a copy-bandwidth probe, where it would be a second copy).

  Returns:
    dict(s=seconds per call, calls=n, repeats, spread=(max - min) / median of
    the per-call estimates, first_s=the first call's wall time (compile
    included), dispatch_included=True where the difference was not positive
    (noise; then `s` is T(2n) / 2n, an upper bound), out=fn(*args)'s output).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  first, rest = args[0], tuple(args[1:])

  @jax.jit
  def loop(n, x, *rest):
    def body(_, carry):
      x, _ = carry
      out = fn(x, *rest)
      x = (x.astype(jnp.float32)
           + 1e-6 * out.astype(jnp.float32)).astype(x.dtype)
      return x, (out if keep_output else None)
    return jax.lax.fori_loop(
        0, n, body, (x, jnp.zeros_like(x) if keep_output else None))

  def wall(n):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(n, first, *rest))
    return time.perf_counter() - t0

  t0 = time.perf_counter()
  out = jax.block_until_ready(loop(1, first, *rest))[1]  # compiles
  first_s = time.perf_counter() - t0
  one = wall(1)
  n = max(1, min(max_calls, int(target_s / max(one, 1e-6))))
  per_call, whole = [], []
  for _ in range(repeats):
    t_n = wall(n)
    whole.append(wall(2 * n))
    per_call.append((whole[-1] - t_n) / n)
  med = statistics.median(per_call)
  upper_bound = med <= 0  # noise beat the difference (tiny CPU runs)
  if upper_bound:
    per_call = [t / (2 * n) for t in whole]
    med = statistics.median(per_call)
  return {"s": med, "calls": n, "repeats": repeats, "first_s": first_s,
          "spread": (max(per_call) - min(per_call)) / med,
          "dispatch_included": upper_bound, "out": out}


def serve_timed(engine, reqs, tag: str):
  """Serves `reqs` (`(prompt ids, max_new_tokens)` pairs, greedy) on `engine`,
  all at once; returns `(wall seconds, {request index: token ids})` (ids are
  `"{tag}-{i}"`, so runs of one engine never collide)."""
  from paged_jax.serving.requests import Request  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  for i, (prompt, new) in enumerate(reqs):
    assert engine.add_request(Request(f"{tag}-{i}", prompt,
                                      SamplingParams(max_new_tokens=new))) is None
  t0 = time.perf_counter()
  outs = engine.run_until_done()
  wall = time.perf_counter() - t0
  return wall, {o.request_id.split("-", 1)[1]: o.completions[0].token_ids for o in outs}
