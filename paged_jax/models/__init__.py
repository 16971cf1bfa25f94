"""Models that serve through `paged_jax.serving` (the `ServingModel` protocol),
by Hugging Face `architectures`.

The API (every function returns a `ServingModel`, today always a
`paged_jax.models.llama.model.Llama`):

    from_hf(config: dict, tensors: Mapping[str, np.ndarray], *,
            dtype: str | None = None,
            implementation: str | None = None) -> ServingModel
        The model for a Hugging Face `config.json` dict and Hugging
        Face-named tensors (`model.embed_tokens.weight`,
        `model.layers.0.self_attn.q_proj.weight` `[out, in]`, ...; NumPy
        arrays, float32 / bfloat16 / float16, or lazy ones with `shape`,
        `dtype` and `__array__`, read once each). `dtype` ("float32",
        "bfloat16", "float16"): the parameter and compute dtype, default
        the config's `torch_dtype` (or `dtype`), else float32.
        `implementation`: the attention backend
        (`paged_jax.attention`). Every name, shape and dtype is checked
        against the config before anything is built.

    load_hf(path, *, dtype: str | None = None,
            implementation: str | None = None) -> ServingModel
        A Hugging Face directory: `config.json` and `*.safetensors` (one file
        or shards listed by `model.safetensors.index.json`). Every file's
        header is checked against its size first; then the tensors are read
        one at a time (peak host memory: the parameters plus about one
        stacked parameter).

    tiny(seed: int = 0, *, implementation: str | None = None,
         **overrides) -> ServingModel
        The seeded random tiny Llama the tests and `--model tiny` use
        (`LlamaConfig.tiny(**overrides)`, e.g. `num_layers=4`).

    config_from_hf(config: dict, *, dtype: str | None = None) -> LlamaConfig
        Just the configuration (checks the config, builds nothing).

    ARCHITECTURES: tuple[str, ...]
        The supported `architectures`: LlamaForCausalLM (Llama 2 / 3.x with
        llama3 RoPE scaling, SmolLM2), Qwen2ForCausalLM, Qwen3ForCausalLM,
        MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (text;
        local and global layers from `layer_types` or
        `sliding_window_pattern`). The engine reclaims the blocks a local
        layer can no longer see (`EngineConfig.sliding_window_reclamation`,
        on by default: Mistral in its one pool, Gemma with a KV pool per
        window, `paged_jax.serving.window_pool`).

Errors: `ValueError` (or `FileNotFoundError` for a missing path or file) with
one line naming what was expected and what was given, raised before any
weight is read: an unsupported architecture (with the supported list), a
missing, mistyped or absurd config field, a truncated or corrupt safetensors
file, a missing, unexpected or misshapen tensor.

Example:
    >>> import paged_jax.models as models
    >>> model = models.tiny(num_layers=1)
    >>> model.config.num_layers
    1
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from paged_jax.models.registry import ARCHITECTURES
from paged_jax.models.llama import checkpoint as _checkpoint
from paged_jax.models.llama import model as _model

config_from_hf = _checkpoint.config_from_hf

__all__ = ["ARCHITECTURES", "config_from_hf", "from_hf", "load_hf", "tiny"]


def from_hf(config: dict, tensors: Mapping[str, np.ndarray], *,
            dtype: str | None = None,
            implementation: str | None = None) -> _model.Llama:
  """The model for a Hugging Face config dict and Hugging Face-named tensors
  (see the module docstring).

  Raises:
    ValueError: for an unsupported architecture, a bad config field, or a
      missing, unexpected or misshapen tensor.
  """
  cfg = _checkpoint.config_from_hf(config, dtype=dtype)
  return _checkpoint.from_tensors(cfg, tensors, implementation=implementation)


def load_hf(path, *, dtype: str | None = None,
            implementation: str | None = None) -> _model.Llama:
  """The model in a Hugging Face checkpoint directory (see the module
  docstring; `paged_jax.models.llama.checkpoint.load_checkpoint`).

  Raises:
    FileNotFoundError: if the directory, `config.json` or a safetensors file
      is missing.
    ValueError: as `from_hf`, and for a truncated or corrupt file.
  """
  return _checkpoint.load_checkpoint(path, dtype=dtype,
                                     implementation=implementation)


def tiny(seed: int = 0, *, implementation: str | None = None,
         **overrides) -> _model.Llama:
  """The seeded random tiny Llama (`LlamaConfig.tiny(**overrides)`)."""
  return _model.init_model(_model.LlamaConfig.tiny(**overrides), seed,
                           implementation=implementation)
