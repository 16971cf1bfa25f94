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


def _layer_types(d: dict, get: Getter, pattern: int) -> tuple[str, ...]:
  """`layer_types` from the config, or Hugging Face's default: every
  `pattern`-th layer (1-based) global, the others sliding."""
  types = d.get("layer_types")
  n = get("num_hidden_layers", int)
  if types is None:
    return tuple("full_attention" if (i + 1) % pattern == 0 else
                 "sliding_attention" for i in range(n))
  if not isinstance(types, list):
    raise ValueError(f"config.json: layer_types must be a list, got {types!r}")
  return tuple(types)


def _gemma_common(d: dict, get: Getter, name: str, pattern: int) -> dict:
  if d.get("use_bidirectional_attention"):
    raise ValueError(f"config.json: {name} with use_bidirectional_attention "
                     "is not supported (causal decoders only)")
  act = get("hidden_activation", str, None) or get("hidden_act", str,
                                                   "gelu_pytorch_tanh")
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"config.json: {name} hidden_activation {act!r} is not "
                     "supported (gelu_pytorch_tanh)")
  return dict(
      gemma_style=True, hidden_act="gelu_pytorch_tanh",
      attention_bias=get("attention_bias", bool, False),
      sliding_window=get("sliding_window", int, 4096),
      layer_types=_layer_types(d, get, pattern),
      query_pre_attn_scalar=get("query_pre_attn_scalar", float, 256.0),
      tie_word_embeddings=get("tie_word_embeddings", bool, True))


def _gemma2(d: dict, get: Getter) -> dict:
  return dict(
      _gemma_common(d, get, "Gemma2ForCausalLM", 2),
      attn_logit_softcapping=get("attn_logit_softcapping", float, 50.0),
      final_logit_softcapping=get("final_logit_softcapping", float, 30.0))


def _gemma3(d: dict, get: Getter) -> dict:
  # Imported here: checkpoint imports this module.
  from paged_jax.models.llama.checkpoint import rope_from_hf  # pylint: disable=import-outside-toplevel
  params = d.get("rope_parameters")
  if isinstance(params, dict) and "full_attention" in params:
    # transformers 5: one RoPE per layer type.
    full, local = params.get("full_attention") or {}, params.get(
        "sliding_attention") or {}
    theta, scaling = rope_from_hf({"rope_parameters": {
        "rope_theta": 1_000_000.0, **full}})
    local_theta, local_scaling = rope_from_hf({"rope_parameters": {
        "rope_theta": 10_000.0, **local}})
    if local_scaling is not None:
      raise ValueError("config.json: Gemma3ForCausalLM with RoPE scaling on "
                       "sliding layers is not supported")
  else:  # the older form: rope_theta, rope_scaling, rope_local_base_freq
    theta, scaling = rope_from_hf({"rope_theta": 1_000_000.0, **d})
    local_theta = get("rope_local_base_freq", float, 10_000.0)
  return dict(
      _gemma_common(d, get, "Gemma3ForCausalLM",
                    get("sliding_window_pattern", int, 6)),
      qk_norm=True, rope_theta=theta, rope_scaling=scaling,
      rope_local_theta=local_theta,
      attn_logit_softcapping=get("attn_logit_softcapping", float, None),
      final_logit_softcapping=get("final_logit_softcapping", float, None))


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", _llama),
    Family("Qwen2ForCausalLM", "qwen2", _qwen2),
    Family("Qwen3ForCausalLM", "qwen3", _qwen3),
    Family("MistralForCausalLM", "mistral", _mistral),
    Family("Gemma2ForCausalLM", "gemma2", _gemma2),
    Family("Gemma3ForCausalLM", "gemma3_text", _gemma3),
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
