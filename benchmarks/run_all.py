"""Runs every benchmark, then rewrites benchmarks/RESULTS.md from their JSON.

  PYTHONPATH=. python -m benchmarks [--quick]        # or python -m benchmarks.run_all

Under 10 minutes on 2 CPU cores. `--quick` is a smoke test (about a minute;
its numbers are not meaningful, and it writes *_quick files and no RESULTS.md).
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import block_size
from benchmarks import common
from benchmarks import concurrency
from benchmarks import host_overhead
from benchmarks import report
from benchmarks import throughput
from benchmarks import utilisation

BENCHMARKS = (
    ("1. utilisation", utilisation),
    ("2. concurrency", concurrency),
    ("3. throughput", throughput),
    ("4. host overhead", host_overhead),
    ("5. block size", block_size),
)


def main(argv=None) -> None:
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  start = time.perf_counter()
  wall = {}
  for title, module in BENCHMARKS:
    print(f"== {title} ({module.__name__})", flush=True)
    t0 = time.perf_counter()
    module.run(args.quick, args.out)
    wall[module.__name__.split(".")[-1]] = time.perf_counter() - t0
  # The scale-out benchmark needs 8 devices, which on CPU must be simulated
  # before JAX starts: run it in its own process.
  print("== 6. scale-out (benchmarks.sharded)", flush=True)
  t0 = time.perf_counter()
  cmd = [sys.executable, "-m", "benchmarks.sharded", "--out", str(args.out)]
  subprocess.run(cmd + (["--quick"] if args.quick else []), check=True)
  wall["sharded"] = time.perf_counter() - t0
  total = time.perf_counter() - start
  print("== wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in wall.items())
        + f"; total {total:.0f}s")
  if not args.quick:
    path = report.write(args.out, wall_s=wall)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
