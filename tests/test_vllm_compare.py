"""benchmarks/vllm_compare.py without vLLM: it skips cleanly, and its
workloads and summaries are what it says (the benchmark itself is not a test)."""

from __future__ import annotations


import types

import pytest

from benchmarks import vllm_compare


def test_skips_with_exit_0_where_vllm_is_missing(capsys):
  assert vllm_compare.main(["--vllm-python", "/nonexistent/python"]) == 0
  out = capsys.readouterr().out
  assert out == ("vllm_compare: skipped: vLLM is not installed (no Python at "
                 "/nonexistent/python (set --vllm-python or $VLLM_PYTHON))\n")


def test_workloads_fit_the_engine_sizes():
  args = vllm_compare.parse_args(["--num-requests", "128"])
  for name in vllm_compare.WORKLOADS:
    lengths = vllm_compare._lengths(name, args)
    assert len(lengths) == 128
    assert all(p >= 1 and o >= 1 and p + o <= args.max_model_len for p, o in lengths)
  # Azure: the trace's first rows, lengths scaled by 1/8 (374 and 44 tokens).
  assert vllm_compare._lengths("azure", args)[0] == (47, 6)


def test_longprompt_workload_is_long_prompts_and_short_outputs():
  args = vllm_compare.parse_args(["--num-requests", "64", "--max-model-len", "512"])
  lengths = vllm_compare._lengths("longprompt", args)
  assert all(100 <= p <= 400 and 10 <= o <= 60 for p, o in lengths)
  assert len(set(lengths)) > 32  # drawn, not one length repeated


def test_summary_and_greedy_comparison():
  a = [{"tokens_per_second": t, "generated_tokens": 10, "wall_seconds": 1.0,
        "token_ids": [[1, 2, 3], [4, 5]], "engine": "paged-jax"} for t in (50.0, 70.0)]
  b = [{"tokens_per_second": t, "generated_tokens": 10, "wall_seconds": 1.0,
        "ttft_p50_s": 0.1, "tpot_p50_s": 0.01, "token_ids": [[1, 2, 3], [4, 6]],
        "engine": "vllm"} for t in (100.0, 140.0)]
  r = vllm_compare.summarise("sharegpt", a, b)
  assert r["throughput_ratio_paged_jax_over_vllm"] == 60.0 / 120.0
  assert r["greedy"] == {"identical_requests": 1, "requests": 2,
                         "first_divergence_positions": [1]}
  assert "ttft_ratio_paged_jax_over_vllm" not in r  # paged-jax reported none
  (line,) = vllm_compare.summary_lines({"workloads": {"sharegpt": r}})
  assert line == (" sharegpt: paged-jax 60.0 vs vLLM 120.0 output tokens/s = 0.50x; "
                  "vLLM median TTFT 100.0 ms (paged-jax: n/a); vLLM median TPOT 10.0 ms "
                  "(paged-jax: n/a); greedy identical 1/2")


def test_sampled_runs_pass_the_same_sampling_to_both_and_compare_no_tokens():
  args = vllm_compare.parse_args(["--temperature", "0.7", "--top-p", "0.9",
                                  "--top-k", "50"])
  assert vllm_compare.sampling_flags(args) == ["--temperature", "0.7", "--top-k",
                                               "50", "--top-p", "0.9"]
  from benchmarks import vllm_worker  # the worker takes the same flags
  w = vllm_worker._args(["--checkpoint", "c", "--kv-bytes", "1",
                              *vllm_compare.sampling_flags(args)])
  assert (w.temperature, w.top_k, w.top_p) == (0.7, 50, 0.9)
  run = {"tokens_per_second": 1.0, "generated_tokens": 10, "wall_seconds": 1.0,
         "token_ids": [[1]], "engine": "x"}
  r = vllm_compare.summarise("sharegpt", [run], [run], greedy=False)
  assert r["greedy"] is None
  (line,) = vllm_compare.summary_lines({"workloads": {"sharegpt": r}})
  assert line.endswith("; sampled (tokens not compared)")
  with pytest.raises(SystemExit):
    vllm_compare.parse_args(["--top-p", "0"])


def test_latencies_are_read_from_generate_json_when_present():
  stats = {"latency": {"ttft_ms": {"p50": 12.0}, "tpot_ms": {"p50": 3.0}}}
  assert vllm_compare._latency_fields(stats) == pytest.approx(
      {"ttft_p50_s": 0.012, "tpot_p50_s": 0.003})
  assert vllm_compare._latency_fields({"tokens_per_second": 1.0}) == {}


def test_both_schedules_are_summarised_side_by_side():
  a = [{"tokens_per_second": 60.0, "generated_tokens": 10, "wall_seconds": w,
        "token_ids": [[1]], "steps": 40, "computed_tokens": 500, "preemptions": 0}
       for w in (2.0, 4.0)]
  b = [{"tokens_per_second": 120.0, "generated_tokens": 10, "wall_seconds": 1.0,
        "token_ids": [[1]], "steps": 50, "computed_tokens": 480, "preemptions": 3}
       for _ in range(2)]
  r = vllm_compare.summarise("sharegpt", a, b)
  assert r["paged_jax"]["wall_ms_per_step"] == 1e3 * 3.0 / 40
  assert r["vllm"]["wall_ms_per_step"] == 1e3 * 1.0 / 50
  assert (r["vllm"]["steps"], r["vllm"]["computed_tokens"], r["vllm"]["preemptions"]) == (50, 480, 3)
  _, line = vllm_compare.summary_lines({"workloads": {"sharegpt": r}})
  assert line == ("           steps 40 vs 50, token rows computed 500 vs 480, preemptions "
                  "0 vs 3, wall per step 75.0 vs 20.0 ms")


def test_the_vllm_worker_reads_its_step_counters():
  from benchmarks import vllm_worker  # standard library only at import
  # `LLM.get_metrics()` objects: a histogram has count and sum, a counter value.
  hist = types.SimpleNamespace(name="vllm:iteration_tokens_total", count=347, sum=10409.0)
  pre = types.SimpleNamespace(name="vllm:num_preemptions", value=2)
  llm = types.SimpleNamespace(get_metrics=lambda: [hist, pre])
  assert vllm_worker._counters(llm) == {"steps": 347, "computed_tokens": 10409.0,
                                        "preemptions": 2}
  def broken():
    raise AttributeError("an older vLLM")
  assert vllm_worker._counters(types.SimpleNamespace(get_metrics=broken)) == {}
