"""The paged KV cache: K/V pages for every layer, and the writes into them.

Pages use the canonical layout `[num_kv_heads, num_blocks, block_size,
head_dim]` per layer; `KVCache` stacks them over layers. Token slots come from
`block_manager.slot_mapping` (`slot = block * block_size + offset`).

Every function here is pure and jittable. Jit the caller with the cache
donated (`donate_argnums`) and XLA updates the pages in place: a write costs
the bytes written, not a copy of the cache. `write_kv` writes one layer's
pages; `write_kv_layer` writes into the stacked `[num_layers, ...]` arrays at
a (traced) layer index, so a model whose layers run under `lax.scan` with the
cache carried updates the carry in place.

No id a caller passes reaches outside the pool: slots and block ids outside
it (negative ones, ids past `num_blocks`, int64 values outside int32) are
dropped by the writes and copies and read as zeros by `gather_kv`, never
clamped or wrapped onto another block. Flat slots are int32, so a pool of
`num_blocks * block_size >= 2**31` slots is refused with a `ValueError`.
A `KVCache` serves one block pool: `check_compatible` checks that a block
state (or the step metadata made from it) agrees with it.

Quantised caches (`int8`, `float8_e4m3fn`; `cache_dtype("fp8")`) store 8-bit
values and, beside them in the same block layout, one float32 scale per token
and KV head (`k_scales`, `v_scales`: `f32[num_layers, num_kv_heads,
num_blocks, block_size]`). `write_kv` computes the scales in the same fused
write (`pallas_kernels.quantization.quantize`), and `copy_blocks`,
`gather_kv` and the sharding helpers carry them. Float caches have no scales
(None: no pytree leaf), exactly as before.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _int32
from paged_jax.block_manager import NULL_BLOCK
from pallas_kernels import quantization

# vLLM's `--kv-cache-dtype` names (and numpy's), to dtypes; "auto" is the
# model's dtype (`cache_dtype`).
_DTYPE_NAMES = {
    "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
    "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}
DTYPE_NAMES = ("auto",) + tuple(_DTYPE_NAMES)


def cache_dtype(name, model_dtype=None) -> jnp.dtype:
  """The page dtype a `--kv-cache-dtype` name (or a dtype) stands for.

  Args:
    name: "auto", "float32", "bfloat16", "float16", "int8", "fp8" (=
      "fp8_e4m3" = "float8_e4m3fn", OCP e4m3), a dtype, or None (= "auto").
    model_dtype: what "auto" means (the model's activation dtype).

  Raises:
    ValueError: for another name, or "auto" without a `model_dtype`.

  Example:
    >>> str(cache_dtype("fp8")), str(cache_dtype("auto", jnp.bfloat16))
    ('float8_e4m3fn', 'bfloat16')
  """
  if name is None or (isinstance(name, str) and name == "auto"):
    if model_dtype is None:
      raise ValueError("cache dtype 'auto' needs the model's dtype")
    return jnp.dtype(model_dtype)
  if isinstance(name, str):
    if name not in _DTYPE_NAMES:
      raise ValueError(f"cache dtype must be one of {list(DTYPE_NAMES)}, got "
                       f"{name!r}")
    return jnp.dtype(_DTYPE_NAMES[name])
  return jnp.dtype(name)


def token_bytes(dtype, head_dim: int) -> int:
  """Bytes one token of one KV head takes in K (or in V): `head_dim` values,
  plus its float32 scale for int8 / fp8 pages."""
  # Imported here: `python -m paged_jax.capacity` must find it unimported.
  from paged_jax import capacity  # pylint: disable=import-outside-toplevel
  return capacity.kv_head_token_bytes(jnp.dtype(dtype).name, head_dim)


@flax.struct.dataclass
class KVCache:
  """K and V pages of a whole model.

  Attributes:
    k_pages: `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`,
      a float dtype, or int8 / float8_e4m3fn (quantised).
    v_pages: same shape and dtype as `k_pages`.
    k_scales: quantised caches: `f32[num_layers, num_kv_heads, num_blocks,
      block_size]`, token `t`'s keys are `k_pages[..., t, :] * k_scales[...,
      t]`; None for float caches.
    v_scales: as `k_scales`, for the values.
  """

  k_pages: jax.Array
  v_pages: jax.Array
  k_scales: jax.Array | None = None
  v_scales: jax.Array | None = None

  @classmethod
  def create(cls, *, num_layers: int, num_kv_heads: int, num_blocks: int,
             block_size: int, head_dim: int, dtype=jnp.bfloat16) -> "KVCache":
    """A zero-filled cache of pages `[num_layers, num_kv_heads, num_blocks,
    block_size, head_dim]`.

    Sizes are keyword-only, as in `block_manager.init`: their orders differ.
    `dtype` int8 or float8_e4m3fn adds zero scales `f32[num_layers,
    num_kv_heads, num_blocks, block_size]` (a name as `cache_dtype` also
    works, "auto" excepted).

    Raises:
      ValueError: as `cache_shape`.
    """
    dtype = cache_dtype(dtype, None)
    shape = cache_shape(num_layers=num_layers, num_kv_heads=num_kv_heads,
                        num_blocks=num_blocks, block_size=block_size,
                        head_dim=head_dim, dtype=dtype)
    return cls(*zero_arrays(shape, dtype, jnp.zeros))

  @property
  def dtype(self) -> jnp.dtype:
    """The pages' dtype (what was actually allocated)."""
    return jnp.dtype(self.k_pages.dtype)

  @property
  def quantized(self) -> bool:
    return self.k_scales is not None

  @property
  def num_layers(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_blocks(self) -> int:
    return self.k_pages.shape[2]

  @property
  def block_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def nbytes(self) -> int:
    """Bytes of every array: pages and scales."""
    return sum(x.nbytes for x in self.arrays())

  @property
  def bytes_per_block(self) -> int:
    """Cache bytes per block (all layers, K and V, scales included), read
    from the allocated arrays: what one block costs to copy between
    memories (`kv_offload`), the one rule for bytes moved."""
    return self.nbytes // self.num_blocks

  @property
  def bytes_per_token(self) -> int:
    """Cache bytes per token slot (all layers, K and V, scales included),
    read from the allocated arrays."""
    return self.nbytes // (self.num_blocks * self.block_size)

  def arrays(self) -> tuple[jax.Array, ...]:
    """`(k_pages, v_pages)`, plus `(k_scales, v_scales)` when quantised."""
    out = (self.k_pages, self.v_pages)
    return out + ((self.k_scales, self.v_scales) if self.quantized else ())

  def layer(self, layer: int) -> dict:
    """Layer `layer`'s arrays by name, for `write_kv` and attention:
    `k_pages`, `v_pages`, and `k_scales`, `v_scales` (None when float)."""
    return dict(
        k_pages=self.k_pages[layer], v_pages=self.v_pages[layer],
        k_scales=None if self.k_scales is None else self.k_scales[layer],
        v_scales=None if self.v_scales is None else self.v_scales[layer])

  def set_layer(self, layer: int, k_pages, v_pages, k_scales=None,
                v_scales=None) -> "KVCache":
    """The cache with layer `layer`'s arrays replaced (as `layer` names them)."""
    new = dict(k_pages=self.k_pages.at[layer].set(k_pages),
               v_pages=self.v_pages.at[layer].set(v_pages))
    if self.quantized:
      new.update(k_scales=self.k_scales.at[layer].set(k_scales),
                 v_scales=self.v_scales.at[layer].set(v_scales))
    return self.replace(**new)


def zero_arrays(shape, dtype, zeros) -> tuple:
  """`(k_pages, v_pages[, k_scales, v_scales])` made by `zeros(shape, dtype)`:
  scales (`shape[:-1]`, float32) only for a quantised `dtype`."""
  out = (zeros(shape, dtype), zeros(shape, dtype))
  if quantization.is_quantized(dtype):
    s = shape[:-1]
    out += (zeros(s, quantization.SCALE_DTYPE), zeros(s, quantization.SCALE_DTYPE))
  return out


def cache_shape(*, num_layers: int, num_kv_heads: int, num_blocks: int,
                block_size: int, head_dim: int, dtype) -> tuple[int, ...]:
  """The pages' shape, after checking the sizes and dtype.

  Raises:
    ValueError: if a size is not a positive int (bools are not), the pool's
      flat slots (`num_blocks * block_size`) would not fit int32, or `dtype`
      is neither floating nor int8.
  """
  sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads,
               num_blocks=num_blocks, block_size=block_size, head_dim=head_dim)
  shape = tuple(_int32.positive_int(k, v) for k, v in sizes.items())
  _check_pool_fits(shape[2], shape[3])
  if not (jnp.issubdtype(dtype, jnp.floating)
          or quantization.is_quantized(dtype)):
    raise ValueError(f"dtype must be a floating dtype or int8, got "
                     f"{jnp.dtype(dtype)}")
  return shape


def _check_pool_fits(num_blocks: int, block_size: int):
  _int32.check_fits("cache slots", num_blocks=num_blocks,
                    block_size=block_size)


def check_compatible(cache, state) -> None:
  """Checks that `cache` holds the block pool that `state` manages.

  Block ids and slots from a block state index the cache's pages directly,
  so a cache with another `block_size` or another number of blocks gives
  silently wrong attention. Call this wherever the two meet;
  `flax_attention.write_and_attend` (and so `PagedAttention`) does.

  Args:
    cache: a `KVCache`, or one layer's pages `[num_kv_heads, num_blocks,
      block_size, head_dim]` (a mesh's global pages: every data shard's pool).
    state: a `block_manager.BlockState` (data shards' states stacked on a
      leading axis count every shard's pool), or a
      `flax_attention.StepMetadata` made from one (it records the state's
      `block_size` and `total_blocks`).

  Raises:
    ValueError: naming both values when `block_size` or the number of blocks
      differ, or when a `KVCache`'s scales do not fit its page dtype (missing
      for int8/fp8 pages, present for float ones, another block layout).

  Example:
    >>> state = block_manager.init(num_blocks=8, block_size=16, max_seqs=2,
    ...                            max_blocks_per_seq=4)
    >>> cache = KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=8,
    ...                        block_size=16, head_dim=64)
    >>> check_compatible(cache, state)
  """
  if isinstance(cache, KVCache):
    blocks, block_size = cache.num_blocks, cache.block_size
    _check_cache_scales(cache)
  else:
    _check_pages("pages", cache)
    blocks, block_size = cache.shape[1], cache.shape[2]
  if block_size != state.block_size:
    raise ValueError(f"the KV cache's block_size={block_size} must equal the "
                     f"block state's block_size={state.block_size}")
  if blocks != state.total_blocks:
    raise ValueError(f"the KV cache's num_blocks={blocks} must equal the block "
                     f"state's {state.total_blocks} blocks (all data shards' "
                     "pools together)")


def _check_cache_scales(cache: KVCache):
  """The scales a `KVCache`'s page dtype needs, in the pages' block layout."""
  pages = jax.ShapeDtypeStruct(cache.k_pages.shape[1:], cache.k_pages.dtype)
  for name in ("k_scales", "v_scales"):
    scales = getattr(cache, name)
    error = quantization.scales_error(
        pages, None if scales is None else jax.ShapeDtypeStruct(
            scales.shape[1:], scales.dtype), name)
    if error is None and scales is not None and (
        scales.shape[0] != cache.num_layers):
      error = (f"{name} must have num_layers={cache.num_layers} layers, got "
               f"shape {scales.shape}")
    if error is not None:
      raise ValueError(f"the KV cache's {error}")


def _check_pages(name: str, pages: jax.Array):
  if pages.ndim != 4:
    raise ValueError(f"{name} must be [num_kv_heads, num_blocks, block_size, "
                     f"head_dim], got shape {pages.shape}")


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array,
             v: jax.Array, slots: jax.Array, *, k_scales: jax.Array | None = None,
             v_scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """Writes new tokens' K/V into one layer's pages (one scatter each).

  Quantised pages (int8 / float8_e4m3fn) also take their scales: each new
  token's K and V are quantised with one scale per KV head
  (`pallas_kernels.quantization.quantize`) in the same jitted write, and the
  values and scales are scattered to the same slots.

  Args:
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    v_pages: same shape as `k_pages`.
    k: `[T, num_kv_heads, head_dim]` new keys (cast to the pages' dtype, or
      quantised to it).
    v: `[T, num_kv_heads, head_dim]` new values.
    slots: `int[T]` flat slots from `slot_mapping`; -1 (and any slot out of
      range, int64 ones outside int32 included) is dropped, so padding tokens
      write nothing.
    k_scales: quantised pages only: `f32[num_kv_heads, num_blocks,
      block_size]`.
    v_scales: as `k_scales`.

  Returns:
    `(k_pages, v_pages)` updated; quantised pages: `(k_pages, v_pages,
    k_scales, v_scales)` (every cache array passed in comes back).

  Raises:
    ValueError: on mismatched shapes, non-integer slots, a pool whose flat
      slots (`num_blocks * block_size`) would not fit int32, or scales
      missing for quantised pages (present for float ones).

  Example:
    >>> pages = jnp.zeros((1, 2, 4, 8))
    >>> k = jnp.ones((1, 1, 8))
    >>> kp, vp = write_kv(pages, pages, k, k, jnp.array([5]))  # block 1, offset 1
    >>> float(kp[0, 1, 1, 0])
    1.0
  """
  _check_pages("k_pages", k_pages)
  n, idx = _check_write(k_pages, v_pages, k, v, slots, k_scales, v_scales)
  kvh = k_pages.shape[0]

  def scatter(pages, new):  # pages [kvh, num_blocks, block_size(, d)]
    flat = pages.reshape(kvh, n, *pages.shape[3:])
    new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)  # [kvh, T(, d)]
    flat = flat.at[:, idx].set(new, mode="drop", unique_indices=False)
    return flat.reshape(pages.shape)

  return _write(scatter, k_pages, v_pages, k, v, k_scales, v_scales)


def _check_write(k_pages, v_pages, k, v, slots, k_scales, v_scales):
  """`write_kv`'s checks on one layer's shapes (`k_pages` `[..., num_kv_heads,
  num_blocks, block_size, head_dim]`; the scales' leading axes as the
  pages'): returns `(num_blocks * block_size, flat slots with every
  out-of-range one set to that (dropped))`."""
  if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
    raise ValueError(f"v_pages ({v_pages.dtype}{list(v_pages.shape)}) must "
                     f"match k_pages ({k_pages.dtype}{list(k_pages.shape)})")
  lead = k_pages.ndim - 4
  layer_pages = jax.ShapeDtypeStruct(k_pages.shape[lead:], k_pages.dtype)
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if scales is not None and scales.shape[:lead] != k_pages.shape[:lead]:
      raise ValueError(f"{name} must have the pages' leading axes "
                       f"{k_pages.shape[:lead]}, got shape {scales.shape}")
    error = quantization.scales_error(
        layer_pages, None if scales is None else jax.ShapeDtypeStruct(
            scales.shape[lead:], scales.dtype), name)
    if error is not None:
      raise ValueError(error)
  kvh, num_blocks, block_size, head_dim = layer_pages.shape
  _check_pool_fits(num_blocks, block_size)
  slots = _int32.as_int32("slots", slots)
  expected = (slots.shape[0], kvh, head_dim)
  if k.shape != expected or v.shape != expected:
    raise ValueError(
        f"k and v must be [T, num_kv_heads, head_dim]={expected} with slots "
        f"i32[T], got k.shape={k.shape}, v.shape={v.shape}, "
        f"slots.shape={slots.shape}")
  n = num_blocks * block_size
  return n, jnp.where((slots >= 0) & (slots < n), slots, n)


def _write(scatter, k_pages, v_pages, k, v, k_scales, v_scales):
  """Scatters `k`, `v` (quantised first, with their scales, for 8-bit pages)
  with `scatter(array, new [T, num_kv_heads(, head_dim)])`."""
  if k_scales is None:
    return scatter(k_pages, k), scatter(v_pages, v)
  kq, ks = quantization.quantize(k, k_pages.dtype)
  vq, vs = quantization.quantize(v, v_pages.dtype)
  return (scatter(k_pages, kq), scatter(v_pages, vq), scatter(k_scales, ks),
          scatter(v_scales, vs))


def write_kv_layer(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array,
                   v: jax.Array, slots: jax.Array, layer,
                   *, k_scales: jax.Array | None = None,
                   v_scales: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """`write_kv` into layer `layer` of the whole cache's pages (one scatter
  each, at the layer index).

  The scatter goes into the stacked arrays directly, so under `lax.scan`
  (the cache carried, `layer` the traced layer index) or under a jit with the
  cache donated, XLA updates the arrays in place: the write costs the bytes
  written, never a copy of the layer's pages out of the cache and back
  (`write_kv` on `KVCache.layer`'s slices plus `KVCache.set_layer`).

  Args:
    k_pages: `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`
      (`KVCache.k_pages`).
    v_pages: same shape and dtype as `k_pages`.
    k: `[T, num_kv_heads, head_dim]` new keys (cast to the pages' dtype, or
      quantised to it).
    v: `[T, num_kv_heads, head_dim]` new values.
    slots: `int[T]` flat slots, as `write_kv` (-1 and out-of-range slots are
      dropped).
    layer: the layer, an int or a traced integer scalar. A static one must be
      in `[0, num_layers)`; a traced one outside it writes nothing.
    k_scales: quantised pages only: `f32[num_layers, num_kv_heads,
      num_blocks, block_size]` (`KVCache.k_scales`).
    v_scales: as `k_scales`.

  Returns:
    `(k_pages, v_pages)` updated, all layers; quantised pages: `(k_pages,
    v_pages, k_scales, v_scales)`.

  Raises:
    ValueError: as `write_kv`, for pages that are not 5-D, or for a layer that
      is not an integer scalar (or, static, outside `[0, num_layers)`).

  Example:
    >>> pages = jnp.zeros((2, 1, 2, 4, 8))
    >>> k = jnp.ones((1, 1, 8))
    >>> kp, vp = write_kv_layer(pages, pages, k, k, jnp.array([5]), 1)
    >>> float(kp[1, 0, 1, 1, 0]), float(kp[0, 0, 1, 1, 0])
    (1.0, 0.0)
  """
  if k_pages.ndim != 5:
    raise ValueError(f"k_pages must be [num_layers, num_kv_heads, num_blocks, "
                     f"block_size, head_dim], got shape {k_pages.shape}")
  num_layers, kvh = k_pages.shape[:2]
  layer = check_layer(layer, num_layers)
  n, idx = _check_write(k_pages, v_pages, k, v, slots, k_scales, v_scales)
  if idx.shape[0] == 1:
    # One token (a 1-row decode step): XLA CPU rewrites a one-index scatter
    # as a dynamic-update-slice under a bounds select, and in the layer scan
    # that form copies the whole carried cache array four times per layer
    # (SmolLM2-135M, 30 layers: 1.4 s CPU per decode step against 0.11 s at 2
    # rows, benchmarks/RESULTS.md 12b). A second, dropped slot keeps it a
    # scatter, written in place as at T >= 2.
    idx = jnp.concatenate([idx, jnp.full((1,), n, idx.dtype)])
    k, v = (jnp.concatenate([x, jnp.zeros_like(x)]) for x in (k, v))

  def scatter(pages, new):  # pages [L, kvh, num_blocks, block_size(, d)]
    flat = pages.reshape(num_layers, kvh, n, *pages.shape[4:])
    # The scalar layer and the slots are advanced indices around a slice, so
    # the indexed dims come first: [T, kvh(, d)], the new tokens' own layout.
    flat = flat.at[layer, :, idx].set(new.astype(pages.dtype), mode="drop",
                                      unique_indices=False)
    return flat.reshape(pages.shape)

  return _write(scatter, k_pages, v_pages, k, v, k_scales, v_scales)


def check_layer(layer, num_layers: int) -> jax.Array:
  """`layer` as an int32 scalar (static: checked to be in `[0, num_layers)`).

  Raises:
    ValueError: for a non-integer or non-scalar layer, or a static one out of
      range.
  """
  if isinstance(layer, bool):
    raise ValueError(f"layer must be an integer scalar, got {layer!r}")
  if isinstance(layer, (int, np.integer)):
    if not 0 <= int(layer) < num_layers:
      raise ValueError(f"layer must be in [0, num_layers={num_layers}), got "
                       f"{layer}")
    return jnp.int32(int(layer))
  layer = jnp.asarray(layer)
  if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
    raise ValueError(f"layer must be an integer scalar, got "
                     f"{layer.dtype}{list(layer.shape)}")
  return layer.astype(jnp.int32)


def copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
  """Copies whole blocks `src -> dst` in every layer (copy-on-write).

  Args:
    cache: the cache, or a tuple of caches over one pool of blocks (a
      target's and its draft's, `serving.spec_draft`): each is copied.
    src: `int[n]` source blocks (`Reservation.copy_src`).
    dst: `int[n]` destination blocks. A pair is skipped when either id is
      outside `[0, num_blocks)`: `NULL_BLOCK`, any other negative id, ids past
      the pool and int64 ids outside int32.

  Returns:
    The updated cache.

  Raises:
    ValueError: if `src` and `dst` are not 1-D integer arrays of equal length.
  """
  if isinstance(cache, tuple):
    return tuple(copy_blocks(c, src, dst) for c in cache)
  src = _int32.as_int32("src", src)
  dst = _int32.as_int32("dst", dst)
  if src.shape != dst.shape:
    raise ValueError(f"src and dst must be 1-D of equal length, got "
                     f"src.shape={src.shape}, dst.shape={dst.shape}")
  n = cache.num_blocks
  valid = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
  src = jnp.where(valid, src, 0)
  dst = jnp.where(valid, dst, n)  # dropped

  def copy(pages):  # pages or scales: the block axis is axis 2 of both
    return pages.at[:, :, dst].set(pages[:, :, src], mode="drop")

  def run(cache):
    return cache.replace(**{name: copy(getattr(cache, name)) for name in
                            ("k_pages", "v_pages", "k_scales", "v_scales")
                            if getattr(cache, name) is not None})

  # Nothing to copy (nearly every step): no gather and scatter of `n` blocks
  # in every layer (RESULTS 7p: 2 x 8.5 ms a SmolLM2 step at 32 pairs, loaded).
  return jax.lax.cond(jnp.any(valid), run, lambda cache: cache, cache)


def gather_kv(pages: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
              max_len: int, *, scales: jax.Array | None = None) -> jax.Array:
  """Contiguous copies of sequences, for audit and debug tools.

  Args:
    pages: one layer's `[num_kv_heads, num_blocks, block_size, head_dim]`.
    block_tables: `int[n, max_blocks_per_seq]`.
    kv_lens: `int[n]`.
    max_len: static output length (at most the table's capacity).
    scales: quantised pages: their `f32[num_kv_heads, num_blocks,
      block_size]` scales; the result is then dequantised float32.

  Returns:
    `[n, max_len, num_kv_heads, head_dim]` (pages' dtype; float32 when
    dequantised): zeros past each `kv_len`, and
    zeros for the tokens of a table entry outside `[0, num_blocks)`
    (`NULL_BLOCK` included), which is never read.

  Raises:
    ValueError: if `max_len` exceeds the block table's capacity, or the
      tables and lengths are not integer arrays of rank 2 and 1.
  """
  _check_pages("pages", pages)
  error = quantization.scales_error(pages, scales, "scales")
  if error is not None:
    raise ValueError(error)
  if scales is not None:
    pages = quantization.dequantize(pages, scales)
  block_tables = _int32.as_int32("block_tables", block_tables, ndim=2)
  kv_lens = _int32.as_int32("kv_lens", kv_lens)
  kvh, num_blocks, block_size, head_dim = pages.shape
  capacity = block_tables.shape[1] * block_size
  if not 0 < max_len <= capacity:
    raise ValueError(f"max_len must be in [1, {capacity}] (block_tables.shape[1]"
                     f" * block_size), got {max_len=}")
  nb = -(-max_len // block_size)
  ids = block_tables[:, :nb]
  owned = (ids >= 0) & (ids < num_blocks)  # [n, nb]
  x = pages[:, jnp.where(owned, ids, 0)]  # [kvh, n, nb, block_size, head_dim]
  x = x.reshape(kvh, ids.shape[0], nb * block_size, head_dim)[:, :, :max_len]
  x = jnp.transpose(x, (1, 2, 0, 3))  # [n, max_len, kvh, head_dim]
  keep = jnp.arange(max_len)[None, :] < kv_lens[:, None]
  keep &= jnp.repeat(owned, block_size, axis=1)[:, :max_len]
  return jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))
