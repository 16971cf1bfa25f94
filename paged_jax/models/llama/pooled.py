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
