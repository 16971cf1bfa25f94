"""Scale out: the paged cache and paged attention on a device mesh.

Two mesh axes, through JAX's own SPMD machinery (`Mesh`, `NamedSharding`,
`jax.shard_map`):

* `"model"` (tensor parallelism): KV heads, and the query heads that read
  them, are split across devices. When `num_kv_heads` is smaller than the
  model axis, each KV head is *replicated* `model // num_kv_heads` times (as
  GQA serving systems do): the cache stores `max(num_kv_heads, model)` heads,
  head `j` holding original KV head `j // replication`, so every device holds
  exactly the KV heads its query heads read and attention needs no
  communication. The K/V projections of a replicated head are computed on
  each device that holds a copy.
* `"data"`: each data shard owns its own block pool (`num_blocks / data`
  blocks), block state and sequences. Block tables hold *local* block ids and
  are replicated within a data shard.

Attention runs under `shard_map` on every backend with no gather of the cache
across devices: each device attends over its own heads and its own pool. So
do the K/V writes (`write_kv_sharded`) and copy-on-write
(`copy_blocks_sharded`). A Flax model needs no change: a `StepMetadata` from
`step_metadata(..., mesh=mesh)` carries the mesh, and
`flax_attention.PagedAttention` then uses these functions (see
`paged_jax/models/llama/tensor_parallel.py` for the weights' layout and
`paged_jax/serving/step.py` for a whole serving step on a mesh).

Example (8 devices):
  >>> mesh = make_mesh(data=2, model=4)
  >>> heads = cache_kv_heads(num_kv_heads=2, model=4)   # 4: each head twice
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import attention
from paged_jax import block_manager as bm
from paged_jax import kv_cache

DATA, MODEL = "data", "model"


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
  """A `(data, model)` mesh over `data * model` devices.

  Raises:
    ValueError: if there are not `data * model` devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1 or data * model > len(devices):
    raise ValueError(f"a data={data} x model={model} mesh needs {data * model} "
                     f"devices, {len(devices)} available")
  grid = np.asarray(devices[:data * model]).reshape(data, model)
  return Mesh(grid, (DATA, MODEL))


def cache_kv_heads(num_kv_heads: int, model: int) -> int:
  """KV heads the cache stores for a model axis of size `model`.

  `num_kv_heads` if it divides evenly over the model axis, else each head is
  replicated `model // num_kv_heads` times.

  Raises:
    ValueError: if neither divides the other.
  """
  if num_kv_heads % model == 0:
    return num_kv_heads
  if model % num_kv_heads == 0:
    return model
  raise ValueError(f"num_kv_heads={num_kv_heads} and the model axis ({model}) "
                   "must divide one another")


def replicate_kv_heads(x: jax.Array, num_kv_heads: int, model: int,
                       axis: int) -> jax.Array:
  """Repeats each KV head along `axis` to `cache_kv_heads(...)` heads."""
  reps = cache_kv_heads(num_kv_heads, model) // num_kv_heads
  return jnp.repeat(x, reps, axis=axis) if reps > 1 else x


def cache_spec() -> P:
  """Spec of `KVCache` pages `[layers, kv_heads, num_blocks, block_size, head_dim]`."""
  return P(None, MODEL, DATA, None, None)


def scales_spec() -> P:
  """Spec of a quantised `KVCache`'s scales `[layers, kv_heads, num_blocks,
  block_size]`: sharded as the pages they scale."""
  return P(None, MODEL, DATA, None)


def spec_of(x) -> P:
  """`cache_spec()` for pages (rank 5), `scales_spec()` for scales (rank 4)."""
  return cache_spec() if len(x.shape) == 5 else scales_spec()


def shard_cache(cache: kv_cache.KVCache, mesh: Mesh) -> kv_cache.KVCache:
  """Places the pages (and scales): KV heads over `model`, the block pool
  over `data` (of every `KVCache` in `cache`, a pytree of them)."""
  return jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, spec_of(x))), cache)


def create_cache(mesh: Mesh, *, num_layers: int, num_kv_heads: int,
                 num_blocks_per_shard: int, block_size: int, head_dim: int,
                 dtype=jnp.bfloat16) -> kv_cache.KVCache:
  """A zero-filled `KVCache` created in place on the mesh.

  Args:
    mesh: a `(data, model)` mesh.
    num_layers, block_size, head_dim: as `KVCache.create`.
    num_kv_heads: heads the cache stores, `cache_kv_heads(...)` of the model's
      KV heads (a multiple of the model axis).
    num_blocks_per_shard: each data shard's pool.
    dtype: page dtype (int8 / float8_e4m3fn add scales sharded
      `scales_spec()`).

  Returns:
    Pages `[num_layers, num_kv_heads, data * num_blocks_per_shard, block_size,
    head_dim]` sharded `cache_spec()`: each device holds
    `num_kv_heads / model` heads of its shard's pool and nothing else (no
    device ever holds the whole cache, not even while it is created).

  Raises:
    ValueError: if `num_kv_heads` is not a multiple of the model axis, or as
      `kv_cache.cache_shape` for one shard's pool (its flat slots must fit
      int32; slots are local to the shard).
  """
  model, data = mesh.shape[MODEL], mesh.shape[DATA]
  if num_kv_heads % model:
    raise ValueError(f"the cache's num_kv_heads={num_kv_heads} must be a "
                     f"multiple of the model axis ({model}); use "
                     "cache_kv_heads() to replicate heads")
  shard = kv_cache.cache_shape(
      num_layers=num_layers, num_kv_heads=num_kv_heads,
      num_blocks=num_blocks_per_shard, block_size=block_size,
      head_dim=head_dim, dtype=dtype)
  shape = shard[:2] + (data * shard[2],) + shard[3:]

  def zeros(shape, dtype):
    s = NamedSharding(mesh, spec_of(jax.ShapeDtypeStruct(shape, dtype)))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=s)()

  return kv_cache.KVCache(*kv_cache.zero_arrays(shape, jnp.dtype(dtype),
                                                zeros))


def per_device_cache_bytes(cache: kv_cache.KVCache) -> dict:
  """Bytes of K/V pages (and scales) each of this process' devices holds:
  `{device: bytes}`."""
  out = {}
  for pages in cache.arrays():
    for shard in pages.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def init_block_states(mesh: Mesh, *, num_blocks_per_shard: int,
                      block_size: int, max_seqs_per_shard: int,
                      max_blocks_per_seq: int,
                      prefix_caching: bool = False) -> bm.BlockState:
  """One block state per data shard, stacked on a leading axis.

  `prefix_caching` as in `block_manager.init` (each shard caches its own
  pool's blocks).

  Operate on it with `jax.vmap(bm.reserve)` etc.; under `jax.jit` each data
  shard's state stays on its devices. Block ids are local to the shard. Its
  cache is `create_cache(mesh, num_blocks_per_shard=..., block_size=...)`
  with the same sizes (`kv_cache.check_compatible` checks them).

  Raises:
    ValueError: as `block_manager.init`.
  """
  state = bm.init(num_blocks=num_blocks_per_shard, block_size=block_size,
                  max_seqs=max_seqs_per_shard,
                  max_blocks_per_seq=max_blocks_per_seq,
                  prefix_caching=prefix_caching)
  data = mesh.shape[DATA]
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (data,) + x.shape),
                         state)
  return jax.device_put(stacked, NamedSharding(mesh, P(DATA)))


def _shard_map(fn, mesh, in_specs, out_specs):
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


def sharded_paged_attention(mesh: Mesh, q, k_pages, v_pages, block_tables,
                            kv_lens, **kwargs) -> jax.Array:
  """`paged_attention` on a mesh, each device on its heads and its pool.

  Args:
    mesh: a `(data, model)` mesh.
    q: `[batch, num_q_heads, head_dim]`; batch split over `data` (each data
      shard's sequences are contiguous), heads over `model`.
    k_pages, v_pages: one layer, `[cache_kv_heads, num_blocks, block_size,
      head_dim]`, sharded `P(model, data)`; `num_blocks` is the sum of the
      data shards' pools.
    block_tables: `i32[batch, max_blocks_per_seq]` with block ids local to the
      sequence's data shard.
    kv_lens: `i32[batch]`.
    **kwargs: as `paged_attention` (`sm_scale` defaults to the real head_dim).

  Returns:
    `[batch, num_q_heads, head_dim]`, sharded like `q`.
  """
  kwargs.setdefault("sm_scale", q.shape[-1] ** -0.5)
  scales, specs, kwargs = _scale_args(kwargs)
  fn = _with_scales(attention.paged_attention, 5, kwargs)
  pages = P(MODEL, DATA, None, None)
  return _shard_map(
      fn, mesh,
      in_specs=(P(DATA, MODEL, None), pages, pages, P(DATA, None), P(DATA))
      + specs,
      out_specs=P(DATA, MODEL, None),
  )(q, k_pages, v_pages, block_tables, kv_lens, *scales)


def _scale_args(kwargs):
  """`(scales, their specs, the other kwargs)`: quantised pages' one-layer
  scales travel as shard_map operands, sharded `P(model, data)`."""
  kwargs = dict(kwargs)
  ks, vs = kwargs.pop("k_scales", None), kwargs.pop("v_scales", None)
  if ks is None:
    return (), (), kwargs
  return (ks, vs), (P(MODEL, DATA, None),) * 2, kwargs


def _with_scales(fn, num_args, kwargs):
  """`fn(*args[:num_args], k_scales=args[num_args], v_scales=...)` when the
  call has scales, else `fn(*args)`."""
  def call(*args):
    scales = dict(zip(("k_scales", "v_scales"), args[num_args:]))
    return fn(*args[:num_args], **scales, **kwargs)
  return call


def sharded_ragged_paged_attention(mesh: Mesh, q, k_pages, v_pages,
                                   block_tables, kv_lens, cu_q_lens, num_seqs,
                                   **kwargs) -> jax.Array:
  """`ragged_paged_attention` on a mesh.

  Every array is the concatenation of the data shards' own arrays: shard `i`
  owns rows `i * num_tokens / data ...` of `q`, its own `cu_q_lens`
  (`data * (max_num_seqs + 1)` in all, each starting at 0), and its own
  `num_seqs` (`i32[data]`).
  """
  kwargs.setdefault("sm_scale", q.shape[-1] ** -0.5)
  scales, specs, kwargs = _scale_args(kwargs)
  fn = _with_scales(attention.ragged_paged_attention, 7, kwargs)
  pages = P(MODEL, DATA, None, None)
  return _shard_map(
      fn, mesh,
      in_specs=(P(DATA, MODEL, None), pages, pages, P(DATA, None), P(DATA),
                P(DATA), P(DATA)) + specs,
      out_specs=P(DATA, MODEL, None),
  )(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *scales)


def copy_blocks_sharded(mesh: Mesh, cache: kv_cache.KVCache, src: jax.Array,
                        dst: jax.Array) -> kv_cache.KVCache:
  """`kv_cache.copy_blocks` on a mesh: each data shard copies within its pool.

  Args:
    mesh: a `(data, model)` mesh.
    cache: a `KVCache` sharded `cache_spec()`.
    src, dst: `i32[data, n]`, row `i` the (local) block pairs of data shard `i`
      (`Reservation.copy_src` / `copy_dst` of its block state).

  Returns:
    The updated cache, sharded as before (a tuple of caches over one pool,
    as `kv_cache.copy_blocks` takes: each is copied).
  """
  if isinstance(cache, tuple):
    return tuple(copy_blocks_sharded(mesh, c, src, dst) for c in cache)

  def local(src, dst, *arrays):
    return kv_cache.copy_blocks(kv_cache.KVCache(*arrays), src[0],
                                dst[0]).arrays()

  arrays = cache.arrays()
  specs = tuple(spec_of(x) for x in arrays)
  return kv_cache.KVCache(*_shard_map(
      local, mesh, in_specs=(P(DATA), P(DATA)) + specs,
      out_specs=specs)(src, dst, *arrays))


def write_kv_sharded(mesh: Mesh, k_pages, v_pages, k, v, slots, *,
                     k_scales=None, v_scales=None):
  """`kv_cache.write_kv` on a mesh: tokens split over `data` (local slots),
  KV heads over `model`; each device writes its own part of its own pool
  (and of the scales, for quantised pages). Returns what `write_kv` does."""
  pages = P(MODEL, DATA, None, None)
  scales, specs, _ = _scale_args(dict(k_scales=k_scales, v_scales=v_scales))
  tokens = P(DATA, MODEL, None)
  return _shard_map(
      _with_scales(kv_cache.write_kv, 5, {}), mesh,
      in_specs=(pages, pages, tokens, tokens, P(DATA)) + specs,
      out_specs=(pages, pages) + specs,
  )(k_pages, v_pages, k, v, slots, *scales)


def write_kv_layer_sharded(mesh: Mesh, k_pages, v_pages, k, v, slots, layer, *,
                           k_scales=None, v_scales=None):
  """`kv_cache.write_kv_layer` on a mesh: into layer `layer` of the whole
  cache's pages (`[num_layers, ...]`, sharded `cache_spec()`), tokens split
  over `data` (local slots), KV heads over `model`. Each device scatters
  into its own part of the stacked pages directly, so with the cache donated
  XLA writes in place: no copy of a layer's pages out and back (measured on
  a 1x1 mesh: that copy added 5% to the tiny Llama's bytes accessed per
  step). Returns what `write_kv_layer` does."""
  scales = () if k_scales is None else (k_scales, v_scales)
  specs = tuple(spec_of(a) for a in (k_pages, v_pages) + scales)
  tokens = P(DATA, MODEL, None)

  def local(k_pages, v_pages, k, v, slots, layer, *scales):
    named = dict(zip(("k_scales", "v_scales"), scales))
    return kv_cache.write_kv_layer(k_pages, v_pages, k, v, slots, layer, **named)
  return _shard_map(
      local, mesh, in_specs=specs[:2] + (tokens, tokens, P(DATA), P()) + specs[2:],
      out_specs=specs)(k_pages, v_pages, k, v, slots, jnp.asarray(layer),
                       *scales)
