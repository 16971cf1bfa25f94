"""The prefix-cache index: chained hashes, salts, longest prefix, the last
token rule, eviction, and its agreement with the block manager."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import prefix_cache
from paged_jax.prefix_cache import PrefixIndex


def test_hashes_are_chained_over_the_whole_prefix():
  index = PrefixIndex(block_size=2, key=b"k")
  a = index.block_hashes([1, 2, 3, 4, 5])
  assert len(a) == 2 and len(set(a)) == 2 and len(a[0]) == 32
  assert index.block_hashes([1, 2, 3, 4, 6]) == a  # only full blocks count
  b = index.block_hashes([9, 2, 3, 4])  # same second block, other parent
  assert b[1] != a[1]
  assert index.chain(a[0], [3, 4]) == a[1]  # incremental hashing agrees
  # Token ids are encoded at a fixed width: no two id lists read the same.
  assert index.block_hashes([256, 0]) != index.block_hashes([0, 1])
  # The same key gives the same hashes; another key, others.
  assert PrefixIndex(2, key=b"k").block_hashes([1, 2]) == a[:1]
  assert PrefixIndex(2).block_hashes([1, 2]) != a[:1]


def test_a_list_and_an_array_hash_the_same_as_the_documented_encoding():
  """`chain` packs a list of ids without NumPy (the engine's case): the
  digest is the documented one, BLAKE2b keyed, of the parent and the ids as
  little-endian int64, whatever container holds them."""
  import hashlib
  index = PrefixIndex(block_size=3, key=b"k")
  parent, ids = index.root(b"s"), [7, 2**40, 0]
  want = hashlib.blake2b(b"block" + parent + np.array(ids, "<i8").tobytes(),
                         digest_size=32, key=b"k").digest()
  assert index.chain(parent, ids) == want
  assert index.chain(parent, np.array(ids, np.int64)) == want
  assert index.chain(parent, tuple(ids)) == want
  with pytest.raises(ValueError, match="block_size=3 token ids, got shape"):
    index.chain(parent, [1, 2])


def test_salts_keep_tenants_apart():
  index = PrefixIndex(block_size=2)
  for h, block in zip(index.block_hashes([1, 2, 3, 4, 5], salt=b"tenant-a"),
                      (10, 11)):
    assert index.insert(h, block)
  assert index.match([1, 2, 3, 4, 5], salt=b"tenant-a") == [10, 11]
  assert index.match([1, 2, 3, 4, 5], salt=b"tenant-b") == []
  assert index.match([1, 2, 3, 4, 5]) == []


def test_longest_prefix_and_the_last_token_is_always_computed():
  index = PrefixIndex(block_size=2)
  h = index.block_hashes([1, 2, 3, 4, 5, 6])
  index.insert(h[0], 0)
  index.insert(h[2], 2)  # a gap: block 1's hash is missing
  assert index.lookup(h) == [0]  # stops at the first miss
  index.insert(h[1], 1)
  assert index.lookup(h) == [0, 1, 2]
  # A fully cached prompt still computes its last token: one block less.
  assert index.match([1, 2, 3, 4, 5, 6]) == [0, 1]
  assert index.match([1, 2, 3, 4, 5, 6, 7]) == [0, 1, 2]
  assert index.match([1]) == [] and index.match([]) == []
  assert [prefix_cache.max_hit_blocks(n, 2) for n in (0, 1, 2, 3, 4, 5)] == [
      0, 0, 0, 1, 1, 2]


def test_insert_and_evict():
  index = PrefixIndex(block_size=2)
  h = index.block_hashes([1, 2, 3, 4])
  assert index.insert(h[0], 5) and index.insert(h[0], 5)  # idempotent
  assert not index.insert(h[0], 6)  # a second block with the same content
  assert len(index) == 1 and h[0] in index
  with pytest.raises(ValueError, match="block 5 is indexed under another "
                     "hash: its eviction was not reported"):
    index.insert(h[1], 5)
  assert index.evict(np.array([[5, -1], [7, -1]])) == 1
  assert len(index) == 0 and index.insert(h[1], 5)


def test_errors():
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    PrefixIndex(0)
  with pytest.raises(ValueError, match="key must be at most 64 bytes, got 65"):
    PrefixIndex(2, key=bytes(65))
  with pytest.raises(ValueError, match=r"a block has block_size=2 token ids, "
                     r"got shape \(3,\)"):
    PrefixIndex(2).chain(b"", [1, 2, 3])


def test_index_follows_the_block_manager_through_hits_and_evictions():
  """Admission (match -> share -> reserve), registration after the write, and
  evictions reported by `reserve`: the index never names a reused block."""
  bs, width = 2, 4
  state = bm.init(num_blocks=7, block_size=bs, max_seqs=3,
                  max_blocks_per_seq=width,
                  prefix_caching=True)
  index = PrefixIndex(bs)
  reserve, release = jax.jit(bm.reserve), jax.jit(bm.release)
  share, register = jax.jit(bm.share), jax.jit(bm.register)
  hits = []

  def admit(state, sid, prompt):
    blocks = index.match(prompt)
    hits.append(len(blocks))
    if blocks:
      row = np.full((1, width), -1, np.int32)
      row[0, :len(blocks)] = blocks
      state, ok = share(state, jnp.array([sid]), jnp.asarray(row),
                        jnp.array([len(blocks)]))
      assert ok.tolist() == [True]
    state, res = reserve(state, jnp.array([sid]),
                         jnp.array([len(prompt) - len(blocks) * bs]))
    assert res.ok.tolist() == [True]
    index.evict(np.asarray(res.evicted))
    # ... the step writes the prompt's K/V; then its full blocks register.
    row = np.asarray(state.block_tables[sid])
    cols = [c for c, h in enumerate(index.block_hashes(prompt))
            if index.insert(h, row[c])]
    state, ok = register(state, jnp.array([sid] * len(cols), jnp.int32),
                         jnp.array(cols, jnp.int32))
    assert all(ok.tolist())
    prefix_cache.check_consistent(index, state)
    return state

  system = [7, 7, 8, 8]
  state = admit(state, 0, system + [1, 1])
  state = admit(state, 1, system + [2, 2, 2])  # hit on the system prompt
  state, _ = release(state, jnp.array([0, 1]))
  state = admit(state, 2, system + [1, 1])  # fully cached: last block computed
  state, _ = release(state, jnp.array([2]))
  # The ring now holds, next evicted first: seq 0's own full block, seq 1's,
  # then the system prompt (released last, by seq 2).
  state = admit(state, 0, [5, 5, 6, 6, 4, 4, 3, 3])  # 3 empty + 1 evicted
  assert index.match(system + [1, 1, 1]) == index.match(system + [2]) != []
  state = admit(state, 1, system + [1])  # evicts seq 1's old block
  assert index.match(system + [2, 2, 2]) == index.match(system + [2])
  bm.check_invariants(state)
  assert hits == [0, 2, 2, 0, 2] and int(state.num_available) == 0
  bad = index.blocks().pop()
  index.evict([bad])
  with pytest.raises(AssertionError, match=f"cacheable but not indexed: "
                     f"\\[{bad}\\]"):
    prefix_cache.check_consistent(index, state)
