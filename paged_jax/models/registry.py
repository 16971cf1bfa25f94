"""The model families `paged_jax.models` builds, keyed by Hugging Face
`architectures`.

Each `Family` says how a Hugging Face `config.json` turns into the switches of
the one Llama-family decoder (`paged_jax.models.llama.model`). A config names
its family by `architectures` (or, without it, by `model_type`); any other
architecture is refused by name, with the supported list.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from paged_jax.models.llama import model as llama_model

# get(key, kind, default) reads a typed config field (checkpoint._get).
Getter = Callable[..., object]


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    architecture: the Hugging Face `architectures` entry, e.g.
      "Qwen2ForCausalLM".
    model_type: the config's `model_type` for that architecture.
    switches: `(config dict, get) -> {LlamaConfig field: value}`: the
      family's own fields (the shared ones are read by
      `checkpoint.config_from_hf`).
    model: the module class built for it (it has `abstract(config, *,
      implementation)`, a weightless instance `nnx.update` fills).
  """

  architecture: str
  model_type: str
  switches: Callable[[dict, Getter], dict]
  model: type = llama_model.Llama


def _no_sliding_window(d: dict, get: Getter, name: str):
  """Qwen's sliding windows are per layer (`layer_types`); refused."""
  layer_types = d.get("layer_types") or []
  if get("use_sliding_window", bool, False) or any(
      t != "full_attention" for t in layer_types):
    raise ValueError(f"config.json: {name} with sliding-window layers "
                     "(use_sliding_window / layer_types) is not supported")


def _llama(d: dict, get: Getter) -> dict:
  return dict(attention_bias=get("attention_bias", bool, False),
              mlp_bias=get("mlp_bias", bool, False))


def _qwen2(d: dict, get: Getter) -> dict:
  _no_sliding_window(d, get, "Qwen2ForCausalLM")
  return dict(qkv_bias=True)


def _qwen3(d: dict, get: Getter) -> dict:
  _no_sliding_window(d, get, "Qwen3ForCausalLM")
  return dict(qk_norm=True, attention_bias=get("attention_bias", bool, False))


def _mistral(d: dict, get: Getter) -> dict:
  return dict(sliding_window=get("sliding_window", int, None))


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", _llama),
    Family("Qwen2ForCausalLM", "qwen2", _qwen2),
    Family("Qwen3ForCausalLM", "qwen3", _qwen3),
    Family("MistralForCausalLM", "mistral", _mistral),
)}
ARCHITECTURES = tuple(FAMILIES)


def family(d: dict) -> Family:
  """The `Family` of a Hugging Face config dict.

  Read from `architectures` (a list with one entry); a config without it is
  taken by its `model_type` ("llama" if absent too).

  Raises:
    ValueError: naming the architecture (or model type) and the supported
      ones when it is not registered, or if `architectures` is malformed.
  """
  archs = d.get("architectures")
  if archs is None:
    model_type = d.get("model_type", "llama")
    for f in FAMILIES.values():
      if f.model_type == model_type:
        return f
    raise ValueError(f"config.json: model_type {model_type!r} is not supported "
                     f"(supported: {', '.join(f.model_type for f in FAMILIES.values())})")
  if (not isinstance(archs, list) or len(archs) != 1
      or not isinstance(archs[0], str)):
    raise ValueError(f"config.json: architectures must be a list of one name, "
                     f"got {archs!r}")
  if archs[0] not in FAMILIES:
    raise ValueError(f"config.json: architecture {archs[0]!r} is not supported "
                     f"(supported: {', '.join(ARCHITECTURES)})")
  return FAMILIES[archs[0]]
