"""Both command lines under hostile values: one line on stderr that starts
with the program's `error:` form, exit status 2, no traceback, before any work.

The property runs the CLIs' argument validation in-process (fast); two
subprocess runs prove the same end to end.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import subprocess
import sys

from hypothesis import given, settings, strategies as st

from paged_jax.entrypoints import generate
from paged_jax import capacity
from paged_jax.serving.config import MAX_MODEL_LEN, SIZE_LIMITS

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
       "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)

# Text that is no number at all, or a number no flag takes.
JUNK = st.one_of(
    st.sampled_from(["", " ", "nan", "-nan", "inf", "-inf", "Infinity", "1e400",
                     "1e999999", "1e99999999", "-1e99999999", "1e-99999999",
                     "0x10", "1_0_", "١٢", "²", "1/0", "--", "\n", "1\n2",
                     "9" * 5000, "\x00", "é" * 100]),
    st.text(max_size=12))

# generate.py: integer flags and their ranges. Flags that set an
# EngineConfig / SamplingParams field take their range from that class
# (`config.SIZE_LIMITS`, int32 for the sampling fields; the batch, 16 by
# default, bounds --n and --beam-width, the context, 256, --max-new-tokens);
# the others are the parser's. This table only picks values outside them.
INT32 = 2**31 - 1
GEN_INTS = {
    "--model-seed": (0, 2**63 - 1), "--num-requests": (1, generate.MAX_REQUESTS),
    "--workload-seed": (0, 2**63 - 1), "--max-new-tokens": (1, 255),
    "--top-k": (0, INT32), "--n": (1, 16), "--beam-width": (1, 16),
    "--seed": (0, INT32), "--block-size": (1, 256),
    "--num-blocks": (1, SIZE_LIMITS["num_blocks"]),
    "--max-batch": (1, 128), "--max-num-seqs": (1, 128),
    "--max-tokens-per-step": (16, SIZE_LIMITS["max_tokens_per_step"]),
    "--max-num-batched-tokens": (16, SIZE_LIMITS["max_tokens_per_step"]),
    "--max-model-len": (2, MAX_MODEL_LEN),
    "--num-processes": (1, generate.MAX_PROCESSES),
    "--process-id": (0, generate.MAX_PROCESSES),
}
GEN_NUMBERS = {"--temperature": (0, 10**39), "--top-p": (0, 1),  # > FLOAT32_MAX
               "--kv-budget-mb": (0, generate.MAX_KV_MB)}
CAP_BASE = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64",
            "--avg-tokens", "8", "--max-model-len", "64"]
CAP_INTS = {f: (1, capacity.MAX_COUNT) for f in (
    "--layers", "--kv-heads", "--head-dim", "--block-size", "--avg-tokens",
    "--max-model-len", "--target-concurrency")}
CAP_INTS.update({"--tp": (1, capacity.MAX_DEVICES), "--dp": (1, capacity.MAX_DEVICES)})
CAP_NUMBERS = {"--mem-gib": (0, capacity.MAX_GIB), "--kv-pool-gib": (0, capacity.MAX_GIB),
               "--weights-gib": (0, capacity.MAX_GIB), "--workspace-gib": (0, capacity.MAX_GIB),
               "--util": (0, 1), "--params": (1, capacity.MAX_PARAMS)}


def _is_int_in(text, lo, hi) -> bool:
  try:
    return lo <= int(text) <= hi
  except ValueError:
    return False


def _is_number_in(text, lo, hi) -> bool:
  try:
    x = float(text)
  except ValueError:
    return "/" in text  # a ratio may be a valid number for capacity
  return lo <= x <= hi  # False for nan and inf


@st.composite
def bad_value(draw, table, number: bool):
  flag = draw(st.sampled_from(sorted(table)))
  lo, hi = table[flag]
  outside = st.one_of(st.integers(max_value=lo - 1), st.integers(min_value=hi + 1))
  value = draw(st.one_of(outside.map(str), JUNK))
  valid = _is_number_in if number else _is_int_in
  if valid(value, lo, hi):
    value = str(hi + 1)
  if value.startswith("-") and not value[1:2].isdigit():
    value = "x" + value  # "--", "-inf": argparse would read another flag
  return flag, value


def _one_error_line(call, prefix: str) -> str:
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      status = call()
    except SystemExit as e:
      status = e.code
  text = err.getvalue()
  assert status == 2, (status, text)
  assert text.count("\n") == 1 and text.endswith("\n"), text
  assert text.startswith(prefix) and "Traceback" not in text, text
  return text


def _generate(argv):
  return _one_error_line(lambda: generate.parse_and_check(argv), "error: ")


def _capacity(argv):
  return _one_error_line(lambda: capacity.main(argv),
                         "python -m paged_jax.capacity: error: ")


@SETTINGS
@given(st.one_of(bad_value(GEN_INTS, number=False), bad_value(GEN_NUMBERS, number=True)))
def test_generate_refuses_out_of_range_flags(flag_value):
  flag, value = flag_value
  assert flag in _generate([flag, value])


@SETTINGS
@given(st.one_of(bad_value(CAP_INTS, number=False), bad_value(CAP_NUMBERS, number=True)))
def test_capacity_refuses_out_of_range_flags(flag_value):
  flag, value = flag_value
  base = CAP_BASE + (["--kv-pool-gib", "1"] if flag != "--kv-pool-gib" else [])
  assert flag in _capacity(base + [flag, value])


@SETTINGS
@given(batch=st.integers(2, SIZE_LIMITS["max_batch"]), data=st.data())
def test_generate_refuses_inconsistent_sizes(batch, data):
  """Cross-flag rules name the flags typed (aliases included)."""
  step = data.draw(st.integers(1, batch - 1))
  b, t = data.draw(st.sampled_from([("--max-batch", "--max-tokens-per-step"),
                                    ("--max-num-seqs", "--max-num-batched-tokens")]))
  err = _generate([b, str(batch), t, str(step)])
  assert err == f"error: {t} {step} must be >= {b} {batch} so every decode fits a step\n"
  block = data.draw(st.integers(257, SIZE_LIMITS["block_size"]))
  assert _generate(["--block-size", str(block)]).startswith(
      f"error: --block-size {block} must be <= --max-model-len 256")
  n = data.draw(st.integers(17, SIZE_LIMITS["max_batch"]))
  assert _generate(["--n", str(n)]) == (
      f"error: --n {n}: every request would be rejected: needs {n} sequences at "
      "once, --max-batch is 16\n")


@SETTINGS
@given(junk=st.text(min_size=1, max_size=30), choice=st.sampled_from(
    ["--mesh", "--coordinator", "--dtype", "--implementation", "--output", "--bogus"]))
def test_generate_refuses_malformed_text(junk, choice):
  """Malformed text values (control characters included) stay one line."""
  if choice == "--output":
    value = f"/nonexistent{junk}/out.json"
  elif choice == "--mesh":
    value = f"data={junk}x"
  elif choice == "--coordinator":
    value = junk.replace(":", "") + "\n"
  else:
    value = junk + "\x00"
  if value.startswith("-"):
    value = "x" + value
  _generate([choice, value])


def test_end_to_end_subprocess():
  """A real run of the script: the device-memory check, after the model is
  built and before the pool is allocated (once an XLA out-of-memory
  traceback). `python -m paged_jax.capacity` is run end to end in
  tests/paged_jax/test_capacity.py."""
  r = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"),
                      "--model", "tiny", "--num-blocks", "100000000", "--no-progress"],
                     capture_output=True, text=True, timeout=300, env=ENV)
  assert r.returncode == 2, r.stderr
  assert r.stderr.startswith("error: --num-blocks 100000000 needs 763 GiB of KV "
                             "memory, more than the "), r.stderr
  assert r.stderr.count("\n") == 1 and r.stdout == ""


@SETTINGS
@given(junk=st.text(min_size=1, max_size=30), choice=st.sampled_from(
    ["--model", "--kv-dtype", "--weight-dtype", "--bogus"]))
def test_capacity_refuses_malformed_text(junk, choice):
  value = ("x" + junk if junk.startswith("-") else junk) + "\x00"
  base = CAP_BASE + ["--mem-gib", "80", "--weights-gib", "1"]
  _capacity(base + [choice, value])


def test_abbreviated_flags_are_refused_not_guessed():
  # argparse's prefix matching read `--max-tokens 0` as `--max-tokens-per-step
  # 0` (and `--temp 2` as `--temperature 2`): every CLI takes full names only.
  for argv in (["--max-tokens", "0"], ["--temp", "2"], ["--max-num-seq", "4"]):
    assert f"unrecognized arguments: {' '.join(argv)}" in _generate(argv)
  assert "unrecognized arguments: --mem 8" in _capacity(CAP_BASE + ["--mem", "8"])
