"""Every GPU benchmark in one command, for one device call on an H200.

    PYTHONPATH=. python benchmarks/gpu_all.py            # on the GPU, <= 8 min
    PYTHONPATH=. python benchmarks/gpu_all.py --dry-run  # CPU check, in-process

(`benchmarks/gpu_all.sh` runs this and keeps the whole log.) Sections, in
order, each under its own time budget (`SECTIONS`, compile included; with the
environment and the summary they add up to at most `TOTAL_BUDGET_S` = 8
minutes, which `check_budgets` enforces before anything runs):

  check       benchmarks/gpu_check.py: every GPU kernel against the float32
              reference. If anything disagrees, the run STOPS here.
  decode      benchmarks/gpu_decode.py: copy bandwidth; ours (Triton, and
              Mosaic GPU when registered) vs JAX's Pallas paged_attention,
              the same kernel on contiguous K/V, cuDNN and dense; a sweep.
  prefill     benchmarks/gpu_prefill.py: ceilings, prefill 8 x 2048, mixed.
  block_size  benchmarks/block_size.py --gpu: block sizes 8-128.
  mesh        benchmarks/gpu_mesh.py: the engine on a mesh of the local GPUs.

On the GPU each section is a subprocess killed at its budget (the scripts
also stop starting new parts before it, and rewrite their JSON after every
part, so a cut-short section keeps what it measured). `--dry-run` runs every
section's `main(["--dry-run"])` in this process on CPU, tiny shapes, kernels
in Pallas interpret mode: it proves the plumbing (arguments, imports, JSON,
goal lines, the hard stop), not the GPU times. JSON files go to
benchmarks/results/ and to `$OUT` when set; the goal lines come last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TOTAL_BUDGET_S = 480  # the device call: 15 min in all, start-up included
ENVIRONMENT_S = 20  # nvidia-smi and versions
SUMMARY_S = 10
# (name, budget in seconds, module, arguments on the GPU, arguments dry)
SECTIONS = (
    ("check", 60, "benchmarks.gpu_check", [], ["--dry-run"]),
    ("decode", 170, "benchmarks.gpu_decode", [], ["--dry-run"]),
    ("prefill", 90, "benchmarks.gpu_prefill", [], ["--dry-run"]),
    ("block_size", 60, "benchmarks.block_size", ["--gpu"], ["--dry-run"]),
    ("mesh", 60, "benchmarks.gpu_mesh", [], ["--dry-run"]),
)
# Run after the sections only if what is left of TOTAL_BUDGET_S covers the
# budget (not in the dry run): the KV-quantisation decode comparison.
EXTRA_SECTIONS = (
    ("kv_quant", 60, "benchmarks.kv_quant", ["--gpu", "--repeats", "20"]),
)
# Sections that take --budget-s (stop starting parts this long before the kill).
SOFT_MARGIN_S = 15
TAKES_BUDGET = ("decode", "prefill")
RESULT_FILES = ("gpu_check", "gpu_decode", "gpu_prefill", "block_size_gpu")


def log(*a):
  print(*a, flush=True)


def check_budgets(sections=SECTIONS) -> int:
  """The planned seconds in all; raises if over `TOTAL_BUDGET_S`."""
  total = ENVIRONMENT_S + SUMMARY_S + sum(s[1] for s in sections)
  if total > TOTAL_BUDGET_S:
    raise ValueError(
        f"section budgets add up to {total} s (environment {ENVIRONMENT_S} +"
        f" summary {SUMMARY_S} + {[s[:2] for s in sections]}), more than "
        f"TOTAL_BUDGET_S={TOTAL_BUDGET_S}")
  return total


def environment(python: str):
  now = datetime.datetime.now(datetime.timezone.utc)
  log(f"==== environment ({now:%Y-%m-%d %H:%M:%S} UTC)")
  for cmd in (["nvidia-smi"],
              ["nvidia-smi", "--format=csv", "--query-gpu=name,driver_version,"
               "memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
               "temperature.gpu"]):
    try:
      subprocess.run(cmd, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
      log(f"  {cmd[0]}: {e}")
  code = ("import importlib.metadata as md, platform\n"
          "names = ('jax', 'jaxlib', 'jax-cuda13-plugin', 'jax-cuda12-plugin',"
          " 'jax-cuda13-pjrt', 'jax-cuda12-pjrt', 'numpy', 'flax', 'triton')\n"
          "found = []\n"
          "for n in names:\n"
          "  try: found.append(f'{n} {md.version(n)}')\n"
          "  except md.PackageNotFoundError: pass\n"
          "print(f'python {platform.python_version()}; ' + ', '.join(found))\n")
  subprocess.run([python, "-c", code], timeout=15, check=False)


def run_subprocess(python, module, argv, limit) -> int:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  try:
    return subprocess.run([python, "-m", module, *argv], cwd=ROOT, env=env,
                          timeout=limit, check=False).returncode
  except subprocess.TimeoutExpired:
    log(f"  stopped at its {limit} s limit")
    return 124


def run_in_process(module, argv) -> int:
  try:
    rc = importlib.import_module(module).main(argv)
  except SystemExit as e:
    rc = e.code
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    log(f"  {type(e).__name__}: {e}")
    return 1
  return int(rc or 0)


def summary(status, dry_run: bool, since: float) -> list[str]:
  """The goal lines of every section's JSON (written in this run)."""
  lines = ["  sections: " + ", ".join(f"{n} rc={rc} {s:.0f}s"
                                       for n, rc, s in status)]
  suffix = "_dry_run" if dry_run else ""
  for name in RESULT_FILES:
    stem = name.replace("_gpu", "") if dry_run and name == "block_size_gpu" else name
    path = RESULTS / f"{stem}{suffix}.json"
    if not path.exists() or path.stat().st_mtime < since:
      lines.append(f"  {path.name}: not written by this run")
      continue
    data = json.loads(path.read_text())
    lines += [f"  {line}" for line in goal_lines(name, data)]
  return lines


def goal_lines(name: str, data: dict) -> list[str]:
  """One line per goal, ready for RESULTS.md."""
  if name == "gpu_check":
    checks = data.get("checks", [])
    bad = [f"{c['kernel']} {c['case']}" for c in checks if c["status"] == "FAIL"]
    return [f"correctness: {sum(c['status'] == 'PASS' for c in checks)} pass,"
            f" {len(bad)} fail, {sum(c['status'] == 'SKIP' for c in checks)}"
            f" skipped" + (f"; FAIL: {'; '.join(bad)}" if bad else "")]
  if name == "gpu_decode":
    return [g["line"] for g in data.get("goals", [])] or [
        "decode: no goal figure (the goal shape was not timed)"]
  if name == "gpu_prefill":
    from benchmarks import gpu_prefill  # pylint: disable=g-import-not-at-top
    return gpu_prefill.summary_lines(data)
  if name == "block_size_gpu":
    out = []
    for impl, res in data.get("implementations", {}).items():
      if "worst_relative_8_to_64" in res:
        out.append(f"block size {impl}: worst of 8-64 / best "
                   f"{res['worst_relative_8_to_64']:.3f} (goal <= "
                   f"{data.get('goal')})"
                   + ("  PASS" if res.get("goal_met") else "  MISS"))
      else:
        out.append(f"block size {impl}: not run ({res.get('error', '?')[:80]})")
    return out
  return []


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dry-run", action="store_true",
                 help="every section on tiny shapes on CPU, in this process")
  p.add_argument("--python", default=sys.executable,
                 help="interpreter for the sections (GPU run)")
  args = p.parse_args(argv)
  total = check_budgets()
  start = time.time()
  log(f"==== plan: {', '.join(f'{s[0]} {s[1]}s' for s in SECTIONS)}; "
      f"{total} s of {TOTAL_BUDGET_S} s with environment and summary")
  if args.dry_run:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  else:
    environment(args.python)
  status = []
  for name, budget, module, gpu_argv, dry_argv in SECTIONS:
    argv_ = list(dry_argv if args.dry_run else gpu_argv)
    if name in TAKES_BUDGET:
      argv_ += ["--budget-s", str(budget - SOFT_MARGIN_S)]
    log(f"\n==== {name} (budget {budget} s, {time.time() - start:.0f} s "
        f"elapsed): python -m {module} {' '.join(argv_)}")
    t0 = time.time()
    rc = (run_in_process(module, argv_) if args.dry_run
          else run_subprocess(args.python, module, argv_, budget))
    status.append((name, rc, time.time() - t0))
    log(f"==== {name}: rc={rc}, {status[-1][2]:.0f} s")
    if name == "check" and rc != 0:
      log("==== STOP: a GPU kernel disagrees with the reference (or the check"
          " could not run); timings of a wrong kernel mean nothing")
      break
  for name, budget, module, argv_ in () if args.dry_run or (
      len(status) < len(SECTIONS)) else EXTRA_SECTIONS:
    left = TOTAL_BUDGET_S - SUMMARY_S - (time.time() - start)
    if left < budget:
      log(f"\n==== {name}: skipped, {left:.0f} s left < its {budget} s")
      continue
    log(f"\n==== {name} (extra, budget {budget} s): python -m {module} "
        f"{' '.join(argv_)}")
    t0 = time.time()
    status.append((name, run_subprocess(args.python, module, argv_, budget),
                   time.time() - t0))
  if not args.dry_run and os.environ.get("OUT"):
    out = pathlib.Path(os.environ["OUT"])
    for name in ("block_size_gpu.json", "block_size_gpu.png",
                 "kv_quant_gpu.json"):
      if (RESULTS / name).exists():
        (out / name).write_bytes((RESULTS / name).read_bytes())
    status_path = out / "gpu_all_sections.tsv"
    status_path.write_text("".join(f"{n}\t{rc}\t{s:.0f}\n"
                                   for n, rc, s in status))
  log(f"\n==================== GPU summary ({time.time() - start:.0f} s) "
      "====================")
  for line in summary(status, args.dry_run, start):
    log(line)
  failed = [n for n, rc, _ in status if rc != 0]
  stopped = sum(n in [s[0] for s in SECTIONS] for n, _, _ in status) < len(
      SECTIONS)
  return 1 if stopped or failed else 0


if __name__ == "__main__":
  sys.exit(main())
