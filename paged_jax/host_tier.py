"""A host-memory tier of KV blocks: swap sequences out of the device pool and back.

The tier is a second block pool, in host memory (`paged_jax.kv_offload` holds
its pages and copies them), with its own pure-functional state (`HostTier`, a
pytree, the same conventions as `block_manager.BlockState`):

* `tables` `i32[max_seqs, max_blocks_per_seq]`: logical block `j` of a
  swapped-out sequence slot `s` lives in host block `tables[s, j]`;
  `NULL_BLOCK` past its last block and in every row that is not swapped out.
* `seq_lens` `i32[max_seqs]`: tokens of each swapped-out sequence (0: none).
* `free_stack` `i32[num_host_blocks]`, `num_free` `i32[]`: the empty host
  blocks, `free_stack[:num_free]`; allocation pops from the top.

Sequence slots are the device state's: a sequence swapped out of slot `s`
leaves the device row empty and fills the tier's row `s`, and comes back into
the same slot. While it is out the slot must stay unused on the device: a
`swap_in` onto a live device slot fails (as a value). The scheduler keeps
the slot reserved, exactly as it keeps a preempted request's slot id.

Shared blocks. Host blocks are never shared: every block of a swapped-out
sequence gets its own host block, including the blocks it shares on the
device with a fork or with the prefix cache (refcount > 1, or cacheable).
`swap_out` is then `block_manager.release` of the device row plus copies, so
a shared block simply loses one reference and stays with its other holders,
a cacheable block whose count reaches zero is cached (still a prefix-cache
hit for others, evictable), and only blocks that nobody else holds are
emptied. `swap_in` is `block_manager.reserve` of the whole length on the
empty slot: fresh, exclusively owned blocks, no copy-on-write pending. Why
copy shared blocks instead of leaving them on the device under the swapped
sequence's reference: (1) the device frees exactly the same blocks either way
(a shared block cannot be freed while another sequence holds it); (2) a row
with holes (some entries on the device, some on the host) breaks the
manager's invariant that a live row is `ceil(seq_len / block_size)` blocks,
which every operation and backend relies on, and keeping references from an
empty slot would hide blocks from `check_invariants`' accounting; (3) a
device reference held for a swapped sequence pins blocks that the prefix
cache could otherwise evict, which is the memory that preemption is trying to
win back. The cost is host bytes and copy bandwidth for the shared blocks
(host memory is the larger one, 4-10x), and after `swap_in` the sequence no
longer shares them (more device blocks than before the swap). A caller that
knows a prefix is still cached on the device can instead `share` it and swap
in only the rest (the second-level prefix cache's job; not built here).

Every operation is pure and jittable, `O(batch x max_blocks_per_seq)` (plus
what `release` / `reserve` cost), and atomic per sequence: a sequence that
does not fit is not moved at all (`ok` False, its rows and both pools exactly
as they were). Requests are served in the order given; a slot may appear
once per call.

Example:
  >>> state = bm.init(num_blocks=8, block_size=4, max_seqs=2,
  ...                 max_blocks_per_seq=4)
  >>> tier = init(state, num_host_blocks=16)
  >>> state, res = bm.reserve(state, jnp.array([0]), jnp.array([6]))
  >>> state, tier, out = swap_out(state, tier, jnp.array([0]))
  >>> bool(out.ok[0]), int(state.num_free), int(tier.num_free)
  (True, 8, 14)
  >>> out.src[0, :2].tolist(), out.dst[0, :2].tolist()  # device -> host
  ([0, 1], [0, 1])
  >>> state, tier, back = swap_in(state, tier, jnp.array([0]))
  >>> bool(back.ok[0]), int(state.seq_lens[0]), int(tier.num_free)
  (True, 6, 16)
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _int32
from paged_jax import block_manager as bm
from paged_jax.block_manager import NULL_BLOCK

_as_ids = bm._as_ids  # pylint: disable=protected-access
_cdiv = bm._cdiv  # pylint: disable=protected-access
_first_occurrence = bm._first_occurrence  # pylint: disable=protected-access


@flax.struct.dataclass
class HostTier:
  """The host pool's state (a pytree; sizes are static or read from shapes).

  Attributes:
    tables: `i32[max_seqs, max_blocks_per_seq]` host block of each logical
      block of a swapped-out slot, `NULL_BLOCK` where unused.
    seq_lens: `i32[max_seqs]` tokens of each swapped-out slot, 0 if none.
    free_stack: `i32[num_host_blocks]`; `free_stack[:num_free]` are empty.
    num_free: `i32[]` empty host blocks.
    block_size: tokens per block (static), the device pool's.
  """

  tables: jax.Array
  seq_lens: jax.Array
  free_stack: jax.Array
  num_free: jax.Array
  block_size: int = flax.struct.field(pytree_node=False)

  @property
  def num_blocks(self) -> int:
    return self.free_stack.shape[0]

  @property
  def max_seqs(self) -> int:
    return self.tables.shape[0]

  @property
  def max_blocks_per_seq(self) -> int:
    return self.tables.shape[1]

  @property
  def num_used(self) -> jax.Array:
    """`i32[]` host blocks holding a swapped-out sequence's K/V."""
    return self.num_blocks - self.num_free


@flax.struct.dataclass
class Swap:
  """Result of `swap_out` / `swap_in`, one row per requested sequence.

  Attributes:
    ok: `bool[n]` whether the sequence moved (all of it).
    src: `i32[n, max_blocks_per_seq]` blocks to copy from (device blocks for
      `swap_out`, host blocks for `swap_in`), `NULL_BLOCK` past the
      sequence's blocks and in failed rows.
    dst: `i32[n, max_blocks_per_seq]` blocks to copy to, paired with `src`.
    evicted: `swap_in` with prefix caching: `i32[n, max_blocks_per_seq]` the
      cached device blocks the allocation evicted (drop them from the prefix
      index, as `Reservation.evicted`); None otherwise.
  """

  ok: jax.Array
  src: jax.Array
  dst: jax.Array
  evicted: jax.Array | None = None


def init(state: bm.BlockState, *, num_host_blocks: int) -> HostTier:
  """An empty host tier for the device pool `state` (its slots, table width
  and block size).

  Args:
    state: the device pool's `BlockState` (one data shard's: not stacked).
    num_host_blocks: blocks in host memory.

  Returns:
    A `HostTier` with every host block free; blocks go out lowest id first.

  Raises:
    ValueError: if `num_host_blocks` is not a positive int, the host pool's
      flat slots (`num_host_blocks * block_size`) would not fit int32, or
      `state` is stacked (data shards).
  """
  n = _int32.positive_int("num_host_blocks", num_host_blocks)
  _int32.check_fits("host cache slots", num_host_blocks=n,
                    block_size=state.block_size)
  if state.block_tables.ndim != 2:
    raise ValueError(f"init takes one pool's state, got block_tables of shape "
                     f"{state.block_tables.shape} (stacked data shards)")
  return HostTier(
      tables=jnp.full(state.block_tables.shape, NULL_BLOCK, jnp.int32),
      seq_lens=jnp.zeros((state.max_seqs,), jnp.int32),
      free_stack=jnp.arange(n - 1, -1, -1, dtype=jnp.int32),
      num_free=jnp.asarray(n, jnp.int32),
      block_size=state.block_size)


def _check_pair(state: bm.BlockState, tier: HostTier):
  if (tier.tables.shape != state.block_tables.shape
      or tier.block_size != state.block_size):
    raise ValueError(
        f"the host tier (tables {tier.tables.shape}, block_size="
        f"{tier.block_size}) must match the device state (block_tables "
        f"{state.block_tables.shape}, block_size={state.block_size})")


def _empty(state, n_width, caching):
  none = jnp.zeros((0, n_width), jnp.int32)
  return Swap(ok=jnp.zeros((0,), bool), src=none, dst=none,
              evicted=none if caching else None)


def swap_out(state: bm.BlockState, tier: HostTier, seq_ids
             ) -> tuple[bm.BlockState, HostTier, Swap]:
  """Moves whole sequences from the device pool to the host tier.

  Each listed live sequence gets `ceil(seq_len / block_size)` host blocks
  (served in order; a sequence that does not fit is left where it was), its
  device row is released (`block_manager.release`: shared blocks stay with
  their other holders, cacheable ones are cached) and its tier row filled.
  Copy `src -> dst` (`kv_offload.copy_to_host`) before the released device
  blocks are written again, i.e. in the same step or before the next one's
  K/V writes (the copies are dispatched first, so stream order suffices).

  Args:
    state: the device pool.
    tier: the host tier of that pool.
    seq_ids: `int[n]` live device slots (any integer dtype).

  Returns:
    `(state, tier, Swap)`; `Swap.src` are device blocks, `Swap.dst` host
    blocks. `ok` is False for out-of-range ids, empty slots, slots already
    swapped out, repeats, and sequences the host pool cannot hold.

  Raises:
    ValueError: if `seq_ids` is not a 1-D integer array, or the tier does not
      match the state.
  """
  _check_pair(state, tier)
  seq_ids = _as_ids("seq_ids", seq_ids)
  n, width = seq_ids.shape[0], state.max_blocks_per_seq
  if n == 0:
    return state, tier, _empty(state, width, False)
  max_seqs, nh = state.max_seqs, tier.num_blocks
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  length = state.seq_lens[sid]
  need = _cdiv(length, state.block_size)
  valid = ((seq_ids >= 0) & (seq_ids < max_seqs) & (length > 0)
           & (tier.seq_lens[sid] == 0) & _first_occurrence(seq_ids))

  def step(num_free, i):  # in order: a later, smaller request may still fit
    ok = valid[i] & (need[i] <= num_free)
    return num_free - jnp.where(ok, need[i], 0), ok

  num_left, ok = jax.lax.scan(step, tier.num_free,
                              jnp.arange(n, dtype=jnp.int32))
  granted = jnp.where(ok, need, 0)
  offset = jnp.cumsum(granted) - granted
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  taking = ok[:, None] & (cols < need[:, None])
  pos = tier.num_free - 1 - offset[:, None] - cols
  dst = jnp.where(taking, tier.free_stack[jnp.clip(pos, 0, nh - 1)],
                  NULL_BLOCK)
  src = jnp.where(taking, state.block_tables[sid], NULL_BLOCK)
  write = jnp.where(ok, sid, max_seqs)
  tier = tier.replace(
      tables=tier.tables.at[write].set(dst, mode="drop"),
      seq_lens=tier.seq_lens.at[write].set(length, mode="drop"),
      num_free=num_left)
  state, _ = bm.release(state, jnp.where(ok, seq_ids, -1))
  return state, tier, Swap(ok=ok, src=src, dst=dst)


def swap_in(state: bm.BlockState, tier: HostTier, seq_ids
            ) -> tuple[bm.BlockState, HostTier, Swap]:
  """Moves swapped-out sequences back into the device pool, same slots.

  Each listed sequence reserves its whole length on its (empty) device slot
  (`block_manager.reserve`: empty blocks first, then cached ones evicted;
  served in order, all or nothing) and gives its host blocks back to the
  tier. Copy `src -> dst` (`kv_offload.copy_to_device`) before the step that
  reads the sequence.

  Args:
    state: the device pool.
    tier: the host tier of that pool.
    seq_ids: `int[n]` swapped-out slots (any integer dtype).

  Returns:
    `(state, tier, Swap)`; `Swap.src` are host blocks, `Swap.dst` device
    blocks, `Swap.evicted` as `Reservation.evicted` (prefix caching). `ok` is
    False for out-of-range ids, slots not swapped out, slots live on the
    device, repeats, and sequences the device pool cannot hold.

  Raises:
    ValueError: if `seq_ids` is not a 1-D integer array, or the tier does not
      match the state.
  """
  _check_pair(state, tier)
  seq_ids = _as_ids("seq_ids", seq_ids)
  n, width = seq_ids.shape[0], state.max_blocks_per_seq
  if n == 0:
    return state, tier, _empty(state, width, state.prefix_caching)
  max_seqs = state.max_seqs
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  length = tier.seq_lens[sid]
  pre = ((seq_ids >= 0) & (seq_ids < max_seqs) & (length > 0)
         & (state.seq_lens[sid] == 0) & _first_occurrence(seq_ids))
  state, res = bm.reserve(state, jnp.where(pre, seq_ids, -1),
                          jnp.where(pre, length, 0))
  ok = pre & res.ok
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  taking = ok[:, None] & (cols < _cdiv(length, state.block_size)[:, None])
  src = jnp.where(taking, tier.tables[sid], NULL_BLOCK)
  dst = jnp.where(taking, state.block_tables[sid], NULL_BLOCK)
  tier = _give_back(tier, sid, ok, src, taking)
  return state, tier, Swap(ok=ok, src=src, dst=dst, evicted=res.evicted)


def _give_back(tier: HostTier, sid, ok, blocks, taking) -> HostTier:
  """Empties the tier rows `sid` where `ok`, pushing their host `blocks`
  (`taking` marks them; host blocks are never shared) onto the free stack."""
  flat, keep = blocks.reshape(-1), taking.reshape(-1)
  pos = tier.num_free + jnp.cumsum(keep, dtype=jnp.int32) - 1
  stack = tier.free_stack.at[jnp.where(keep, pos, tier.num_blocks)].set(
      flat, mode="drop")
  write = jnp.where(ok, sid, tier.max_seqs)
  return tier.replace(
      tables=tier.tables.at[write].set(NULL_BLOCK, mode="drop"),
      seq_lens=tier.seq_lens.at[write].set(0, mode="drop"),
      free_stack=stack,
      num_free=tier.num_free + jnp.sum(keep, dtype=jnp.int32))


def drop(tier: HostTier, seq_ids) -> tuple[HostTier, jax.Array]:
  """Forgets swapped-out sequences (an aborted or finished request): their
  host blocks go back to the tier's free stack, nothing is copied.

  Args:
    tier: the host tier.
    seq_ids: `int[n]` swapped-out slots.

  Returns:
    `(tier, ok)`; `ok` is `bool[n]`, False for out-of-range ids, slots not
    swapped out and repeats.

  Raises:
    ValueError: if `seq_ids` is not a 1-D integer array.
  """
  seq_ids = _as_ids("seq_ids", seq_ids)
  sid = jnp.clip(seq_ids, 0, tier.max_seqs - 1)
  length = tier.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < tier.max_seqs) & (length > 0)
        & _first_occurrence(seq_ids))
  cols = jnp.arange(tier.max_blocks_per_seq, dtype=jnp.int32)[None, :]
  taking = ok[:, None] & (cols < _cdiv(length, tier.block_size)[:, None])
  return _give_back(tier, sid, ok, tier.tables[sid], taking), ok


def pack_pairs(src, dst) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Flattens copy pairs and puts the real ones first, in their order.

  Args:
    src: `int[...]` source blocks (`Swap.src`), `NULL_BLOCK` for no copy.
    dst: `int[...]` destination blocks, same shape.

  Returns:
    `(src i32[k], dst i32[k], count i32[])`, `k = src.size`: the `count`
    pairs with both ids >= 0 first, `NULL_BLOCK` after. A caller copies a
    prefix `[:m]` with `m >= count` (a bucket) instead of every entry.
  """
  src = _as_ids("src", jnp.reshape(jnp.asarray(src), (-1,)))
  dst = _as_ids("dst", jnp.reshape(jnp.asarray(dst), (-1,)))
  real = (src >= 0) & (dst >= 0)
  order = jnp.argsort(~real, stable=True)
  return (jnp.where(real[order], src[order], NULL_BLOCK),
          jnp.where(real[order], dst[order], NULL_BLOCK),
          jnp.sum(real, dtype=jnp.int32))


def usage(tier: HostTier) -> dict:
  """Host-side figures: `{"blocks_used", "blocks_total", "swapped_seqs",
  "tokens"}` (`tokens` in int64)."""
  lens = np.asarray(tier.seq_lens, np.int64)
  return {"blocks_used": int(tier.num_used), "blocks_total": tier.num_blocks,
          "swapped_seqs": int(np.sum(lens > 0)), "tokens": int(np.sum(lens))}


def check_invariants(tier: HostTier, state: bm.BlockState | None = None
                     ) -> None:
  """Checks the tier's bookkeeping on the host (tests and debugging).

  Checked: int32 arrays of consistent shapes; each row holds exactly
  `ceil(seq_len / block_size)` host blocks then `NULL_BLOCK`; no host block
  is in two rows, twice in a row, or both in a row and free; used + free =
  `num_host_blocks`. With `state`: the tier matches its shapes and block
  size, no slot is live on the device and swapped out at once, and the
  device pool's own invariants hold (`block_manager.check_invariants`).

  Raises:
    AssertionError: naming the broken invariant.
  """
  for name in ("tables", "seq_lens", "free_stack", "num_free"):
    dtype = getattr(tier, name).dtype
    assert dtype == jnp.int32, f"{name} has dtype {dtype}, expected int32"
  assert tier.seq_lens.shape == tier.tables.shape[:1], (
      f"seq_lens {tier.seq_lens.shape} != {tier.tables.shape[:1]}")
  tables, lens = np.asarray(tier.tables), np.asarray(tier.seq_lens)
  nh, bs, num_free = tier.num_blocks, tier.block_size, int(tier.num_free)
  assert 0 <= num_free <= nh, f"num_free={num_free} outside [0, {nh}]"
  cap = tier.max_blocks_per_seq * bs
  assert np.all((lens >= 0) & (lens <= cap)), f"seq_lens outside [0, {cap}]"
  need = -(-lens.astype(np.int64) // bs)
  held = []
  for s, row in enumerate(tables):
    used, rest = row[:need[s]], row[need[s]:]
    assert np.all(rest == NULL_BLOCK), (
        f"slot {s}: entries past its {need[s]} host blocks are not "
        f"NULL_BLOCK: {row}")
    assert np.all((used >= 0) & (used < nh)), f"slot {s}: bad host ids {used}"
    held += used.tolist()
  free = np.asarray(tier.free_stack)[:num_free].tolist()
  assert len(set(held)) == len(held), "a host block is held twice"
  assert len(set(free)) == len(free), "a host block is twice in the free list"
  assert all(0 <= b < nh for b in free), f"bad ids in the free list: {free}"
  assert not set(held) & set(free), (
      f"host blocks both held and free: {sorted(set(held) & set(free))}")
  assert len(held) + num_free == nh, (
      f"held ({len(held)}) + free ({num_free}) != num_host_blocks ({nh})")
  if state is not None:
    _check_pair(state, tier)
    both = np.nonzero((lens > 0) & (np.asarray(state.seq_lens) > 0))[0]
    assert both.size == 0, f"slots live on the device and swapped out: {both}"
    bm.check_invariants(state)
