"""Per-layer attention patterns under `lax.scan`: hybrid local/global models.

A layer's attention is described by a static `LayerSpec` (its sliding window,
or None for global attention, and its RoPE). Llama, Qwen and Mistral have one
spec for every layer; Gemma 2 alternates local and global layers; Gemma 3
repeats 5 local layers and 1 global one, local and global with their own
RoPE theta.

How the windows go through the scan: the spec sequence is periodic with a
smallest period `p` (1 for Llama or Mistral, 2 for Gemma 2, 6 for Gemma 3), and
`run_layers` scans over the `num_layers // p` whole periods with a body that
runs the period's `p` layers one after another, each with its own static
spec, then runs the `num_layers % p` remaining layers (Gemma 3 1B: 26 = 4 x 6
+ 2) unrolled once after the scan. Why static windows rather than a window
scanned as a traced value:

* every attention backend takes `sliding_window` as a static int, so a
  kernel knows at trace time which blocks a local layer can ever see and
  skips the rest (decode work O(window) on a local layer); a traced window
  would need every kernel to take it dynamically and would hide that the
  layer is local from the block manager's groups;
* the program holds at most `2p - 1` layers whatever the depth (the test
  `test_program_does_not_grow_with_depth...` checks it); Gemma 3 compiles
  8 layer bodies instead of 1, a fixed cost, and Llama-like models keep
  exactly one;
* one `lax.cond`/`switch` on a per-layer flag would also keep one body per
  distinct spec, but both branches take and return the whole carried KV
  cache, which XLA may copy; the unrolled period keeps the cache a plain
  carry updated in place.

The layers' parameters stay stacked `[num_layers, ...]` (checkpoints and
tensor parallelism do not change); the body reads layer `g * p + j` with a
dynamic index, so nothing is reshaped or copied.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from paged_jax import rope as rope_lib

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """What differs between layers of a hybrid model (static, hashable).

  Attributes:
    sliding_window: the layer sees the last `sliding_window` positions
      (itself included), or None for global attention.
    rope: the layer's `rope.RopeConfig`.
  """

  sliding_window: int | None
  rope: rope_lib.RopeConfig


def period(specs: Sequence[LayerSpec]) -> int:
  """The smallest `p >= 1` with `specs[i] == specs[i % p]` for every `i`
  (`len(specs)` if the sequence never repeats)."""
  n = len(specs)
  for p in range(1, n + 1):
    if all(specs[i] == specs[i % p] for i in range(n)):
      return p
  return n


def run_layers(body: Callable, params, specs: Sequence[LayerSpec], carry):
  """Runs `carry = body(carry, layer_params, spec, index)` for every layer.

  Args:
    body: `(carry, layer_params, spec: LayerSpec, index: i32[] traced or
      int) -> carry`; `layer_params` is one layer's slice of `params`.
    params: a pytree whose leaves are stacked `[num_layers, ...]`.
    specs: `num_layers` `LayerSpec`s.
    carry: the loop state (e.g. the hidden states and the KV cache).

  Returns:
    The final carry. The whole periods of `specs` run under one `lax.scan`
    whose body holds one period (see the module docstring); the remainder
    runs after it, unrolled.
  """
  n = len(specs)
  leaves = jax.tree.leaves(params)
  if leaves and leaves[0].shape[0] != n:
    raise ValueError(f"params are stacked over {leaves[0].shape[0]} layers, "
                     f"specs has {n}")
  p = period(specs)
  groups, tail = divmod(n, p)

  def layer(i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
        a, i, keepdims=False), params)

  if p == 1:
    # One spec: scan straight over the stacked parameters (as before hybrid
    # models), one layer in the program.
    def step1(c, layer_params):
      c, i = c
      return (body(c, layer_params, specs[0], i), i + 1), None
    (carry, _), _ = jax.lax.scan(step1, (carry, jnp.int32(0)), params)
    return carry

  def step(c, g):
    for j in range(p):
      i = g * p + j
      c = body(c, layer(i), specs[j], i)
    return c, None

  if groups:
    carry, _ = jax.lax.scan(step, carry, jnp.arange(groups, dtype=jnp.int32))
  for j in range(tail):
    i = groups * p + j
    carry = body(carry, jax.tree.map(lambda a, i=i: a[i], params), specs[j],
                 jnp.int32(i))
  return carry
