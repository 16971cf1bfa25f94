"""The GPU benchmark script (benchmarks/gpu_all.py): its plan fits the device
call, it stops when a kernel is wrong, and its dry run runs every section."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import gpu_all


def test_section_budgets_fit_in_eight_minutes():
  assert gpu_all.TOTAL_BUDGET_S <= 8 * 60
  assert gpu_all.check_budgets() <= gpu_all.TOTAL_BUDGET_S
  assert [s[0] for s in gpu_all.SECTIONS] == [
      "check", "decode", "prefill", "block_size", "mesh"]


def test_an_over_budget_plan_is_refused():
  plan = gpu_all.SECTIONS + (("more", 100, "benchmarks.x", [], []),)
  with pytest.raises(ValueError, match=r"section budgets add up to 570 s "
                     r"\(environment 20 \+ summary 10 \+ .*\), more than "
                     r"TOTAL_BUDGET_S=480"):
    gpu_all.check_budgets(plan)


def test_a_failed_correctness_check_stops_the_run(monkeypatch, capsys):
  ran = []

  def fake(module, argv):
    ran.append(module)
    return 1 if module == "benchmarks.gpu_check" else 0

  monkeypatch.setattr(gpu_all, "run_in_process", fake)
  assert gpu_all.main(["--dry-run"]) == 1
  assert ran == ["benchmarks.gpu_check"]
  assert "STOP: a GPU kernel disagrees" in capsys.readouterr().out


def test_decode_dry_run_gives_every_goal_line(capsys):
  """The decode section alone (the goals' section), tiny shapes on CPU, the
  kernels in interpret mode: rows, the paged-vs-contiguous agreement and one
  line per goal."""
  from benchmarks import gpu_decode  # pylint: disable=g-import-not-at-top
  assert gpu_decode.main(["--dry-run"]) == 0
  out = capsys.readouterr().out
  assert "decode 2x64 triton: " in out
  assert "triton vs JAX Pallas paged_attention" in out
  assert "triton paged / contiguous (same kernel, identity tables)" in out
  decode = json.loads(
      (gpu_all.RESULTS / "gpu_decode_dry_run.json").read_text())
  row = decode["decode"][0]
  assert {"triton", "triton contiguous", "jax", "dense"} <= set(row["times"])
  assert row["paged_vs_contiguous_max_abs"]["triton"] < 2e-2
  assert [g["goal"] for g in decode["goals"] if g["kernel"] == "triton"] == [
      "frac_copy", "speedup_vs_jax", "paged_over_contiguous"]


# About 65 CPU-seconds (interpret-mode and XLA compiles in every section):
# over the default suite's allowance, so behind -m slow.
@pytest.mark.slow
def test_dry_run_runs_every_section(capsys):
  """Tiny shapes, CPU, kernels in interpret mode: every section returns 0,
  writes its JSON, and the goal lines come last."""
  assert gpu_all.main(["--dry-run"]) == 0
  out = capsys.readouterr().out
  summary = out[out.index("GPU summary"):]
  for name in ("check", "decode", "prefill", "block_size", "mesh"):
    assert f"{name} rc=0" in summary
  assert "not written by this run" not in summary
  # 3 cases for each registered GPU kernel (more once Mosaic GPU is there).
  assert re.search(r"correctness: ([3-9]|\d\d+) pass, 0 fail", summary)
  assert "triton paged / contiguous (same kernel, identity tables)" in summary
  assert "triton vs JAX Pallas paged_attention" in summary
  decode = json.loads(
      (gpu_all.RESULTS / "gpu_decode_dry_run.json").read_text())
  row = decode["decode"][0]
  assert {"triton", "triton contiguous", "jax", "dense"} <= set(row["times"])
  # Paged and contiguous runs compute the same function of the same K/V.
  assert row["paged_vs_contiguous_max_abs"]["triton"] < 2e-2
