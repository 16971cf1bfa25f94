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
