"""Hugging Face checkpoints of the Llama family: `config.json` plus safetensors.

* `config_from_hf(dict)` turns a `config.json` into a `LlamaConfig`, the
  family read from `architectures` (`paged_jax.models.registry`);
* `from_tensors(config, tensors)` checks every Hugging Face-named tensor
  (`model.layers.0.self_attn.q_proj.weight`, ...) against the config (names,
  shapes, dtypes) before anything is built, then stacks the layers' tensors
  onto the scanned model (`Llama.abstract`, so nothing is initialised);
* `load_checkpoint(dir)` reads a directory: one or more `*.safetensors`, or a
  sharded `model.safetensors.index.json`; every header is checked against its
  file before a tensor byte is read (`paged_jax.models.safetensors_io`), and
  the tensors are read lazily, one at a time while stacking;
* `save_checkpoint` writes the same layout (tests, and to export the random
  tiny model).

Hugging Face stores linear weights as `[out, in]`; NNX kernels are `[in, out]`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import rope as rope_lib
from paged_jax.models import registry
from paged_jax.models import safetensors_io
from paged_jax.models.llama import model as model_lib

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "torch.float32": "float32", "torch.bfloat16": "bfloat16",
                "torch.float16": "float16"}
INDEX_FILE = "model.safetensors.index.json"


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


def rope_from_hf(d: dict) -> tuple[float, object]:
  """(theta, scaling) from either the old (`rope_theta`, `rope_scaling`) or the
  new (`rope_parameters`) Hugging Face config form."""
  params = d.get("rope_parameters")
  if isinstance(params, dict) and params:
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
      raise ValueError(f"config.json: rope_theta must be a number, got {theta!r}")
    theta = float(theta)
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
  except (TypeError, ValueError):
    raise ValueError(f"config.json: {kind} rope scaling has a non-numeric "
                     f"field: {scaling!r}") from None
  raise ValueError(f"config.json: unsupported rope scaling type {kind!r} "
                   "(supported: default, llama3, linear)")


def config_from_hf(d: dict, *, dtype: str | None = None) -> model_lib.LlamaConfig:
  """`LlamaConfig` from a Hugging Face `config.json` dict.

  Args:
    d: the parsed `config.json`. The family comes from `architectures`
      (`paged_jax.models.registry.ARCHITECTURES`; without it, `model_type`).
    dtype: parameter dtype; default the checkpoint's `torch_dtype` (or
      `dtype`), float32 if absent.

  Raises:
    ValueError: for an unsupported architecture (naming the supported ones), a
      missing, mistyped or absurd field, an activation other than SiLU, or an
      unsupported RoPE scaling.

  Example:
    >>> config_from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32,
    ...     "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
    ...     "num_attention_heads": 4}).qkv_bias
    True
  """
  if not isinstance(d, dict):
    raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
  fam = registry.family(d)
  get = lambda key, kind, default=...: _get(d, key, kind, default)  # noqa: E731
  switches = fam.switches(d, get)
  act = get("hidden_act", str, "silu")
  if "hidden_act" not in switches and act not in ("silu", "swish"):
    raise ValueError(f"config.json: hidden_act {act!r} is not supported (silu)")
  num_heads = get("num_attention_heads", int)
  hidden = get("hidden_size", int)
  theta, scaling = rope_from_hf(d)
  eos = d.get("eos_token_id")
  eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_ids):
    raise ValueError(f"config.json: eos_token_id must be int or list of int, got {eos!r}")
  if dtype is None:
    name = d.get("torch_dtype") or d.get("dtype") or "float32"
    if name not in _DTYPE_NAMES:
      raise ValueError(f"config.json: unsupported dtype {name!r}")
    dtype = _DTYPE_NAMES[name]
  if num_heads <= 0 or hidden % num_heads and d.get("head_dim") is None:
    raise ValueError(f"config.json: hidden_size={hidden} is not divisible by "
                     f"num_attention_heads={num_heads} and head_dim is not given")
  try:
    fields = dict(
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int),
        num_layers=get("num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads", int, num_heads),
        head_dim=get("head_dim", int, hidden // num_heads),
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=get("tie_word_embeddings", bool, False),
        max_position_embeddings=get("max_position_embeddings", int, 2048),
        eos_token_ids=eos_ids,
        dtype=dtype,
        architecture=fam.architecture)
    return model_lib.LlamaConfig(**{**fields, **switches})
  except ValueError as e:
    msg = str(e)
    raise ValueError(msg if msg.startswith("config.json") else
                     f"config.json: {msg}") from None


def config_to_hf(config: model_lib.LlamaConfig) -> dict:
  """The Hugging Face `config.json` dict for `config`."""
  fam = registry.FAMILIES[config.architecture]
  d = {
      "architectures": [config.architecture], "model_type": fam.model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
      "tie_word_embeddings": config.tie_word_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "hidden_act": "silu", "torch_dtype": config.dtype,
  }
  if config.architecture == "LlamaForCausalLM":
    d.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
  elif config.architecture == "Qwen3ForCausalLM":
    d.update(attention_bias=config.attention_bias)
  elif config.architecture == "MistralForCausalLM":
    d.update(sliding_window=config.sliding_window)
  elif config.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
    d.update(hidden_activation=config.hidden_act,
             attention_bias=config.attention_bias,
             sliding_window=config.sliding_window,
             layer_types=list(config.layer_types or ()),
             query_pre_attn_scalar=config.query_pre_attn_scalar,
             attn_logit_softcapping=config.attn_logit_softcapping,
             final_logit_softcapping=config.final_logit_softcapping)
    del d["hidden_act"]
    if config.architecture == "Gemma3ForCausalLM":
      d["rope_local_base_freq"] = config.rope_local_theta
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


class _Slot:
  """Where one model parameter comes from: its Hugging Face name (`{}` for
  the layer index of a stacked one), whether it is a transposed linear kernel,
  and its per-layer shape in the model."""

  __slots__ = ("path", "name", "transpose", "stacked", "shape")

  def __init__(self, path: tuple, shape: tuple[int, ...]):
    *mods, leaf = [str(p) for p in path]
    self.path = path
    # `layers.<i>...` (an int in the path): one of separate layers
    # (`scan_layers=False`), already named per layer.
    self.stacked = mods[:1] == ["layers"] and not isinstance(path[1], int)
    self.shape = shape[1:] if self.stacked else shape
    self.transpose = leaf == "kernel"
    if mods == ["embed_tokens"]:
      self.name = "model.embed_tokens.weight"
    elif mods == ["lm_head"]:
      self.name = "lm_head.weight"
    else:
      if self.stacked:
        mods = ["layers", "{}"] + mods[1:]
      self.name = "model." + ".".join(mods) + (
          ".weight" if leaf == "kernel" else f".{leaf}")

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return self.shape[::-1] if self.transpose else self.shape

  def names(self, num_layers: int) -> list[str]:
    return ([self.name.format(i) for i in range(num_layers)] if self.stacked
            else [self.name])


def _slots(model: nnx.Module) -> list[_Slot]:
  _, state = nnx.split(model, nnx.Param)
  return [_Slot(path, tuple(var.get_value().shape))
          for path, var in nnx.to_flat_state(state)]


def _abstract(config, implementation):
  """The registered family's module for `config`, without weights."""
  model_cls = registry.FAMILIES[config.architecture].model
  return model_cls.abstract(config, implementation=implementation)


def _set_nested(tree: dict, path: tuple, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def check_tensors(config: model_lib.LlamaConfig, tensors: Mapping[str, np.ndarray],
                  where: Mapping[str, str] | None = None) -> None:
  """Checks Hugging Face-named tensors against `config`, reading no data.

  Args:
    config: the model's configuration.
    tensors: `{name: array}`; only `.shape` and `.dtype` are read.
    where: optional `{name: file}` for the messages.

  Raises:
    ValueError: for the first missing tensor, a tensor whose shape is not the
      config's (both shapes named), a non-float tensor, or tensors the model
      does not use (a count and a few names).
  """
  _check(config, _slots(_abstract(config, None)), tensors, where or {})


def _check(config, slots, tensors, where):
  used = set()
  for slot in slots:
    for name in slot.names(config.num_layers):
      if name not in tensors:
        raise ValueError(f"checkpoint lacks tensor {name!r}")
      t = tensors[name]
      src = f" in {where[name]}" if name in where else ""
      if tuple(t.shape) != slot.hf_shape:
        raise ValueError(f"tensor {name!r}{src} has shape {tuple(t.shape)}, "
                         f"expected {slot.hf_shape} from the config")
      if not np.issubdtype(np.dtype(t.dtype), np.floating) and np.dtype(
          t.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"tensor {name!r}{src} has dtype {t.dtype}, expected "
                         "a float dtype")
      used.add(name)
  ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
  extra = sorted(k for k in tensors
                 if k not in used and k not in ignorable and "rotary_emb" not in k)
  if extra:
    raise ValueError(f"checkpoint has {len(extra)} tensors this "
                     f"{config.architecture} does not use, e.g. {extra[:3]}")


def from_tensors(config: model_lib.LlamaConfig, tensors: Mapping[str, np.ndarray],
                 *, implementation: str | None = None,
                 where: Mapping[str, str] | None = None) -> model_lib.Llama:
  """The model for `config` with Hugging Face-named weights.

  Every tensor is checked first (`check_tensors`); then each parameter is
  built in the model's dtype, the layers' tensors stacked one at a time (a
  lazy `safetensors_io.Tensor` is read once, when it is copied).

  Args:
    config: the model's configuration.
    tensors: `{Hugging Face name: array}`, e.g.
      `model.layers.0.self_attn.q_proj.weight` `[out, in]`: NumPy arrays, or
      anything with `shape` and `dtype` that `np.asarray` takes (such as
      `safetensors_io.Tensor`).
    implementation: attention backend passed to the model.
    where: optional `{name: file}` for error messages.

  Returns:
    The `Llama` with those weights.

  Raises:
    ValueError: as `check_tensors`.
  """
  model = _abstract(config, implementation)
  slots = _slots(model)
  _check(config, slots, tensors, where or {})
  np_dtype = np.dtype(config.jnp_dtype)
  updates = {}
  for slot in slots:
    names = slot.names(config.num_layers)
    # NumPy transposes and casts one layer's tensor at a time as fast as XLA
    # does the whole stack, and compiles nothing.
    out = np.empty((len(names),) + slot.shape if slot.stacked else slot.shape,
                   np_dtype)
    for i, name in enumerate(names):
      t = np.asarray(tensors[name])
      dst = out[i] if slot.stacked else out
      dst[...] = t.T if slot.transpose else t
    _set_nested(updates, slot.path, jnp.asarray(out))
    del out
  nnx.update(model, updates)
  return model


def to_tensors(model: model_lib.Llama) -> dict[str, np.ndarray]:
  """The model's weights by Hugging Face name (`from_tensors`' inverse)."""
  _, state = nnx.split(model, nnx.Param)
  out = {}
  for path, var in nnx.to_flat_state(state):
    value = np.asarray(var.get_value())
    slot = _Slot(path, value.shape)
    for i, name in enumerate(slot.names(model.config.num_layers)):
      t = value[i] if slot.stacked else value
      out[name] = np.ascontiguousarray(t.T if slot.transpose else t)
  return out


def read_config(root: pathlib.Path) -> dict:
  """The parsed `config.json` of a checkpoint directory.

  Raises:
    FileNotFoundError: if the directory or its `config.json` is missing.
    ValueError: if `config.json` is not valid JSON.
  """
  if not root.is_dir():
    raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
  cfg_path = root / "config.json"
  if not cfg_path.is_file():
    raise FileNotFoundError(f"{str(cfg_path)!r} not found")
  try:
    return json.loads(cfg_path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None


def _weight_files(root: pathlib.Path) -> tuple[list[pathlib.Path], dict | None]:
  """The safetensors files to read, and the index's weight map if sharded."""
  index = root / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: not a valid index (no weight_map: {e})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()):
      raise ValueError(f"{index}: weight_map must map tensor names to file names")
    files = [root / f for f in sorted(set(weight_map.values()))]
    for f in files:
      if f.parent != root or not f.is_file():
        raise FileNotFoundError(f"{index} names {f.name!r}, which is not in "
                                f"{str(root)!r}")
    return files, weight_map
  files = sorted(root.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {str(root)!r}")
  return files, None


def read_tensors(path) -> tuple[dict[str, safetensors_io.Tensor], dict[str, str]]:
  """Every tensor of a checkpoint directory, lazily (`safetensors_io.Tensor`),
  after checking every file's header against its size.

  Returns:
    `({name: array}, {name: file name})`.

  Raises:
    FileNotFoundError: if the directory has no safetensors files, or its
      index names a missing file.
    ValueError: for a truncated or corrupt file, a tensor in two files, or an
      index whose weight map disagrees with the files.
  """
  root = pathlib.Path(path)
  files, weight_map = _weight_files(root)
  headers, where = {}, {}
  for f in files:
    header, start = safetensors_io.read_header(f)
    for name in header:
      if name in where:
        raise ValueError(f"tensor {name!r} is in both {where[name]} and {f.name}")
      if weight_map is not None and weight_map.get(name) != f.name:
        raise ValueError(f"{f}: holds tensor {name!r}, which {INDEX_FILE} puts "
                         f"in {weight_map.get(name)!r}")
      where[name] = f.name
    headers[f] = (header, start)
  if weight_map is not None:
    missing = sorted(set(weight_map) - set(where))
    if missing:
      raise ValueError(f"{INDEX_FILE} lists {len(missing)} tensors that no file "
                       f"holds, e.g. {missing[:3]}")
  tensors = {}
  for f, (header, start) in headers.items():
    tensors.update(safetensors_io.open_tensors(f, header, start))
  return tensors, where


def load_checkpoint(path, *, dtype: str | None = None,
                    implementation: str | None = None) -> model_lib.Llama:
  """Loads a Hugging Face checkpoint directory of a registered family.

  Args:
    path: directory with `config.json` and `*.safetensors` (one file, or
      shards listed by `model.safetensors.index.json`); float32, bfloat16 or
      float16 tensors.
    dtype: parameter and compute dtype; default the checkpoint's.
    implementation: attention backend passed to the model.

  Returns:
    The `Llama` model with the checkpoint's weights.

  Raises:
    FileNotFoundError: if the directory, `config.json` or any safetensors file
      is missing.
    ValueError: for a malformed config or an unsupported architecture, a
      truncated or corrupt file, a missing, unexpected or misshapen tensor;
      all of them before any weight is read.
  """
  root = pathlib.Path(path)
  config = config_from_hf(read_config(root), dtype=dtype)
  tensors, where = read_tensors(root)
  return from_tensors(config, tensors, implementation=implementation, where=where)


def save_checkpoint(model: model_lib.Llama, path) -> None:
  """Writes `model` as a Hugging Face checkpoint (`config.json`, `model.safetensors`)."""
  root = pathlib.Path(path)
  root.mkdir(parents=True, exist_ok=True)
  safetensors_io.save(to_tensors(model), root / "model.safetensors",
                      metadata={"format": "pt"})
  (root / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2))
