"""A Llama-architecture decoder in Flax NNX, paged and dense.

RMSNorm, RoPE (with Llama 3 scaling), grouped-query attention, SwiGLU MLP,
tied or untied embeddings. Parameter names follow Hugging Face's
`LlamaForCausalLM` (`embed_tokens`, `layers.N.self_attn.q_proj`, ...) so that
`checkpoint.py` maps a checkpoint onto the model name by name.

Two forward paths share the weights:

`Llama` implements `paged_jax.serving.ServingModel`, so `paged_jax.serving`'s
engine serves it.

* `Llama.paged_forward` runs one serving step over a ragged token batch and
  the paged `KVCache` (via `paged_jax.flax_attention`);
* `Llama.dense_logits` runs whole sequences with plain causal attention and no
  cache: the oracle the tests compare the paged path against.

`LlamaConfig.tiny()` is a small configuration with seeded random weights that
runs anywhere on CPU in seconds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import flax_attention
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import rope as rope_lib
from paged_jax import step_metadata

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static model configuration (hashable).

  Attributes mirror Hugging Face's `LlamaConfig` names where they exist;
  `dtype` is the parameter and compute dtype ("float32", "bfloat16" or
  "float16").
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

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim",
                 "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
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

  def kv_bytes_per_token(self, cache_dtype=None) -> int:
    """Bytes of K and V one token takes in the cache, all layers: the pages,
    plus a float32 scale per KV head for int8 / fp8 (`cache_dtype` as
    `kv_cache.cache_dtype`: a name, "auto" or None for the model's dtype)."""
    dtype = kv_cache_lib.cache_dtype(cache_dtype, self.jnp_dtype)
    return (2 * self.num_layers * self.num_kv_heads
            * kv_cache_lib.token_bytes(dtype, self.head_dim))


class RMSNorm(nnx.Module):
  """Root-mean-square norm, computed in float32 as Hugging Face Llama does."""

  def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * x32.astype(x.dtype)


class MLP(nnx.Module):
  """SwiGLU: `down(silu(gate(x)) * up(x))`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    dt = config.jnp_dtype
    linear = lambda i, o: nnx.Linear(  # noqa: E731
        i, o, use_bias=config.mlp_bias, dtype=dt, param_dtype=dt, rngs=rngs)
    self.gate_proj = linear(config.hidden_size, config.intermediate_size)
    self.up_proj = linear(config.hidden_size, config.intermediate_size)
    self.down_proj = linear(config.intermediate_size, config.hidden_size)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm attention block and pre-norm MLP block, each residual."""

  def __init__(self, config: LlamaConfig, *, implementation: str | None,
               rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=dt)
    self.self_attn = flax_attention.PagedAttention(
        config.hidden_size, config.num_heads, config.num_kv_heads,
        config.head_dim, rope=config.rope, use_bias=config.attention_bias,
        implementation=implementation, dtype=dt, param_dtype=dt, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
        config.hidden_size, config.rms_norm_eps, param_dtype=dt)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, meta, cache, layer):
    h, cache = self.self_attn(self.input_layernorm(x), meta, cache, layer)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), cache

  def dense(self, x):
    x = x + self.self_attn.dense(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
  """Llama decoder with a language-model head.

  Example:
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> model.dense_logits(jnp.array([[1, 5, 7]])).shape
    (1, 3, 512)
  """

  def __init__(self, config: LlamaConfig, *, implementation: str | None = None,
               rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.config = config
    self.embed_tokens = nnx.Embed(
        config.vocab_size, config.hidden_size, dtype=dt, param_dtype=dt,
        embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.layers = nnx.List([
        DecoderLayer(config, implementation=implementation, rngs=rngs)
        for _ in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=dt)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size,
                                use_bias=False, dtype=dt, param_dtype=dt,
                                rngs=rngs)

  def make_cache(self, num_blocks: int, block_size: int,
                 dtype=None) -> kv_cache_lib.KVCache:
    """A zeroed `KVCache` for this model: `dtype` a dtype or a name as
    `kv_cache.cache_dtype` ("int8", "fp8" add scales; "auto" or None: the
    model's dtype)."""
    c = self.config
    return kv_cache_lib.KVCache.create(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
        num_blocks=num_blocks, block_size=block_size, head_dim=c.head_dim,
        dtype=kv_cache_lib.cache_dtype(dtype, c.jnp_dtype))

  def paged_forward(
      self,
      tokens: jax.Array,  # i32[num_tokens]
      meta: step_metadata.StepMetadata,
      cache: kv_cache_lib.KVCache,
  ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """One serving step over the paged cache.

    Args:
      tokens: `i32[num_tokens]` in the step's ragged layout (see
        `paged_jax.step_metadata`); padding rows may hold any valid id.
      meta: the step's `StepMetadata`.
      cache: the `KVCache`; this step's K/V are written into it.

    Returns:
      `(hidden [num_tokens, hidden_size], cache)`; `hidden` is before the final
      norm; pass the rows to sample from to `logits`.
    """
    x = self.embed_tokens(tokens)
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, meta, cache, i)
    return x, cache

  def shard(self, mesh) -> "Llama":
    """This model laid out tensor-parallel on a `(data, model)` mesh
    (`paged_jax.models.llama.tensor_parallel.shard_model`; `paged_jax.serving`'s
    `ServingModel.shard`)."""
    from paged_jax.models.llama import tensor_parallel  # pylint: disable=import-outside-toplevel
    return tensor_parallel.shard_model(self, mesh)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final norm and LM head: `[..., hidden_size] -> f32[..., vocab_size]`."""
    x = self.norm(hidden)
    if self.config.tie_word_embeddings:
      out = self.embed_tokens.attend(x)
    else:
      out = self.lm_head(x)
    return out.astype(jnp.float32)

  def dense_logits(self, tokens: jax.Array) -> jax.Array:
    """Whole-sequence forward with causal attention and no cache (the oracle).

    Args:
      tokens: `i32[batch, seq_len]`; every row starts at position 0.

    Returns:
      `f32[batch, seq_len, vocab_size]`.
    """
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer.dense(x)
    return self.logits(x)


def init_model(config: LlamaConfig, seed: int = 0, *,
               implementation: str | None = None) -> Llama:
  """A model with seeded random weights."""
  return Llama(config, implementation=implementation, rngs=nnx.Rngs(seed))
