"""The paged KV cache: K/V pages for every layer, and the writes into them.

Pages use the canonical layout `[num_kv_heads, num_blocks, block_size,
head_dim]` per layer; `KVCache` stacks them over layers. Token slots come from
`block_manager.slot_mapping` (`slot = block * block_size + offset`).

Every function here is pure and jittable. Jit the caller with the cache
donated (`donate_argnums`) and XLA updates the pages in place: a write costs
the bytes written, not a copy of the cache.

No id a caller passes reaches outside the pool: slots and block ids outside
it (negative ones, ids past `num_blocks`, int64 values outside int32) are
dropped by the writes and copies and read as zeros by `gather_kv`, never
clamped or wrapped onto another block. Flat slots are int32, so a pool of
`num_blocks * block_size >= 2**31` slots is refused with a `ValueError`.
A `KVCache` serves one block pool: `check_compatible` checks that a block
state (or the step metadata made from it) agrees with it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import _int32
from paged_jax.block_manager import NULL_BLOCK


@flax.struct.dataclass
class KVCache:
  """K and V pages of a whole model.

  Attributes:
    k_pages: `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`.
    v_pages: same shape and dtype as `k_pages`.
  """

  k_pages: jax.Array
  v_pages: jax.Array

  @classmethod
  def create(cls, *, num_layers: int, num_kv_heads: int, num_blocks: int,
             block_size: int, head_dim: int, dtype=jnp.bfloat16) -> "KVCache":
    """A zero-filled cache of pages `[num_layers, num_kv_heads, num_blocks,
    block_size, head_dim]`.

    Sizes are keyword-only, as in `block_manager.init`: their orders differ.

    Raises:
      ValueError: as `cache_shape`.
    """
    shape = cache_shape(num_layers=num_layers, num_kv_heads=num_kv_heads,
                        num_blocks=num_blocks, block_size=block_size,
                        head_dim=head_dim, dtype=dtype)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

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
    return self.k_pages.nbytes + self.v_pages.nbytes


def cache_shape(*, num_layers: int, num_kv_heads: int, num_blocks: int,
                block_size: int, head_dim: int, dtype) -> tuple[int, ...]:
  """The pages' shape, after checking the sizes and dtype.

  Raises:
    ValueError: if a size is not a positive int (bools are not), the pool's
      flat slots (`num_blocks * block_size`) would not fit int32, or `dtype`
      is not floating.
  """
  sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads,
               num_blocks=num_blocks, block_size=block_size, head_dim=head_dim)
  shape = tuple(_int32.positive_int(k, v) for k, v in sizes.items())
  _check_pool_fits(shape[2], shape[3])
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
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
      differ.

  Example:
    >>> state = block_manager.init(num_blocks=8, block_size=16, max_seqs=2,
    ...                            max_blocks_per_seq=4)
    >>> cache = KVCache.create(num_layers=1, num_kv_heads=1, num_blocks=8,
    ...                        block_size=16, head_dim=64)
    >>> check_compatible(cache, state)
  """
  if isinstance(cache, KVCache):
    blocks, block_size = cache.num_blocks, cache.block_size
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


def _check_pages(name: str, pages: jax.Array):
  if pages.ndim != 4:
    raise ValueError(f"{name} must be [num_kv_heads, num_blocks, block_size, "
                     f"head_dim], got shape {pages.shape}")


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array,
             v: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Writes new tokens' K/V into one layer's pages (one scatter each).

  Args:
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    v_pages: same shape as `k_pages`.
    k: `[T, num_kv_heads, head_dim]` new keys (cast to the pages' dtype).
    v: `[T, num_kv_heads, head_dim]` new values.
    slots: `int[T]` flat slots from `slot_mapping`; -1 (and any slot out of
      range, int64 ones outside int32 included) is dropped, so padding tokens
      write nothing.

  Returns:
    `(k_pages, v_pages)` updated.

  Raises:
    ValueError: on mismatched shapes, non-integer slots, or a pool whose flat
      slots (`num_blocks * block_size`) would not fit int32.

  Example:
    >>> pages = jnp.zeros((1, 2, 4, 8))
    >>> k = jnp.ones((1, 1, 8))
    >>> kp, vp = write_kv(pages, pages, k, k, jnp.array([5]))  # block 1, offset 1
    >>> float(kp[0, 1, 1, 0])
    1.0
  """
  _check_pages("k_pages", k_pages)
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages.shape={v_pages.shape} must equal "
                     f"k_pages.shape={k_pages.shape}")
  kvh, num_blocks, block_size, head_dim = k_pages.shape
  _check_pool_fits(num_blocks, block_size)
  slots = _int32.as_int32("slots", slots)
  expected = (slots.shape[0], kvh, head_dim)
  if k.shape != expected or v.shape != expected:
    raise ValueError(
        f"k and v must be [T, num_kv_heads, head_dim]={expected} with slots "
        f"i32[T], got k.shape={k.shape}, v.shape={v.shape}, "
        f"slots.shape={slots.shape}")
  n = num_blocks * block_size
  idx = jnp.where((slots >= 0) & (slots < n), slots, n)

  def scatter(pages, new):
    flat = pages.reshape(kvh, n, head_dim)
    new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)  # [kvh, T, head_dim]
    flat = flat.at[:, idx].set(new, mode="drop", unique_indices=False)
    return flat.reshape(pages.shape)

  return scatter(k_pages, k), scatter(v_pages, v)


def copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
  """Copies whole blocks `src -> dst` in every layer (copy-on-write).

  Args:
    cache: the cache.
    src: `int[n]` source blocks (`Reservation.copy_src`).
    dst: `int[n]` destination blocks. A pair is skipped when either id is
      outside `[0, num_blocks)`: `NULL_BLOCK`, any other negative id, ids past
      the pool and int64 ids outside int32.

  Returns:
    The updated cache.

  Raises:
    ValueError: if `src` and `dst` are not 1-D integer arrays of equal length.
  """
  src = _int32.as_int32("src", src)
  dst = _int32.as_int32("dst", dst)
  if src.shape != dst.shape:
    raise ValueError(f"src and dst must be 1-D of equal length, got "
                     f"src.shape={src.shape}, dst.shape={dst.shape}")
  n = cache.num_blocks
  valid = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
  src = jnp.where(valid, src, 0)
  dst = jnp.where(valid, dst, n)  # dropped

  def copy(pages):
    return pages.at[:, :, dst].set(pages[:, :, src], mode="drop")

  return cache.replace(k_pages=copy(cache.k_pages), v_pages=copy(cache.v_pages))


def gather_kv(pages: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
              max_len: int) -> jax.Array:
  """Contiguous copies of sequences, for audit and debug tools.

  Args:
    pages: one layer's `[num_kv_heads, num_blocks, block_size, head_dim]`.
    block_tables: `int[n, max_blocks_per_seq]`.
    kv_lens: `int[n]`.
    max_len: static output length (at most the table's capacity).

  Returns:
    `[n, max_len, num_kv_heads, head_dim]`: zeros past each `kv_len`, and
    zeros for the tokens of a table entry outside `[0, num_blocks)`
    (`NULL_BLOCK` included), which is never read.

  Raises:
    ValueError: if `max_len` exceeds the block table's capacity, or the
      tables and lengths are not integer arrays of rank 2 and 1.
  """
  _check_pages("pages", pages)
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
