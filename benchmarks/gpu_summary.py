"""Compact summary of the GPU benchmarks' JSON, with each issue goal's verdict.

Printed last by benchmarks/gpu_all.sh (the device tool returns only the end of
the output); runs anywhere the JSON files are:

    PYTHONPATH=. python benchmarks/gpu_summary.py [--since EPOCH] [--status FILE]

Reads benchmarks/results/{gpu_decode,gpu_prefill,block_size_gpu}.json. With
`--since`, a file written before that time is reported as stale, not as a
result of this run. `--status` is gpu_all.sh's table of section, exit code,
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

RESULTS = pathlib.Path(__file__).parent / "results"
FILES = {"decode": "gpu_decode.json", "prefill": "gpu_prefill.json",
         "block_size": "block_size_gpu.json"}
# Decode goals hold at batch >= 64 and context >= 4096.
GOAL_BATCH, GOAL_CONTEXT = 64, 4096
GOAL_FRAC_COPY = 0.85
GOAL_PAGED_OVER_DENSE = 1.03
GOAL_SPEEDUP_VS_JAX = 1.5


def load(results: pathlib.Path, name: str, since: float | None):
  path = results / FILES[name]
  if not path.exists():
    return None, f"{path.name}: missing (section failed or timed out early?)"
  if since is not None and os.path.getmtime(path) < since:
    return None, f"{path.name}: stale (written before this run)"
  try:
    return json.loads(path.read_text()), None
  except ValueError as e:
    return None, f"{path.name}: unreadable ({e})"


def verdict(ok) -> str:
  return "-" if ok is None else ("PASS" if ok else "MISS")


def goal_line(what: str, measured: str, goal: str, ok) -> str:
  return f"  {what:<46} {measured:>10}  {goal:<9} {verdict(ok)}"


def decode_lines(d) -> list[str]:
  lines = []
  corr = d.get("correctness")
  if isinstance(corr, list):
    bad = [c["case"] for c in corr if not c.get("ok")]
    lines.append(f"  decode correctness: {len(corr) - len(bad)}/{len(corr)} "
                 "pass" + (f"; FAIL: {'; '.join(bad)}" if bad else ""))
  copy = d.get("copy", {})
  if "gbps" in copy:
    lines.append(f"  copy bandwidth {copy['gbps']:.0f} GB/s")
  rows = [r for r in d.get("decode", []) if isinstance(r, dict)
          and "ours_s" in r] if isinstance(d.get("decode"), list) else []
  goal_rows = [r for r in rows if r["batch"] >= GOAL_BATCH
               and r["context"] >= GOAL_CONTEXT]
  where = f"b>={GOAL_BATCH},ctx>={GOAL_CONTEXT}"
  fracs = [r["ours_frac_copy"] for r in goal_rows if "ours_frac_copy" in r]
  ratios = [r["paged_over_dense"] for r in goal_rows if "paged_over_dense" in r]
  speed = [r["speedup_vs_jax"] for r in goal_rows if "speedup_vs_jax" in r]
  if fracs:
    lines.append(goal_line(f"decode GB/s / copy, worst {where}",
                           f"{100 * min(fracs):.1f}%",
                           f">= {100 * GOAL_FRAC_COPY:.0f}%",
                           min(fracs) >= GOAL_FRAC_COPY))
  if ratios:
    lines.append(goal_line(f"decode paged / dense, worst {where}",
                           f"{max(ratios):.3f}",
                           f"<= {GOAL_PAGED_OVER_DENSE}",
                           max(ratios) <= GOAL_PAGED_OVER_DENSE))
  if speed:
    lines.append(goal_line(f"decode ours vs JAX Pallas, worst {where}",
                           f"{min(speed):.2f}x", f">= {GOAL_SPEEDUP_VS_JAX}x",
                           min(speed) >= GOAL_SPEEDUP_VS_JAX))
  if rows:
    lines.append(f"  {'batch':>5} {'ctx':>6} {'ours us':>9} {'GB/s':>6} "
                 f"{'%copy':>6} {'jax us':>9} {'xla us':>9} {'dense us':>9} "
                 f"{'pg/dense':>8} {'vs jax':>6}")
    for r in rows:
      def us(k, r=r):
        return f"{r[k] * 1e6:9.1f}" if k in r else f"{'-':>9}"
      def num(k, fmt, r=r):
        return format(r[k], fmt) if k in r else "-"
      lines.append(
          f"  {r['batch']:5d} {r['context']:6d} {us('ours_s')} "
          f"{r['ours_gbps']:6.0f} {100 * r.get('ours_frac_copy', 0):6.1f} "
          f"{us('jax_s')} {us('xla_s')} {us('dense_s')} "
          f"{num('paged_over_dense', '8.3f'):>8} "
          f"{num('speedup_vs_jax', '6.2f'):>6}")
  sweep = d.get("config_sweep")
  if isinstance(sweep, list):
    for shape in sorted({(r["batch"], r["context"]) for r in sweep}):
      recs = [r for r in sweep if (r["batch"], r["context"]) == shape
              and "s" in r]
      default = [r for r in recs if r["default"]]
      if recs and default:
        best = min(recs, key=lambda r: r["s"])
        lines.append(f"  sweep b={shape[0]} ctx={shape[1]}: default / best "
                     f"config = {default[0]['s'] / best['s']:.2f}"
                     + ("" if best["default"] else f" (best {best['config']})"))
  return lines


def prefill_lines(p) -> list[str]:
  lines = []
  corr = p.get("correctness")
  if isinstance(corr, list):
    bad = [c["case"] for c in corr if not c.get("ok")]
    lines.append(f"  ragged correctness: {len(corr) - len(bad)}/{len(corr)} "
                 "pass" + (f"; FAIL: {'; '.join(bad)}" if bad else ""))
  ceil = p.get("ceilings", {})
  if "matmul_tflops" in ceil:
    lines.append(f"  bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s "
                 f"({ceil['matmul_n']}^3), copy {ceil['copy_gbps']:.0f} GB/s")
  goals = p.get("goals", {})
  pre = p.get("prefill", {})
  if "ours_frac_matmul" in pre:
    lines.append(goal_line(
        f"prefill {pre['seqs']}x{pre['q_len']}: TFLOP/s / matmul",
        f"{100 * pre['ours_frac_matmul']:.1f}%",
        f">= {100 * goals.get('frac_matmul', 0.5):.0f}%",
        pre.get("goal_frac_matmul_met")))
  if "paged_over_contiguous" in pre:
    lines.append(goal_line(
        f"prefill paged / {pre['best_contiguous']}",
        f"{pre['paged_over_contiguous']:.3f}",
        f"<= {goals.get('paged_over_contiguous', 1.1)}",
        pre.get("goal_paged_over_contiguous_met")))
  mix = p.get("mixed", {})
  if "ours_s" in mix:
    lines.append(goal_line("mixed 50/50: time / roofline floor",
                           f"{100 * mix['ours_frac_floor']:.1f}%", "", None))
  if "paged_over_contiguous" in mix:
    lines.append(goal_line(f"mixed paged / {mix['best_contiguous']}",
                           f"{mix['paged_over_contiguous']:.3f}", "", None))
  if "mixed_over_separate" in mix:
    lines.append(goal_line("mixed one call / its two parts separately",
                           f"{mix['mixed_over_separate']:.3f}", "", None))
  for title, sec in (("prefill", pre), ("mixed", mix)):
    rows = sec.get("rows") if isinstance(sec, dict) else None
    if not rows:
      continue
    lines.append(f"  {title:<8} {'implementation':<26} {'ms':>8} "
                 f"{'TFLOP/s':>8} {'%mm':>5} {'GB/s':>6} {'rel err':>8}")
    for r in rows:
      if "s" in r:
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        flag = "" if r.get("correct", True) else " WRONG"
        lines.append(f"  {'':<8} {r['name']:<26} {r['s'] * 1e3:8.3f} "
                     f"{r['tflops']:8.1f} {100 * r['frac_matmul']:5.1f} "
                     f"{r['gbps']:6.0f} {err:>8}{flag}")
      else:
        lines.append(f"  {'':<8} {r['name']:<26} {r.get('error', '?')[:70]}")
  for key in ("prefill", "mixed", "ceilings"):
    if isinstance(p.get(key), dict) and "error" in p[key]:
      lines.append(f"  {key} section failed: "
                   f"{p[key]['error'].strip().splitlines()[-1][:120]}")
  return lines


def block_size_lines(b) -> list[str]:
  lines = []
  for impl, res in b.get("implementations", {}).items():
    if "times" not in res:
      lines.append(f"  block size {impl}: not run ({res.get('error', '?')[:90]})")
      continue
    rel = " ".join(f"{k}:{t['relative']:.3f}" for k, t in res["times"].items())
    best_ms = 1e3 * min(t["median_s"] for t in res["times"].values())
    lines.append(goal_line(f"block size {impl}: worst of 8-64 / best",
                           f"{res['worst_relative_8_to_64']:.3f}",
                           f"<= {b.get('goal', 1.1)}", res.get("goal_met")))
    lines.append(f"    time/best {rel} (best {best_ms:.3f} ms)")
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--since", type=float, default=None,
                 help="epoch seconds; older JSON files count as stale")
  p.add_argument("--status", type=pathlib.Path, default=None,
                 help="gpu_all.sh's section status file")
  p.add_argument("--results", type=pathlib.Path, default=RESULTS,
                 help=f"where the JSON files are (default {RESULTS})")
  args = p.parse_args(argv)
  print("\n==================== GPU summary ====================")
  data = {}
  for name in FILES:
    data[name], problem = load(args.results, name, args.since)
    if problem:
      print(f"  {problem}")
  head = next((d for d in (data["prefill"], data["decode"]) if d), None)
  if head:
    dev = head.get("device", {})
    print(f"  {dev.get('device_kind')} ({dev.get('num_sms')} SMs), jax "
          f"{dev.get('jax')}, jaxlib {dev.get('jaxlib')}, python "
          f"{dev.get('python')}, {head.get('date', '')[:16]} UTC")
  if args.status and args.status.exists():
    parts = [line.split("\t") for line in args.status.read_text().splitlines()
             if line.strip()]
    print("  sections: " + ", ".join(
        f"{n} rc={rc} {s}s" for n, rc, s in parts))
  print(f"  {'goal':<46} {'measured':>10}  {'target':<9} verdict")
  for name, fn in (("prefill", prefill_lines), ("decode", decode_lines),
                   ("block_size", block_size_lines)):
    if data[name]:
      for line in fn(data[name]):
        print(line)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
