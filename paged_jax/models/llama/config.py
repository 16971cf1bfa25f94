"""`LlamaConfig`: the static configuration of the Llama-family decoder
(`paged_jax.models.llama.model`), with the switches each registered family
sets (`paged_jax.models.registry`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from paged_jax import kv_cache as kv_cache_lib
from paged_jax import rope as rope_lib
from paged_jax.models.llama import layers as layers_lib

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_MAX_SIZE = 2**31 - 1  # every size indexes with int32
MAX_PARAMETERS = 10**13  # "absurd": 10x beyond the largest open models


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static model configuration (hashable).

  Attributes mirror Hugging Face's config names where they exist; `dtype` is
  the parameter and compute dtype ("float32", "bfloat16" or "float16").
  `attention_bias` puts a bias on q, k, v and o (Llama's meaning);
  `qkv_bias` on q, k and v only (Qwen2); `qk_norm` adds per-head RMSNorms
  `q_norm`, `k_norm` (Qwen3); `sliding_window` limits every layer's
  attention to the last `sliding_window` positions (Mistral), or only the
  layers `layer_types` marks "sliding_attention" (the others
  "full_attention"; Gemma); `architecture` is the Hugging Face
  `architectures` entry the config was made for.

  Gemma switches: `gemma_style` means (1 + w) RMSNorms computed in float32,
  norms after attention and around the MLP (`post_attention_layernorm`,
  `pre_feedforward_layernorm`, `post_feedforward_layernorm`) and the
  embedding scaled by sqrt(hidden_size); `hidden_act` is "silu" or
  "gelu_pytorch_tanh" (the gate's activation); `query_pre_attn_scalar` sets
  `sm_scale = query_pre_attn_scalar ** -0.5` (default head_dim ** -0.5);
  `attn_logit_softcapping`, `final_logit_softcapping` cap scores and logits
  as `c * tanh(x / c)`; `rope_local_theta` is the RoPE theta of sliding
  layers (default RoPE, no scaling; global layers keep `rope_theta` and
  `rope_scaling`), None for the same RoPE on every layer.

  `disable_sliding_window` (vLLM's `--disable-sliding-window`): every layer
  attends to the whole sequence (`layer_specs` gives no windows; sliding
  layers keep their own RoPE), which is the windowed model's attention for
  sequences of at most the window, so the engine caps `max_model_len` at
  `disabled_sliding_window`. No effect on a model without a window.

  `scan_layers` (MaxText's name): True stacks the layers' parameters
  `[num_layers, ...]` and runs them under `lax.scan` (one layer compiled
  whatever the depth); False keeps one `DecoderLayer` per layer, separate
  arrays run by an unrolled Python loop (the program grows with the depth,
  but no layer's weights are sliced out of a stack: XLA CPU materialises
  that slice, a copy of every weight per step; `benchmarks/RESULTS.md`
  section 12 measures both).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: rope_lib.Llama3Scaling | rope_lib.LinearScaling | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  max_position_embeddings: int = 2048
  eos_token_ids: tuple[int, ...] = ()
  dtype: str = "float32"
  qkv_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  architecture: str = "LlamaForCausalLM"
  layer_types: tuple[str, ...] | None = None
  rope_local_theta: float | None = None
  hidden_act: str = "silu"
  gemma_style: bool = False
  query_pre_attn_scalar: float | None = None
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  scan_layers: bool = True
  disable_sliding_window: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim",
                 "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
      if value > _MAX_SIZE:
        raise ValueError(f"{name}={value} is absurd (more than 2**31 - 1)")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
    for t in self.eos_token_ids:
      if not 0 <= t < self.vocab_size:
        raise ValueError(f"eos token id {t} is outside the vocabulary "
                         f"[0, {self.vocab_size})")
    w = self.sliding_window
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
      raise ValueError(f"sliding_window must be a positive int or None, got {w!r}")
    if self.layer_types is not None:
      types = self.layer_types
      if not isinstance(types, tuple) or len(types) != self.num_layers or any(
          t not in layers_lib.LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must be a tuple of num_layers="
                         f"{self.num_layers} entries from "
                         f"{layers_lib.LAYER_TYPES}, got {types!r}")
      if w is None and layers_lib.SLIDING in types:
        raise ValueError("layer_types has sliding_attention layers but "
                         "sliding_window is None")
    for name in ("scan_layers", "disable_sliding_window"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got "
                         f"{getattr(self, name)!r}")
    if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
      raise ValueError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh', "
                       f"got {self.hidden_act!r}")
    for name in ("rope_local_theta", "query_pre_attn_scalar",
                 "attn_logit_softcapping", "final_logit_softcapping"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float))
                                    and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    if self.num_parameters > MAX_PARAMETERS:
      raise ValueError(f"the config describes {self.num_parameters:.3g} "
                       f"parameters, which is absurd (more than "
                       f"{MAX_PARAMETERS:.0e}); check its sizes")

  @classmethod
  def tiny(cls, **overrides) -> "LlamaConfig":
    """A ~0.4M-parameter model with Llama 3 RoPE scaling, for CPU examples."""
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=192,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
              rope_theta=500000.0, rope_scaling=rope_lib.Llama3Scaling(),
              max_position_embeddings=1024, eos_token_ids=(2,))
    kw.update(overrides)
    return cls(**kw)

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def rope(self) -> rope_lib.RopeConfig:
    return rope_lib.RopeConfig(self.head_dim, self.rope_theta, self.rope_scaling)

  @property
  def layer_specs(self) -> tuple[layers_lib.LayerSpec, ...]:
    """Each layer's window and RoPE (`layers.LayerSpec`), `num_layers` of
    them: with `layer_types`, sliding layers get `sliding_window` (and the
    local RoPE if `rope_local_theta`), full ones None; without, every layer
    gets `sliding_window`. With `disable_sliding_window` no layer gets a
    window (each keeps its RoPE)."""
    window = None if self.disable_sliding_window else self.sliding_window
    types = self.layer_types or (
        (layers_lib.SLIDING if self.sliding_window else layers_lib.FULL,)
        * self.num_layers)
    local_rope = (self.rope if self.rope_local_theta is None else
                  rope_lib.RopeConfig(self.head_dim, float(self.rope_local_theta)))
    return tuple(
        layers_lib.LayerSpec(window, local_rope)
        if t == layers_lib.SLIDING else layers_lib.LayerSpec(None, self.rope)
        for t in types)

  @property
  def disabled_sliding_window(self) -> int | None:
    """The smallest sliding window this model runs without
    (`disable_sliding_window`; the longest sequence it serves as the
    windowed model would), or None: the window is kept, or there is none."""
    return self.sliding_window if self.disable_sliding_window else None

  @property
  def sm_scale(self) -> float | None:
    """The attention's score scale (None: `head_dim ** -0.5`)."""
    q = self.query_pre_attn_scalar
    return None if q is None else float(q) ** -0.5

  @property
  def num_parameters(self) -> int:
    """Parameters of the model (biases and norms included), from the sizes."""
    h, d = self.hidden_size, self.head_dim
    q, kv = self.num_heads * d, self.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h
    if self.attention_bias or self.qkv_bias:
      attn += q + 2 * kv
    if self.attention_bias:
      attn += h
    mlp = 3 * h * self.intermediate_size
    if self.mlp_bias:
      mlp += 2 * self.intermediate_size + h
    norms = (4 if self.gemma_style else 2) * h + (2 * d if self.qk_norm else 0)
    embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * (attn + mlp + norms) + embed + h

  def kv_bytes_per_token(self, cache_dtype=None) -> int:
    """Bytes of K and V one token takes in the cache, all layers: the pages,
    plus a float32 scale per KV head for int8 / fp8 (`cache_dtype` as
    `kv_cache.cache_dtype`: a name, "auto" or None for the model's dtype)."""
    dtype = kv_cache_lib.cache_dtype(cache_dtype, self.jnp_dtype)
    return (2 * self.num_layers * self.num_kv_heads
            * kv_cache_lib.token_bytes(dtype, self.head_dim))
