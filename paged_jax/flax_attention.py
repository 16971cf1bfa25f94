"""Paged attention for Flax NNX models.

FlashInfer's plan/run split in pure-JAX form:

* `paged_jax.step_metadata.step_metadata` ("plan", re-exported here) turns the
  block state and the step's layout into a `StepMetadata` pytree, computed
  once per step and shared by every layer;
* `PagedAttention` ("run") is an NNX module with the q/k/v/o projections of a
  Llama-style attention block. Given hidden states, the metadata and the
  `KVCache`, it applies RoPE, writes the new K/V into the layer's pages, runs
  paged attention and returns the output with the updated cache. The cache goes
  in and comes out explicitly; nothing is stored on the module.

Token layout (vLLM-style ragged batch): the step's `num_tokens` rows hold the
new tokens of sequence 0, then sequence 1, ... (`cu_q_lens` gives the
boundaries); rows past `cu_q_lens[num_seqs]` are padding. A decode-only step
(`decode_only=True`) has `num_tokens == num_seqs_max` and row `i` is the one new
token of sequence `i`; it uses the decode kernel, every other step the ragged
one. Both give the same numbers for a one-token query.

Example (one layer, one step; see `paged_jax/models/llama/model.py` for a model):

    state, res = block_manager.reserve(state, seq_ids, q_lens)
    meta = step_metadata(state, seq_ids, q_lens, num_tokens=tokens.shape[0])
    for layer, attn in enumerate(attn_layers):
      out, cache = attn(x, meta, cache, layer)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import attention
from paged_jax import block_manager
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import rope as rope_lib
from paged_jax import sharding
# StepMetadata and its builders live in `paged_jax.step_metadata` (nothing
# Flax-specific); re-exported here for existing callers.
from paged_jax.step_metadata import StepMetadata  # noqa: F401
from paged_jax.step_metadata import sharded_step_metadata  # noqa: F401
from paged_jax.step_metadata import step_metadata  # noqa: F401

NULL_BLOCK = block_manager.NULL_BLOCK


def write_and_attend(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    k_pages: jax.Array,  # [(num_layers,) num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # same as k_pages
    meta: StepMetadata,
    *,
    layer=None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    implementation: str | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
  """Writes one layer's new K/V and attends over the pages.

  `q` and `k` must already carry their position encoding. Quantised pages
  (int8 / float8_e4m3fn) come with their scales (pages' shape without
  `head_dim`, float32); the new K/V are quantised in the write and the
  attention dequantises.

  Two forms:

  * `layer=None`: one layer's pages `[num_kv_heads, num_blocks, block_size,
    head_dim]` (`KVCache.layer`), scales `f32[num_kv_heads, num_blocks,
    block_size]`; the updated pages come back.
  * `layer=i` (an int, or a traced integer scalar such as a `lax.scan`'s
    layer counter): the whole cache's pages `[num_layers, num_kv_heads,
    num_blocks, block_size, head_dim]` (`KVCache.k_pages`), scales
    `f32[num_layers, num_kv_heads, num_blocks, block_size]`. The K/V go
    straight into layer `i` of them (`kv_cache.write_kv_layer`) and attention
    reads layer `i`'s pages from the written arrays, so a carried or donated
    cache is updated in place, not copied out and back per layer; all
    layers come back. With a mesh (`meta.mesh`) the write is
    `sharding.write_kv_sharded` on layer `i`'s slice, put back with
    `dynamic_update_slice`.

  Returns:
    `(out [num_tokens, num_q_heads, head_dim] in q.dtype, k_pages, v_pages)`,
    then `k_scales, v_scales` for quantised pages (as `kv_cache.write_kv`),
    in the shapes given.

  Raises:
    ValueError: if the pages' block size or number of blocks differ from the
      pool `meta` was computed from (`kv_cache.check_compatible`), the pages
      are not 4-D (`layer=None`) or 5-D (a layer), or the layer is not an
      integer scalar (a static one outside `[0, num_layers)`).
  """
  if layer is None:
    kv_cache_lib.check_compatible(k_pages, meta)
  else:
    if k_pages.ndim != 5:
      raise ValueError(
          f"with layer={layer!r}, k_pages must be the whole cache's "
          f"[num_layers, num_kv_heads, num_blocks, block_size, head_dim], got "
          f"shape {k_pages.shape}")
    layer = kv_cache_lib.check_layer(layer, k_pages.shape[0])
    kv_cache_lib.check_compatible(
        jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype), meta)
  scales = {} if k_scales is None else dict(k_scales=k_scales,
                                            v_scales=v_scales)
  if not scales:  # float pages: cast (quantised ones quantise in the write)
    k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
  kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap,
                sliding_window=sliding_window, implementation=implementation)
  args = (meta.block_tables, meta.kv_lens)
  if not meta.decode_only:
    args += (meta.cu_q_lens, meta.num_seqs)
  if meta.mesh is None:
    if layer is None:
      arrays = kv_cache_lib.write_kv(k_pages, v_pages, k, v, meta.slots,
                                     **scales)
    else:
      arrays = kv_cache_lib.write_kv_layer(k_pages, v_pages, k, v, meta.slots,
                                           layer, **scales)
    attend = (attention.paged_attention if meta.decode_only
              else attention.ragged_paged_attention)
  else:
    if layer is None:
      arrays = sharding.write_kv_sharded(meta.mesh, k_pages, v_pages, k, v,
                                         meta.slots, **scales)
    else:
      arrays = sharding.write_kv_layer_sharded(meta.mesh, k_pages, v_pages, k,
                                               v, meta.slots, layer, **scales)
    fn = (sharding.sharded_paged_attention if meta.decode_only
          else sharding.sharded_ragged_paged_attention)
    attend = functools.partial(fn, meta.mesh)
  read = arrays if layer is None else tuple(
      jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in arrays)
  new_scales = dict(zip(("k_scales", "v_scales"), read[2:]))
  out = attend(q, *read[:2], *args, **new_scales, **kwargs)
  return (out.astype(q.dtype),) + tuple(arrays)


class PagedAttention(nnx.Module):
  """Llama-style attention block over a paged KV cache.

  Projections `q_proj`, `k_proj`, `v_proj`, `o_proj` (names as in Hugging Face
  Llama), RoPE on q and k, grouped-query attention (`num_heads` a multiple of
  `num_kv_heads`), any `head_dim` the attention backends accept.
  """

  def __init__(
      self,
      hidden_size: int,
      num_heads: int,
      num_kv_heads: int,
      head_dim: int,
      *,
      rope: rope_lib.RopeConfig | None,
      use_bias: bool = False,
      sm_scale: float | None = None,
      soft_cap: float | None = None,
      sliding_window: int | None = None,
      implementation: str | None = None,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    if num_heads % num_kv_heads:
      raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if rope is not None and rope.head_dim != head_dim:
      raise ValueError(f"{rope.head_dim=} must equal {head_dim=}")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope = rope
    self.sm_scale = sm_scale
    self.soft_cap = soft_cap
    self.sliding_window = sliding_window
    self.implementation = implementation
    linear = lambda i, o: nnx.Linear(  # noqa: E731
        i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)
    self.q_proj = linear(hidden_size, num_heads * head_dim)
    self.k_proj = linear(hidden_size, num_kv_heads * head_dim)
    self.v_proj = linear(hidden_size, num_kv_heads * head_dim)
    self.o_proj = linear(num_heads * head_dim, hidden_size)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """`x [num_tokens, hidden]`, `positions i32[num_tokens]` -> roped q, k, v."""
    t = x.shape[0]
    q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
    if self.rope is not None:
      q = rope_lib.apply_rope(q, positions, self.rope)
      k = rope_lib.apply_rope(k, positions, self.rope)
    return q, k, v

  def __call__(
      self,
      x: jax.Array,  # [num_tokens, hidden]
      meta: StepMetadata,
      cache: kv_cache_lib.KVCache,
      layer: int,
  ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """Paged step: writes this step's K/V into layer `layer` and attends.

    Args:
      x: `[num_tokens, hidden]` hidden states in the step's token layout.
      meta: the step's `StepMetadata` (from `step_metadata`).
      cache: the model's `KVCache` (all layers).
      layer: the layer's index into the cache: an int, or a traced integer
        scalar (the K/V are written into the whole cache at it,
        `write_and_attend(..., layer=layer)`).

    Returns:
      `(out [num_tokens, hidden], cache)` with layer `layer` updated.

    Raises:
      ValueError: if `cache` does not hold the pool `meta` was computed from
        (another block size or number of blocks).
    """
    q, k, v = self.qkv(x, meta.positions)
    names = ["k_pages", "v_pages"] + (["k_scales", "v_scales"]
                                      if cache.quantized else [])
    out, *arrays = write_and_attend(
        q, k, v, cache.k_pages, cache.v_pages, meta, layer=layer,
        sm_scale=self.sm_scale, soft_cap=self.soft_cap,
        sliding_window=self.sliding_window, implementation=self.implementation,
        **{n: getattr(cache, n) for n in names[2:]})
    cache = cache.replace(**dict(zip(names, arrays)))
    return self.o_proj(out.reshape(x.shape[0], -1)), cache

  def dense(self, x: jax.Array) -> jax.Array:
    """Non-paged causal attention over whole sequences (the test oracle).

    Args:
      x: `[batch, seq_len, hidden]`; token `j` of each row sits at position `j`.

    Returns:
      `[batch, seq_len, hidden]`.
    """
    batch, seq_len, hidden = x.shape
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
    q, k, v = self.qkv(x.reshape(batch * seq_len, hidden), positions)
    split = lambda a: a.reshape(batch, seq_len, *a.shape[1:])  # noqa: E731
    o = dense_causal_attention(
        split(q), split(k), split(v), sm_scale=self.sm_scale,
        soft_cap=self.soft_cap, sliding_window=self.sliding_window)
    return self.o_proj(o.astype(x.dtype).reshape(batch, seq_len, -1))


def dense_causal_attention(
    q: jax.Array,  # [batch, seq_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, seq_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, seq_len, num_kv_heads, head_dim]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
  """Plain causal GQA attention over contiguous sequences, softmax in float32.

  Same conventions as `paged_jax.reference` (jittable, unlike the reference).

  Returns:
    float32 `[batch, seq_len, num_q_heads, head_dim]`.
  """
  _, seq_len, num_q_heads, head_dim = q.shape
  group = num_q_heads // k.shape[2]
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32,
                 precision="highest") * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  pos = jnp.arange(seq_len)
  visible = pos[None, :] <= pos[:, None]
  if sliding_window is not None:
    visible &= pos[None, :] > pos[:, None] - sliding_window
  s = jnp.where(visible, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32),
                    precision="highest")
