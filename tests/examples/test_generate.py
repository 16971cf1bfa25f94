"""`examples/generate.py`: end-to-end runs and its one-line errors."""

from __future__ import annotations

import json

import pytest

from examples import generate
from examples.llama import checkpoint
from examples.llama import model as model_lib

# The sizes of the engine tests (tests/examples/conftest.py), so that the
# compiled steps are shared: 32 blocks x 4 tokens = 128 KV tokens.
SMALL = ["--block-size", "4", "--num-blocks", "32", "--max-batch", "4",
         "--max-tokens-per-step", "16", "--max-model-len", "64", "--no-progress",
         "--no-compile-cache"]


def run(args, capsys):
  rc = generate.main(args)
  out, err = capsys.readouterr()
  return rc, out, err


def test_synthetic_workload_with_baseline_is_deterministic(tmp_path, capsys):
  outs = []
  for i in range(2):
    path = tmp_path / f"out{i}.json"
    rc, out, _ = run(SMALL + ["--num-requests", "6", "--output", str(path)], capsys)
    assert rc == 0
    outs.append(json.loads(path.read_text()))
  assert "contiguous KV cache, same memory: 2 slots x 64 tokens" in out
  assert "greedy outputs identical in both engines: 6/6" in out
  doc = outs[0]
  assert doc["requests"] == outs[1]["requests"]
  assert len(doc["requests"]) == 6
  for r in doc["requests"]:
    (c,) = r["completions"]
    assert c["finish_reason"] in ("stop", "length") and c["token_ids"]
  stats = doc["stats"]
  assert stats["paged"]["served"] == stats["contiguous"]["served"] == 6
  assert stats["paged"]["kv_bytes"] == stats["contiguous"]["kv_bytes"]


def test_mesh_run_matches_one_device(tmp_path, capsys):
  outs = []
  for mesh in ([], ["--mesh", "data=2,model=2"]):
    path = tmp_path / "out.json"
    rc, out, _ = run(SMALL + ["--num-requests", "5", "--no-baseline",
                              "--output", str(path)] + mesh, capsys)
    assert rc == 0
    outs.append(json.loads(path.read_text()))
  assert ("mesh: data=2 x model=2 on 4 cpu devices; weights 2-way tensor "
          "parallel") in out
  assert "32 blocks x 4 tokens in each of 2 data shards" in out
  assert outs[0]["requests"] == outs[1]["requests"]
  one, mesh = outs[0]["stats"]["paged"], outs[1]["stats"]["paged"]
  assert (one["devices"], mesh["devices"]) == (1, 4)
  # Two pools of the same size; each device holds 1 of 2 KV heads of one.
  assert mesh["kv_bytes"] == 2 * one["kv_bytes"]
  assert mesh["kv_bytes_per_device"] == one["kv_bytes"] // 2


def test_prompt_file_with_sampling_and_beam_search(tmp_path, capsys):
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([[5, 6, 7], [8, 9, 10, 11, 12], [13] * 70]))
  out_path = tmp_path / "out.json"
  rc, _, err = run(SMALL + ["--prompt-ids", str(prompts), "--n", "2",
                            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                            "--max-new-tokens", "5", "--no-baseline",
                            "--output", str(out_path)], capsys)
  assert rc == 0
  reqs = json.loads(out_path.read_text())["requests"]
  assert [len(r["completions"]) for r in reqs] == [2, 2, 0]
  assert "max_model_len=64" in reqs[2]["rejected"] and "rejected request 2" in err
  rc, _, _ = run(SMALL + ["--prompt-ids", str(prompts), "--beam-width", "2",
                          "--max-new-tokens", "4", "--no-baseline",
                          "--output", str(out_path)], capsys)
  assert rc == 0
  reqs = json.loads(out_path.read_text())["requests"]
  assert all("logprob" in c for c in reqs[0]["completions"])


def test_baseline_that_cannot_run_is_skipped_with_a_note(capsys):
  args = [a if a != "32" else "8" for a in SMALL]  # 8 blocks x 4 < max_model_len 64
  rc, out, _ = run(args + ["--num-requests", "2", "--max-new-tokens", "2"], capsys)
  assert rc == 0
  assert "contiguous baseline skipped: KV budget of 32 tokens is less than one" in out


def test_checkpoint_run(tmp_path, capsys):
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
  checkpoint.save_checkpoint(model, tmp_path / "ckpt")
  out_path = tmp_path / "out.json"
  rc, out, _ = run(SMALL + ["--checkpoint", str(tmp_path / "ckpt"), "--num-requests", "6",
                            "--no-baseline", "--output", str(out_path)], capsys)
  assert rc == 0 and "model: checkpoint" in out
  # Same weights as the default tiny model: same greedy outputs.
  rc, _, _ = run(SMALL + ["--num-requests", "6", "--no-baseline",
                          "--output", str(tmp_path / "tiny.json")], capsys)
  assert (json.loads(out_path.read_text())["requests"]
          == json.loads((tmp_path / "tiny.json").read_text())["requests"])


@pytest.fixture
def bad_checkpoint(tmp_path):
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(num_layers=1), seed=0)
  checkpoint.save_checkpoint(model, tmp_path)
  (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 512}')
  return tmp_path


@pytest.mark.parametrize("args,match", [
    (["--checkpoint", "/nonexistent/ckpt"], "error: checkpoint directory '/nonexistent/ckpt' does not exist"),
    (["--num-blocks", "0"], "error: --num-blocks must be >= 1"),
    (["--block-size", "0"], "error: --block-size must be >= 1"),
    (["--max-batch", "8", "--max-tokens-per-step", "4"], "error: max_tokens_per_step=4 must be >= max_batch=8"),
    (["--max-model-len", "5000"], "error: --max-model-len 5000 exceeds the model's max_position_embeddings"),
    (["--num-blocks", "4", "--kv-budget-mb", "1"], "error: give --num-blocks or --kv-budget-mb"),
    (["--kv-budget-mb", "0.00001"], "error: the KV budget holds 0 tokens"),
    (["--temperature", "-1"], "error: temperature must be >= 0"),
    (["--prompt-ids", "/nonexistent.json"], "error: prompt file '/nonexistent.json' not found"),
    (["--mesh", "data=2,modle=4"], "error: --mesh must look like data=2,model=4, got 'data=2,modle=4'"),
    (["--mesh", "data=4,model=4"], "error: a data=4 x model=4 mesh needs 16 devices, 8 available"),
    (["--mesh", "model=8"], "error: num_heads=4 must be a multiple of the model axis (8)"),
    (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
     "error: --process-id must be in [0, 2), got 2"),
])
def test_bad_input_is_one_error_line(args, match, capsys):
  rc, out, err = run(args + ["--no-progress"], capsys)
  assert rc == 2
  assert err.startswith(match), err
  assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("content,match", [
    ("[[1, 2], [3, 99999]]", "error: prompt 1: token id 99999 is outside the vocabulary"),
    ("{not json", "not valid JSON"),
    ('[[1, 2], "x"]', "prompt 1 must be a non-empty list of ints"),
    ("[]", "expected a non-empty JSON list"),
])
def test_bad_prompt_file(tmp_path, capsys, content, match):
  f = tmp_path / "p.json"
  f.write_text(content)
  rc, _, err = run(["--prompt-ids", str(f), "--no-progress"], capsys)
  assert rc == 2 and match in err and err.count("\n") == 1


def test_malformed_checkpoint_config(bad_checkpoint, capsys):
  rc, _, err = run(["--checkpoint", str(bad_checkpoint), "--no-progress"], capsys)
  assert rc == 2
  assert err == "error: config.json: missing required field 'num_attention_heads'\n"


def test_poisson_arrivals_and_latency_report(tmp_path, capsys):
  path = tmp_path / "out.json"
  rc, out, _ = run(SMALL + ["--num-requests", "4", "--request-rate", "40",
                            "--no-baseline", "--output", str(path)], capsys)
  assert rc == 0
  for label in ("time to first token", "time per output token",
                "inter-token latency", "rows computed"):
    assert label in out
  doc = json.loads(path.read_text())
  stats = doc["stats"]["paged"]
  lat = stats["latency_seconds"]
  assert lat["ttft"]["count"] == 4 and 0 < lat["ttft"]["p50"] <= lat["ttft"]["p99"]
  assert lat["itl"]["count"] > 0
  assert stats["padded_rows"] >= stats["computed_tokens"] > 0
  assert [r["request_id"] for r in doc["latency_seconds"]] == [0, 1, 2, 3]
  times = generate.poisson_arrivals(1000, 40.0, seed=0)
  assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
  assert abs(times[-1] / 999 - 1 / 40) < 0.1 / 40  # mean gap 1 / rate
  rc, _, err = run(SMALL + ["--request-rate", "0"], capsys)
  assert rc == 2 and "--request-rate must be positive, got 0.0" in err

