"""Pure-functional block manager: allocation, release, fork and copy-on-write.

The whole state is one pytree (`BlockState`); every operation is a pure,
jittable function `state -> (new state, result)`. Nothing leaves the device:
allocation, reference counting and copy-on-write decisions run inside
`jax.jit` with no host round trip, and only array values change between calls,
so a jitted step compiles once.

Layout of the state:

* `block_tables` `i32[max_seqs, max_blocks_per_seq]`: logical block `j` of
  sequence slot `s` lives in physical block `block_tables[s, j]`. Entries past
  the sequence's last block hold `NULL_BLOCK` (-1); an empty slot's row is all
  `NULL_BLOCK`. Attention backends never read `NULL_BLOCK` entries.
* `seq_lens` `i32[max_seqs]`: token slots reserved per sequence slot. A slot with
  `seq_lens == 0` is empty (not live).
* `refcounts` `i32[num_blocks]`: how many block-table entries point at each block.
* `free_stack` `i32[num_blocks]`, `num_free` `i32[]`: `free_stack[:num_free]`
  are the empty blocks; allocation pops from the top, release pushes.
* Prefix caching (`init(..., prefix_caching=True)`; `register`, `share`; see
  "Cached blocks" below): `cacheable` `bool[num_blocks]`, the cached-block
  ring `lru` `i32[2 * num_blocks]` with `lru_head`, `lru_len`, `num_cached`
  `i32[]`, and its index `lru_pos` `i32[num_blocks]`. Without prefix caching
  (the default) these fields are `None` and every operation runs the plain
  allocator: no sort by release order, no eviction loop, no ring updates.

Cached blocks (automatic prefix caching). The host says which full blocks hold
hashed content (`register`); such a block is *cacheable*. When a cacheable
block's refcount falls to zero it is not emptied but *cached*: it keeps its
K/V and can be shared into a new sequence (`share`, a prefix-cache hit) until
an allocation evicts it. Every block is exactly one of empty (on the free
stack), cached (in the ring) or live (refcount > 0). Allocation takes empty
blocks first, then evicts cached blocks least recently released first; within
one released sequence its last blocks go first (vLLM's order: a request's
tail is the least likely to be shared). Nothing registered means nothing
cached: every operation then gives the same results as without prefix
caching (at the cost of the ring bookkeeping; switch it off to skip that).

The evictable set is a FIFO ring of block ids in release order. A release
appends at the tail, an allocation pops from the head, both vectorised (one
scatter or gather of the blocks concerned). A hit removes a block from the
middle in O(1) through the index `lru_pos` (block -> ring slot): its slot
becomes a tombstone (`NULL_BLOCK`), which the head skips when it passes.
Eviction is a `while_loop` over chunks of `batch * max_blocks_per_seq` ring
slots, normally one iteration; every tombstone is skipped once in its life,
so the work is O(batch x max_blocks_per_seq + hits), never O(num_blocks).
Tombstones that the head has not reached yet take ring slots: the ring has
`2 * num_blocks` of them and is compacted (one O(num_blocks) pass, stable, in
a `while_loop` that runs zero times when not needed, also under `vmap`) only
when an append would overflow it. Live + cached entries never exceed
`num_blocks`, so a compaction happens after at least `num_blocks` hits since
the last one: O(1) amortised per hit. Why not a doubly linked list (vLLM's
free queue): popping k blocks from a list is k dependent pointer chases, a
sequential loop on the device; the ring pops k blocks with one gather.

Cached content is immutable: `register` accepts only blocks that are full in
the registering sequence, `slot_mapping` never maps a write into a cacheable
block, and allocation clears `cacheable` for every block it hands out, so a
block named by the host's index holds exactly the tokens it was hashed from
until `reserve` reports it evicted (`Reservation.evicted`).

Speculative decoding is a transaction on this state: a verification step
reserves `1 + k` slots per sequence (`reserve`: its last sampled token and
`k` draft tokens), and once `a` drafts are accepted rolls back to what it
keeps (`truncate`, to `L + 1 + a`). The rollback gives back the blocks past
the accepted length, never one that a fork or the prefix cache still holds,
and leaves copy-on-write exactly as before; truncating in the same step as
the verification, before the next `register`, keeps draft tokens out of the
prefix cache (see `truncate`; the verifiers are in `paged_jax.speculative`).

Operations are vectorised over the batch: each touches the listed sequences'
table rows and at most `max_blocks_per_seq` blocks per sequence, with one
scatter per pool-sized array, so the cost is O(batch x max_blocks_per_seq)
(plus an O(batch^2) ordering pass), independent of `num_blocks`. `reserve`
serves requests in the order given (earlier requests get blocks first), and a
sequence slot may appear once per call. Jit the caller with the state donated
(`donate_argnums`) so the pool-sized arrays are updated in place.

Failure is a value: every operation returns an `ok` mask, and a failed request
leaves its part of the state exactly as it was. Out-of-range ids, negative or
oversized requests, forking onto a live slot and releasing an empty slot all
come back as `ok == False`; nothing a caller passes can corrupt the pool.
That holds at the int32 extremes too: `init` refuses sizes whose token
positions or flat slots would not fit int32, no operation computes a value
that can wrap (lengths are compared against the room left, block counts are
divided without an `a + b - 1` that overflows), and ids or counts outside
int32 (int64 or uint64 arrays, Python ints) mean `ok == False` instead of
being truncated into a valid id. Empty batches are accepted everywhere.
Static mistakes (wrong shapes or dtypes, bad sizes) raise `ValueError`.

Example:
  >>> state = init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4)
  >>> state, res = reserve(state, jnp.array([0]), jnp.array([6]))  # 2 blocks
  >>> bool(res.ok[0]), int(state.num_free)
  (True, 6)
  >>> state, ok = fork(state, jnp.array([0]), jnp.array([1]))      # shares both
  >>> state, res = reserve(state, jnp.array([1]), jnp.array([1]))  # copy-on-write
  >>> int(res.copy_src[0]), int(res.copy_dst[0])
  (1, 2)
  >>> state = init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4,
  ...              prefix_caching=True)
  >>> state, res = reserve(state, jnp.array([0]), jnp.array([6]))
  >>> state, ok = fork(state, jnp.array([0]), jnp.array([1]))
  >>> state, res = reserve(state, jnp.array([1]), jnp.array([1]))
  >>> state, ok = register(state, jnp.array([0]), jnp.array([0]))  # full, hashed
  >>> state, ok = release(state, jnp.array([0, 1]))
  >>> int(state.num_free), int(state.num_cached), cached_blocks(state)
  (7, 1, [0])
  >>> state, ok = share(state, jnp.array([1]), jnp.array([[0]]), jnp.array([1]))
  >>> bool(ok[0]), int(state.seq_lens[1]), int(state.num_cached)  # a hit
  (True, 4, 0)
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _int32

# Unused block-table entries, and "no copy" in copy-on-write pairs.
NULL_BLOCK = -1


@flax.struct.dataclass
class BlockState:
  """The block manager's whole state (a pytree; sizes are static).

  Data shards' states (`sharding.init_block_states`) are stacked on a leading
  axis; the size properties are then those of one shard, and `total_blocks`
  counts every shard's pool.

  Attributes:
    block_tables: `i32[max_seqs, max_blocks_per_seq]`, `NULL_BLOCK` where unused.
    seq_lens: `i32[max_seqs]` token slots reserved per sequence slot.
    refcounts: `i32[num_blocks]` number of table entries referencing each block.
    free_stack: `i32[num_blocks]`; `free_stack[:num_free]` are the empty blocks.
    num_free: `i32[]` number of empty blocks (not counting cached ones).
    cacheable: `bool[num_blocks]` blocks holding registered (hashed, full,
      immutable) content: live ones and cached ones. This and the five
      fields below are `None` without prefix caching.
    lru: `i32[2 * num_blocks]` ring of cached block ids in release order;
      slots `lru_head .. lru_head + lru_len - 1` (mod its size) are in use,
      `NULL_BLOCK` there is a tombstone (a block shared out by a hit).
    lru_pos: `i32[num_blocks]` ring slot of each cached block, -1 if the block
      is not cached.
    lru_head: `i32[]` ring slot of the least recently released entry.
    lru_len: `i32[]` ring slots in use (cached blocks plus tombstones).
    num_cached: `i32[]` cached blocks (refcount 0, content kept, evictable).
    block_size: tokens per block (static).
    window: None, or a sliding window of `window` tokens that every layer
      attends within (static): the engine then gives back, after each step,
      the leading blocks that no future query of a sequence can see
      (`paged_jax.window_reclaim`), their entries `NULL_BLOCK` inside
      `seq_lens`. `release` and `fork` skip such entries (without a
      window they trace the same program as before windows existed).
  """

  block_tables: jax.Array
  seq_lens: jax.Array
  refcounts: jax.Array
  free_stack: jax.Array
  num_free: jax.Array
  cacheable: jax.Array | None
  lru: jax.Array | None
  lru_pos: jax.Array | None
  lru_head: jax.Array | None
  lru_len: jax.Array | None
  num_cached: jax.Array | None
  block_size: int = flax.struct.field(pytree_node=False)
  window: int | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def prefix_caching(self) -> bool:
    """Whether this state caches released registered blocks (static: part
    of the pytree's structure, so operations branch on it in Python)."""
    return self.lru is not None

  @property
  def num_blocks(self) -> int:
    return self.refcounts.shape[-1]

  @property
  def total_blocks(self) -> int:
    """Blocks of the whole pool: `num_blocks` times the stacked shards."""
    return self.refcounts.size

  @property
  def max_seqs(self) -> int:
    return self.block_tables.shape[-2]

  @property
  def max_blocks_per_seq(self) -> int:
    return self.block_tables.shape[1]

  @property
  def max_seq_len(self) -> int:
    """Largest number of tokens one sequence can hold."""
    return self.max_blocks_per_seq * self.block_size

  @property
  def num_used(self) -> jax.Array:
    """`i32[]` blocks currently referenced by at least one sequence."""
    if not self.prefix_caching:
      return self.num_blocks - self.num_free
    return self.num_blocks - self.num_free - self.num_cached

  @property
  def num_available(self) -> jax.Array:
    """`i32[]` blocks an allocation can take: empty plus cached (evictable)."""
    if not self.prefix_caching:
      return self.num_free
    return self.num_free + self.num_cached


@flax.struct.dataclass
class Reservation:
  """Result of `reserve`, one entry per requested sequence.

  Attributes:
    ok: `bool[n]` whether the sequence got all the slots it asked for.
    copy_src: `i32[n]` copy-on-write source block, `NULL_BLOCK` if none.
    copy_dst: `i32[n]` copy-on-write destination block, `NULL_BLOCK` if none.
    evicted: `i32[n, max_blocks_per_seq]` the cached blocks this call evicted
      (their old content is gone: drop them from the prefix index), at the
      table entries they were given to; `NULL_BLOCK` elsewhere. `None`
      without prefix caching (nothing is ever evicted).
  """

  ok: jax.Array
  copy_src: jax.Array
  copy_dst: jax.Array
  evicted: jax.Array | None


def init(*, num_blocks: int, block_size: int, max_seqs: int,
         max_blocks_per_seq: int, prefix_caching: bool = False,
         window: int | None = None) -> BlockState:
  """An empty pool: every block free, every sequence slot empty.

  Sizes are keyword-only, as in `KVCache.create`: their orders differ.

  Args:
    num_blocks: physical blocks in the pool.
    block_size: tokens per block.
    max_seqs: sequence slots (rows of the block table).
    max_blocks_per_seq: block-table width; a sequence holds at most
      `max_blocks_per_seq * block_size` tokens.
    prefix_caching: keep released registered blocks cached (`register`,
      `share`). Off (the default), the cache fields are `None`, `register`
      and `share` refuse the state, and the other operations cost what they
      cost without prefix caching.
    window: None, or the sliding window (tokens, >= 1) of every layer, for
      block reclamation (`BlockState.window`). With prefix caching, a
      reclaimed cacheable block is cached, as a released one
      (`paged_jax.serving.pooled_step`: the engine's hybrid pools).

  Returns:
    A `BlockState`. Blocks are handed out lowest id first from a fresh pool.
    Its `KVCache` must have the same `num_blocks` and `block_size`
    (`kv_cache.check_compatible`).

  Raises:
    ValueError: if a size is not a positive int, or if a sequence
      (`max_blocks_per_seq * block_size` tokens), the pool's flat slots
      (`num_blocks * block_size`), `max_seqs` or, with prefix caching, the
      cached-block ring (`2 * num_blocks` slots) would not fit int32
      (< 2**31); if `prefix_caching` is not a bool; if `window` is not None
      or a positive int.
  """
  num_blocks = _int32.positive_int("num_blocks", num_blocks)
  block_size = _int32.positive_int("block_size", block_size)
  max_seqs = _int32.positive_int("max_seqs", max_seqs)
  max_blocks_per_seq = _int32.positive_int("max_blocks_per_seq",
                                           max_blocks_per_seq)
  _int32.check_fits("token positions", max_blocks_per_seq=max_blocks_per_seq,
                    block_size=block_size)
  _int32.check_fits("cache slots", num_blocks=num_blocks,
                    block_size=block_size)
  _int32.check_fits("sequence ids", max_seqs=max_seqs)
  if not isinstance(prefix_caching, (bool, np.bool_)):
    raise ValueError(f"prefix_caching must be a bool, got {prefix_caching!r}")
  if window is not None:
    window = _int32.positive_int("window", window)
  cache = dict.fromkeys(("cacheable", "lru", "lru_pos", "lru_head", "lru_len",
                         "num_cached"))
  if prefix_caching:
    _int32.check_fits("cached-block ring slots", ring_per_block=2,
                      num_blocks=num_blocks)
    cache = dict(
        cacheable=jnp.zeros((num_blocks,), bool),
        lru=jnp.full((2 * num_blocks,), NULL_BLOCK, jnp.int32),
        lru_pos=jnp.full((num_blocks,), -1, jnp.int32),
        lru_head=jnp.zeros((), jnp.int32),
        lru_len=jnp.zeros((), jnp.int32),
        num_cached=jnp.zeros((), jnp.int32))
  return BlockState(
      block_tables=jnp.full((max_seqs, max_blocks_per_seq), NULL_BLOCK,
                            jnp.int32),
      seq_lens=jnp.zeros((max_seqs,), jnp.int32),
      refcounts=jnp.zeros((num_blocks,), jnp.int32),
      free_stack=jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32),
      num_free=jnp.asarray(num_blocks, jnp.int32),
      block_size=block_size,
      window=window,
      **cache,
  )


def _require_caching(op: str, state: BlockState) -> None:
  if not state.prefix_caching:
    raise ValueError(
        f"{op} needs a state with prefix caching (init(..., "
        f"prefix_caching=True)), got one without (its cache fields are None)")


_as_ids = _int32.as_int32  # values outside int32 become -1: invalid everywhere


def _same_length(a_name, a, b_name, b):
  if a.shape != b.shape:
    raise ValueError(f"{a_name} and {b_name} must have the same shape, got "
                     f"{a_name}.shape={a.shape} and {b_name}.shape={b.shape}")


def _cdiv(a, b):
  """`ceil(a / b)` for `a >= 0`, `b > 0`; no `a + b - 1` that could wrap."""
  return a // b + (a % b != 0).astype(a.dtype)


# Rows a call handles on its short path (`_leading_rows`): a step releases,
# forks or truncates a few sequences at a time, out of `max_seqs` rows.
LEADING_ROWS = 8


def _leading_rows(op, state: BlockState, ids: jax.Array, *rows: jax.Array):
  """`op(state, ids, *rows)` (an op with an `ok` per row that leaves rows
  whose `ids` are negative untouched), at the cost of its first
  `LEADING_ROWS` rows when every other row is padding (`ids < 0`).

  Those trailing rows change nothing and are refused (`ok` False) either
  way, so the two give the same result, bit for bit; but the op's work is
  O(rows x max_blocks_per_seq) (a sort of every entry, for `release`), and
  the engine's steps pass `max_seqs` rows, entries first, of which one or
  two are real. A `lax.cond`: under `vmap` (data shards stacked on a mesh)
  it becomes a `select` and both run, the whole call's cost as before plus
  the short one, with no collective (a `while_loop`'s batched predicate
  would need an all-reduce across the shards); under `shard_map` (the
  engine's step) it stays a cond.
  """
  n = ids.shape[0]
  k = LEADING_ROWS
  if n <= k:
    return op(state, ids, *rows)

  def short(st):
    new_state, ok = op(st, ids[:k], *(r[:k] for r in rows))
    return new_state, jnp.concatenate([ok, jnp.zeros((n - k,), bool)])

  return jax.lax.cond(jnp.any(ids[k:] >= 0),
                      lambda st: op(st, ids, *rows), short, state)


def _scatter_add(x: jax.Array, idx: jax.Array, mask: jax.Array, val):
  """`x[idx] += val` where `mask`; one scatter, in place when `x` is donated."""
  return x.at[jnp.where(mask, idx, x.shape[0])].add(val, mode="drop")


def _first_occurrence(ids: jax.Array) -> jax.Array:
  """`bool[n]`: True where `ids[i]` does not appear in `ids[:i]` (O(n^2), small n)."""
  n = ids.shape[0]
  earlier = jnp.tril(ids[:, None] == ids[None, :], k=-1)
  return ~jnp.any(earlier, axis=1) if n else jnp.zeros((0,), bool)


def _ring_slot(head, k, size: int):
  """`(head + k) % size` for `0 <= head < size`, `0 <= k <= size`; no sum that
  can wrap (`size` itself fits int32, by `init`)."""
  return jnp.where(k >= size - head, k - (size - head), head + k)


def _evict(state: BlockState, count, out_len: int):
  """Pops the `count` least recently released cached blocks off the ring.

  `count <= state.num_cached` and `count <= out_len` (callers guarantee it).
  One `while_loop` iteration looks at `out_len` ring slots from the head
  (tombstones included), so it normally runs once; each tombstone is passed
  once in its life.

  Returns:
    `(ids i32[out_len], head, length)`: the evicted ids in eviction order
    (`NULL_BLOCK` past `count`) and the ring's new head and length.
  """
  size = state.lru.shape[0]
  chunk = min(out_len, size)
  cols = jnp.arange(chunk, dtype=jnp.int32)

  def body(carry):
    head, length, got, out = carry
    ent = state.lru[_ring_slot(head, cols, size)]
    live = (cols < length) & (ent >= 0)
    rank = got + jnp.cumsum(live, dtype=jnp.int32) - 1
    take = live & (rank < count)
    out = out.at[jnp.where(take, rank, out_len)].set(ent, mode="drop")
    done = got + jnp.sum(live, dtype=jnp.int32) >= count
    last = jnp.max(jnp.where(take, cols, -1))
    adv = jnp.where(done, last + 1, jnp.minimum(chunk, length))
    return (_ring_slot(head, adv, size), length - adv,
            got + jnp.sum(take, dtype=jnp.int32), out)

  carry = (state.lru_head, state.lru_len, jnp.zeros((), jnp.int32),
           jnp.full((out_len,), NULL_BLOCK, jnp.int32))
  head, length, _, out = jax.lax.while_loop(lambda c: c[2] < count, body,
                                            carry)
  return out, head, length


def _serve(valid, partial, last, last_refs, grow, num_available, *,
           ordered: bool = False, num_sub: int = 1):
  """`reserve`'s decision: who of the `n` requests is served, and at what
  cost. The one rule of the joint grant too (`num_sub > 1`:
  `serving.shared_pool.joint_ok`, `block_groups.reserve`).

  Requests are served in order; request `i` needs `grow[i]` new blocks, plus
  one if it grows into a partial last block (`partial`) that is still shared
  (copy-on-write), and is served if that many are available after the
  earlier ones. A sibling that copied the same shared block earlier in the
  call lowers its count, so one request can change another's need. With
  `num_sub > 1` the requests come in runs of `num_sub` (one entry's rows in
  every sub-group or layer group, which grow together): a run is served
  whole, if every request of it is valid and their needs together fit, or
  not at all.

  Args:
    valid: `bool[n]` the requests that may be served.
    partial: `bool[n]` valid requests growing into their partial last block.
    last: `i32[n]` that block; `last_refs`: `i32[n]` its refcount.
    grow: `i32[n]` blocks past the current ones.
    num_available: `i32[]` blocks the pool can give.
    ordered: static, for tests: always decide by the scan.
    num_sub: static, requests per run (`n` a multiple of it).

  Returns:
    `(num_left i32[], ok bool[n], cow bool[n], need i32[n])`; `ok` is the
    same for every request of a run.
  """
  n = valid.shape[0]
  runs = n // num_sub
  shape = (runs, num_sub)
  valid = jnp.repeat(valid.reshape(shape).all(axis=1), num_sub)

  # Serve in order: a scan over the runs with O(n) carry decides who fits and
  # who must copy (siblings that copied earlier in this call lower the count).
  def step(carry, i):
    num_free, copied = carry  # copied: i32[n] blocks left by earlier copies
    lst = jax.lax.dynamic_slice(last, (i * num_sub,), (num_sub,))
    par = jax.lax.dynamic_slice(partial, (i * num_sub,), (num_sub,))
    refs = jax.lax.dynamic_slice(last_refs, (i * num_sub,), (num_sub,))
    drops = jnp.sum((copied[None, :] == lst[:, None]) & par[:, None], axis=1,
                    dtype=jnp.int32)
    cow = par & (refs - drops > 1)
    need = jax.lax.dynamic_slice(grow, (i * num_sub,), (num_sub,)) + cow.astype(jnp.int32)
    ok = valid[i * num_sub] & (jnp.sum(need, dtype=jnp.int32) <= num_free)
    num_free = num_free - jnp.where(ok, jnp.sum(need, dtype=jnp.int32), 0)
    copied = jax.lax.dynamic_update_slice(
        copied, jnp.where(ok & cow, lst, NULL_BLOCK), (i * num_sub,))
    return (num_free, copied), (jnp.broadcast_to(ok, (num_sub,)), cow & ok,
                                jnp.where(ok, need, 0))

  def serve_in_order():
    init = (num_available, jnp.full((n,), NULL_BLOCK, jnp.int32))
    (num_left, _), (ok, cow, need) = jax.lax.scan(
        step, init, jnp.arange(runs, dtype=jnp.int32))
    return num_left, ok.reshape(-1), cow.reshape(-1), need.reshape(-1)

  # The common case needs no scan: when no two requests grow into the same
  # shared partial block (the only way one request changes another's need)
  # and the pool holds what they all ask for, every valid request is served
  # with its own need. Otherwise the scan decides, the same results either
  # way. A `lax.cond` (under `vmap` both run, no collective; see
  # `_leading_rows`).
  cow_all = partial & (last_refs > 1)
  need_all = jnp.where(valid, grow + cow_all.astype(jnp.int32), 0)
  total_all = jnp.sum(need_all, dtype=jnp.int32)  # <= max_seqs * width
  shared = jnp.sort(jnp.where(cow_all, last, NULL_BLOCK))
  siblings = jnp.any((shared[1:] == shared[:-1]) & (shared[1:] >= 0))
  in_order = ordered | siblings | (total_all > num_available)
  num_left, ok, cow, need = jax.lax.cond(
      in_order, serve_in_order,
      lambda: (num_available - total_all, valid, cow_all & valid, need_all))
  return num_left, ok, cow, need


def reserve(state: BlockState, seq_ids, num_new_tokens
            ) -> tuple[BlockState, Reservation]:
  """Grows each listed sequence by `num_new_tokens` token slots.

  Sequences are served in the order given: earlier requests get blocks first.
  A sequence crossing a block boundary takes new blocks from the pool (empty
  blocks first, then cached ones, least recently released first, reported in
  `Reservation.evicted`); it
  either gets everything it asked for or is left exactly as it was (`ok`).
  Reserving on an empty slot starts a new sequence there. A slot may appear
  once per call; later occurrences fail.

  Copy-on-write: a sequence that grows into a partially filled last block
  whose refcount is > 1 (shared after `fork`) gets a fresh block for it, and
  the pair (`copy_src`, `copy_dst`) tells the caller to copy that block's K/V
  (`kv_cache.copy_blocks`) before writing. Full shared blocks are never copied.
  When every holder of a shared partial block grows in the same call, the last
  one in order keeps the original (its refcount has dropped to 1 by then).

  Args:
    state: the block state.
    seq_ids: `int[n]` sequence slots (any integer dtype). Ids outside
      `[0, max_seqs)` fail, int64 ones outside int32 included.
    num_new_tokens: `int[n]` slots to add; negative requests fail, and so do
      requests past `max_blocks_per_seq * block_size` tokens in all (however
      large: the room left is compared, no sum can wrap).

  Returns:
    `(new_state, Reservation)`; an empty batch gives empty results and the
    state unchanged.

  Raises:
    ValueError: if the arguments are not 1-D integer arrays of equal length.
  """
  return _reserve(state, seq_ids, num_new_tokens)


def _reserve(state: BlockState, seq_ids, num_new_tokens, *,
             ordered: bool = False) -> tuple[BlockState, Reservation]:
  """`reserve`; `ordered` (static, for tests) always decides by the scan."""
  seq_ids = _as_ids("seq_ids", seq_ids)
  num_new_tokens = _as_ids("num_new_tokens", num_new_tokens)
  _same_length("seq_ids", seq_ids, "num_new_tokens", num_new_tokens)
  bs = state.block_size
  num_blocks, max_seqs, width = (state.num_blocks, state.max_seqs,
                                 state.max_blocks_per_seq)
  n = seq_ids.shape[0]
  if n == 0:  # static: the scan below cannot index an empty batch
    none = jnp.zeros((0,), jnp.int32)
    evicted = (jnp.zeros((0, width), jnp.int32) if state.prefix_caching
               else None)
    return state, Reservation(ok=jnp.zeros((0,), bool), copy_src=none,
                              copy_dst=none, evicted=evicted)
  valid = ((seq_ids >= 0) & (seq_ids < max_seqs) & (num_new_tokens >= 0)
           & _first_occurrence(seq_ids))
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  old_len = state.seq_lens[sid]
  rows = state.block_tables[sid]  # [n, width]
  # Both sides lie in [0, max_seq_len] (< 2**31 by `init`): no sum can wrap.
  valid &= num_new_tokens <= state.max_seq_len - old_len
  new_len = old_len + jnp.where(valid, num_new_tokens, 0)
  cur_blocks = _cdiv(old_len, bs)
  new_blocks = _cdiv(new_len, bs)
  last = jnp.take_along_axis(rows, jnp.maximum(cur_blocks - 1, 0)[:, None],
                             axis=1)[:, 0]
  partial = valid & (num_new_tokens > 0) & (old_len % bs != 0)
  last_refs = state.refcounts[jnp.clip(last, 0, num_blocks - 1)]

  num_left, ok, cow, need = _serve(valid, partial, last, last_refs,
                                   new_blocks - cur_blocks,
                                   state.num_available, ordered=ordered)

  offset = jnp.cumsum(need) - need  # blocks taken by earlier requests
  first = cur_blocks - cow.astype(jnp.int32)  # first table column to fill
  k = jnp.arange(width, dtype=jnp.int32)[None, :] - first[:, None]
  taking = ok[:, None] & (k >= 0) & (k < need[:, None])
  if state.prefix_caching:
    # Hand out blocks in request order: the top of the free stack first, then
    # cached blocks from the ring's head (evictions).
    total = jnp.sum(need, dtype=jnp.int32)  # <= n * width, fits int32
    from_cache = jnp.maximum(total - state.num_free, 0)
    evicted_ids, head, length = _evict(state, from_cache, n * width)
    g = offset[:, None] + k  # this block's rank among the call's allocations
    from_stack = g < state.num_free
    stack_ids = state.free_stack[jnp.clip(state.num_free - 1 - g, 0,
                                          num_blocks - 1)]
    cache_ids = evicted_ids[jnp.clip(g - state.num_free, 0, n * width - 1)]
    new_ids = jnp.where(from_stack, stack_ids, cache_ids)
  else:
    # Hand out blocks from the top of the free stack, in request order.
    pos = state.num_free - 1 - offset[:, None] - k
    new_ids = state.free_stack[jnp.clip(pos, 0, num_blocks - 1)]
  new_rows = jnp.where(taking, new_ids, rows)
  refs = _scatter_add(state.refcounts, new_ids, taking, 1)
  refs = _scatter_add(refs, last, cow, -1)
  write = jnp.where(ok, sid, max_seqs)  # failed requests write nothing
  tables = state.block_tables.at[write].set(new_rows, mode="drop")
  lens = state.seq_lens.at[write].set(new_len, mode="drop")
  dst = jnp.take_along_axis(new_rows, jnp.maximum(first, 0)[:, None],
                            axis=1)[:, 0]
  new_state = state.replace(block_tables=tables, seq_lens=lens, refcounts=refs,
                            num_free=num_left)
  evicted = None
  if state.prefix_caching:
    # Handed-out blocks get new content: no longer cacheable, no longer cached.
    cacheable = state.cacheable.at[jnp.where(taking, new_ids,
                                             num_blocks)].set(False,
                                                              mode="drop")
    lru_pos = state.lru_pos.at[jnp.where(evicted_ids >= 0, evicted_ids,
                                         num_blocks)].set(-1, mode="drop")
    num_cached = state.num_cached - from_cache
    new_state = new_state.replace(
        num_free=state.num_free - (total - from_cache), cacheable=cacheable,
        lru_pos=lru_pos, lru_head=head,
        lru_len=jnp.where(num_cached == 0, 0, length), num_cached=num_cached)
    evicted = jnp.where(taking & ~from_stack, new_ids, NULL_BLOCK)
  return new_state, Reservation(ok=ok,
                                copy_src=jnp.where(cow, last, NULL_BLOCK),
                                copy_dst=jnp.where(cow, dst, NULL_BLOCK),
                                evicted=evicted)


def release(state: BlockState, seq_ids) -> tuple[BlockState, jax.Array]:
  """Drops the listed sequences; their blocks lose one reference each.

  A block returns to the pool when its refcount reaches zero; blocks still
  shared with other sequences stay. A cacheable block (`register`) whose count
  reaches zero is cached instead of emptied: appended to the eviction ring,
  each sequence's blocks last block first, sequences in the order given (a
  block shared by several of them counts as released by the last).

  Args:
    state: the block state.
    seq_ids: `int[n]` sequence slots to free (any integer dtype).

  Returns:
    `(new_state, ok)`; `ok` is `bool[n]`, False for out-of-range ids (int64
    ones outside int32 included), empty slots and repeats of an id earlier in
    the same call.

  Raises:
    ValueError: if `seq_ids` is not a 1-D integer array.
  """
  return _leading_rows(_release, state, _as_ids("seq_ids", seq_ids))


def _release(state: BlockState, seq_ids) -> tuple[BlockState, jax.Array]:
  bs = state.block_size
  max_seqs, width = state.max_seqs, state.max_blocks_per_seq
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  length = state.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < max_seqs) & (length > 0)
        & _first_occurrence(seq_ids))
  rows = state.block_tables[sid]  # [n, width]
  cols = jnp.arange(width, dtype=jnp.int32)
  owned = ok[:, None] & (cols[None, :] < _cdiv(length, bs)[:, None])
  if state.window is not None:  # a reclaimed entry holds no reference
    owned &= rows >= 0
  state = _unref(state, rows, owned)
  write = jnp.where(ok, sid, max_seqs)
  tables = state.block_tables.at[write].set(NULL_BLOCK, mode="drop")
  lens = state.seq_lens.at[write].set(0, mode="drop")
  return state.replace(block_tables=tables, seq_lens=lens), ok


def _unref(state: BlockState, rows, dropped) -> BlockState:
  """Drops one reference from each `dropped` entry of `rows` (`release`,
  `truncate`): blocks whose refcount reaches zero go back to the pool (to the
  free stack, or cached if cacheable); blocks still held elsewhere stay.
  Table rows and lengths are the caller's to update.

  `rows` `i32[n, width]` are table rows, `dropped` `bool[n, width]` the
  entries that give up their reference (each a distinct (row, column)).
  """
  num_blocks = state.num_blocks
  refs = _scatter_add(state.refcounts, rows, dropped, -1)
  if state.prefix_caching:
    return _free_or_cache(state.replace(refcounts=refs), rows, dropped)
  # Blocks whose count reached zero go back on the stack, once each even
  # when several rows shared them: sort, keep first of each.
  flat = jnp.sort(jnp.where(dropped, rows, num_blocks).reshape(-1))
  fresh = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]])
  freed = fresh & (flat < num_blocks)
  freed &= refs[jnp.clip(flat, 0, num_blocks - 1)] == 0
  pos = state.num_free + jnp.cumsum(freed.astype(jnp.int32)) - 1
  stack = state.free_stack.at[jnp.where(freed, pos, num_blocks)].set(
      flat, mode="drop")
  num_free = state.num_free + jnp.sum(freed, dtype=jnp.int32)
  return state.replace(refcounts=refs, free_stack=stack, num_free=num_free)


def truncate(state: BlockState, seq_ids, new_lens
             ) -> tuple[BlockState, jax.Array]:
  """Rolls sequences back to `new_lens` tokens (speculative decoding's undo).

  Sequence `seq_ids[i]` keeps its first `new_lens[i]` token slots and the
  `ceil(new_lens[i] / block_size)` blocks that hold them; each block past
  them loses this sequence's reference and returns to the pool only when no
  one else holds it, exactly as in `release`: a block shared with a fork
  (refcount > 1) stays with the fork, and a cacheable one (`register`)
  whose count reaches zero is cached, not emptied. The block at the new end
  keeps its refcount: if it is now a partial block that another sequence
  shares, `slot_mapping` keeps it read-only and the next `reserve` copies it
  (copy-on-write), so a rollback below a fork point never writes into the
  sibling's K/V. Slots past `new_lens` inside a kept block hold stale K/V
  that nothing reads (attention stops at `seq_lens`); the next reserve
  overwrites them. Truncating to 0 empties the slot (as `release` does).

  Lookahead for a verification step is plain `reserve`: a sequence of `L`
  cached tokens reserves `1 + k` slots (its last sampled token and `k` draft
  tokens; copy-on-write as usual), the step writes their K/V, and once
  `a <= k` drafts are accepted `truncate(state, seq, L + 1 + a)` gives back
  the rest. The pair is exact: after `reserve(1 + k)` then `truncate(L + 1
  + a)` every sequence has the lengths, block counts and copy-on-write pair
  that `reserve(1 + a)` would have given it, and the pool as many available
  blocks (which free blocks fill the rows, and the free stack's order, may
  differ). With prefix caching, cached blocks that the lookahead evicted
  stay evicted (`Reservation.evicted` already told the host; their content
  is gone) and come back empty.

  Unverified tokens never reach the prefix cache: `register` accepts only
  blocks that are full within `seq_lens`, so a caller that truncates in the
  same step as it verifies (before the next `register`) never registers a
  block holding draft tokens. Truncating into registered content (a
  cacheable block that would become partial) is refused: registered content
  is immutable, and the sequence would have to write into it.

  Args:
    state: the block state.
    seq_ids: `int[n]` live sequence slots (any integer dtype).
    new_lens: `int[n]` lengths to keep, in `[0, seq_lens[seq_ids]]`.

  Returns:
    `(new_state, ok)`; `ok` is `bool[n]`, False for out-of-range ids (int64
    ones outside int32 included), empty slots, repeats of an id earlier in
    the same call, `new_lens` below 0 or above the current length, and (with
    prefix caching) a new end inside a cacheable block. A failed entry
    leaves its sequence exactly as it was.

  Raises:
    ValueError: if the arguments are not 1-D integer arrays of equal length.

  Example:
    >>> state = init(num_blocks=8, block_size=4, max_seqs=2,
    ...              max_blocks_per_seq=4)
    >>> state, res = reserve(state, jnp.array([0]), jnp.array([6]))
    >>> state, res = reserve(state, jnp.array([0]), jnp.array([1 + 4]))
    >>> int(state.seq_lens[0]), int(state.num_free)  # 11 slots, 3 blocks
    (11, 5)
    >>> state, ok = truncate(state, jnp.array([0]), jnp.array([6 + 1 + 1]))
    >>> bool(ok[0]), int(state.seq_lens[0]), int(state.num_free)
    (True, 8, 6)
  """
  seq_ids = _as_ids("seq_ids", seq_ids)
  new_lens = _as_ids("new_lens", new_lens)
  _same_length("seq_ids", seq_ids, "new_lens", new_lens)
  return _leading_rows(_truncate, state, seq_ids, new_lens)


def _truncate(state: BlockState, seq_ids, new_lens
              ) -> tuple[BlockState, jax.Array]:
  bs = state.block_size
  num_blocks, max_seqs, width = (state.num_blocks, state.max_seqs,
                                 state.max_blocks_per_seq)
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  length = state.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < max_seqs) & (length > 0)
        & (new_lens >= 0) & (new_lens <= length)
        & _first_occurrence(seq_ids))
  rows = state.block_tables[sid]  # [n, width]
  keep = _cdiv(jnp.clip(new_lens, 0, length), bs)  # blocks kept
  if state.prefix_caching:
    end = jnp.take_along_axis(rows, jnp.maximum(keep - 1, 0)[:, None],
                              axis=1)[:, 0]
    cut = (new_lens % bs != 0) & state.cacheable[jnp.clip(end, 0,
                                                          num_blocks - 1)]
    ok &= ~cut
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  dropped = ok[:, None] & (cols >= keep[:, None]) & (
      cols < _cdiv(length, bs)[:, None])
  state = _unref(state, rows, dropped)
  write = jnp.where(ok, sid, max_seqs)
  tables = state.block_tables.at[write].set(
      jnp.where(cols >= keep[:, None], NULL_BLOCK, rows), mode="drop")
  lens = state.seq_lens.at[write].set(new_lens, mode="drop")
  return state.replace(block_tables=tables, seq_lens=lens), ok


def _free_or_cache(state: BlockState, rows, owned) -> BlockState:
  """`release` with prefix caching, after the refcounts dropped: blocks at
  zero go to the free stack, cacheable ones to the ring's tail instead.

  `rows` `i32[n, width]` are the released rows, `owned` `bool[n, width]` their
  entries that held a reference.
  """
  num_blocks, refs = state.num_blocks, state.refcounts
  # Release order: sequences as given, each one's blocks last first.
  order = jnp.where(owned, rows, num_blocks)[:, ::-1].reshape(-1)
  idx = jnp.arange(order.shape[0], dtype=jnp.int32)
  # Blocks whose count reached zero leave once each even when several released
  # sequences shared them: sort by (block, order), keep the last of each run.
  flat, at = jax.lax.sort((order, idx), num_keys=2)
  final = jnp.concatenate([flat[1:] != flat[:-1], jnp.ones((1,), bool)])
  safe = jnp.clip(flat, 0, num_blocks - 1)
  freed = final & (flat < num_blocks) & (refs[safe] == 0)
  keep = state.cacheable[safe]
  to_stack = freed & ~keep
  pos = state.num_free + jnp.cumsum(to_stack.astype(jnp.int32)) - 1
  stack = state.free_stack.at[jnp.where(to_stack, pos, num_blocks)].set(
      flat, mode="drop")
  num_free = state.num_free + jnp.sum(to_stack, dtype=jnp.int32)
  # Cacheable ones go to the ring's tail in release order.
  to_ring = jnp.zeros(order.shape, bool).at[at].set(freed & keep)
  num_new = jnp.sum(to_ring, dtype=jnp.int32)
  state = _compact_if_full(state, num_new)
  size = state.lru.shape[0]
  slot = _ring_slot(state.lru_head,
                    state.lru_len + jnp.cumsum(to_ring, dtype=jnp.int32) - 1,
                    size)
  lru = state.lru.at[jnp.where(to_ring, slot, size)].set(order, mode="drop")
  lru_pos = state.lru_pos.at[jnp.where(to_ring, order, num_blocks)].set(
      slot, mode="drop")
  return state.replace(free_stack=stack, num_free=num_free, lru=lru,
                       lru_pos=lru_pos, lru_len=state.lru_len + num_new,
                       num_cached=state.num_cached + num_new)


def _compact_if_full(state: BlockState, num_new) -> BlockState:
  """The ring with its tombstones squeezed out, if `num_new` more entries
  would not fit; else unchanged.

  A `while_loop` that runs once or not at all (a `cond` would become a
  `select` under `vmap` and pay the O(num_blocks) pass on every call).
  Afterwards `lru_len == num_cached`, and `num_cached + num_new <= num_blocks`
  (cached and newly released blocks are distinct blocks of the pool), so the
  entries fit the `2 * num_blocks` slots.
  """
  size = state.lru.shape[0]

  def compact(st):
    cols = jnp.arange(size, dtype=jnp.int32)
    ent = st.lru[_ring_slot(st.lru_head, cols, size)]
    live = (cols < st.lru_len) & (ent >= 0)
    pos = jnp.cumsum(live, dtype=jnp.int32) - 1
    lru = jnp.full((size,), NULL_BLOCK, jnp.int32).at[
        jnp.where(live, pos, size)].set(ent, mode="drop")
    lru_pos = st.lru_pos.at[jnp.where(live, ent, st.num_blocks)].set(
        pos, mode="drop")
    return st.replace(lru=lru, lru_pos=lru_pos,
                      lru_head=jnp.zeros((), jnp.int32), lru_len=st.num_cached)

  return jax.lax.while_loop(lambda st: st.lru_len > size - num_new, compact,
                            state)


def fork(state: BlockState, parent_ids, child_ids
         ) -> tuple[BlockState, jax.Array]:
  """Makes each child share every block of its parent (refcounts go up).

  For parallel sampling, beam search and shared prompts. The child gets the
  parent's length; the first time either grows into the shared partial last
  block, `reserve` copies it (copy-on-write). Requests are judged against the
  state at the start of the call.

  Args:
    state: the block state.
    parent_ids: `int[n]` live sequence slots to fork from (one parent may
      have several children).
    child_ids: `int[n]` empty sequence slots to fork into.

  Returns:
    `(new_state, ok)`; `ok` is `bool[n]`, False when an id is out of range
    (int64 ones outside int32 included), the parent is empty, the child is
    live, equals its parent, or is claimed by an earlier pair of the same call.

  Raises:
    ValueError: if the arguments are not 1-D integer arrays of equal length.
  """
  parent_ids = _as_ids("parent_ids", parent_ids)
  child_ids = _as_ids("child_ids", child_ids)
  _same_length("parent_ids", parent_ids, "child_ids", child_ids)
  return _leading_rows(_fork, state, parent_ids, child_ids)


def _fork(state: BlockState, parent_ids, child_ids
          ) -> tuple[BlockState, jax.Array]:
  bs = state.block_size
  max_seqs, width = state.max_seqs, state.max_blocks_per_seq
  pid = jnp.clip(parent_ids, 0, max_seqs - 1)
  cid = jnp.clip(child_ids, 0, max_seqs - 1)
  length = state.seq_lens[pid]
  ok = ((parent_ids >= 0) & (parent_ids < max_seqs) & (child_ids >= 0)
        & (child_ids < max_seqs) & (length > 0) & (state.seq_lens[cid] == 0)
        & (parent_ids != child_ids) & _first_occurrence(child_ids))
  rows = state.block_tables[pid]
  cols = jnp.arange(width, dtype=jnp.int32)
  owned = ok[:, None] & (cols[None, :] < _cdiv(length, bs)[:, None])
  if state.window is not None:  # a reclaimed entry holds no reference
    owned &= rows >= 0
  refs = _scatter_add(state.refcounts, rows, owned, 1)
  write = jnp.where(ok, cid, max_seqs)
  tables = state.block_tables.at[write].set(rows, mode="drop")
  lens = state.seq_lens.at[write].set(length, mode="drop")
  return state.replace(block_tables=tables, seq_lens=lens, refcounts=refs), ok


def register(state: BlockState, seq_ids, block_cols
             ) -> tuple[BlockState, jax.Array]:
  """Marks blocks as holding hashed, immutable content (prefix caching).

  Entry `i` names logical block `block_cols[i]` of sequence `seq_ids[i]`; the
  host calls it once that block is full and its K/V are written, and records
  the physical block (`block_tables[seq, col]`) under the block's hash. From
  then on the block is read-only (`slot_mapping`), and when its last holder
  releases it, it is cached instead of emptied, until `reserve` evicts it.
  Registering an already registered block is a no-op that succeeds.

  Args:
    state: the block state.
    seq_ids: `int[k]` live sequence slots.
    block_cols: `int[k]` block-table columns.

  Returns:
    `(new_state, ok)`; `ok` is `bool[k]`, False for out-of-range ids, an empty
    slot, a column that is not a full block of that sequence
    (`(col + 1) * block_size > seq_len`), or (with a `window`) one already
    reclaimed (`NULL_BLOCK`).

  Raises:
    ValueError: if the state has no prefix caching, or the arguments are not
      1-D integer arrays of equal length.
  """
  _require_caching("register", state)
  seq_ids = _as_ids("seq_ids", seq_ids)
  block_cols = _as_ids("block_cols", block_cols)
  _same_length("seq_ids", seq_ids, "block_cols", block_cols)
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  col = jnp.clip(block_cols, 0, state.max_blocks_per_seq - 1)
  ok = ((seq_ids >= 0) & (seq_ids < state.max_seqs) & (block_cols >= 0)
        & (block_cols < state.seq_lens[sid] // state.block_size))
  block = state.block_tables[sid, col]
  if state.window is not None:  # a reclaimed entry holds no block
    ok &= block >= 0
  cacheable = state.cacheable.at[jnp.where(ok, block, state.num_blocks)].set(
      True, mode="drop")
  return state.replace(cacheable=cacheable), ok


def share(state: BlockState, seq_ids, block_ids, num_shared
          ) -> tuple[BlockState, jax.Array]:
  """Starts sequences on cached prefixes (prefix-cache hits).

  Sequence `seq_ids[i]` (an empty slot) gets blocks `block_ids[i,
  :num_shared[i]]` as its first blocks and `num_shared[i] * block_size`
  tokens, the same bookkeeping as `fork`: refcounts go up, and blocks that
  were cached leave the eviction ring (an O(1) removal each). Every block must
  be cacheable (`register`): live in another sequence or cached. A block that
  was evicted is no longer cacheable, so a stale index entry fails here
  instead of reading someone else's K/V. Requests are judged against the
  state at the start of the call; a slot may appear once per call.

  Args:
    state: the block state.
    seq_ids: `int[n]` empty sequence slots.
    block_ids: `int[n, m]` physical blocks, `m <= max_blocks_per_seq`; entries
      past `num_shared[i]` are ignored.
    num_shared: `int[n]` blocks to share, in `[1, m]`.

  Returns:
    `(new_state, ok)`; `ok` is `bool[n]`, False when an id is out of range,
    the slot is live or repeated, `num_shared` is outside `[1, m]`, or a block
    is out of range, not cacheable, or listed twice in its row.

  Raises:
    ValueError: if the state has no prefix caching, if `seq_ids`,
      `num_shared` are not 1-D integer arrays of equal length, or `block_ids` is not `[len(seq_ids), m]` with
      `m <= max_blocks_per_seq`.
  """
  _require_caching("share", state)
  seq_ids = _as_ids("seq_ids", seq_ids)
  num_shared = _as_ids("num_shared", num_shared)
  block_ids = _as_ids("block_ids", block_ids, ndim=2)
  _same_length("seq_ids", seq_ids, "num_shared", num_shared)
  n, m = block_ids.shape
  if n != seq_ids.shape[0] or m > state.max_blocks_per_seq:
    raise ValueError(
        f"block_ids must have shape [len(seq_ids)={seq_ids.shape[0]}, m] with "
        f"m <= max_blocks_per_seq={state.max_blocks_per_seq}, got "
        f"{block_ids.shape}")
  return _leading_rows(_share, state, seq_ids, block_ids, num_shared)


def _share(state: BlockState, seq_ids, block_ids, num_shared
           ) -> tuple[BlockState, jax.Array]:
  n, m = block_ids.shape
  num_blocks, max_seqs, width = (state.num_blocks, state.max_seqs,
                                 state.max_blocks_per_seq)
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  cols = jnp.arange(m, dtype=jnp.int32)
  inside = cols[None, :] < num_shared[:, None]
  safe = jnp.clip(block_ids, 0, num_blocks - 1)
  good = (block_ids >= 0) & (block_ids < num_blocks) & state.cacheable[safe]
  ranked = jnp.sort(jnp.where(inside, block_ids, NULL_BLOCK), axis=1)
  repeated = jnp.any((ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0),
                     axis=1) if m > 1 else jnp.zeros((n,), bool)
  ok = ((seq_ids >= 0) & (seq_ids < max_seqs) & (state.seq_lens[sid] == 0)
        & (num_shared >= 1) & (num_shared <= m) & _first_occurrence(seq_ids)
        & jnp.all(good | ~inside, axis=1) & ~repeated)
  owned = ok[:, None] & inside
  refs = _scatter_add(state.refcounts, block_ids, owned, 1)
  # Cached blocks leave the ring: a tombstone at their slot, counted once each
  # even when several rows share them (sort, first of each run).
  flat = jnp.sort(jnp.where(owned, block_ids, num_blocks).reshape(-1))
  fresh = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]])
  fsafe = jnp.clip(flat, 0, num_blocks - 1)
  slot = state.lru_pos[fsafe]
  leaving = fresh & (flat < num_blocks) & (slot >= 0)
  size = state.lru.shape[0]
  lru = state.lru.at[jnp.where(leaving, slot, size)].set(NULL_BLOCK,
                                                          mode="drop")
  lru_pos = state.lru_pos.at[jnp.where(leaving, flat, num_blocks)].set(
      -1, mode="drop")
  num_cached = state.num_cached - jnp.sum(leaving, dtype=jnp.int32)
  row = jnp.full((n, width), NULL_BLOCK, jnp.int32).at[:, :m].set(
      jnp.where(inside, block_ids, NULL_BLOCK))
  write = jnp.where(ok, sid, max_seqs)
  tables = state.block_tables.at[write].set(row, mode="drop")
  lens = state.seq_lens.at[write].set(num_shared * state.block_size,
                                      mode="drop")
  return state.replace(
      block_tables=tables, seq_lens=lens, refcounts=refs, lru=lru,
      lru_pos=lru_pos, num_cached=num_cached,
      lru_len=jnp.where(num_cached == 0, 0, state.lru_len)), ok


def cached_blocks(state: BlockState) -> list[int]:
  """Host side: the cached blocks in eviction order (next evicted first);
  `[]` without prefix caching."""
  if not state.prefix_caching:
    return []
  size = state.lru.shape[0]
  head, length = int(state.lru_head), int(state.lru_len)
  ring = np.asarray(state.lru)
  ent = ring[(head + np.arange(length, dtype=np.int64)) % size]
  return ent[ent >= 0].tolist()


def slot_mapping(state: BlockState, seq_ids, positions) -> jax.Array:
  """Flat cache slots (`block * block_size + offset`) for writing new tokens.

  Writes into shared blocks are impossible by construction: a position whose
  block has refcount > 1 or is cacheable (registered content is immutable)
  maps to -1, and so does a position outside
  `[0, seq_lens[seq])` or an out-of-range id (int64 values outside int32
  included). `kv_cache.write_kv` drops -1 slots. After `reserve` (and its
  copy-on-write), every newly reserved position maps to an exclusively owned
  block. Slots fit int32: `init` bounds `num_blocks * block_size`.

  Args:
    state: the block state.
    seq_ids: `int[T]` sequence slot of each token.
    positions: `int[T]` token position within its sequence.

  Returns:
    `i32[T]` flat slots, -1 where the token must not be written.

  Raises:
    ValueError: if the arguments are not 1-D integer arrays of equal length.
  """
  seq_ids = _as_ids("seq_ids", seq_ids)
  positions = _as_ids("positions", positions)
  _same_length("seq_ids", seq_ids, "positions", positions)
  bs = state.block_size
  valid = (seq_ids >= 0) & (seq_ids < state.max_seqs)
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  valid &= (positions >= 0) & (positions < state.seq_lens[sid])
  col = jnp.clip(positions // bs, 0, state.max_blocks_per_seq - 1)
  block = state.block_tables[sid, col]
  safe = jnp.clip(block, 0, state.num_blocks - 1)
  valid &= (block >= 0) & (state.refcounts[safe] == 1)
  if state.prefix_caching:
    valid &= ~state.cacheable[safe]
  return jnp.where(valid, block * bs + positions % bs, -1)


def gather_tables(state: BlockState, seq_ids) -> tuple[jax.Array, jax.Array]:
  """Block tables and lengths of `seq_ids`, in the form attention takes.

  Args:
    state: the block state.
    seq_ids: `int[n]`; out-of-range ids (e.g. -1 for padding, or int64 ids
      outside int32) give an all-`NULL_BLOCK` row and length 0.

  Returns:
    `(block_tables i32[n, max_blocks_per_seq], kv_lens i32[n])`.

  Raises:
    ValueError: if `seq_ids` is not a 1-D integer array.
  """
  seq_ids = _as_ids("seq_ids", seq_ids)
  valid = (seq_ids >= 0) & (seq_ids < state.max_seqs)
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  tables = jnp.where(valid[:, None], state.block_tables[sid], NULL_BLOCK)
  lens = jnp.where(valid, state.seq_lens[sid], 0)
  return tables, lens


def usage(state: BlockState) -> dict:
  """Host-side usage figures for monitoring.

  Returns:
    `{"blocks_used", "blocks_total", "fraction", "live_seqs", "tokens"}`, where
    `fraction` is `blocks_used / blocks_total` and `tokens` sums `seq_lens` in
    int64 (forked sequences share blocks, so it may pass 2**31).
  """
  used = int(state.num_used)
  lens = np.asarray(state.seq_lens, np.int64)
  return {
      "blocks_used": used,
      "blocks_total": state.num_blocks,
      "fraction": used / state.num_blocks,
      "live_seqs": int(np.sum(lens > 0)),
      "tokens": int(np.sum(lens)),
  }


def reclaimable_columns(window: int | None, lens, block_size: int):
  """Leading block-table columns that no query at a position `>= lens` can
  see with a sliding window of `window` tokens (0 without one). A query at
  `p` sees keys `p - window + 1 .. p`, so column `j` is invisible once
  `(j + 1) * block_size <= lens - window + 1`. The one rule: the engine's
  reclamation (`paged_jax.window_reclaim`), its host model and
  `paged_jax.block_groups` use it. Works on Python ints, NumPy and JAX
  arrays alike."""
  if window is None:
    return lens * 0
  d = lens - window + 1
  return (d + abs(d)) // 2 // block_size  # max(d, 0) for ints and arrays


def check_invariants(state: BlockState) -> None:
  """Checks the pool's bookkeeping on the host (tests and debugging).

  Checked: every block is exactly one of free, cached or referenced; refcounts
  equal the number of table references; no block
  appears twice in one row or twice in the free list; each row holds exactly
  `ceil(seq_len / block_size)` blocks followed by `NULL_BLOCK` (with a
  `window`, after a `NULL_BLOCK` prefix of at most `reclaimable_columns`
  columns); lengths lie
  within the table's capacity; every array is int32 with the pool's shapes.
  With prefix caching, the cached set: each cached block has refcount 0, is cacheable and sits at
  its `lru_pos` slot inside the ring's window; the window holds no other
  entry (no stale id of a reused block); empty blocks are not cacheable; no
  sequence's partial last block is cacheable; free + cached + used =
  `num_blocks`.

  Data shards' states stacked on leading axes are checked shard by shard.

  Raises:
    AssertionError: naming the broken invariant (and the shard).
  """
  if state.block_tables.ndim > 2:
    for shard in np.ndindex(state.block_tables.shape[:-2]):
      try:
        check_invariants(jax.tree.map(lambda x, i=shard: x[i], state))
      except AssertionError as e:
        raise AssertionError(f"data shard {shard}: {e}") from None
    return
  cache_fields = ("cacheable", "lru", "lru_pos", "lru_head", "lru_len",
                  "num_cached")
  absent = [f for f in cache_fields if getattr(state, f) is None]
  assert len(absent) in (0, len(cache_fields)), (
      f"prefix-caching fields {absent} are None but the others are not")
  for name in ("block_tables", "seq_lens", "refcounts", "free_stack",
               "num_free") + (cache_fields[1:] if state.prefix_caching else ()):
    dtype = getattr(state, name).dtype
    assert dtype == jnp.int32, f"{name} has dtype {dtype}, expected int32"
  assert state.free_stack.shape == state.refcounts.shape, (
      f"free_stack {state.free_stack.shape} != refcounts "
      f"{state.refcounts.shape}")
  assert state.seq_lens.shape == state.block_tables.shape[:1], (
      f"seq_lens {state.seq_lens.shape} != {state.block_tables.shape[:1]}")
  tables = np.asarray(state.block_tables)
  lens = np.asarray(state.seq_lens)
  refs = np.asarray(state.refcounts)
  num_free = int(state.num_free)
  free = np.asarray(state.free_stack)[:num_free]
  n, bs = state.num_blocks, state.block_size
  assert 0 <= num_free <= n, f"num_free={num_free} outside [0, {n}]"
  assert np.all((lens >= 0) & (lens <= state.max_seq_len)), (
      f"seq_lens outside [0, {state.max_seq_len}]: {lens}")
  need = -(-lens.astype(np.int64) // bs)
  counts = np.zeros(n, np.int64)
  for s, row in enumerate(tables):
    used, rest = row[:need[s]], row[need[s]:]
    if state.window is not None:  # a reclaimed prefix: at most what is invisible
      limit = reclaimable_columns(state.window, int(lens[s]), bs)
      prefix = int(np.argmax(used >= 0)) if np.any(used >= 0) else len(used)
      assert prefix <= limit, (
          f"slot {s}: {prefix} leading NULL_BLOCK columns, but only {limit} "
          f"are invisible to window {state.window} at seq_len {lens[s]}: {row}")
      used = used[prefix:]
    assert np.all(rest == NULL_BLOCK), (
        f"slot {s}: entries past its {need[s]} blocks are not NULL_BLOCK: {row}")
    assert np.all((used >= 0) & (used < n)), f"slot {s}: bad block ids {used}"
    assert len(set(used.tolist())) == len(used), f"slot {s}: repeated block {used}"
    np.add.at(counts, used, 1)
  assert np.array_equal(counts, refs), (
      f"refcounts != table references at blocks "
      f"{np.nonzero(counts != refs)[0].tolist()}")
  assert len(set(free.tolist())) == num_free, "a block is twice in the free list"
  assert np.all((free >= 0) & (free < n)), f"bad ids in the free list: {free}"
  assert np.all(refs[free] == 0), (
      f"blocks both free and referenced: {free[refs[free] != 0].tolist()}")
  num_cached = 0
  if state.prefix_caching:
    num_cached = int(state.num_cached)
    _check_cache_invariants(state, tables, lens, refs, free)
  used = int(np.sum(refs > 0))
  assert used + num_cached + num_free == n, (
      f"free ({num_free}) + cached ({num_cached}) + used ({used}) != "
      f"num_blocks ({n})")


def _check_cache_invariants(state, tables, lens, refs, free):
  """The cached set and its ring (see `check_invariants`)."""
  n, bs = state.num_blocks, state.block_size
  assert state.cacheable.dtype == bool, (
      f"cacheable has dtype {state.cacheable.dtype}, expected bool")
  assert state.lru.shape == (2 * n,) and state.lru_pos.shape == (n,), (
      f"lru {state.lru.shape} / lru_pos {state.lru_pos.shape}, expected "
      f"({2 * n},) / ({n},)")
  cacheable = np.asarray(state.cacheable)
  pos = np.asarray(state.lru_pos)
  ring = np.asarray(state.lru)
  size, head, length = 2 * n, int(state.lru_head), int(state.lru_len)
  num_cached = int(state.num_cached)
  assert 0 <= head < size and 0 <= length <= size, (
      f"ring head={head}, len={length} outside [0, {size})")
  window = (head + np.arange(length, dtype=np.int64)) % size
  cached = np.nonzero(pos >= 0)[0]
  assert len(cached) == num_cached, (
      f"num_cached={num_cached} but {len(cached)} blocks have a ring slot")
  assert np.all(refs[cached] == 0), (
      f"blocks both cached and referenced: {cached[refs[cached] != 0].tolist()}")
  assert np.all(cacheable[cached]), (
      f"cached blocks that are not cacheable: "
      f"{cached[~cacheable[cached]].tolist()}")
  assert not np.any(cacheable[free]), (
      f"empty blocks still marked cacheable: {free[cacheable[free]].tolist()}")
  assert not set(free.tolist()) & set(cached.tolist()), (
      f"blocks both free and cached: {sorted(set(free) & set(cached))}")
  in_window = set(window.tolist())
  for b in cached.tolist():
    assert int(pos[b]) in in_window and ring[pos[b]] == b, (
        f"cached block {b}: ring slot {pos[b]} holds {ring[pos[b]]} or lies "
        f"outside the ring's window")
  ent = ring[window]
  assert np.sum(ent >= 0) == num_cached, (
      f"ring window holds {int(np.sum(ent >= 0))} entries (stale ones?), "
      f"expected num_cached={num_cached}")
  for s, row in enumerate(tables):  # registered content is full everywhere
    tail = row[lens[s] // bs:-(-lens[s] // bs)]
    assert not np.any(cacheable[tail]), (
        f"slot {s}: cacheable block {tail.tolist()} is its partial last block")
