"""`examples/generate.py`: end-to-end runs and its one-line errors."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from paged_jax.entrypoints import generate
from paged_jax.models.llama import checkpoint
from paged_jax.models.llama import model as model_lib

# The sizes of the engine tests (tests/examples/conftest.py), so that the
# compiled steps are shared: 32 blocks x 4 tokens = 128 KV tokens.
SMALL = ["--model", "tiny", "--block-size", "4", "--num-blocks", "32", "--max-batch", "4",
         "--max-tokens-per-step", "16", "--max-model-len", "64", "--no-progress",
         "--no-compile-cache", "--min-bucket", "16"]  # 2 step shapes: decode 4, mixed 16


def same_requests(a: list, b: list, atol: float = 1e-4):
  """`--output` requests equal: token ids, finish reasons exactly; the
  sampled tokens' log-probs to `atol` (their float noise depends on the
  layout a token was computed in: batch, mesh, processes)."""
  def split(reqs):
    ids, lps = [], []
    for r in reqs:
      r = dict(r, completions=[dict(c) for c in r["completions"]])
      for c in r["completions"]:
        lps.extend(c.pop("token_logprobs", None) or [])
      ids.append(r)
    return ids, np.array(lps)
  (ia, la), (ib, lb) = split(a), split(b)
  assert ia == ib
  np.testing.assert_allclose(la, lb, atol=atol)


def run(args, capsys):
  rc = generate.main(args)  # returns argparse's SystemExit code too
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
  # --min-bucket reaches both engines: 2 step shapes each (decode, mixed).
  assert stats["paged"]["buckets_compiled"] == stats["contiguous"]["buckets_compiled"] == 2
  # Prefix caching is off by default (its cost at 0% hits, RESULTS.md 11).
  assert not stats["paged"]["prefix_caching"] and not stats["contiguous"]["prefix_caching"]
  assert stats["paged"]["prefix_queried_tokens"] == 0
  assert "  prefix cache        off" in out


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
  same_requests(outs[0]["requests"], outs[1]["requests"])
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
  assert rc == 0 and f"model: ckpt from {tmp_path / 'ckpt'} (2 layers" in out
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
    (["--checkpoint", "/nonexistent/ckpt"], "error: --model '/nonexistent/ckpt': no such file or directory (expected 'tiny', "
     "'smollm2', a .gguf file or a Hugging Face directory)\n"),
    (["--num-blocks", "0"], "error: --num-blocks must be a positive int, got 0\n"),
    (["--block-size", "0"], "error: --block-size must be a positive int, got 0\n"),
    (["--max-batch", "8", "--max-tokens-per-step", "4"],
     "error: --max-tokens-per-step 4 must be >= --max-batch 8 so every decode fits a step\n"),
    # vLLM's names are aliases; a message names the flag that was typed.
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
     "error: --max-num-batched-tokens 4 must be >= --max-num-seqs 8 so every decode fits a step\n"),
    (["--max-model-len", "5000"], "error: --max-model-len 5000 exceeds the model's max_position_embeddings"),
    (["--num-blocks", "4", "--kv-budget-mb", "1"], "error: give --num-blocks or --kv-budget-mb"),
    (["--kv-budget-mb", "0.00001"],
     "error: --kv-budget-mb 1e-05 holds 0 tokens, less than one block of --block-size 16\n"),
    (["--temperature", "-1"], "error: --temperature must be >= 0 and finite, got -1.0\n"),
    (["--prompt-ids", "/nonexistent.json"], "error: prompt file '/nonexistent.json' not found"),
    (["--mesh", "data=2,modle=4"],
     "error: --mesh must look like data=2,model=4 (each from 1 to 4096), got 'data=2,modle=4'\n"),
    (["--mesh", "data=4,model=4"], "error: a data=4 x model=4 mesh needs 16 devices, 8 available"),
    (["--mesh", "model=8"], "error: num_heads=4 must be a multiple of the model axis (8)"),
    (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
     "error: --process-id must be in [0, 2), got 2"),
    # Each of these was a traceback, a hang or silently accepted (issue 12).
    (["--implementation", "pallas_tpu"],
     "error: --implementation pallas_tpu cannot serve this model here: it runs on tpu, "
     "the default backend is cpu"),
    (["--implementation", "pallas_gpu"],
     "error: --implementation pallas_gpu cannot serve this model here: it runs on gpu"),
    (["--output", "/nonexistent/dir/out.json"],
     "error: --output '/nonexistent/dir/out.json': folder '/nonexistent/dir' does not exist\n"),
    (["--output", "/"], "error: --output '/' is a folder; give a file name\n"),
    (["--num-blocks", "100000000"], "error: --num-blocks 100000000 needs 763 GiB of KV memory, "
     "more than the "),
    (["--kv-budget-mb", "1e9"], "error: --kv-budget-mb 1e+09 needs 954 TiB of KV memory, more than the "),
    (["--model-seed", str(2**64)],
     "error: argument --model-seed: expected an integer in [0, 9223372036854775807], "
     "got 18446744073709551616\n"),
    (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1, got 0\n"),
    (["--max-new-tokens", "256"], "error: every request would be rejected: prompt (1) + --max-new-tokens (256) = 257 exceeds --max-model-len 256\n"),
    (["--block-size", "100000"], "error: --block-size 100000 must be <= --max-model-len 256\n"),
    (["--max-model-len", "1"], "error: --max-model-len must be >= 2, got 1\n"),
    (["--n", "2", "--seed", "2147483647"],
     "error: --seed + 1 (sample i uses --seed + i) must be < 2**31, got --seed 2147483647\n"),
    (["--n", "17"], "error: --n 17: every request would be rejected: needs 17 sequences at once, --max-batch is 16\n"),
    (["--beam-width", "8", "--max-num-seqs", "4", "--max-tokens-per-step", "8"],
     "error: --beam-width 8 must be <= --max-num-seqs 4"),
    (["--n", "2", "--beam-width", "2"], "error: use --n or --beam-width, not both (got --n 2, --beam-width 2)\n"),
    (["--top-k", str(2**40)], "error: --top-k must be >= 0 and < 2**31, got 1099511627776\n"),
    (["--top-p", "nan"], "error: argument --top-p: expected a finite number, got 'nan'\n"),
    (["--num-requests", "10000000000"], "error: argument --num-requests: expected an integer in [1, 100000]"),
    (["--coordinator", "nocolon"], "error: --coordinator must look like HOST:PORT, got 'nocolon'\n"),
])
def test_bad_input_is_one_error_line(args, match, capsys):
  rc, out, err = run(["--model", "tiny"] + args + ["--no-progress"], capsys)
  assert rc == 2
  assert err.startswith(match), err
  assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("content,match", [
    ("[[1, 2], [3, 99999]]", "error: prompt 1: prompt token 99999 is outside the vocabulary"),
    ("[[1, 2.0]]", "prompt 0, token 1: expected an int token id, got 2.0 (float)"),
    ("[[true, 2]]", "prompt 0, token 0: expected an int token id, got True (bool)"),
    ("[[1e400]]", "prompt 0, token 0: expected an int token id, got inf (float)"),
    ("[" * 100000 + "]" * 100000, "JSON nested too deeply"),
    ("[[" + "1" * 5000 + "]]", "cannot read it (Exceeds the limit"),
    ('[{"prompt_ids": [1, 2], "max_new_tokens": 0}]', "prompt 0: max_new_tokens must be an int >= 1, got 0"),
    ('[{"prompt_ids": [1, 2], "max_new_token": 3}]',
     "prompt 0: expected keys prompt_ids and optionally max_new_tokens, got ['max_new_token', 'prompt_ids']"),
    ('[{"prompt_ids": [1, 2], "max_new_tokens": true}]', "max_new_tokens must be an int >= 1, got True"),
    ("{not json", "not valid JSON"),
    ('[[1, 2], "x"]', "prompt 1 must be a non-empty list of ints"),
    ("[]", "expected a non-empty JSON list"),
])
def test_bad_prompt_file(tmp_path, capsys, content, match):
  f = tmp_path / "p.json"
  f.write_text(content)
  rc, _, err = run(["--model", "tiny", "--prompt-ids", str(f), "--no-progress"], capsys)
  assert rc == 2 and match in err and err.count("\n") == 1


def test_malformed_checkpoint_config(bad_checkpoint, capsys):
  rc, _, err = run(["--checkpoint", str(bad_checkpoint), "--no-progress"], capsys)
  assert rc == 2
  assert err == "error: config.json: missing required field 'num_attention_heads'\n"


def test_prompt_objects_ignore_eos_and_exact_kv_bytes(tmp_path, capsys):
  """Objects give per-request budgets beside plain lists; --ignore-eos makes
  each request generate exactly its budget even where the model stops."""
  # The tiny model's greedy continuation of this prompt is its EOS (2) at
  # the third token.
  stops = [254, 431, 320, 36]
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([{"prompt_ids": [5, 6, 7], "max_new_tokens": 3},
                                 [8, 9, 10], {"prompt_ids": stops}]))
  out = tmp_path / "out.json"
  got = {}
  for extra in ([], ["--ignore-eos"]):
    rc, text, _ = run(SMALL + ["--prompt-ids", str(prompts), "--max-new-tokens", "6",
                               "--no-baseline", "--output", str(out)] + extra, capsys)
    assert rc == 0
    got[bool(extra)] = [(len(c["token_ids"]), c["finish_reason"], c["token_ids"][-1])
                        for r in json.loads(out.read_text())["requests"]
                        for c in r["completions"]]
  # 32 blocks x 4 tokens x 512 bytes per token (2 layers, K and V, 2 heads x 16, f32).
  assert "KV memory allocated 65536 bytes (0.06 MiB: 32 blocks x 4 tokens)" in text
  assert [n for n, _, _ in got[True]] == [3, 6, 6]
  assert {reason for _, reason, _ in got[True]} == {"length"}
  assert got[False][2] == (3, "stop", 2)
  assert got[False][:2] == got[True][:2]


def test_block_size_keeps_the_kv_memory(capsys):
  """Memory first: without --num-blocks, --block-size changes the number of
  blocks, not the bytes; --num-blocks still sets the pool explicitly."""
  per_token = model_lib.LlamaConfig.tiny().kv_bytes_per_token()
  sizes = {}
  for block in ("8", "16", "32"):
    args = generate.parse_and_check(["--block-size", block])
    tokens, source = generate.kv_tokens_from_args(args, per_token)
    sizes[block] = tokens // int(block)
    assert tokens == generate.DEFAULT_KV_TOKENS and source.startswith("the default")
  assert sizes == {"8": 128, "16": 64, "32": 32}
  args = generate.parse_and_check(["--block-size", "48", "--kv-budget-mb", "1"])
  tokens, _ = generate.kv_tokens_from_args(args, per_token)
  assert tokens == 2**20 // per_token == 2048  # 42 whole blocks of 48 are allocated
  args = generate.parse_and_check(["--block-size", "8", "--num-blocks", "10"])
  assert generate.kv_tokens_from_args(args, per_token) == (80, "--num-blocks 10")


def test_prefix_caching_flag():
  assert not generate.parse_and_check([]).enable_prefix_caching
  assert generate.parse_and_check(["--enable-prefix-caching"]).enable_prefix_caching


def test_vllm_aliases():
  args = generate.parse_and_check(["--max-num-seqs", "8", "--max-num-batched-tokens", "64"])
  assert (args.max_batch, args.max_tokens_per_step) == (8, 64)
  args = generate.parse_and_check(["--max-batch", "8"])
  assert args.max_batch == 8 and generate.ea.flag(args, "max_batch") == "--max-batch"


class _FakeDevice:
  platform, id = "gpu", 3

  def memory_stats(self):
    return {"bytes_limit": 8 * 2**30, "bytes_in_use": 6 * 2**30}


def test_kv_memory_is_checked_against_the_device():
  generate.check_kv_memory(2**30, 4 * 2**30, "--num-blocks 10", [_FakeDevice()])
  with pytest.raises(ValueError, match=r"^--num-blocks 99 needs 3 GiB of KV memory per "
                     r"device, more than the 2 GiB of gpu device 3$"):
    generate.check_kv_memory(3 * 2**30, 6 * 2**30, "--num-blocks 99", [_FakeDevice()])
  free, where = generate.free_memory_bytes(jax.devices("cpu")[0])
  assert free > 0 and where.startswith("host memory")


def test_every_request_rejected_exits_1_after_the_report(tmp_path, capsys):
  out = tmp_path / "out.json"
  prompts = tmp_path / "p.json"
  prompts.write_text(json.dumps([[5] * 70, [6] * 80]))
  rc, text, err = run(SMALL + ["--prompt-ids", str(prompts), "--no-baseline",
                               "--output", str(out)], capsys)
  assert rc == 1
  assert "requests served     0 of 2 (2 rejected)" in text and out.exists()
  assert err.splitlines()[-1] == "error: all 2 requests were rejected"


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
  assert rc == 2 and "--request-rate" in err and err.count("\n") == 1


def test_kv_cache_dtype_is_allocated_and_reported(model):
  """--kv-cache-dtype reaches the engine's cache; with --kv-budget-mb fixed,
  8-bit pages hold as many more tokens as their bytes (scales counted) allow;
  what is reported is read from the allocated arrays, so a dtype the engine
  ignored would show."""
  from paged_jax.entrypoints import workload  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine  # pylint: disable=import-outside-toplevel
  cfg = model.config  # float32, head_dim 16, 2 layers, 2 KV heads
  want = {"auto": "float32", "bfloat16": "bfloat16", "int8": "int8",
          "fp8": "float8_e4m3fn"}
  tokens = {}
  for flag, dtype in want.items():
    args = generate.parse_and_check(["--kv-cache-dtype", flag,
                                     "--kv-budget-mb", "0.25"])
    per_token = cfg.kv_bytes_per_token(args.kv_cache_dtype)
    tokens[flag], _ = generate.kv_tokens_from_args(args, per_token)
    config = workload.engine_config(
        "paged", kv_tokens=tokens[flag], block_size=16, max_batch=2,
        max_tokens_per_step=16, max_model_len=64,
        cache_dtype=args.kv_cache_dtype)
    kv = workload.allocated_cache(Engine(model, config).cache)
    assert kv == {"dtype": dtype, "scales": flag in ("int8", "fp8"),
                  "bytes": config.num_blocks * 16 * per_token,
                  "bytes_per_token": per_token}, flag
    line = generate.kv_cache_line(kv)
    assert line.startswith(f"  KV cache allocated  {dtype}")
    assert f"{per_token} bytes per token" in line
  # 2 (K, V) x 2 layers x 2 heads x (16 x 4) bytes vs (16 x 1 + 4) bytes.
  assert cfg.kv_bytes_per_token("float32") == 512
  assert cfg.kv_bytes_per_token("int8") == cfg.kv_bytes_per_token("fp8") == 160
  assert tokens["int8"] == tokens["fp8"] == 2**18 // 160
  assert tokens["auto"] == 2**18 // 512 and tokens["bfloat16"] == 2**18 // 256
  with pytest.raises(SystemExit):
    generate.parse_and_check(["--kv-cache-dtype", "int4"])
