"""The Llama-family decoder in Flax NNX, paged and dense, layers under scan.

One implementation serves every family `paged_jax.models` registers; they
differ only in `LlamaConfig` switches:

| family (HF `architectures`) | switches |
|---|---|
| `LlamaForCausalLM` (Llama 2/3.x, SmolLM2) | `rope_scaling` (llama3, linear), `tie_word_embeddings`, `attention_bias`, `mlp_bias` |
| `Qwen2ForCausalLM` | `qkv_bias` (bias on q/k/v, none on o) |
| `Qwen3ForCausalLM` | `qk_norm` (RMSNorm over each head of q and k, before RoPE) |
| `MistralForCausalLM` | `sliding_window` (every layer) |
| `Gemma2ForCausalLM` | `gemma_style`, `hidden_act="gelu_pytorch_tanh"`, `layer_types` (local, global alternating), `query_pre_attn_scalar`, `attn_logit_softcapping`, `final_logit_softcapping` |
| `Gemma3ForCausalLM` | as Gemma 2 plus `qk_norm`, `layer_types` (5 local : 1 global), `rope_local_theta` |

Layers may differ in their attention (`layers.LayerSpec`: window and RoPE);
`layers.run_layers` scans over whole periods of the pattern (see there why).

RMSNorm, RoPE, grouped-query attention, SwiGLU MLP. Parameter names follow
Hugging Face (`embed_tokens`, `layers.self_attn.q_proj`, ...) so that
`checkpoint.py` maps a checkpoint onto the model name by name.

Layers are stacked, MaxText's scan_layers: `Llama.layers` is one
`DecoderLayer` whose parameters carry a leading `[num_layers]` axis (drawn
layer by layer from the seed, so a seed's weights did not change), and both
forward paths run them with `jax.lax.scan`, so a step compiles one layer
whatever the depth. The paged step carries the whole
`KVCache` through the scan: layer `i` scatters this step's K/V straight into
the carried 5-D arrays at the traced index `i` and attends on layer `i`'s
pages read from them (`flax_attention.write_and_attend(..., layer=i)`), so XLA
updates the carry in place and a donated cache stays one buffer (its arrays
alias the outputs). Slicing the layer's pages out, writing them and putting
them back copied one layer's pages twice per layer per step
(`benchmarks/RESULTS.md`, section 12).

With `LlamaConfig(scan_layers=False)` `Llama.layers` is instead an
`nnx.List` of `num_layers` separate `DecoderLayer`s (parameters named
`layers.<i>. ...`, drawn from the seed as the stacked ones) run by an unrolled
Python loop with static layer indices: the program grows with the depth, but
no weight is sliced out of a stack, which XLA CPU materialises (a copy of
every layer's weights per step; section 12 measures both). Checkpoints and
tensor parallelism take both forms.

`Llama` implements `paged_jax.serving.ServingModel`:

* `Llama.paged_forward` runs one serving step over a ragged token batch and
  the paged `KVCache` (via `paged_jax.flax_attention.write_and_attend`);
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
from paged_jax.models.llama import layers as layers_lib
from paged_jax.models.llama.config import (  # noqa: F401  (the model's API)
    MAX_PARAMETERS, LlamaConfig)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, computed in float32 as Hugging
  Face's Llama, Qwen and Mistral do (`w * norm(x).astype(x.dtype)`), or with
  `unit_offset` as Gemma does (`(norm(x) * (1 + w)).astype(x.dtype)`, `w`
  initialised to zeros)."""

  def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32,
               unit_offset: bool = False):
    init = jnp.zeros if unit_offset else jnp.ones
    self.weight = nnx.Param(init((dim,), param_dtype))
    self.eps = eps
    self.unit_offset = unit_offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.unit_offset:
      return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
    return self.weight[...] * x32.astype(x.dtype)


def _norm(config: LlamaConfig, dim: int) -> RMSNorm:
  return RMSNorm(dim, config.rms_norm_eps, param_dtype=config.jnp_dtype,
                 unit_offset=config.gemma_style)


def _linear(config: LlamaConfig, i: int, o: int, bias: bool, rngs: nnx.Rngs):
  dt = config.jnp_dtype
  return nnx.Linear(i, o, use_bias=bias, dtype=dt, param_dtype=dt, rngs=rngs)


class MLP(nnx.Module):
  """SwiGLU `down(silu(gate(x)) * up(x))`, or GeGLU with
  `hidden_act="gelu_pytorch_tanh"` (gelu, tanh approximation)."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    h, m, b = config.hidden_size, config.intermediate_size, config.mlp_bias
    self.gate_proj = _linear(config, h, m, b, rngs)
    self.up_proj = _linear(config, h, m, b, rngs)
    self.down_proj = _linear(config, m, h, b, rngs)
    self.gelu = config.hidden_act == "gelu_pytorch_tanh"

  def __call__(self, x: jax.Array) -> jax.Array:
    g = self.gate_proj(x)
    g = jax.nn.gelu(g, approximate=True) if self.gelu else jax.nn.silu(g)
    return self.down_proj(g * self.up_proj(x))


class Attention(nnx.Module):
  """Grouped-query attention with RoPE, over the paged cache or dense.

  `q_proj`, `k_proj`, `v_proj`, `o_proj` as Hugging Face names them, with the
  config's bias, q/k norm, score scale and soft-cap switches; the window and
  RoPE come per call as a `layers.LayerSpec` (default: the first layer's).
  """

  def __init__(self, config: LlamaConfig, *, implementation: str | None,
               rngs: nnx.Rngs):
    h, d = config.hidden_size, config.head_dim
    qkv_bias = config.attention_bias or config.qkv_bias
    self.num_heads, self.num_kv_heads, self.head_dim = (
        config.num_heads, config.num_kv_heads, d)
    self.spec = config.layer_specs[0]
    self.sm_scale = config.sm_scale
    self.soft_cap = config.attn_logit_softcapping
    self.implementation = implementation
    self.q_proj = _linear(config, h, config.num_heads * d, qkv_bias, rngs)
    self.k_proj = _linear(config, h, config.num_kv_heads * d, qkv_bias, rngs)
    self.v_proj = _linear(config, h, config.num_kv_heads * d, qkv_bias, rngs)
    self.o_proj = _linear(config, config.num_heads * d, h, config.attention_bias, rngs)
    if config.qk_norm:
      self.q_norm = _norm(config, d)
      self.k_norm = _norm(config, d)
    self.qk_norm = config.qk_norm

  def qkv(self, x: jax.Array, positions: jax.Array, rope=None):
    """`x [num_tokens, hidden]`, `positions i32[num_tokens]` -> roped
    `q [T, num_heads, head_dim]`, `k, v [T, num_kv_heads, head_dim]`
    (`rope`: a `rope.RopeConfig`, default this layer's spec's)."""
    rope = self.spec.rope if rope is None else rope
    t = x.shape[0]
    q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return (rope_lib.apply_rope(q, positions, rope),
            rope_lib.apply_rope(k, positions, rope), v)

  def __call__(self, x: jax.Array, meta: step_metadata.StepMetadata,
               pages: dict, layer=None,
               spec: layers_lib.LayerSpec | None = None) -> tuple[jax.Array, dict]:
    """Paged step on one layer of the cache.

    Args:
      x: `[num_tokens, hidden]` in the step's token layout.
      meta: the step's `StepMetadata`.
      pages: the cache's arrays by name: `k_pages`, `v_pages`, and `k_scales`,
        `v_scales` for a quantised cache (None or absent for a float one).
        With `layer=None` one layer's (`KVCache.layer`: pages `[num_kv_heads,
        num_blocks, block_size, head_dim]`); with a layer the whole cache's
        (pages `[num_layers, num_kv_heads, num_blocks, block_size,
        head_dim]`).
      layer: None, or the layer index into the whole cache (an int or a
        traced int32 scalar): the K/V are then written in place at it
        (`flax_attention.write_and_attend(..., layer=...)`).
      spec: the layer's window and RoPE (`layers.LayerSpec`, static);
        default the module's `spec`.

    Returns:
      `(out [num_tokens, hidden], pages)` with this step's K/V written, the
      arrays in the shapes given.
    """
    spec = self.spec if spec is None else spec
    q, k, v = self.qkv(x, meta.positions, spec.rope)
    names = [n for n in ("k_pages", "v_pages", "k_scales", "v_scales")
             if pages.get(n) is not None]
    out, *arrays = flax_attention.write_and_attend(
        q, k, v, pages["k_pages"], pages["v_pages"], meta, layer=layer,
        sm_scale=self.sm_scale, soft_cap=self.soft_cap,
        sliding_window=spec.sliding_window, implementation=self.implementation,
        **{n: pages[n] for n in names[2:]})
    return self.o_proj(out.reshape(x.shape[0], -1)), dict(zip(names, arrays))

  def dense(self, x: jax.Array, spec: layers_lib.LayerSpec | None = None) -> jax.Array:
    """Causal attention over whole sequences `[batch, seq_len, hidden]`, token
    `j` of each row at position `j` (the test oracle); `spec` as in
    `__call__`."""
    spec = self.spec if spec is None else spec
    batch, seq_len, hidden = x.shape
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
    q, k, v = self.qkv(x.reshape(batch * seq_len, hidden), positions, spec.rope)
    split = lambda a: a.reshape(batch, seq_len, *a.shape[1:])  # noqa: E731
    o = flax_attention.dense_causal_attention(
        split(q), split(k), split(v), sm_scale=self.sm_scale,
        soft_cap=self.soft_cap, sliding_window=spec.sliding_window)
    return self.o_proj(o.astype(x.dtype).reshape(batch, seq_len, -1))


class DecoderLayer(nnx.Module):
  """Pre-norm attention block and pre-norm MLP block, each residual.

  With `gemma_style` (Gemma 2/3) the sandwich: `x + post_attention_layernorm(
  attn(input_layernorm(x)))`, then `x + post_feedforward_layernorm(mlp(
  pre_feedforward_layernorm(x)))`; otherwise `post_attention_layernorm` is
  the MLP's pre-norm, as Llama names it.
  """

  def __init__(self, config: LlamaConfig, *, implementation: str | None,
               rngs: nnx.Rngs):
    h = config.hidden_size
    self.input_layernorm = _norm(config, h)
    self.self_attn = Attention(config, implementation=implementation, rngs=rngs)
    self.post_attention_layernorm = _norm(config, h)
    self.sandwich = config.gemma_style
    if self.sandwich:
      self.pre_feedforward_layernorm = _norm(config, h)
      self.post_feedforward_layernorm = _norm(config, h)
    self.mlp = MLP(config, rngs=rngs)

  def _residuals(self, x, h):
    """The attention output `h` added to `x`, then the MLP block."""
    if not self.sandwich:
      x = x + h
      return x + self.mlp(self.post_attention_layernorm(x))
    x = x + self.post_attention_layernorm(h)
    return x + self.post_feedforward_layernorm(
        self.mlp(self.pre_feedforward_layernorm(x)))

  def __call__(self, x, meta, pages: dict, layer=None, spec=None):
    """As `Attention.__call__` (`pages`, `layer` and `spec` alike)."""
    h, pages = self.self_attn(self.input_layernorm(x), meta, pages, layer, spec)
    return self._residuals(x, h), pages

  def dense(self, x, spec=None):
    return self._residuals(x, self.self_attn.dense(self.input_layernorm(x), spec))


_CACHE_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")


class Llama(nnx.Module):
  """Llama-family decoder with a language-model head, layers stacked.

  Attributes:
    layers: one `DecoderLayer` whose parameters have a leading
      `[num_layers]` axis (e.g. `layers.self_attn.q_proj.kernel` is
      `[num_layers, hidden, num_heads * head_dim]`); with
      `config.scan_layers=False` an `nnx.List` of `num_layers` separate
      `DecoderLayer`s (`layers[i].self_attn.q_proj.kernel` `[hidden,
      num_heads * head_dim]`).

  Example:
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    >>> model.dense_logits(jnp.array([[1, 5, 7]])).shape
    (1, 3, 512)
  """

  def __init__(self, config: LlamaConfig, *, implementation: str | None = None,
               rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.config = config
    self.implementation = implementation
    self.embed_tokens = nnx.Embed(
        config.vocab_size, config.hidden_size, dtype=dt, param_dtype=dt,
        embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    # The layers drawn one after another from `rngs`, as separate modules
    # would be (a seed gives the weights it gave before stacking), then
    # stacked on a leading axis.
    parts = [DecoderLayer(config, implementation=implementation, rngs=rngs)
             for _ in range(config.num_layers)]
    if config.scan_layers:
      parts = [nnx.split(layer) for layer in parts]
      self.layers = nnx.merge(parts[0][0], jax.tree.map(
          lambda *xs: jnp.stack(xs), *[state for _, state in parts]))
    else:
      self.layers = nnx.List(parts)
    self.norm = _norm(config, config.hidden_size)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size,
                                use_bias=False, dtype=dt, param_dtype=dt,
                                rngs=rngs)

  @classmethod
  def abstract(cls, config: LlamaConfig, *,
               implementation: str | None = None) -> "Llama":
    """The model with `jax.ShapeDtypeStruct`s for parameters: nothing is
    allocated or initialised, and one layer is traced whatever the depth
    (`nnx.eval_shape` of the whole constructor traces every layer's random
    init: 11 s for 30 SmolLM2 layers on a loaded 2-core CPU). Fill it with
    `nnx.update`."""
    one = nnx.eval_shape(lambda: cls(
        dataclasses.replace(config, num_layers=1, scan_layers=True, layer_types=(
            None if config.layer_types is None else config.layer_types[:1])),
        implementation=implementation, rngs=nnx.Rngs(0)))
    one.config = config
    stacked = config.scan_layers
    for _, var in nnx.to_flat_state(nnx.state(one.layers)):
      x = var.get_value()
      lead = (config.num_layers,) if stacked else ()
      var.set_value(jax.ShapeDtypeStruct(lead + x.shape[1:], x.dtype))
    if not stacked:
      one.layers = nnx.List([nnx.clone(one.layers)
                             for _ in range(config.num_layers)])
    return one

  def with_scan_layers(self, scan_layers: bool) -> "Llama":
    """This model with its layers stacked (`scan_layers=True`) or separate
    (False), the same weights (copied; `self` is unchanged, or returned if
    already in that form)."""
    if scan_layers == self.config.scan_layers:
      return self
    config = dataclasses.replace(self.config, scan_layers=scan_layers)
    new = type(self).abstract(config, implementation=self.implementation)
    _, state = nnx.split(self, nnx.Param)
    updates, layers = {}, {}
    for path, var in nnx.to_flat_state(state):
      value = var.get_value()
      node = updates
      if path[0] != "layers":
        for p in path[:-1]:
          node = node.setdefault(p, {})
        node[path[-1]] = value
      elif scan_layers:  # separate -> stacked: path ("layers", i, ...)
        layers.setdefault(path[2:], [None] * config.num_layers)[path[1]] = value
      else:  # stacked -> separate
        for i in range(config.num_layers):
          node = updates.setdefault("layers", {}).setdefault(i, {})
          for p in path[1:-1]:
            node = node.setdefault(p, {})
          node[path[-1]] = value[i]
    for rest, values in layers.items():
      node = updates.setdefault("layers", {})
      for p in rest[:-1]:
        node = node.setdefault(p, {})
      node[rest[-1]] = jnp.stack(values)
    nnx.update(new, updates)
    return new

  def without_sliding_window(self) -> "Llama":
    """This model with full attention in every layer
    (`LlamaConfig.disable_sliding_window`, vLLM's `--disable-sliding-window`),
    the same weights (shared, not copied); `self` if it has no window or runs
    without it already. Its outputs are the windowed model's for sequences
    of at most `config.disabled_sliding_window` tokens, the longest the
    engine then serves.

    Example:
      >>> m = init_model(LlamaConfig.tiny(sliding_window=8)).without_sliding_window()
      >>> m.config.disabled_sliding_window, m.config.layer_specs[0].sliding_window
      (8, None)
    """
    if self.config.sliding_window is None or self.config.disable_sliding_window:
      return self
    config = dataclasses.replace(self.config, disable_sliding_window=True)
    new = type(self).abstract(config, implementation=self.implementation)
    nnx.update(new, nnx.state(self, nnx.Param))
    return new

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
    """One serving step over the paged cache, the layers under `lax.scan`
    (or unrolled, `scan_layers=False`).

    Args:
      tokens: `i32[num_tokens]` in the step's ragged layout (see
        `paged_jax.step_metadata`); padding rows may hold any valid id.
      meta: the step's `StepMetadata`.
      cache: the `KVCache`; this step's K/V are written into it.

    Returns:
      `(hidden [num_tokens, hidden_size], cache)`; `hidden` is before the final
      norm; pass the rows to sample from to `logits`.

    Raises:
      ValueError: if `cache` has another number of layers than the model, or
        does not hold the pool `meta` was computed from.
    """
    if cache.num_layers != self.config.num_layers:
      raise ValueError(f"the KV cache has {cache.num_layers} layers, the model "
                       f"num_layers={self.config.num_layers}")
    kv_cache_lib.check_compatible(cache, meta)
    names = [n for n in _CACHE_FIELDS if getattr(cache, n) is not None]

    def body(carry, layer, spec, i):
      x, arrays = carry
      # The whole cache goes in with the traced layer index: the K/V are
      # scattered into the carry at layer i (in place) and attention reads
      # layer i's pages from it, no per-layer copy out and back.
      x, pages = layer(x, meta, dict(zip(names, arrays)), i, spec)
      return x, tuple(pages[n] for n in names)

    carry = (self.embed(tokens), tuple(getattr(cache, n) for n in names))
    x, arrays = self._run_layers(body, carry)
    return x, cache.replace(**dict(zip(names, arrays)))

  def _run_layers(self, body, carry):
    """`carry = body(carry, layer: DecoderLayer, spec, index)` over the
    layers: under `layers.run_layers`'s scan when stacked, else a Python
    loop over the separate layers (static index and spec)."""
    specs = self.config.layer_specs
    if isinstance(self.layers, nnx.List):
      for i, (layer, spec) in enumerate(zip(self.layers, specs)):
        carry = body(carry, layer, spec, i)
      return carry
    graphdef, params = nnx.split(self.layers)
    return layers_lib.run_layers(
        lambda c, p, spec, i: body(c, nnx.merge(graphdef, p), spec, i),
        params, specs, carry)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """`i32[...] -> [..., hidden_size]`, scaled by sqrt(hidden_size) (in the
    model's dtype, as Hugging Face's Gemma) with `gemma_style`."""
    x = self.embed_tokens(tokens)
    if self.config.gemma_style:
      x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
    return x

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
    out = out.astype(jnp.float32)
    cap = self.config.final_logit_softcapping
    if cap is not None:
      out = cap * jnp.tanh(out / cap)
    return out

  def dense_logits(self, tokens: jax.Array) -> jax.Array:
    """Whole-sequence forward with causal attention and no cache (the oracle).

    Args:
      tokens: `i32[batch, seq_len]`; every row starts at position 0.

    Returns:
      `f32[batch, seq_len, vocab_size]`.
    """
    def body(x, layer, spec, i):
      del i
      return layer.dense(x, spec)

    return self.logits(self._run_layers(body, self.embed(tokens)))


def init_model(config: LlamaConfig, seed: int = 0, *,
               implementation: str | None = None) -> Llama:
  """A model with seeded random weights."""
  return Llama(config, implementation=implementation, rngs=nnx.Rngs(seed))
