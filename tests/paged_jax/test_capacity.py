"""Capacity planner: worked examples to the byte, inverse questions, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from paged_jax import capacity
from paged_jax.capacity import GIB, MIB

LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)


def test_worked_example_80gib_card():
  pool = capacity.kv_pool_bytes(80 * GIB, 0.9, 16 * GIB)
  assert pool == 56 * GIB
  p = capacity.plan(kv_pool_bytes=pool, **LLAMA_8B, kv_dtype="bfloat16",
                    block_size=16, avg_tokens=512, max_model_len=8192)
  assert p.bytes_per_block == 2 * MIB
  assert p.num_blocks == 28672
  assert p.blocks_per_seq == 32
  assert p.max_concurrency_paged == 896
  assert p.max_concurrency_contiguous == 56
  assert p.concurrency_ratio == 16.0


def test_worked_example_24gib_card():
  # 24 GiB card, 16 GiB of weights: all of the remaining 8 GiB is KV pool.
  assert capacity.kv_pool_bytes(24 * GIB, 1.0, 16 * GIB) == 8 * GIB
  p = capacity.plan(kv_pool_bytes=8 * GIB, **LLAMA_8B, block_size=16,
                    avg_tokens=128, max_model_len=8192)
  assert p.num_blocks == 4096
  assert p.blocks_per_seq == 8
  assert p.max_concurrency_paged == 512


def test_bytes_per_block_formula():
  # 2 x layers x block_size x kv_heads x (head_dim x dtype bytes + scale).
  assert capacity.bytes_per_block(80, 8, 128, 32, "fp8") == (
      2 * 80 * 32 * 8 * (128 + 4))  # a float32 scale per token and KV head
  assert capacity.bytes_per_block(80, 8, 128, 32, "float8_e5m2") == (
      2 * 80 * 32 * 8 * 128)  # not a scaled dtype of paged-jax
  assert capacity.bytes_per_block(2, 3, 5, 7, "float32") == 2 * 2 * 7 * 3 * 5 * 4


def test_partial_block_rounds_up():
  p = capacity.plan(kv_pool_bytes=8 * GIB, **LLAMA_8B, block_size=16,
                    avg_tokens=129, max_model_len=8192)
  assert p.blocks_per_seq == 9
  assert p.max_concurrency_paged == 4096 // 9


def test_inverse_questions():
  p = capacity.plan(kv_pool_bytes=56 * GIB, **LLAMA_8B, block_size=16,
                    avg_tokens=512, max_model_len=8192)
  assert p.blocks_for_concurrency(896) == 28672
  assert p.blocks_for_concurrency(1) == 32
  # 56 sequences that may all reach max length: exactly the contiguous case.
  assert p.max_model_len_for_concurrency(56) == 8192
  assert p.max_model_len_for_concurrency(896) == 512
  assert p.max_model_len_for_concurrency(1000) == (28672 // 1000) * 16
  assert p.max_model_len_for_concurrency(28673) == 0
  with pytest.raises(ValueError, match="num_seqs=0 must be a positive integer"):
    p.blocks_for_concurrency(0)
  with pytest.raises(ValueError, match="num_seqs=-1 must be a positive integer"):
    p.max_model_len_for_concurrency(-1)


def test_weight_bytes_from_params():
  assert capacity.weight_bytes(8 * 10**9, "bf16") == 16 * 10**9
  assert capacity.weight_bytes(3, "int4") == 2  # Rounded up.


def test_no_contiguous_fit_gives_no_ratio():
  block = capacity.bytes_per_block(**LLAMA_8B, block_size=16)
  p = capacity.plan(kv_pool_bytes=4 * block, **LLAMA_8B, block_size=16,
                    avg_tokens=16, max_model_len=8192)
  assert p.max_concurrency_contiguous == 0
  assert p.concurrency_ratio is None


@pytest.mark.parametrize("call, match", [
    (lambda: capacity.kv_pool_bytes(80 * GIB, 1.5, 0), r"util=1.5 must be in \(0, 1\]"),
    (lambda: capacity.kv_pool_bytes(80 * GIB, 0, 0), r"util=0.0 must be in \(0, 1\]"),
    (lambda: capacity.kv_pool_bytes(0, 0.9, 0), "mem_bytes=0 must be positive"),
    (lambda: capacity.kv_pool_bytes(GIB, 0.9, -1), "weight_bytes=-1 .* must be >= 0"),
    (lambda: capacity.kv_pool_bytes(GIB, 0.9, GIB), "no memory left for the KV cache"),
    (lambda: capacity.dtype_bytes("float7"), "unknown dtype 'float7'"),
    (lambda: capacity.dtype_bytes("int4"), "dtype 'int4' is sub-byte"),
    (lambda: capacity.weight_bytes(0), "num_params=0 must be a positive integer"),
    (lambda: capacity.bytes_per_block(0, 8, 128, 16), "num_layers=0 must be a positive"),
    (lambda: capacity.plan(kv_pool_bytes=GIB, **LLAMA_8B, block_size=16,
                           avg_tokens=9000, max_model_len=8192),
     "avg_tokens=9000 must be <= max_model_len=8192"),
    (lambda: capacity.plan(kv_pool_bytes=GIB, **LLAMA_8B, block_size=16,
                           avg_tokens=0, max_model_len=8192),
     "avg_tokens=0 must be a positive integer"),
    (lambda: capacity.plan(kv_pool_bytes=MIB, **LLAMA_8B, block_size=16,
                           avg_tokens=1, max_model_len=8192),
     "kv_pool_bytes=1048576 holds no block of 2097152 bytes"),
])
def test_api_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ---------------------------------------------------------------------------
# Command line.

EXAMPLE_80 = ("--model llama-3.1-8b --mem-gib 80 --util 0.9 --weights-gib 16 "
              "--avg-tokens 512 --max-model-len 8192")
JSON_KEYS = {"kv_pool_bytes", "bytes_per_block", "num_blocks", "blocks_per_seq",
             "max_concurrency_paged", "max_concurrency_contiguous",
             "concurrency_ratio"}


def _json(capsys, args: str) -> dict:
  assert capacity.main(args.split() + ["--json"]) == 0
  return json.loads(capsys.readouterr().out)


def test_cli_json_worked_example(capsys):
  out = _json(capsys, EXAMPLE_80)
  assert JSON_KEYS <= out.keys()
  assert out["bytes_per_block"] == 2 * MIB
  assert out["num_blocks"] == 28672
  assert out["max_concurrency_paged"] == 896
  assert out["max_concurrency_contiguous"] == 56
  assert out["concurrency_ratio"] == 16.0


def test_cli_explicit_shape_matches_preset(capsys):
  explicit = EXAMPLE_80.replace("--model llama-3.1-8b",
                                "--layers 32 --kv-heads 8 --head-dim 128 --kv-dtype bf16")
  assert _json(capsys, explicit) == _json(capsys, EXAMPLE_80)


@pytest.mark.parametrize("memory", [
    "--kv-pool-gib 8",
    "--mem-gib 24 --weights-gib 16 --kv-pool-gib 8",
    "--mem-gib 24 --util 1 --weights-gib 16",
])
def test_cli_24gib_example(capsys, memory):
  out = _json(capsys, f"--model llama-3.1-8b {memory} --avg-tokens 128 "
              "--max-model-len 8192 --target-concurrency 512")
  assert out["kv_pool_bytes"] == 8 * GIB
  assert out["num_blocks"] == 4096
  assert out["max_concurrency_paged"] == 512
  assert out["blocks_for_target"] == 4096
  assert out["kv_pool_bytes_for_target"] == 8 * GIB
  assert out["max_model_len_for_target"] == 128


def test_cli_params_and_workspace(capsys):
  out = _json(capsys, "--model llama-3.1-8b --mem-gib 80 --params 8e9 "
              "--weight-dtype int8 --workspace-gib 2 --avg-tokens 512 "
              "--max-model-len 8192")
  assert out["kv_pool_bytes"] == 72 * GIB - 8 * 10**9 - 2 * GIB
  # A preset alone sizes the weights from its parameter count.
  out = _json(capsys, "--model llama-3.1-8b --mem-gib 80 --avg-tokens 512 "
              "--max-model-len 8192")
  assert out["kv_pool_bytes"] == 72 * GIB - 2 * 8_030_261_248


def test_cli_text_report(capsys):
  assert capacity.main(EXAMPLE_80.split()) == 0
  text = capsys.readouterr().out
  assert "28672" in text and "896 paged vs 56 contiguous" in text and "16x" in text


@pytest.mark.parametrize("args, match", [
    # argparse rejections.
    ("--avg-tokens 512", "the following arguments are required: --max-model-len"),
    (EXAMPLE_80 + " --model gpt-9", "argument --model: invalid choice: 'gpt-9'"),
    (EXAMPLE_80 + " --layers x", "argument --layers: expected an integer, got 'x'"),
    (EXAMPLE_80 + " --block-size 0",
     r"argument --block-size: expected an integer in \[1, 2147483647\], got 0$"),
    (EXAMPLE_80 + " --mem-gib lots", "argument --mem-gib: expected a finite number, got 'lots'"),
    (EXAMPLE_80 + " --workspace-gib -1",
     r"argument --workspace-gib: expected a number in \[0, 1048576\], got -1$"),
    (EXAMPLE_80 + " --weights-gib 1/0", "argument --weights-gib: expected a finite number, got '1/0'"),
    # Overflowing, infinite and huge values (once tracebacks or a hang).
    (EXAMPLE_80 + " --weights-gib 0 --params inf",
     "argument --params: expected a finite number, got 'inf'$"),
    (EXAMPLE_80 + " --params 1e400",
     r"argument --params: expected a number in \[1, 1000000000000000\], got 1e400$"),
    (EXAMPLE_80 + " --params nan", "argument --params: expected a finite number, got 'nan'$"),
    (EXAMPLE_80 + " --mem-gib 1e999999",
     r"argument --mem-gib: expected a number in \(0, 1048576\], got 1e999999$"),
    (EXAMPLE_80 + " --mem-gib 1e99999999",
     r"argument --mem-gib: expected a number in \(0, 1048576\], got 1e99999999$"),
    (EXAMPLE_80 + " --kv-pool-gib 1e999999", r"argument --kv-pool-gib: expected a number in \(0, 1048576\]"),
    (EXAMPLE_80 + " --weights-gib 1e999999", r"argument --weights-gib: expected a number in \[0, 1048576\]"),
    (EXAMPLE_80 + " --workspace-gib 1e999999", r"argument --workspace-gib: expected a number in \[0, 1048576\]"),
    (EXAMPLE_80 + " --workspace-gib 1e-99999999",
     r"argument --workspace-gib: expected a number in \[0, 1048576\] with at most 30 decimal places"),
    (EXAMPLE_80 + " --layers 1" + "0" * 5000, "argument --layers: expected an integer, got '1000"),
    (EXAMPLE_80 + " --tp 99999999999999999999", r"argument --tp: expected an integer in \[1, 1048576\]"),
    # Values that round to nothing name the flag, not a derived size.
    ("--model llama-3.1-8b --kv-pool-gib 1e-20 --avg-tokens 1 --max-model-len 8",
     "--kv-pool-gib 1e-20 is less than one byte"),
    ("--model llama-3.1-8b --mem-gib 1e-20 --weights-gib 0 --avg-tokens 1 --max-model-len 8",
     "--mem-gib 1e-20 is less than one byte"),
    # Planner rejections.
    ("--mem-gib 80 --weights-gib 16 --avg-tokens 512 --max-model-len 8192",
     "missing --layers, --kv-heads, --head-dim"),
    (EXAMPLE_80 + " --util 1.2", r"argument --util: expected a number in \(0, 1\], got 1.2"),
    (EXAMPLE_80 + " --kv-dtype float7", "unknown dtype 'float7'"),
    (EXAMPLE_80 + " --kv-dtype int4", "dtype 'int4' is sub-byte"),
    (EXAMPLE_80 + " --params 8e9", "give --weights-gib or --params, not both"),
    ("--layers 32 --kv-heads 8 --head-dim 128 --mem-gib 80 --avg-tokens 512 "
     "--max-model-len 8192", "--mem-gib needs --weights-gib, --params or --model"),
    ("--model llama-3.1-8b --avg-tokens 512 --max-model-len 8192",
     "give --mem-gib \\(with weights\\) or --kv-pool-gib"),
    ("--model llama-3.1-8b --mem-gib 24 --weights-gib 16 --kv-pool-gib 9 "
     "--avg-tokens 512 --max-model-len 8192", "--kv-pool-gib 9 does not fit: 8 GiB left"),
    ("--model llama-3.1-8b --mem-gib 16 --weights-gib 16 --avg-tokens 512 "
     "--max-model-len 8192", "no memory left for the KV cache"),
    (EXAMPLE_80.replace("--avg-tokens 512", "--avg-tokens 9000"),
     "--avg-tokens 9000 must be <= --max-model-len 8192"),
    ("--model llama-3.1-8b --kv-pool-gib 0.001 --avg-tokens 1 --max-model-len 8",
     r"the KV pool from --kv-pool-gib \(1.024 MiB\) holds no block of 2 MiB \(--block-size 16\)"),
])
def test_cli_errors_are_one_line(capsys, args, match):
  try:
    status = capacity.main(args.split())
  except SystemExit as e:  # argparse
    status = e.code
  assert status == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  lines = captured.err.splitlines()
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("python -m paged_jax.capacity: error: ")
  assert re.search(match, lines[0]), lines[0]


def _run_main(argv, capsys) -> tuple[int, str]:
  try:
    rc = capacity.main(argv)
  except SystemExit as e:  # argparse's own errors
    rc = e.code
  return rc, capsys.readouterr().err


BAD_VALUES = (["--avg-tokens", "0"], [*EXAMPLE_80.split(), "--mem-gib", "1e99999999", "--json"],
              [*EXAMPLE_80.split(), "--params", "inf"])


def test_module_entry_point(capsys):
  result = subprocess.run(
      [sys.executable, "-m", "paged_jax.capacity", *EXAMPLE_80.split(), "--json"],
      capture_output=True, text=True, check=True)
  assert json.loads(result.stdout)["concurrency_ratio"] == 16.0
  # A bad value end to end (a process of its own: exit 2, one line, no
  # traceback, no hang); the others through `main`, which the module runs.
  result = subprocess.run([sys.executable, "-m", "paged_jax.capacity", *BAD_VALUES[0]],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2
  assert result.stderr.count("\n") == 1, result.stderr
  assert result.stderr.startswith("python -m paged_jax.capacity: error: ")
  for bad in BAD_VALUES:
    rc, err = _run_main(bad, capsys)
    assert rc == 2
    assert err.count("\n") == 1, err
    assert err.startswith("python -m paged_jax.capacity: error: ")


# Published Hugging Face config.json values of each preset: vocab, hidden,
# intermediate, layers, query heads, KV heads, head_dim, tied embeddings,
# q/k/v bias, norms per layer.
PUBLISHED = {
    "llama-2-7b": (32000, 4096, 11008, 32, 32, 32, 128, False, False, 2),
    "llama-3.1-8b": (128256, 4096, 14336, 32, 32, 8, 128, False, False, 2),
    "llama-3.1-70b": (128256, 8192, 28672, 80, 64, 8, 128, False, False, 2),
    "mistral-7b": (32000, 4096, 14336, 32, 32, 8, 128, False, False, 2),
    "qwen2.5-7b": (152064, 3584, 18944, 28, 28, 4, 128, False, True, 2),
    "gemma-2-9b": (256000, 3584, 14336, 42, 16, 8, 256, True, False, 4),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_configs(name):
  """Each preset's shape, and its parameter count recomputed from the
  published architecture (gated MLP, GQA attention, RMSNorm weights)."""
  vocab, hidden, inter, layers, heads, kv, hd, tied, qkv_bias, norms = PUBLISHED[name]
  q, k = heads * hd, kv * hd
  attn = hidden * (q + 2 * k) + q * hidden + (q + 2 * k) * qkv_bias
  per_layer = attn + 3 * hidden * inter + norms * hidden
  params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
  assert capacity.PRESETS[name] == capacity.ModelShape(layers, kv, hd, params)


def test_cli_several_devices(capsys):
  base = ("--layers 32 --kv-heads 8 --head-dim 128 --kv-pool-gib 56 "
          "--avg-tokens 512 --max-model-len 8192")
  one = _json(capsys, base)
  assert "devices" not in one and one["max_concurrency_paged"] == 896
  # tp 4: 2 of the 8 KV heads per device, a quarter of the block bytes.
  out = _json(capsys, base + " --tp 4 --dp 2")
  assert out["bytes_per_block"] == 512 * 1024
  assert out["kv_heads_per_device"] == 2 and out["kv_head_replication"] == 1
  assert out["max_concurrency_paged"] == 4 * 896
  assert out["max_concurrency_paged_total"] == 8 * 896
  assert out["devices"] == 8
  # tp 16 > 8 KV heads: each head stored twice, one per device.
  out = _json(capsys, base + " --tp 16")
  assert out["kv_heads_per_device"] == 1 and out["kv_head_replication"] == 2
  assert out["max_concurrency_paged_total"] == 8 * 896
  # Weights split over tp: 80 GiB per device, 16 GiB of weights over 4.
  out = _json(capsys, "--layers 32 --kv-heads 8 --head-dim 128 --mem-gib 80 "
              "--util 0.9 --weights-gib 16 --avg-tokens 512 "
              "--max-model-len 8192 --tp 4")
  assert out["kv_pool_bytes"] == 72 * GIB - 4 * GIB


def test_cli_tp_must_divide_kv_heads(capsys):
  assert capacity.main("--layers 2 --kv-heads 3 --head-dim 64 --kv-pool-gib 1 "
                       "--avg-tokens 8 --max-model-len 64 --tp 2".split()) == 2
  assert capsys.readouterr().err == (
      "python -m paged_jax.capacity: error: --kv-heads 3 and --tp 2 must "
      "divide one another\n")


@pytest.mark.parametrize("kv_dtype, name", [("int8", "int8"),
                                            ("fp8", "float8_e4m3fn")])
def test_cli_8bit_kv_counts_the_scales(capsys, kv_dtype, name):
  """int8 / fp8 blocks hold 1-byte values plus a float32 scale per token and
  KV head: (128 + 4) / 256 of a bf16 block for Llama 3.1 8B, so the same pool
  holds 256 / 132 = 1.94x the blocks, not 2x."""
  bf16 = _json(capsys, EXAMPLE_80)
  out = _json(capsys, EXAMPLE_80 + f" --kv-dtype {kv_dtype}")
  assert out["kv_dtype"] == name and bf16["kv_dtype"] == "bfloat16"
  assert out["bytes_per_token"] == 2 * 32 * 8 * (128 + 4) == 67584
  assert out["kv_scale_bytes_per_token"] == 2 * 32 * 8 * 4
  assert bf16["kv_scale_bytes_per_token"] == 0
  assert out["num_blocks"] == bf16["kv_pool_bytes"] // (16 * 67584) == 55606
  assert 1.93 < out["num_blocks"] / bf16["num_blocks"] < 1.94
  assert capacity.main((EXAMPLE_80 + f" --kv-dtype {kv_dtype}").split()) == 0
  assert (f"KV dtype:         {name} (+2 KiB of float32 scales per token, "
          "counted above)") in capsys.readouterr().out
