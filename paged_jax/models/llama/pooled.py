"""The paged forward with one KV pool per attention window (hybrid models).

A hybrid model (Gemma 2: alternating local and global layers; Gemma 3: 5
local to 1 global) reclaims blocks in its local layers only if those layers
keep their K/V in a pool of their own (`paged_jax.serving.window_pool`): one
`KVCache` and one block state per distinct window, each cache holding only
its group's layers. `paged_forward_pooled` is `Llama.paged_forward` with a
`StepMetadata` and a cache per pool: layer `i` writes and reads pool
`pool_of[i]`'s cache at that cache's own layer index `index_in_pool[i]`
(looked up from a static table with the scan's traced layer index, so the
layers stay under `layers.run_layers`'s scan).
"""

from __future__ import annotations

from typing import Sequence

import math

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import kv_cache as kv_cache_lib
from paged_jax import step_metadata

_CACHE_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")


def pool_windows(windows: Sequence[int | None]) -> tuple:
  """The distinct windows of the layers, first appearance first (the pools'
  order; `hybrid_capacity.groups_from_windows`' order)."""
  return tuple(dict.fromkeys(windows))


def layer_pools(windows: Sequence[int | None]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """`(pool_of, index_in_pool)`: per layer its pool and its layer index in
  that pool's cache."""
  order = pool_windows(windows)
  seen = [0] * len(order)
  pool_of, index = [], []
  for w in windows:
    g = order.index(w)
    pool_of.append(g)
    index.append(seen[g])
    seen[g] += 1
  return tuple(pool_of), tuple(index)


def sub_groups(layer_windows) -> tuple[int, tuple, tuple, tuple]:
  """`(G, windows, sub_of, index_of)`: layers per sub-group; per sub-group
  its window (groups in first-appearance order, each split into runs of `G`
  of its layers in layer order); per layer its sub-group and its layer
  index in that sub-group's `G`."""
  layer_windows = list(layer_windows)
  order = pool_windows(layer_windows)
  counts = [layer_windows.count(w) for w in order]
  g = math.gcd(*counts)
  first = np.cumsum([0] + [c // g for c in counts])[:-1]
  windows = tuple(w for w, c in zip(order, counts) for _ in range(c // g))
  seen = [0] * len(order)
  sub_of, index_of = [], []
  for w in layer_windows:
    o = order.index(w)
    sub_of.append(int(first[o]) + seen[o] // g)
    index_of.append(seen[o] % g)
    seen[o] += 1
  return g, windows, tuple(sub_of), tuple(index_of)


def paged_forward_pooled(model, tokens: jax.Array,
                         metas: Sequence[step_metadata.StepMetadata],
                         caches: Sequence[kv_cache_lib.KVCache]):
  """`model.paged_forward` over one cache per pool.

  Args:
    model: a `Llama`.
    tokens: `i32[num_tokens]`, the step's ragged layout.
    metas: per pool (`pool_windows` order) the `StepMetadata` of its block
      state.
    caches: per pool its `KVCache`, with that pool's number of layers.

  Returns:
    `(hidden [num_tokens, hidden_size], caches)`.

  Raises:
    ValueError: if the caches do not match the model's layer groups.
  """
  windows = [s.sliding_window for s in model.config.layer_specs]
  order = pool_windows(windows)
  pool_of, index = layer_pools(windows)
  counts = [pool_of.count(g) for g in range(len(order))]
  if len(caches) != len(order) or [c.num_layers for c in caches] != counts:
    raise ValueError(f"expected {len(order)} caches of {counts} layers (windows "
                     f"{order}), got {[c.num_layers for c in caches]}")
  for c, m in zip(caches, metas):
    kv_cache_lib.check_compatible(c, m)
  names = [n for n in _CACHE_FIELDS if getattr(caches[0], n) is not None]
  index_table = jnp.asarray(np.asarray(index, np.int32))

  def body(carry, layer, spec, i):
    x, arrays = carry
    g = order.index(spec.sliding_window)  # static: the spec is
    x, pages = layer(x, metas[g], dict(zip(names, arrays[g])), index_table[i], spec)
    arrays = arrays[:g] + (tuple(pages[n] for n in names),) + arrays[g + 1:]
    return x, arrays

  carry = (model.embed(tokens),
           tuple(tuple(getattr(c, n) for n in names) for c in caches))
  x, arrays = model._run_layers(body, carry)  # pylint: disable=protected-access
  return x, tuple(c.replace(**dict(zip(names, a))) for c, a in zip(caches, arrays))


def paged_forward_shared(model, tokens: jax.Array,
                         metas: Sequence[step_metadata.StepMetadata],
                         cache: kv_cache_lib.KVCache):
  """`model.paged_forward` over one pool shared by every layer group
  (`paged_jax.serving.shared_pool`): layer `i` writes and reads the cache's
  layer `index_of[i]` through sub-group `sub_of[i]`'s metadata
  (`sub_groups`; looked up with the scan's traced layer index).

  Args:
    model: a `Llama`.
    tokens: `i32[num_tokens]`, the step's ragged layout.
    metas: per sub-group its `StepMetadata` (same shapes; its own slots and
      block tables).
    cache: the `KVCache` of `G` layers (a block holds one sub-group's).

  Returns:
    `(hidden [num_tokens, hidden_size], cache)`.

  Raises:
    ValueError: if the cache or the metadata do not match the sub-groups.
  """
  windows = [s.sliding_window for s in model.config.layer_specs]
  g, subs, sub_of, index_of = sub_groups(windows)
  if cache.num_layers != g or len(metas) != len(subs):
    raise ValueError(f"expected a cache of {g} layers and {len(subs)} metadata "
                     f"(sub-groups {subs}), got {cache.num_layers} layers and "
                     f"{len(metas)}")
  for m in metas:
    kv_cache_lib.check_compatible(cache, m)
  names = [n for n in _CACHE_FIELDS if getattr(cache, n) is not None]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *metas)
  sub_table = jnp.asarray(np.asarray(sub_of, np.int32))
  index_table = jnp.asarray(np.asarray(index_of, np.int32))

  def body(carry, layer, spec, i):
    x, arrays = carry
    meta = jax.tree.map(lambda a: a[sub_table[i]], stacked)
    x, pages = layer(x, meta, dict(zip(names, arrays)), index_table[i], spec)
    return x, tuple(pages[n] for n in names)

  carry = (model.embed(tokens), tuple(getattr(cache, n) for n in names))
  x, arrays = model._run_layers(body, carry)  # pylint: disable=protected-access
  return x, cache.replace(**dict(zip(names, arrays)))
