"""The paged KV cache: K/V pages for every layer, and the writes into them.

Pages use the canonical layout `[num_kv_heads, num_blocks, block_size,
head_dim]` per layer; `KVCache` stacks them over layers. Token slots come from
`block_manager.slot_mapping` (`slot = block * block_size + offset`).

Every function here is pure and jittable. Jit the caller with the cache
donated (`donate_argnums`) and XLA updates the pages in place: a write costs
the bytes written, not a copy of the cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

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
  def create(cls, num_layers: int, num_kv_heads: int, num_blocks: int,
             block_size: int, head_dim: int, dtype=jnp.bfloat16) -> "KVCache":
    """A zero-filled cache.

    Raises:
      ValueError: if a size is not positive or `dtype` is not floating.
    """
    shape = cache_shape(num_layers, num_kv_heads, num_blocks, block_size,
                        head_dim, dtype)
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


def cache_shape(num_layers: int, num_kv_heads: int, num_blocks: int,
                block_size: int, head_dim: int, dtype) -> tuple[int, ...]:
  """The pages' shape, after checking the sizes and dtype.

  Raises:
    ValueError: if a size is not positive or `dtype` is not floating.
  """
  sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads,
               num_blocks=num_blocks, block_size=block_size, head_dim=head_dim)
  for name, value in sizes.items():
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
  return (num_layers, num_kv_heads, num_blocks, block_size, head_dim)


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
    slots: `i32[T]` flat slots from `slot_mapping`; -1 (and any slot out of
      range) is dropped, so padding tokens write nothing.

  Returns:
    `(k_pages, v_pages)` updated.

  Raises:
    ValueError: on mismatched shapes.

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
  expected = (slots.shape[0], kvh, head_dim)
  if slots.ndim != 1 or k.shape != expected or v.shape != expected:
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
    src: `i32[n]` source blocks (`Reservation.copy_src`).
    dst: `i32[n]` destination blocks; pairs with `NULL_BLOCK` are skipped.

  Returns:
    The updated cache.
  """
  if src.shape != dst.shape or src.ndim != 1:
    raise ValueError(f"src and dst must be 1-D of equal length, got "
                     f"src.shape={src.shape}, dst.shape={dst.shape}")
  n = cache.num_blocks
  valid = (src != NULL_BLOCK) & (dst != NULL_BLOCK)
  src = jnp.clip(src, 0, n - 1)
  dst = jnp.where(valid, dst, n)

  def copy(pages):
    return pages.at[:, :, dst].set(pages[:, :, src], mode="drop")

  return cache.replace(k_pages=copy(cache.k_pages), v_pages=copy(cache.v_pages))


def gather_kv(pages: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
              max_len: int) -> jax.Array:
  """Contiguous copies of sequences, for audit and debug tools.

  Args:
    pages: one layer's `[num_kv_heads, num_blocks, block_size, head_dim]`.
    block_tables: `i32[n, max_blocks_per_seq]`.
    kv_lens: `i32[n]`.
    max_len: static output length (at most the table's capacity).

  Returns:
    `[n, max_len, num_kv_heads, head_dim]`, zeros past each `kv_len`.

  Raises:
    ValueError: if `max_len` exceeds the block table's capacity.
  """
  _check_pages("pages", pages)
  kvh, num_blocks, block_size, head_dim = pages.shape
  capacity = block_tables.shape[1] * block_size
  if not 0 < max_len <= capacity:
    raise ValueError(f"max_len must be in [1, {capacity}] (block_tables.shape[1]"
                     f" * block_size), got {max_len=}")
  nb = -(-max_len // block_size)
  ids = jnp.clip(block_tables[:, :nb], 0, num_blocks - 1)
  x = pages[:, ids]  # [kvh, n, nb, block_size, head_dim]
  x = x.reshape(kvh, ids.shape[0], nb * block_size, head_dim)[:, :, :max_len]
  x = jnp.transpose(x, (1, 2, 0, 3))  # [n, max_len, kvh, head_dim]
  keep = jnp.arange(max_len)[None, :] < kv_lens[:, None]
  return jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))
