"""Load time and peak host memory of a Hugging Face checkpoint directory.

A SmolLM2-135M-shaped checkpoint (30 layers, hidden 576, vocab 49,152, tied;
seeded random weights) is written once in float32 and once in bfloat16, then
loaded in a fresh process per measurement with `paged_jax.models.load_hf`
(this tree), and, where `--baseline` gives another source tree (the commit
before the loader was rewritten), with that tree's
`checkpoint.load_checkpoint`, interleaved, `--repeats` times; medians.

Peak host memory is the process's peak resident set (`VmHWM`) minus its
resident set just before the load (after importing JAX and the package), so
it counts what the load itself holds at its worst: the file's pages (read
from the page cache: the files were just written, a warm read), any copies,
and the model's parameters (on CPU, JAX arrays are host memory too).

  PYTHONPATH=. python -m benchmarks.load_hf [--baseline DIR] [--repeats N]
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import common
from benchmarks.compile_layers import SMOLLM2


def _status_kib(field: str) -> int:
  """`VmRSS` (resident now) or `VmHWM` (its peak) of this process, in KiB.
  (`ru_maxrss` would not do: Linux carries it over from the parent across
  fork and exec.)"""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def child(path: str, dtype: str | None, api: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  if api == "load_hf":
    import paged_jax.models as models  # pylint: disable=import-outside-toplevel
    load = models.load_hf
  else:
    load = checkpoint.load_checkpoint
  before = _status_kib("VmRSS")
  t0 = time.perf_counter()
  model = load(path, dtype=dtype)
  params = nnx.state(model, nnx.Param)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t0
  peak = _status_kib("VmHWM")
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  return {"load_s": seconds, "peak_extra_mib": (peak - before) / 1024,
          "param_mib": param_bytes / 2**20, "rss_before_mib": before / 1024}


def _write(root: pathlib.Path, dtype: str):
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  model = model_lib.init_model(model_lib.LlamaConfig(
      num_layers=30, dtype=dtype, **SMOLLM2), seed=0)
  checkpoint.save_checkpoint(model, root)


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--baseline", type=pathlib.Path)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--child", nargs=3, help=argparse_hidden())
  args = p.parse_args(argv)
  if args.child:
    path, dtype, api = args.child
    print("RESULT " + json.dumps(child(path, None if dtype == "auto" else dtype, api)))
    return 0
  here = pathlib.Path(__file__).resolve().parents[1]
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="load_hf_"))
  files = {}
  for dtype in ("float32", "bfloat16"):
    _write(tmp / dtype, dtype)
    files[dtype] = tmp / dtype
  cases = [("load_hf", here, "float32", "auto"), ("load_hf", here, "bfloat16", "auto"),
           ("load_hf", here, "float32", "bfloat16")]
  if args.baseline:
    cases.insert(1, ("baseline", args.baseline.resolve(), "float32", "auto"))
    cases.insert(3, ("baseline", args.baseline.resolve(), "bfloat16", "auto"))
  runs = {c: [] for c in cases}
  for r in range(args.repeats if not args.quick else 1):
    for case in cases:
      api, src, file_dtype, dtype = case
      env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{here}"}
      proc = subprocess.run(
          [sys.executable, __file__, "--child", str(files[file_dtype]), dtype,
           api], cwd=here.parent, env=env, capture_output=True, text=True,
          check=False)
      line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not line:
        print(f"{case} failed: {proc.stderr.strip().splitlines()[-1:]}")
        runs[case].append(None)
        continue
      res = json.loads(line[0][7:])
      runs[case].append(res)
      print(f"repeat {r} {api:8s} {file_dtype} file as {dtype}: {res['load_s']:.2f} s, "
            f"peak +{res['peak_extra_mib']:.0f} MiB (params {res['param_mib']:.0f} MiB)",
            flush=True)
  sizes = {d: sum(f.stat().st_size for f in files[d].iterdir()) / 2**20 for d in files}
  summary = []
  for (api, _, file_dtype, dtype), rs in runs.items():
    rs = [x for x in rs if x]
    if not rs:
      summary.append({"api": api, "file": file_dtype, "as": dtype, "failed": True})
      continue
    summary.append({"api": api, "file": file_dtype, "as": dtype,
                    "file_mib": sizes[file_dtype],
                    **{k: statistics.median(x[k] for x in rs) for k in rs[0]}})
    s = summary[-1]
    print(f"{api:8s} {file_dtype} file ({s['file_mib']:.0f} MiB) as {dtype}: median "
          f"{s['load_s']:.2f} s, peak +{s['peak_extra_mib']:.0f} MiB for "
          f"{s['param_mib']:.0f} MiB of parameters")
  path = common.write_json(args.out, "load_hf", {
      "model": "SmolLM2-135M shape, 30 layers, random weights",
      "conditions": "fresh process per load, files in the page cache (warm), "
                    "2 CPU cores shared with other jobs",
      "summary": summary}, quick=args.quick)
  print(f"wrote {path}")
  for d in files.values():
    for f in d.iterdir():
      f.unlink()
    d.rmdir()
  tmp.rmdir()
  return 0


def argparse_hidden():
  import argparse  # pylint: disable=import-outside-toplevel
  return argparse.SUPPRESS


if __name__ == "__main__":
  sys.exit(main())
