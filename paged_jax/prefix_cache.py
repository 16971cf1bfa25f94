"""The prefix-cache index: block hashes -> physical blocks, on the host.

A block's identity is the content of the whole prefix up to and including it:
`hash_i = H(hash_{i-1} || tokens of block i)`, with `hash_{-1} = H(salt)` for
an optional per-request salt (a tenant, a LoRA adapter, a multimodal input
digest), so equal tokens under different salts never share. Only full blocks
are hashed and cached. `PrefixIndex` maps hashes to the physical blocks that
hold them; the block manager (`block_manager.register` / `share` / the
eviction ring) owns which blocks are cached and which are evicted, and the
index follows it exactly: the host registers a block on the device only when
`insert` accepted it, and drops the blocks that `Reservation.evicted` names
(`evict`). `check_consistent` verifies that no entry points at a reused block.

Collisions. `H` is BLAKE2b with a 256-bit digest, keyed with 32 random bytes
per index (`secrets.token_bytes`), the parent digest and the token ids encoded
at a fixed width (int64), so the encoding of a block is unambiguous. Keyed
BLAKE2b is a pseudo-random function: without the key an adversary cannot
steer two prompts to one digest, and by the birthday bound `q` hashed blocks
collide with probability at most `q**2 / 2**257` (below `2**-177` for `q =
2**40`). A hit is therefore not compared token by token; the key would be
shared explicitly between hosts that must agree (`key=`).

Why a host dictionary and not an on-device table. vLLM and SGLang keep it on
the host, for reasons that hold here too: the tokens are on the host at
admission anyway (the scheduler decides what to prefill before the step
runs); a lookup is a longest-prefix walk over a variable number of blocks,
which a Python dict does in O(hit blocks) while an on-device hash table needs
fixed-size probing, collision handling and a device round trip before the
scheduler can size the step; and a wide cryptographic hash is cheap in
`hashlib` but awkward in int32 XLA. The device keeps what must be exact inside
the jitted step: which blocks are cached, their refcounts and the LRU order,
in the `BlockState` pytree. The host learns evictions from its exact NumPy
model of the pool (`paged_jax.serving.host_pool.HostPool`, proven equal to the
block manager and checked against a device fingerprint every step), so it
never has to ask.

Example:
  >>> index = PrefixIndex(block_size=4)
  >>> h = index.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 full blocks
  >>> index.insert(h[0], 7), index.insert(h[1], 3)
  (True, True)
  >>> index.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # the last token computed
  [7, 3]
  >>> index.match([1, 2, 3, 4, 5, 6, 7, 8])  # a full hit leaves one block
  [7]
"""

from __future__ import annotations

import array
import hashlib
import secrets
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from paged_jax import _int32

DIGEST_SIZE = 32  # bytes: 256-bit block hashes
_BIG_ENDIAN = sys.byteorder == "big"  # block token ids are hashed as "<i8"


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
  """Cached blocks a prompt may use: full blocks before its last token.

  The last prompt token is always computed (its logits give the first output
  token), so a prompt of `L` tokens reuses at most `(L - 1) // block_size`
  blocks; a fully cached prompt recomputes its last block's tokens up to it.
  """
  return max(num_prompt_tokens - 1, 0) // block_size


class PrefixIndex:
  """Block hash -> physical block, with the reverse map for evictions.

  One block per hash: when two sequences compute the same block at once, the
  first `insert` wins and the second block stays unregistered (it is emptied,
  not cached, when released).

  Args:
    block_size: tokens per block (the pool's).
    key: optional BLAKE2b key (up to 64 bytes); random per index by default.

  Raises:
    ValueError: if `block_size` is not a positive int or `key` is longer
      than 64 bytes.
  """

  def __init__(self, block_size: int, *, key: bytes | None = None):
    self.block_size = _int32.positive_int("block_size", block_size)
    key = secrets.token_bytes(32) if key is None else bytes(key)
    if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
      raise ValueError(f"key must be at most {hashlib.blake2b.MAX_KEY_SIZE} "
                       f"bytes, got {len(key)}")
    self._key = key
    # The keyed state, copied for each hash (cheaper than keying anew).
    self._keyed = hashlib.blake2b(digest_size=DIGEST_SIZE, key=key)
    self._block_of: dict[bytes, int] = {}
    self._hash_of: dict[int, bytes] = {}

  def _h(self, *parts: bytes) -> bytes:
    h = self._keyed.copy()
    for p in parts:
      h.update(p)
    return h.digest()

  def root(self, salt: bytes = b"") -> bytes:
    """The parent hash of a prompt's first block, for `salt`."""
    return self._h(b"root", len(salt).to_bytes(8, "little"), salt)

  def chain(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
    """The hash of one full block after `parent` (incremental hashing).

    Raises:
      ValueError: if `block_tokens` is not exactly `block_size` token ids.
    """
    if isinstance(block_tokens, list) and len(block_tokens) == self.block_size:
      # (the engine's case: a list of ints, packed without NumPy)
      ids = array.array("q", block_tokens)
      if _BIG_ENDIAN:
        ids.byteswap()
      return self._h(b"block", parent, ids.tobytes())
    ids = np.asarray(block_tokens, np.int64)
    if ids.shape != (self.block_size,):
      raise ValueError(f"a block has block_size={self.block_size} token ids, "
                       f"got shape {ids.shape}")
    return self._h(b"block", parent, ids.astype("<i8").tobytes())

  def block_hashes(self, token_ids: Sequence[int], salt: bytes = b""
                   ) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (a partial last block
    has none)."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    bs = self.block_size
    out, parent = [], self.root(salt)
    for i in range(len(ids) // bs):
      parent = self.chain(parent, ids[i * bs:(i + 1) * bs])
      out.append(parent)
    return out

  def lookup(self, hashes: Iterable[bytes]) -> list[int]:
    """Blocks of the longest indexed prefix of `hashes` (stops at a miss)."""
    out = []
    for h in hashes:
      block = self._block_of.get(h)
      if block is None:
        break
      out.append(block)
    return out

  def match(self, prompt: Sequence[int], salt: bytes = b"") -> list[int]:
    """The cached blocks a new prompt can share: the longest indexed prefix,
    leaving its last token (and so at least one token) to compute."""
    hashes = self.block_hashes(prompt, salt)
    return self.lookup(hashes[:max_hit_blocks(len(prompt), self.block_size)])

  def insert(self, block_hash: bytes, block: int) -> bool:
    """Records that `block` holds `block_hash`.

    Returns:
      True if recorded (then register the block on the device); False if
      another block already holds that hash (leave this one unregistered).

    Raises:
      ValueError: if `block` is indexed under another hash: it was reused
        without its eviction being reported (`evict`), a stale entry.
    """
    block = int(block)
    old = self._hash_of.get(block)
    if old is not None and old != block_hash:
      raise ValueError(f"block {block} is indexed under another hash: its "
                       f"eviction was not reported (call evict first)")
    if old == block_hash:
      return True
    if block_hash in self._block_of:
      return False
    self._block_of[block_hash] = block
    self._hash_of[block] = block_hash
    return True

  def evict(self, blocks: Iterable[int]) -> int:
    """Drops the entries of evicted `blocks` (`Reservation.evicted`; negative
    ids, i.e. `NULL_BLOCK`, and unindexed blocks are ignored).

    Returns:
      The number of entries dropped.
    """
    dropped = 0
    for b in np.asarray(list(blocks) if not isinstance(blocks, np.ndarray)
                        else blocks, np.int64).reshape(-1).tolist():
      h = self._hash_of.pop(b, None)
      if h is not None:
        del self._block_of[h]
        dropped += 1
    return dropped

  def relabel(self, new_ids) -> None:
    """Follows a compaction: every indexed block `b` becomes `new_ids[b]`
    (`compaction.Compaction.new_ids`, old block -> new block).

    Raises:
      ValueError: if an indexed block has no new id (`new_ids[b] < 0`): it
        was neither live nor cached, so the index was already stale.
    """
    new = np.asarray(new_ids, np.int64).reshape(-1)
    lost = [b for b in self._hash_of if not 0 <= b < new.size or new[b] < 0]
    if lost:
      raise ValueError(f"indexed blocks {sorted(lost)} have no new id: they "
                       f"were neither live nor cached (a stale index)")
    self._hash_of = {int(new[b]): h for b, h in self._hash_of.items()}
    self._block_of = {h: int(new[b]) for h, b in self._block_of.items()}

  def block_of(self, block_hash: bytes) -> int | None:
    """The block indexed for `block_hash` (None if none)."""
    return self._block_of.get(block_hash)

  def hash_of(self, block: int) -> bytes | None:
    """The hash indexed for `block` (None if it holds none)."""
    return self._hash_of.get(block)

  def __len__(self) -> int:
    return len(self._block_of)

  def __contains__(self, block_hash: bytes) -> bool:
    return block_hash in self._block_of

  def blocks(self) -> set[int]:
    """Every indexed block."""
    return set(self._hash_of)


def check_consistent(index: PrefixIndex, state) -> None:
  """Checks the index against a `block_manager.BlockState` (tests, debugging):
  the indexed blocks are exactly the cacheable ones, so no entry points at a
  block that was evicted and reused.

  Raises:
    AssertionError: naming the blocks that differ.
  """
  cacheable = set(np.nonzero(np.asarray(state.cacheable))[0].tolist())
  indexed = index.blocks()
  assert indexed == cacheable, (
      f"indexed but not cacheable (stale): {sorted(indexed - cacheable)}; "
      f"cacheable but not indexed: {sorted(cacheable - indexed)}")
