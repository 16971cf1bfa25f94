"""Benchmark 3, throughput: a HOOK, to be completed with the Flax decoder.

Throughput (generated tokens per second, paged vs contiguous KV cache) needs
the serving example (`examples/serving`), which is built separately. Until it
exists this benchmark prints a note and writes nothing; `run_all` calls it so
that it starts running as soon as the decoder lands.

  PYTHONPATH=. python -m benchmarks.throughput [--quick]
"""

from __future__ import annotations

import pathlib

from benchmarks import common

SERVING = pathlib.Path(__file__).resolve().parent.parent / "examples" / "serving"


def available() -> bool:
  return SERVING.is_dir()


def run(quick: bool = False, out=common.RESULTS_DIR) -> dict | None:
  if not available():
    print(f"  skipped: {SERVING.relative_to(SERVING.parents[1])} does not exist "
          "yet (throughput needs the Flax decoder)")
    return None
  # TODO(decoder): drive examples/serving over benchmarks.utilisation's traces
  # at block sizes 8-64, paged vs contiguous reservation; write
  # common.write_json(out, "throughput", ...) and a figure like the others.
  print("  skipped: examples/serving exists but the throughput driver is not "
        "written yet (benchmarks/throughput.py)")
  return None


def main(argv=None):
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  run(args.quick, args.out)


if __name__ == "__main__":
  main()
