"""Capacity planning for hybrid local/global models with block reclamation.

`paged_jax.capacity` sizes a pool where every layer keeps every block. A
hybrid model (Gemma 2/3, Mistral with `sliding_window`) has layer groups
(`paged_jax.block_groups`): a global group keeps `ceil(L / block_size)`
blocks of a sequence of `L` tokens; a local group of window `w` keeps at
most `ceil((w - 1) / block_size) + 1` (<= `ceil(w / block_size) + 1`): in a
decode step, after `block_groups.reserve` reclaimed what the new token
cannot see, its blocks cover the `w` positions `L - w + 1 .. L`; and never
more than the sequence has. Per group `g` of `n_g` layers:

  bytes_per_token[g] = 2 (K and V) * n_g * num_kv_heads
                       * capacity.kv_head_token_bytes(kv_dtype, head_dim)
  blocks[g]          = ceil(L / bs)                            (global)
                       min(ceil(L / bs), ceil((w - 1) / bs) + 1)  (local)
  bytes_per_seq      = sum_g blocks[g] * bs * bytes_per_token[g]
  max_seqs           = kv_pool_bytes // bytes_per_seq

and the same with every group keeping `ceil(L / bs)` blocks (reclamation
off). This assumes a block of group `g` stores only group `g`'s layers (one
pool of blocks shared by the groups, each group's layers writing their own
pages), as vLLM's hybrid allocator lays its cache out; with a cache that has
every layer's pages at every block id, reclamation frees nothing.

Example (Gemma 3 27B: 62 layers, 5 local of window 1024 to 1 global, 16 KV
heads of 128, bfloat16; 8k-token sequences in 40 GiB):

  >>> p = plan_hybrid(kv_pool_bytes=40 * capacity.GIB,
  ...     groups=groups_from_windows([None if (i + 1) % 6 == 0 else 1024
  ...                                 for i in range(62)]),
  ...     num_kv_heads=16, head_dim=128, block_size=16, context=8192)
  >>> p.groups, p.blocks_per_seq
  ((LayerGroup(num_layers=52, window=1024), LayerGroup(num_layers=10, window=None)), (65, 512))
  >>> p.max_seqs, p.max_seqs_without_reclamation, round(p.ratio, 2)
  (38, 10, 3.73)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from paged_jax import capacity


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """Layers sharing an attention pattern: `window` None (global) or the
  sliding window in tokens."""
  num_layers: int
  window: int | None


def groups_from_windows(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
  """One `LayerGroup` per distinct window (first appearance order) from each
  layer's window (None: global), e.g. `[s.sliding_window for s in
  LlamaConfig.layer_specs]`.

  Raises:
    ValueError: for no layers, or a window that is not None or a positive int.
  """
  windows = list(windows)
  if not windows:
    raise ValueError("windows must name at least one layer, got []")
  counts: dict = {}
  for w in windows:
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
      raise ValueError(f"a layer's window must be None or a positive int, got {w!r}")
    counts[w] = counts.get(w, 0) + 1
  return tuple(LayerGroup(n, w) for w, n in counts.items())


@dataclasses.dataclass(frozen=True)
class HybridPlan:
  """What a KV pool holds for a hybrid model at one context length.

  Attributes:
    groups: the layer groups planned for.
    bytes_per_token: per group, K and V bytes of one token over its layers.
    blocks_per_seq: per group, blocks one sequence of `context` tokens
      holds with reclamation.
    bytes_per_seq: one sequence's KV bytes with reclamation.
    bytes_per_seq_without_reclamation: every group keeping every block.
    max_seqs, max_seqs_without_reclamation: sequences of `context` tokens
      that fit in `kv_pool_bytes`.
    ratio: bytes_per_seq_without_reclamation / bytes_per_seq (the most
      sequences reclamation can add, before rounding to whole sequences).
    kv_pool_bytes, block_size, context: the inputs.
  """
  groups: tuple[LayerGroup, ...]
  bytes_per_token: tuple[int, ...]
  blocks_per_seq: tuple[int, ...]
  bytes_per_seq: int
  bytes_per_seq_without_reclamation: int
  max_seqs: int
  max_seqs_without_reclamation: int
  ratio: float
  kv_pool_bytes: int
  block_size: int
  context: int


def local_blocks(window: int | None, context: int, block_size: int) -> int:
  """Blocks a decoding sequence of `context` tokens holds in a group at
  most (see the module docstring); a prefill chunk of `c` tokens holds up
  to `ceil((w + c - 2) / bs) + 1` within its step, until `reclaim`."""
  full = -(-context // block_size)
  if window is None:
    return full
  return min(full, math.ceil((window - 1) / block_size) + 1)


def plan_hybrid(*, kv_pool_bytes: int, groups: Sequence[LayerGroup],
                num_kv_heads: int, head_dim: int, block_size: int,
                context: int, kv_dtype: str = "bfloat16") -> HybridPlan:
  """Sequences of `context` tokens that fit, with and without reclamation.

  Args:
    kv_pool_bytes: bytes for the KV cache (`capacity.kv_pool_bytes`).
    groups: the model's `LayerGroup`s (`groups_from_windows`).
    num_kv_heads, head_dim: per layer (every group alike).
    block_size: tokens per block.
    context: tokens per sequence (prompt and output).
    kv_dtype: the cache's dtype name (`capacity.DTYPE_BYTES`).

  Raises:
    ValueError: a non-positive size, no groups, or a pool that holds no
      sequence even with reclamation.
  """
  groups = tuple(groups)
  if not groups:
    raise ValueError("groups must not be empty")
  capacity._check_positive(  # pylint: disable=protected-access
      kv_pool_bytes=kv_pool_bytes, num_kv_heads=num_kv_heads,
      head_dim=head_dim, block_size=block_size, context=context,
      **{f"groups[{i}].num_layers": g.num_layers for i, g in enumerate(groups)})
  token = capacity.kv_head_token_bytes(kv_dtype, head_dim)
  per_token = tuple(2 * g.num_layers * num_kv_heads * token for g in groups)
  blocks = tuple(local_blocks(g.window, context, block_size) for g in groups)
  full = -(-context // block_size)
  with_r = sum(b * block_size * t for b, t in zip(blocks, per_token))
  without = sum(full * block_size * t for t in per_token)
  if kv_pool_bytes < with_r:
    raise ValueError(f"{kv_pool_bytes=} holds no sequence of {context} tokens "
                     f"({with_r} bytes each with reclamation)")
  return HybridPlan(
      groups=groups, bytes_per_token=per_token, blocks_per_seq=blocks,
      bytes_per_seq=with_r, bytes_per_seq_without_reclamation=without,
      max_seqs=kv_pool_bytes // with_r,
      max_seqs_without_reclamation=kv_pool_bytes // without,
      ratio=without / with_r, kv_pool_bytes=kv_pool_bytes,
      block_size=block_size, context=context)
