"""The prefix cache's host level: block hashes -> host blocks, LRU (issue #24).

Blocks evicted from the device prefix cache (`block_manager`'s ring, reported
by `reserve`) are copied to a host-memory pool (`kv_offload.host_cache`) and
indexed here by their chained hash (`prefix_cache.PrefixIndex.chain`); a later
admission whose device lookup stops short continues here, and its host hits
are copied back into device blocks before the step that attends them
(`serving/prefix_offload.py`). This module is the host bookkeeping only: pure
Python, no JAX; it decides which host block each store writes and each hit
reads, and the caller copies.

What is kept: every evicted registered block whose hash is not on the host
yet (a hash already there is only moved to the front of the LRU, no copy).
Not a "hit at least once" gate: in multi-turn chat (the Mooncake trace) a
block's first reuse is the next turn of its conversation, often after the
device has evicted it, so such a gate drops exactly the hits the tier is for.
The cost is bounded instead: at most one batched copy each way per step,
nothing at all on a step that evicts nothing and hits nothing on the host.

Within a step (`begin_step`), a host block that a load reads or a store
writes is pinned: the copies to the host are dispatched before the loads
and would otherwise overwrite what a load is about to read, and one batched
copy must not write a host block twice.

Example:
  >>> tier = HostPrefixTier(num_blocks=2)
  >>> tier.begin_step(); tier.store([b"a", b"b"])
  [(b'a', 0), (b'b', 1)]
  >>> tier.lookup([b"a", b"x"])
  [0]
  >>> tier.begin_step(); tier.store([b"c"])  # evicts b"b", the least recent
  [(b'c', 1)]
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence

GIB = 2**30


def num_host_blocks(size_gib, bytes_per_block: int) -> int:
  """Host blocks of `size_gib` GiB (`--kv-offloading-size`), each
  `bytes_per_block` bytes (`KVCache.bytes_per_block`).

  Raises:
    ValueError: if `size_gib` is not a finite number > 0, or holds no block.
  """
  if (isinstance(size_gib, bool) or not isinstance(size_gib, (int, float))
      or not math.isfinite(size_gib) or size_gib <= 0):
    raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got "
                     f"{size_gib!r}")
  n = int(size_gib * GIB) // bytes_per_block
  if n < 1:
    raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV block of "
                     f"{bytes_per_block} bytes (expected >= "
                     f"{bytes_per_block / GIB:.3g} GiB)")
  return n


class HostPrefixTier:
  """Block hash -> host block, least recently used first out.

  Args:
    num_blocks: host blocks (the host cache's block axis).
  """

  def __init__(self, num_blocks: int):
    if not isinstance(num_blocks, int) or num_blocks < 1:
      raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    self.num_blocks = num_blocks
    self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self._free = list(range(num_blocks - 1, -1, -1))
    self._pinned: set[int] = set()  # host blocks this step's loads read

  def __len__(self) -> int:
    return len(self._lru)

  def __contains__(self, block_hash: bytes) -> bool:
    return block_hash in self._lru

  def begin_step(self):
    """Forgets the last step's pins (its loads are dispatched)."""
    self._pinned.clear()

  def lookup(self, hashes: Iterable[bytes]) -> list[int]:
    """The host blocks of the longest prefix of `hashes` held here (each
    moved to the front of the LRU and pinned for this step)."""
    out = []
    for h in hashes:
      block = self._lru.get(h)
      if block is None:
        break
      self._lru.move_to_end(h)
      self._pinned.add(block)
      out.append(block)
    return out

  def unpin(self, blocks: Sequence[int]):
    """Takes back pins of a lookup whose admission was taken back."""
    self._pinned.difference_update(blocks)

  def pin(self, blocks: Sequence[int]):
    self._pinned.update(blocks)

  def store(self, hashes: Iterable[bytes]) -> list[tuple[bytes, int]]:
    """Host blocks for `hashes` (evicted from the device): `[(hash, block)]`
    to copy, for the hashes not held yet (one held already is refreshed,
    not copied); a full tier evicts its least recently used unpinned entry,
    and a hash finds no room when every entry is pinned (skipped). The
    blocks taken are pinned for this step."""
    out = []
    for h in hashes:
      if h in self._lru:
        self._lru.move_to_end(h)
        continue
      block = self._take()
      if block is None:
        continue
      self._lru[h] = block
      self._pinned.add(block)  # one batched copy: each host block written once
      out.append((h, block))
    return out

  def _take(self) -> int | None:
    if self._free:
      return self._free.pop()
    for h, block in self._lru.items():  # least recent first
      if block not in self._pinned:
        del self._lru[h]
        return block
    return None

  def check(self):
    """Asserts every host block is free or held by exactly one hash."""
    held = list(self._lru.values())
    assert len(set(held)) == len(held), "a host block held twice"
    assert sorted(held + self._free) == list(range(self.num_blocks)), (
        "host blocks lost or duplicated")
