"""Copies of KV blocks between the device cache and a host-memory cache.

The host tier's pages (`host_tier.HostTier` manages their blocks) are a
`KVCache` of the same layout, `[num_layers, num_kv_heads, num_host_blocks,
block_size, head_dim]` (plus the int8 / fp8 scales `[..., num_host_blocks,
block_size]`), placed in a host memory space: `pinned_host` where the
platform has it (GPU and TPU, and JAX's CPU backend, where it is ordinary
memory), else `unpinned_host`, else a second pool in device memory
(`host_memory_kind`).

Each copy is three dispatched programs and returns without waiting:

* `copy_to_host`: gather the listed device blocks into a contiguous staging
  buffer (on the device), `jax.device_put` it to the host memory kind (the
  DMA), scatter it into the host pages (a program whose operands all live in
  host memory; the host pages are donated, so the update is in place).
* `copy_to_device`: gather the listed host blocks (host memory), put the
  staging buffer on the device, scatter it into the cache (donated).

JAX dispatches all three asynchronously and orders them by data
dependence, so a step dispatched after `copy_to_device` that takes the new
cache waits only for that copy, and a `copy_to_host` of blocks that a later
step overwrites reads them first (the step consumes the cache the gather
read, in program order). The caller never blocks; `jax.block_until_ready`
on the result is the only wait. Copies are sized by the pairs passed:
`host_tier.pack_pairs` puts the real pairs first so that a bucketed prefix
`[:m]` moves `m` blocks, not `batch x max_blocks_per_seq`.

Not verified on an accelerator yet (no device in this session): on GPU / TPU
the host-side gather and scatter rely on XLA placing a program whose operands
are all in `pinned_host` on the host; if a backend refuses it, pass
`memory_kind="device"` (a second device pool: the same code, no host memory
saved) until a host-compute path is added.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _int32
from paged_jax.kv_cache import KVCache, zero_arrays

_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")
MEMORY_KINDS = ("pinned_host", "unpinned_host", "device")


def host_memory_kind(device: jax.Device | None = None) -> str:
  """The memory kind the host tier uses on `device` (default: the first):
  `"pinned_host"` if the device can address it, else `"unpinned_host"`,
  else `"device"` (no host memory space: a second pool in device memory)."""
  device = jax.devices()[0] if device is None else device
  kinds = {m.kind for m in device.addressable_memories()}
  for kind in MEMORY_KINDS[:2]:
    if kind in kinds:
      return kind
  return "device"


def _sharding(device, memory_kind: str) -> jax.sharding.Sharding:
  if memory_kind not in MEMORY_KINDS:
    raise ValueError(f"memory_kind must be one of {MEMORY_KINDS}, got "
                     f"{memory_kind!r}")
  if memory_kind == "device":
    return jax.sharding.SingleDeviceSharding(device)
  return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def host_cache(like: KVCache, num_host_blocks: int, *,
               memory_kind: str | None = None) -> KVCache:
  """A zero-filled cache of `num_host_blocks` blocks in host memory.

  Args:
    like: the device cache (layers, heads, block size, head dim, dtype and
      scales are taken from it; its first array's device is used).
    num_host_blocks: blocks of the host pool (`HostTier.num_blocks`).
    memory_kind: one of `MEMORY_KINDS`; default `host_memory_kind()`.

  Returns:
    A `KVCache` whose arrays live in `memory_kind` memory.

  Raises:
    ValueError: for a bad `num_host_blocks` or `memory_kind`.
  """
  n = _int32.positive_int("num_host_blocks", num_host_blocks)
  device = next(iter(like.k_pages.devices()))
  kind = host_memory_kind(device) if memory_kind is None else memory_kind
  sharding = _sharding(device, kind)
  shape = list(like.k_pages.shape)
  shape[2] = n
  # Host zeros (calloc'd, not touched) put into the memory kind: a program
  # with `out_shardings` there would return arrays whose type lacks the host
  # memory space on JAX 0.10, which later programs then mix with host ones.
  arrays = zero_arrays(tuple(shape), like.dtype, np.zeros)
  return KVCache(*jax.device_put(arrays, sharding))


def _arrays(cache: KVCache) -> dict:
  return {f: getattr(cache, f) for f in _FIELDS if getattr(cache, f) is not None}


def _pairs(src, dst, num_src: int, num_dst: int):
  src = _int32.as_int32("src", src)
  dst = _int32.as_int32("dst", dst)
  if src.shape != dst.shape:
    raise ValueError(f"src and dst must be 1-D of equal length, got "
                     f"src.shape={src.shape}, dst.shape={dst.shape}")
  valid = (src >= 0) & (src < num_src) & (dst >= 0) & (dst < num_dst)
  return jnp.where(valid, src, 0), jnp.where(valid, dst, num_dst)


def _check_like(cache: KVCache, host: KVCache):
  a, b = cache.k_pages, host.k_pages
  if (a.shape[:2] + a.shape[3:] != b.shape[:2] + b.shape[3:]
      or a.dtype != b.dtype or cache.quantized != host.quantized):
    raise ValueError(
        f"the host cache ({b.dtype}{list(b.shape)}, scales: {host.quantized}) "
        f"must match the device cache ({a.dtype}{list(a.shape)}, scales: "
        f"{cache.quantized}) in every axis but the blocks (axis 2)")


@jax.jit
def _gather(arrays: dict, ids):
  return {f: x[:, :, ids] for f, x in arrays.items()}


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(arrays: dict, staged: dict, ids):
  return {f: x.at[:, :, ids].set(staged[f], mode="drop")
          for f, x in arrays.items()}


@functools.cache
def _host_ops(sharding: jax.sharding.Sharding):
  """The gather and scatter as programs whose results stay in `sharding`'s
  memory (one pair per memory kind and device)."""
  gather = jax.jit(_gather.__wrapped__, out_shardings=sharding)
  scatter = jax.jit(_scatter.__wrapped__, out_shardings=sharding,
                    donate_argnums=0)
  return gather, scatter


def copy_to_host(cache: KVCache, host: KVCache, src, dst) -> KVCache:
  """Copies device blocks `src` into host blocks `dst` (a swap-out).

  Dispatched, not awaited: returns the new host cache at once. `host` is
  donated (do not use it after the call).

  Args:
    cache: the device cache `[num_layers, num_kv_heads, num_blocks,
      block_size, head_dim]` (+ scales).
    host: the host cache, same layout with `num_host_blocks` (`host_cache`).
    src: `int[k]` device blocks (`pack_pairs` of `Swap.src`).
    dst: `int[k]` host blocks. A pair with either id outside its pool
      (`NULL_BLOCK` included) is skipped; it still costs one block's bytes.

  Returns:
    The updated host cache, in the host's memory kind.

  Raises:
    ValueError: if the caches' layouts or the pairs' shapes differ.
  """
  _check_like(cache, host)
  src, dst = _pairs(src, dst, cache.num_blocks, host.num_blocks)
  sharding = host.k_pages.sharding
  _, scatter = _host_ops(sharding)
  staged = jax.device_put(_gather(_arrays(cache), src), sharding)
  out = scatter(_arrays(host), staged, jax.device_put(dst, sharding))
  return host.replace(**out)


def copy_to_device(cache: KVCache, host: KVCache, src, dst) -> KVCache:
  """Copies host blocks `src` into device blocks `dst` (a swap-in).

  Dispatched, not awaited: returns the new device cache at once. `cache` is
  donated (do not use it after the call).

  Args:
    cache: the device cache.
    host: the host cache (`host_cache`).
    src: `int[k]` host blocks (`pack_pairs` of `Swap.src`).
    dst: `int[k]` device blocks; pairs outside either pool are skipped.

  Returns:
    The updated device cache.

  Raises:
    ValueError: if the caches' layouts or the pairs' shapes differ.
  """
  _check_like(cache, host)
  src, dst = _pairs(src, dst, host.num_blocks, cache.num_blocks)
  sharding = host.k_pages.sharding
  gather, _ = _host_ops(sharding)
  staged = gather(_arrays(host), jax.device_put(src, sharding))
  staged = jax.device_put(staged, cache.k_pages.sharding)
  return cache.replace(**_scatter(_arrays(cache), staged, dst))


class NumpyHostPool:
  """A host pool of KV blocks as NumPy arrays, for the prefix cache's host
  level (`serving/prefix_offload.py`): `[num_layers, num_kv_heads,
  num_host_blocks, block_size, head_dim]` per field, as the device cache.

  Why not `host_cache`: on XLA CPU a scatter into a pool-sized operand costs
  about O(pool), not O(blocks moved), even donated and in place (RESULTS.md
  section 14), and this pool is several times the device's. Here a store is
  one small jitted gather of the blocks on the device, fetched without
  waiting (`copy_to_host_async`) and written into the arrays by index
  assignment (O(blocks)) at the next copy call, when its gather has run; a
  load is a NumPy gather, a `device_put` and one scatter into the device
  cache (donated). Nothing waits for a step in flight: a load never reads a
  block stored in the same call (the caller pins them, `HostPrefixTier`).
  On CPU the gathered blocks are not fetched ahead (`copy_to_host_async`):
  they are in host memory already.

  Args:
    like: the device cache (its layout, dtype, scales and device).
    num_blocks: host blocks.
  """

  def __init__(self, like: KVCache, num_blocks: int):
    n = _int32.positive_int("num_blocks", num_blocks)
    self.num_blocks = n
    self.arrays = {}
    for f, x in _arrays(like).items():
      shape = list(x.shape)
      shape[2] = n
      self.arrays[f] = np.zeros(shape, x.dtype)
    self._pending = []  # (staged device arrays, host blocks) not written yet
    # On CPU the device's memory is the host's: nothing to fetch ahead.
    device = next(iter(like.k_pages.devices()))
    self._fetch_ahead = device.platform != "cpu"

  def flush(self):
    """Writes the stores dispatched so far into the arrays (waits for their
    gathers, which run before any later step)."""
    for staged, dst in self._pending:
      for f, x in staged.items():
        self.arrays[f][:, :, dst] = np.asarray(x)[:, :, :dst.size]
    self._pending = []

  def store(self, cache: KVCache, src, dst):
    """Queues device blocks `src` (`int[m]`, real pairs first, padded with
    -1 to a compiled size) into host blocks `dst` (`int[k]`, `k <= m`, the
    real ones); returns without waiting."""
    dst = np.asarray(dst, np.int64)
    # NumPy straight into the jitted gather (`jnp.asarray` first cost ~0.6 ms
    # a call on CPU, more than the gather).
    src = np.where(np.asarray(src) >= 0, src, 0).astype(np.int32)
    staged = _gather(_arrays(cache), src)
    for x in staged.values() if self._fetch_ahead else ():
      x.copy_to_host_async()
    self._pending.append((staged, dst))

  def load(self, cache: KVCache, src, dst) -> KVCache:
    """Copies host blocks `src` (`int[m]`, padded with -1) into device
    blocks `dst` (`int[m]`, -1 = skipped); `cache` is donated. Returns the
    new cache (dispatched, not awaited). Reads the arrays as they are: call
    `flush` first (not here: this step's own stores are still in flight,
    and a load never reads them)."""
    src = np.asarray(src)
    take = np.where(src >= 0, src, 0)
    staged = {f: a[:, :, take] for f, a in self.arrays.items()}
    staged = jax.device_put(staged, cache.k_pages.sharding)
    dst = np.where(np.asarray(dst) >= 0, dst, cache.num_blocks).astype(np.int32)
    return cache.replace(**_scatter(_arrays(cache), staged, dst))
