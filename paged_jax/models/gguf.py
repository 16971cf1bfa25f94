"""GGUF files (llama.cpp's format) as a Hugging Face checkpoint.

`read_gguf(path)` parses the file with the `gguf` package and returns what a
Hugging Face directory would hold: a `config.json`-style dict, float32
tensors under Hugging Face's names, and the tokenizer with its chat template
(`paged_jax.serving.tokenizer.HFTokenizer`). `paged_jax.models.from_hf` then
builds the model from the first two, exactly as for a directory.

* Weights are dequantised at load, by the `gguf` package (F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K..Q6_K, and the IQ types it
  implements); another tensor type is refused by name.
* llama.cpp's converter permutes the rows of `attn_q` / `attn_k` for its
  rotary layout (`convert_hf_to_gguf.py`, `LlamaModel.permute`) for the
  `llama` architecture; `unpermute` undoes it, so the tensors are HF's.
* The config comes from `{arch}.*` metadata; tied embeddings = no
  `output.weight`; Llama 3 RoPE scaling is recovered from `rope_freqs.weight`
  (checked against the factors it implies).

A file that is not GGUF, is truncated or inconsistent raises one
`GGUFError` (a ValueError) naming the file and what is wrong, before any
model is built.

Example:
  >>> ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
  >>> ckpt.config["architectures"], ckpt.tensors["model.norm.weight"].shape
  (['LlamaForCausalLM'], (576,))
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import numpy as np

# general.architecture -> (Hugging Face architecture, model_type, whether
# llama.cpp permuted q/k).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

# GGUF tensor names -> Hugging Face's (per layer: blk.N.<key>).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Tensors that hold no weights of the HF model (rope_freqs: folded into the
# config's rope_scaling).
_DERIVED = ("rope_freqs.weight",)
# Sizes beyond these are a corrupt header, not a model.
_MAX_DIM = 2**24


class GGUFError(ValueError):
  """A GGUF file that cannot be loaded; the message names the file."""


@dataclasses.dataclass
class GGUFCheckpoint:
  """A GGUF file as a Hugging Face checkpoint.

  Attributes:
    config: `config.json`-style dict (`architectures`, sizes, `rope_theta`,
      `tie_word_embeddings`, `rms_norm_eps`, `bos_token_id`, `eos_token_id`).
    tensors: Hugging Face name -> float32 array in HF's layout (`[out, in]`
      for linear weights).
    tokenizer_metadata: the `tokenizer.*` keys (without `tokenizer.ggml.`),
      for `HFTokenizer.from_gguf_metadata`.
    name: `general.name`, else the file name.
    tensor_types: GGUF tensor type name -> count (what was dequantised).
  """
  config: dict
  tensors: dict[str, np.ndarray]
  tokenizer_metadata: dict
  name: str
  tensor_types: dict[str, int]

  def tokenizer(self):
    """The `HFTokenizer` of the metadata, None if the file has none
    (ValueError if it is unsupported)."""
    from paged_jax.serving.tokenizer import HFTokenizer  # pylint: disable=import-outside-toplevel
    if "model" not in self.tokenizer_metadata:
      return None
    return HFTokenizer.from_gguf_metadata(self.tokenizer_metadata)


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation: `w` is `[num_heads * head_dim,
  ...]` with each head's rows as (half, pair) interleaved; returns HF's
  (pair, half) order. `num_heads` is the KV head count for `attn_k`."""
  half = w.shape[0] // num_heads // 2
  return (w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's permutation (the inverse of `unpermute`), for tests and
  writers."""
  half = w.shape[0] // num_heads // 2
  return (w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _import_gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("reading a .gguf file needs the `gguf` package (pip install "
                      "gguf, or the `gguf` extra: pip install 'paged-jax[gguf]')") from e
  return gguf


def _field_value(gguf, field) -> Any:
  """A metadata field as Python (str, int, float, bool, or a list)."""
  vt = gguf.GGUFValueType
  main = field.types[0]
  if main == vt.ARRAY:
    sub = field.types[-1]
    if sub == vt.STRING:
      return [bytes(field.parts[i]).decode("utf-8", errors="replace")
              for i in field.data]
    return [x.item() for i in field.data for x in field.parts[i]]
  if main == vt.STRING:
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
  value = field.parts[field.data[0]][0].item()
  return bool(value) if main == vt.BOOL else value


def _metadata(gguf, reader) -> dict:
  return {name: _field_value(gguf, f) for name, f in reader.fields.items()
          if not name.startswith("GGUF.")}


def _dequantise(gguf, t) -> np.ndarray:
  """One tensor as float32 in NumPy's (row-major, reversed GGUF) shape."""
  shape = tuple(int(d) for d in reversed(t.shape.tolist()))
  qt = gguf.GGMLQuantizationType
  data = np.asarray(t.data)
  if data.nbytes != int(t.n_bytes):
    raise ValueError(f"tensor {t.name!r} holds {data.nbytes} bytes, its header "
                     f"says {int(t.n_bytes)} (truncated file?)")
  if t.tensor_type in (qt.F32, qt.F16, qt.F64):
    out = data.astype(np.float32)
  else:
    try:
      out = gguf.quants.dequantize(data, t.tensor_type)
    except NotImplementedError:
      raise ValueError(f"tensor {t.name!r} has type {t.tensor_type.name}, which "
                       "the gguf package cannot dequantise") from None
  return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)


def _get(meta: dict, key: str, kind=int, default=...):
  if key not in meta:
    if default is ...:
      raise ValueError(f"missing metadata {key!r}")
    return default
  value = meta[key]
  if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    # GGUF stores float32: its shortest decimal (1e-05, not 9.9999997e-06).
    value = float(str(np.float32(value)))
  if not isinstance(value, kind) or kind is int and isinstance(value, bool):
    raise ValueError(f"metadata {key!r} must be {kind.__name__}, got {value!r:.60}")
  if kind is int and not 0 < value <= _MAX_DIM:
    raise ValueError(f"metadata {key}={value} is outside [1, {_MAX_DIM}]")
  return value


def llama3_rope_factors(theta: float, head_dim: int, factor: float,
                        low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_position_embeddings: int = 8192) -> np.ndarray:
  """The per-frequency factors llama.cpp's converter stores as
  `rope_freqs.weight` for Llama 3 RoPE scaling (f32[head_dim // 2])."""
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  low_wavelen = original_max_position_embeddings / low_freq_factor
  high_wavelen = original_max_position_embeddings / high_freq_factor
  out = []
  for f in freqs:
    wavelen = 2 * math.pi / f
    if wavelen < high_wavelen:
      out.append(1.0)
    elif wavelen > low_wavelen:
      out.append(factor)
    else:
      smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                / (high_freq_factor - low_freq_factor))
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def _rope_scaling(meta: dict, arch: str, theta: float, head_dim: int,
                  rope_freqs: np.ndarray | None) -> dict | None:
  kind = meta.get(f"{arch}.rope.scaling.type")
  if kind == "linear":
    return {"rope_type": "linear",
            "factor": _get(meta, f"{arch}.rope.scaling.factor", float)}
  if kind not in (None, "none"):
    raise ValueError(f"rope scaling type {kind!r} is not supported (linear, or "
                     "Llama 3's rope_freqs)")
  if rope_freqs is None:
    return None
  # Llama 3.x: only the factors are stored; the published 3.1/3.2 parameters
  # (low 1, high 4, original context 8192) must reproduce them.
  factor = float(rope_freqs.max())
  want = llama3_rope_factors(theta, head_dim, factor)
  if rope_freqs.shape != want.shape or not np.allclose(rope_freqs, want, rtol=1e-4):
    raise ValueError("rope_freqs.weight does not match Llama 3 RoPE scaling "
                     f"(factor {factor:g}, low 1, high 4, original 8192)")
  return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _config(meta: dict, tensors: dict, rope_freqs) -> dict:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"architecture {arch!r} is not supported (supported: "
                     f"{', '.join(ARCHITECTURES)})")
  hf_arch, model_type, _ = ARCHITECTURES[arch]
  g = lambda key, *a: _get(meta, f"{arch}.{key}", *a)  # noqa: E731
  hidden, heads = g("embedding_length"), g("attention.head_count")
  head_dim = g("attention.key_length", int, hidden // heads)
  theta = g("rope.freq_base", float, 10000.0)
  embed = tensors.get("model.embed_tokens.weight")
  vocab = g("vocab_size", int, embed.shape[0] if embed is not None else 0)
  tok = {k: meta.get(f"tokenizer.ggml.{k}") for k in ("bos_token_id", "eos_token_id")}
  config = {
      "architectures": [hf_arch], "model_type": model_type,
      "vocab_size": vocab, "hidden_size": hidden,
      "intermediate_size": g("feed_forward_length"),
      "num_hidden_layers": g("block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": g("attention.head_count_kv", int, heads),
      "head_dim": head_dim,
      "rms_norm_eps": g("attention.layer_norm_rms_epsilon", float, 1e-6),
      "rope_theta": theta,
      "max_position_embeddings": g("context_length", int, 2048),
      "tie_word_embeddings": "lm_head.weight" not in tensors,
      "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
      "hidden_act": "silu", "torch_dtype": "float32",
      **{k: v for k, v in tok.items() if isinstance(v, int)},
  }
  scaling = _rope_scaling(meta, arch, theta, head_dim, rope_freqs)
  if scaling:
    config["rope_scaling"] = scaling
  window = meta.get(f"{arch}.attention.sliding_window")
  if isinstance(window, int) and window > 0:
    config["sliding_window"] = window
  return config


def _hf_name(name: str, num_layers: int) -> str:
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  blk, _, rest = name.partition(".")
  layer, _, key = rest.partition(".")
  if blk != "blk" or not layer.isdigit() or key not in _LAYER_NAMES:
    raise ValueError(f"tensor {name!r} has no Hugging Face counterpart here")
  if int(layer) >= num_layers:
    raise ValueError(f"tensor {name!r}: layer {layer} >= block_count {num_layers}")
  return f"model.layers.{int(layer)}.{_LAYER_NAMES[key]}"


def read_gguf(path) -> GGUFCheckpoint:
  """Reads a GGUF file as a Hugging Face checkpoint (see the module doc).

  Args:
    path: the `.gguf` file.

  Returns:
    `GGUFCheckpoint` with the config dict, HF-named float32 tensors and the
    tokenizer metadata.

  Raises:
    FileNotFoundError: no such file.
    GGUFError: not a GGUF file, truncated, an unsupported architecture or
      tensor type, a tensor with no HF counterpart, or bad metadata.
    ImportError: without the `gguf` package.
  """
  f = pathlib.Path(path)
  if not f.is_file():
    raise FileNotFoundError(f"GGUF file {str(f)!r} not found")
  gguf = _import_gguf()
  try:
    reader = gguf.GGUFReader(str(f), "r")
    meta = _metadata(gguf, reader)
  except Exception as e:  # pylint: disable=broad-except  # the reader raises anything on bad bytes
    raise GGUFError(f"{f}: not a readable GGUF file ({type(e).__name__}: "
                    f"{str(e)[:200]})") from None
  try:
    return _checkpoint(gguf, reader, meta, f)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
    raise GGUFError(f"{f}: {str(e)[:300]}") from None


def _checkpoint(gguf, reader, meta: dict, f: pathlib.Path) -> GGUFCheckpoint:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"architecture {arch!r} is not supported (supported: "
                     f"{', '.join(ARCHITECTURES)})")
  num_layers = _get(meta, f"{arch}.block_count")
  heads = _get(meta, f"{arch}.attention.head_count")
  kv_heads = _get(meta, f"{arch}.attention.head_count_kv", int, heads)
  permuted = ARCHITECTURES[arch][2]
  tensors, types, rope_freqs = {}, {}, None
  for t in reader.tensors:
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    if t.name in _DERIVED:
      rope_freqs = _dequantise(gguf, t)
      continue
    name = _hf_name(t.name, num_layers)
    w = _dequantise(gguf, t)
    if permuted and t.name.endswith(("attn_q.weight", "attn_k.weight")):
      n = heads if "attn_q" in t.name else kv_heads
      if w.shape[0] % (2 * n):
        raise ValueError(f"tensor {t.name!r} has {w.shape[0]} rows, not a "
                         f"multiple of 2 x {n} heads")
      w = unpermute(w, n)
    tensors[name] = w
  if not tensors:
    raise ValueError("no tensors")
  config = _config(meta, tensors, rope_freqs)
  tok = {k.removeprefix("tokenizer.ggml.").removeprefix("tokenizer."): v
         for k, v in meta.items() if k.startswith("tokenizer.")}
  name = meta.get("general.name")
  return GGUFCheckpoint(config=config, tensors=tensors, tokenizer_metadata=tok,
                        name=name if isinstance(name, str) and name else f.stem,
                        tensor_types=types)
