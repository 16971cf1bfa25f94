"""Hugging Face Llama checkpoints: `config.json` plus `*.safetensors`.

`load_checkpoint(dir)` reads the config, builds the NNX model without
initialising it (`nnx.eval_shape`) and fills every parameter from the
safetensors files, checking names and shapes. `save_checkpoint` writes the
same layout (used by tests and to export the random tiny model).

Hugging Face stores linear weights as `[out, in]`; NNX kernels are `[in, out]`.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from paged_jax.models.llama import model as model_lib
from paged_jax import rope as rope_lib

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "torch.float32": "float32", "torch.bfloat16": "bfloat16",
                "torch.float16": "float16"}


def _get(d: dict, key: str, kind, default=...):
  if key not in d or d[key] is None:
    if default is ...:
      raise ValueError(f"config.json: missing required field {key!r}")
    return default
  value = d[key]
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if kind is int and isinstance(value, bool) or not isinstance(value, kind):
    raise ValueError(f"config.json: field {key!r} must be {kind.__name__}, "
                     f"got {value!r}")
  return value


def _rope_from_hf(d: dict) -> tuple[float, object]:
  """(theta, scaling) from either the old (`rope_theta`, `rope_scaling`) or the
  new (`rope_parameters`) Hugging Face config form."""
  params = d.get("rope_parameters")
  if isinstance(params, dict) and params:
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = params
  else:
    theta = _get(d, "rope_theta", float, 10000.0)
    scaling = d.get("rope_scaling")
  if not scaling:
    return theta, None
  if not isinstance(scaling, dict):
    raise ValueError(f"config.json: rope scaling must be an object, got {scaling!r}")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  try:
    if kind == "default":
      return theta, None
    if kind == "llama3":
      return theta, rope_lib.Llama3Scaling(
          factor=float(scaling["factor"]),
          low_freq_factor=float(scaling["low_freq_factor"]),
          high_freq_factor=float(scaling["high_freq_factor"]),
          original_max_position_embeddings=int(
              scaling["original_max_position_embeddings"]))
    if kind == "linear":
      return theta, rope_lib.LinearScaling(factor=float(scaling["factor"]))
  except KeyError as e:
    raise ValueError(f"config.json: {kind} rope scaling lacks {e.args[0]!r}") from None
  raise ValueError(f"config.json: unsupported rope scaling type {kind!r} "
                   "(supported: default, llama3, linear)")


def config_from_hf(d: dict, *, dtype: str | None = None) -> model_lib.LlamaConfig:
  """`LlamaConfig` from a Hugging Face `config.json` dict.

  Args:
    d: the parsed `config.json`.
    dtype: parameter dtype; default the checkpoint's `torch_dtype` (or
      `dtype`), float32 if absent.

  Raises:
    ValueError: for a non-Llama model, a missing or mistyped field, or an
      unsupported RoPE scaling.
  """
  if not isinstance(d, dict):
    raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
  model_type = d.get("model_type", "llama")
  if model_type != "llama":
    raise ValueError(f"config.json: model_type {model_type!r} is not 'llama'")
  num_heads = _get(d, "num_attention_heads", int)
  hidden = _get(d, "hidden_size", int)
  theta, scaling = _rope_from_hf(d)
  eos = d.get("eos_token_id")
  eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  if not all(isinstance(t, int) for t in eos_ids):
    raise ValueError(f"config.json: eos_token_id must be int or list of int, got {eos!r}")
  if dtype is None:
    name = d.get("torch_dtype") or d.get("dtype") or "float32"
    if name not in _DTYPE_NAMES:
      raise ValueError(f"config.json: unsupported dtype {name!r}")
    dtype = _DTYPE_NAMES[name]
  if num_heads <= 0 or hidden % num_heads and "head_dim" not in d:
    raise ValueError(f"config.json: hidden_size={hidden} is not divisible by "
                     f"num_attention_heads={num_heads} and head_dim is not given")
  return model_lib.LlamaConfig(
      vocab_size=_get(d, "vocab_size", int),
      hidden_size=hidden,
      intermediate_size=_get(d, "intermediate_size", int),
      num_layers=_get(d, "num_hidden_layers", int),
      num_heads=num_heads,
      num_kv_heads=_get(d, "num_key_value_heads", int, num_heads),
      head_dim=_get(d, "head_dim", int, hidden // num_heads),
      rms_norm_eps=_get(d, "rms_norm_eps", float, 1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      tie_word_embeddings=_get(d, "tie_word_embeddings", bool, False),
      attention_bias=_get(d, "attention_bias", bool, False),
      mlp_bias=_get(d, "mlp_bias", bool, False),
      max_position_embeddings=_get(d, "max_position_embeddings", int, 2048),
      eos_token_ids=eos_ids,
      dtype=dtype,
  )


def config_to_hf(config: model_lib.LlamaConfig) -> dict:
  """The Hugging Face `config.json` dict for `config`."""
  d = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
      "tie_word_embeddings": config.tie_word_embeddings,
      "attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias,
      "max_position_embeddings": config.max_position_embeddings,
      "hidden_act": "silu", "torch_dtype": config.dtype,
  }
  if config.eos_token_ids:
    d["eos_token_id"] = list(config.eos_token_ids)
  s = config.rope_scaling
  if isinstance(s, rope_lib.Llama3Scaling):
    d["rope_scaling"] = {
        "rope_type": "llama3", "factor": s.factor,
        "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings}
  elif isinstance(s, rope_lib.LinearScaling):
    d["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
  return d


def _hf_name(path: tuple) -> tuple[str, bool]:
  """(Hugging Face tensor name, whether it is a transposed linear kernel)."""
  *mods, leaf = [str(p) for p in path]
  if mods == ["embed_tokens"]:
    return "model.embed_tokens.weight", False
  if mods == ["lm_head"]:
    return "lm_head.weight", True
  prefix = "model." + ".".join(mods)
  if leaf == "kernel":
    return prefix + ".weight", True
  return f"{prefix}.{leaf}", False  # "weight" of a norm, "bias" of a linear


def _param_items(module: nnx.Module):
  _, state = nnx.split(module, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    yield path, var


def _set_nested(tree: dict, path: tuple, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def load_checkpoint(path, *, dtype: str | None = None,
                    implementation: str | None = None) -> model_lib.Llama:
  """Loads a Hugging Face Llama checkpoint directory.

  Args:
    path: directory with `config.json` and one or more `*.safetensors`.
    dtype: parameter and compute dtype; default the checkpoint's.
    implementation: attention backend passed to the model.

  Returns:
    The `Llama` model with the checkpoint's weights.

  Raises:
    FileNotFoundError: if the directory, `config.json` or any safetensors file
      is missing.
    ValueError: for a malformed config, a missing, unexpected or misshapen
      tensor.
  """
  root = pathlib.Path(path)
  if not root.is_dir():
    raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
  cfg_path = root / "config.json"
  if not cfg_path.is_file():
    raise FileNotFoundError(f"{str(cfg_path)!r} not found")
  try:
    raw = json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
  config = config_from_hf(raw, dtype=dtype)
  files = sorted(root.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {str(root)!r}")
  tensors, where = {}, {}
  for f in files:
    try:
      with safe_open(str(f), framework="numpy") as handle:
        for key in handle.keys():
          tensors[key] = handle.get_tensor(key)
          where[key] = f.name
    except Exception as e:  # safetensors raises its own error types
      raise ValueError(f"{f}: not a readable safetensors file ({e})") from None

  model = nnx.eval_shape(
      lambda: model_lib.Llama(config, implementation=implementation,
                              rngs=nnx.Rngs(0)))
  updates, used = {}, set()
  for p, var in _param_items(model):
    name, transpose = _hf_name(p)
    if name not in tensors:
      raise ValueError(f"checkpoint lacks tensor {name!r}")
    t = tensors[name]
    if transpose:
      t = t.T
    want = tuple(var.get_value().shape)
    if t.shape != want:
      raise ValueError(f"tensor {name!r} in {where[name]} has shape "
                       f"{tuple(t.shape)} (after transpose), expected {want}")
    _set_nested(updates, p, jnp.asarray(t, config.jnp_dtype))
    used.add(name)
  ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
  extra = sorted(k for k in tensors
                 if k not in used and k not in ignorable and "rotary_emb" not in k)
  if extra:
    raise ValueError(f"checkpoint has {len(extra)} tensors this Llama does not "
                     f"use, e.g. {extra[:3]}")
  nnx.update(model, updates)
  return model


def save_checkpoint(model: model_lib.Llama, path) -> None:
  """Writes `model` as a Hugging Face checkpoint (`config.json`, `model.safetensors`)."""
  root = pathlib.Path(path)
  root.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for p, var in _param_items(model):
    name, transpose = _hf_name(p)
    t = np.asarray(var.get_value())
    tensors[name] = np.ascontiguousarray(t.T if transpose else t)
  save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
  (root / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2))
