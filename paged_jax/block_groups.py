"""Per-layer-group block tables over one pool: hybrid local/global attention.

Layers with the same attention pattern form a *group* (Gemma 2: the local
layers and the global layers; Gemma 3: likewise, 5 local layers to each
global one; Mistral: one local group). Each group has its own block table;
all groups draw from one pool of physical blocks (one free stack, one
refcount per block), so memory a local group gives back serves any group. A
group's `window` is None (global: it keeps every block of a sequence) or a
sliding window of `w` tokens (local): once no future query of a sequence can
see a block, the group gives it back and its table entry becomes
`NULL_BLOCK`, which every attention backend skips (`pallas_kernels.contract`:
a `NULL_BLOCK` inside `kv_len` contributes no tokens and is never read).

When is a block invisible? A query at position `p` of a local layer sees keys
`p - w + 1 .. p`. The next query of a sequence of `L` tokens is at `L` or
later, so column `j` (tokens `j * bs .. (j + 1) * bs - 1`) is invisible to
every future query once `(j + 1) * bs <= L - w + 1`: `reclaimable(L)` =
`max(L - w + 1, 0) // bs` leading columns. After `reclaim` a sequence holds
the columns covering `L - w + 1 .. L - 1`, and within a decode step (after
`reserve` reclaimed and added token `L`) those covering `L - w + 1 .. L`: at
most `ceil((w - 1) / bs) + 1 <= ceil(w / bs) + 1` blocks per local group,
whatever its length (`hybrid_capacity` plans with this).

* `reserve` first reclaims, in local groups, the blocks that the step's
  first new token (at the old length) cannot see, then grows every group by
  the same number of tokens. The decision is joint: requests are served in
  order, and a sequence gets its blocks in every group or in none (its
  groups' tables, length and copy-on-write untouched), the pool counted once
  for all groups. A prefill chunk still gets a block for every new token
  (the step writes them, and its own queries read them); `reclaim` after the
  step gives back what the chunk's end can no longer see.
* `release`, `truncate` (refused below what a local group already gave
  back), `fork` (copy-on-write per group: a group copies its shared
  partial last block the first time either holder grows, as
  `block_manager.reserve` does) and `reclaim`; `slot_mapping` and
  `gather_tables` per group (`view`).
* `check_invariants` (host side) for the grouped state.

Everything is one pytree (`GroupedBlockState`), every op pure, jittable and
O(batch x max_blocks_per_seq x groups), and the per-group work runs
`block_manager`'s own functions on a per-group `BlockState` view that shares
the pool's arrays. Prefix caching with groups is not implemented (a hit
would need the full prefix in global groups and the last window in local
ones); `init` has no `prefix_caching` flag, and the views are plain states.

Memory: the pool's block ids are shared by the groups, so reclamation saves
memory only if a block of group `g` stores group `g`'s layers alone (the
cache laid out per group, as vLLM's hybrid allocator does); with one
`KVCache` holding every layer's pages at every block id, a block given back
by a local group is just another block id for any group. Laying the cache
out per group is the engine's part (not here).

Example:
  >>> state = init(num_blocks=16, block_size=4, max_seqs=2,
  ...              max_blocks_per_seq=8, windows=(None, 5))
  >>> state, ok = reserve(state, jnp.array([0]), jnp.array([20]))  # 5 blocks each
  >>> int(state.num_free)
  6
  >>> state, ok = reclaim(state, jnp.array([0]))  # local: keeps tokens 16..19
  >>> int(state.num_free), state.block_tables[1, 0, :5].tolist()
  (10, [-1, -1, -1, -1, 9])
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm

NULL_BLOCK = bm.NULL_BLOCK


@flax.struct.dataclass
class GroupedBlockState:
  """The grouped manager's whole state (a pytree; sizes are static).

  Attributes:
    block_tables: `i32[num_groups, max_seqs, max_blocks_per_seq]`; a local
      group's reclaimed columns (a prefix of each row) hold `NULL_BLOCK`.
    seq_lens: `i32[max_seqs]` token slots per sequence (every group the same).
    refcounts: `i32[num_blocks]` table references per block, all groups.
    free_stack: `i32[num_blocks]`; `free_stack[:num_free]` are empty blocks.
    num_free: `i32[]`.
    block_size: tokens per block (static).
    windows: per group, None (global) or the sliding window in tokens
      (static).
  """

  block_tables: jax.Array
  seq_lens: jax.Array
  refcounts: jax.Array
  free_stack: jax.Array
  num_free: jax.Array
  block_size: int = flax.struct.field(pytree_node=False)
  windows: tuple = flax.struct.field(pytree_node=False)

  @property
  def num_groups(self) -> int:
    return len(self.windows)

  @property
  def num_blocks(self) -> int:
    return self.refcounts.shape[-1]

  @property
  def max_seqs(self) -> int:
    return self.block_tables.shape[-2]

  @property
  def max_blocks_per_seq(self) -> int:
    return self.block_tables.shape[-1]


def init(*, num_blocks: int, block_size: int, max_seqs: int,
         max_blocks_per_seq: int, windows) -> GroupedBlockState:
  """An empty pool shared by `len(windows)` groups.

  Args:
    num_blocks, block_size, max_seqs, max_blocks_per_seq: as
      `block_manager.init` (checked by it).
    windows: a non-empty sequence, per group None (global attention) or a
      positive int window (local).

  Raises:
    ValueError: as `block_manager.init`, or for an empty `windows` or a
      window that is not None or a positive int.
  """
  windows = tuple(windows)
  if not windows or not all(
      w is None or (isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                    and w > 0) for w in windows):
    raise ValueError(f"windows must be a non-empty sequence of None or "
                     f"positive ints, got {windows!r}")
  base = bm.init(num_blocks=num_blocks, block_size=block_size,
                 max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
  return GroupedBlockState(
      block_tables=jnp.full((len(windows),) + base.block_tables.shape,
                            NULL_BLOCK, jnp.int32),
      seq_lens=base.seq_lens, refcounts=base.refcounts,
      free_stack=base.free_stack, num_free=base.num_free,
      block_size=block_size, windows=tuple(
          None if w is None else int(w) for w in windows))


def view(state: GroupedBlockState, group: int) -> bm.BlockState:
  """Group `group` as a `block_manager.BlockState` sharing the pool's arrays
  (for `bm.slot_mapping`, `bm.gather_tables`, `step_metadata`). Its table
  may hold `NULL_BLOCK` inside `seq_lens` (reclaimed): `bm.check_invariants`
  does not accept that, `check_invariants` here does."""
  none = dict.fromkeys(("cacheable", "lru", "lru_pos", "lru_head", "lru_len",
                        "num_cached"))
  return bm.BlockState(block_tables=state.block_tables[group],
                       seq_lens=state.seq_lens, refcounts=state.refcounts,
                       free_stack=state.free_stack, num_free=state.num_free,
                       block_size=state.block_size, **none)


def _with_view(state: GroupedBlockState, group: int, v: bm.BlockState):
  return state.replace(block_tables=state.block_tables.at[group].set(
      v.block_tables), seq_lens=v.seq_lens, refcounts=v.refcounts,
                       free_stack=v.free_stack, num_free=v.num_free)


def reclaimable(window: int | None, lens, block_size: int):
  """`i32[...]`: leading columns no query at position `>= lens` can see
  (0 for a global group)."""
  if window is None:
    return jnp.zeros_like(lens)
  return bm.reclaimable_columns(window, lens, block_size)


def _drop_prefix(state: GroupedBlockState, sid, lens, ok):
  """Gives back, in each local group, the columns `< reclaimable(lens)` of
  rows `sid` where `ok` (already reclaimed ones are `NULL_BLOCK`)."""
  cols = jnp.arange(state.max_blocks_per_seq, dtype=jnp.int32)[None, :]
  for g, w in enumerate(state.windows):
    if w is None:
      continue
    v = view(state, g)
    rows = v.block_tables[sid]
    cut = reclaimable(w, lens, state.block_size)[:, None]
    dropped = ok[:, None] & (cols < cut) & (rows >= 0)
    v = bm._unref(v, rows, dropped)  # pylint: disable=protected-access
    write = jnp.where(ok, sid, state.max_seqs)
    tables = v.block_tables.at[write].set(
        jnp.where(cols < cut, NULL_BLOCK, rows), mode="drop")
    state = _with_view(state, g, v.replace(block_tables=tables))
  return state


def reclaim(state: GroupedBlockState, seq_ids
            ) -> tuple[GroupedBlockState, jax.Array]:
  """Gives back, in every local group, the blocks of `seq_ids` that no query
  at or past their current length can see (see the module docstring); a
  block shared with a fork stays until its last holder drops it.

  Call it after a step has written its tokens. (A caller that rolls a
  sequence back must not have reclaimed past what the shorter sequence's
  next query sees; the grouped state has no `truncate` yet.)

  Args:
    seq_ids: `int[n]` sequence slots.

  Returns:
    `(new_state, ok bool[n])`: False for out-of-range ids, empty slots and
    repeats; those change nothing.
  """
  seq_ids = bm._as_ids("seq_ids", seq_ids)  # pylint: disable=protected-access
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  lens = state.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < state.max_seqs) & (lens > 0)
        & bm._first_occurrence(seq_ids))  # pylint: disable=protected-access
  return _drop_prefix(state, sid, lens, ok), ok


def reserve(state: GroupedBlockState, seq_ids, num_new_tokens
            ) -> tuple[GroupedBlockState, bm.Reservation]:
  """Grows each listed sequence by `num_new_tokens` slots in every group.

  First, in local groups, each listed live sequence gives back the blocks
  its first new token (at its current length) cannot see: a pure function
  of that length, the same whether or not the request then succeeds, and
  invisible to every later query. Then requests are served in order; request
  `i` needs, summed over groups, `block_manager.reserve`'s blocks (new
  columns plus a copy-on-write copy where its group's partial last block is
  shared), and succeeds only if all of them fit: a refused sequence keeps
  its length and every table entry in every group.

  Args:
    seq_ids, num_new_tokens: as `block_manager.reserve`.

  Returns:
    `(new_state, Reservation)` with `copy_src`, `copy_dst` as `i32[n,
    num_groups]` (per group a copy-on-write pair or `NULL_BLOCK`; the copy
    is of that group's layers only) and `evicted` None.

  Raises:
    ValueError: if the arguments are not 1-D integer arrays of equal length.
  """
  seq_ids = bm._as_ids("seq_ids", seq_ids)  # pylint: disable=protected-access
  num_new = bm._as_ids("num_new_tokens", num_new_tokens)  # pylint: disable=protected-access
  bm._same_length("seq_ids", seq_ids, "num_new_tokens", num_new)  # pylint: disable=protected-access
  n, num_groups = seq_ids.shape[0], state.num_groups
  if n == 0:
    none = jnp.zeros((0, num_groups), jnp.int32)
    return state, bm.Reservation(ok=jnp.zeros((0,), bool), copy_src=none,
                                 copy_dst=none, evicted=None)
  bs, max_seqs = state.block_size, state.max_seqs
  valid = ((seq_ids >= 0) & (seq_ids < max_seqs) & (num_new >= 0)
           & bm._first_occurrence(seq_ids))  # pylint: disable=protected-access
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  old_len = state.seq_lens[sid]
  state = _drop_prefix(state, sid, old_len, valid & (old_len > 0))
  valid &= num_new <= state.max_blocks_per_seq * bs - old_len
  grow = jnp.where(valid, num_new, 0)
  cur = bm._cdiv(old_len, bs)  # pylint: disable=protected-access
  new = bm._cdiv(old_len + grow, bs)  # pylint: disable=protected-access
  partial = valid & (grow > 0) & (old_len % bs != 0)
  last = jnp.take_along_axis(state.block_tables[:, sid],
                             jnp.maximum(cur - 1, 0)[None, :, None],
                             axis=2)[..., 0]  # [groups, n]
  last_refs = state.refcounts[jnp.clip(last, 0, state.num_blocks - 1)]

  # block_manager.reserve's in-order decision, every group at once (its one
  # rule, `_serve`, over runs of `num_groups`): a request fits if its blocks
  # in all groups fit what is left.
  k = num_groups
  ok = bm._serve(jnp.repeat(valid, k), jnp.repeat(partial, k),  # pylint: disable=protected-access
                 last.T.reshape(-1), last_refs.T.reshape(-1),
                 jnp.repeat(new - cur, k), state.num_free, num_sub=k)[1][::k]
  # Each group's own reserve, refused requests asking for 0 tokens: the same
  # order and counts, so every request judged ok above gets its blocks.
  asked = jnp.where(ok, grow, 0)
  srcs, dsts = [], []
  lens = state.seq_lens  # every group grows from the same lengths
  for g in range(num_groups):
    v, res = bm.reserve(view(state, g).replace(seq_lens=lens), seq_ids, asked)
    state = _with_view(state, g, v)
    srcs.append(res.copy_src)
    dsts.append(res.copy_dst)
  return state, bm.Reservation(ok=ok, copy_src=jnp.stack(srcs, 1),
                               copy_dst=jnp.stack(dsts, 1), evicted=None)


def release(state: GroupedBlockState, seq_ids
            ) -> tuple[GroupedBlockState, jax.Array]:
  """Drops the listed sequences in every group (`block_manager.release`;
  reclaimed entries hold no reference).

  Returns:
    `(new_state, ok bool[n])`: False for out-of-range ids, empty slots and
    repeats.
  """
  seq_ids = bm._as_ids("seq_ids", seq_ids)  # pylint: disable=protected-access
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  lens = state.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < state.max_seqs) & (lens > 0)
        & bm._first_occurrence(seq_ids))  # pylint: disable=protected-access
  cols = jnp.arange(state.max_blocks_per_seq, dtype=jnp.int32)[None, :]
  write = jnp.where(ok, sid, state.max_seqs)
  for g in range(state.num_groups):
    v = view(state, g)
    rows = v.block_tables[sid]
    owned = ok[:, None] & (cols < bm._cdiv(lens, state.block_size)[:, None]) & (  # pylint: disable=protected-access
        rows >= 0)
    v = bm._unref(v, rows, owned)  # pylint: disable=protected-access
    state = _with_view(state, g, v.replace(
        block_tables=v.block_tables.at[write].set(NULL_BLOCK, mode="drop")))
  return state.replace(seq_lens=state.seq_lens.at[write].set(
      0, mode="drop")), ok


def fork(state: GroupedBlockState, parent_ids, child_ids
         ) -> tuple[GroupedBlockState, jax.Array]:
  """Each child shares every held block of its parent in every group (and
  its reclaimed prefix); copy-on-write per group in the next `reserve`.
  Same `ok` rules as `block_manager.fork`."""
  parent_ids = bm._as_ids("parent_ids", parent_ids)  # pylint: disable=protected-access
  child_ids = bm._as_ids("child_ids", child_ids)  # pylint: disable=protected-access
  bm._same_length("parent_ids", parent_ids, "child_ids", child_ids)  # pylint: disable=protected-access
  max_seqs = state.max_seqs
  pid = jnp.clip(parent_ids, 0, max_seqs - 1)
  cid = jnp.clip(child_ids, 0, max_seqs - 1)
  length = state.seq_lens[pid]
  ok = ((parent_ids >= 0) & (parent_ids < max_seqs) & (child_ids >= 0)
        & (child_ids < max_seqs) & (length > 0) & (state.seq_lens[cid] == 0)
        & (parent_ids != child_ids)
        & bm._first_occurrence(child_ids))  # pylint: disable=protected-access
  rows = state.block_tables[:, pid]  # [groups, n, width]
  cols = jnp.arange(state.max_blocks_per_seq, dtype=jnp.int32)
  owned = (ok[None, :, None] & (rows >= 0)
           & (cols < bm._cdiv(length, state.block_size)[:, None]))  # pylint: disable=protected-access
  refs = bm._scatter_add(state.refcounts, rows.reshape(-1), owned.reshape(-1), 1)  # pylint: disable=protected-access
  write = jnp.where(ok, cid, max_seqs)
  tables = state.block_tables.at[:, write].set(rows, mode="drop")
  lens = state.seq_lens.at[write].set(length, mode="drop")
  return state.replace(block_tables=tables, seq_lens=lens, refcounts=refs), ok


def truncate(state: GroupedBlockState, seq_ids, new_lens
             ) -> tuple[GroupedBlockState, jax.Array]:
  """Rolls sequences back to `new_lens` tokens in every group
  (`block_manager.truncate`: speculative decoding's undo; blocks past the
  new end lose this sequence's reference, shared ones stay).

  Refused where a local group has already given back a block that the
  shorter sequence's next query (at `new_lens`) would see: its reclaimed
  prefix must be at most `reclaimable(new_lens)` columns. A verification
  step is safe: `reserve(1 + k)` reclaims by the old length `L`, and the
  rollback keeps `L + 1 + a >= L` tokens.

  Returns:
    `(new_state, ok bool[n])`: False for out-of-range ids, empty slots,
    repeats, `new_lens` outside `[0, seq_lens]`, and the case above; a
    refused sequence is left as it was in every group.
  """
  seq_ids = bm._as_ids("seq_ids", seq_ids)  # pylint: disable=protected-access
  new_lens = bm._as_ids("new_lens", new_lens)  # pylint: disable=protected-access
  bm._same_length("seq_ids", seq_ids, "new_lens", new_lens)  # pylint: disable=protected-access
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  length = state.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < state.max_seqs) & (length > 0)
        & (new_lens >= 0) & (new_lens <= length)
        & bm._first_occurrence(seq_ids))  # pylint: disable=protected-access
  cols = jnp.arange(state.max_blocks_per_seq, dtype=jnp.int32)[None, :]
  need = bm._cdiv(length, state.block_size)[:, None]  # pylint: disable=protected-access
  for g, w in enumerate(state.windows):
    if w is not None:  # NULL_BLOCK inside the length: the reclaimed prefix
      prefix = jnp.sum((cols < need) & (state.block_tables[g, sid] < 0), axis=1,
                       dtype=jnp.int32)
      ok &= prefix <= reclaimable(w, jnp.maximum(new_lens, 0), state.block_size)
  lens = state.seq_lens
  keep = jnp.where(ok, new_lens, length)  # a refused one truncates nothing
  for g in range(state.num_groups):
    v, _ = bm.truncate(view(state, g).replace(seq_lens=lens), seq_ids, keep)
    state = _with_view(state, g, v)
  return state, ok


def slot_mapping(state: GroupedBlockState, group: int, seq_ids, positions):
  """`block_manager.slot_mapping` in group `group`: `i32[T]` flat slots, -1
  where a token must not be written (reclaimed positions included)."""
  return bm.slot_mapping(view(state, group), seq_ids, positions)


def check_invariants(state: GroupedBlockState) -> None:
  """Checks the grouped pool on the host (tests and debugging).

  Checked: every block is exactly one of free or referenced, and its
  refcount equals its table references over all groups; no block is in two
  groups, twice in a row or twice in the free list; each row of a group
  holds `NULL_BLOCK` on a reclaimed prefix, then blocks up to
  `ceil(seq_len / block_size)`, then `NULL_BLOCK`; a global group's prefix
  is empty, and a local group's is at most `reclaimable(seq_len)` columns
  (it never gave back a block that the next query could see).

  Raises:
    AssertionError: naming the broken invariant.
  """
  tables = np.asarray(state.block_tables)
  lens = np.asarray(state.seq_lens)
  refs = np.asarray(state.refcounts)
  num_free = int(state.num_free)
  free = np.asarray(state.free_stack)[:num_free]
  n, bs = state.num_blocks, state.block_size
  assert tables.shape[0] == state.num_groups, (
      f"{tables.shape[0]} tables for {state.num_groups} groups")
  assert 0 <= num_free <= n, f"num_free={num_free} outside [0, {n}]"
  cap = state.max_blocks_per_seq * bs
  assert np.all((lens >= 0) & (lens <= cap)), f"seq_lens outside [0, {cap}]"
  counts = np.zeros(n, np.int64)
  group_of = {}
  for g, w in enumerate(state.windows):
    for s, row in enumerate(tables[g]):
      need = -(-int(lens[s]) // bs)
      held = row[:need]
      prefix = int(np.argmax(held >= 0)) if np.any(held >= 0) else need
      limit = int(reclaimable(w, np.int64(lens[s]), bs)) if w else 0
      assert prefix <= limit, (
          f"group {g} (window {w}) slot {s}: {prefix} leading NULL_BLOCK "
          f"columns, but only {limit} are invisible at seq_len {lens[s]}: {row}")
      used = held[prefix:]
      assert np.all((used >= 0) & (used < n)), (
          f"group {g} slot {s}: bad block ids after its reclaimed prefix: {row}")
      assert np.all(row[need:] == NULL_BLOCK), (
          f"group {g} slot {s}: entries past its {need} blocks are not "
          f"NULL_BLOCK: {row}")
      assert len(set(used.tolist())) == len(used), (
          f"group {g} slot {s}: repeated block {used}")
      for b in used.tolist():
        assert group_of.setdefault(b, g) == g, (
            f"block {b} is in groups {group_of[b]} and {g}")
      np.add.at(counts, used, 1)
  assert np.array_equal(counts, refs), (
      f"refcounts != table references at blocks "
      f"{np.nonzero(counts != refs)[0].tolist()}")
  assert len(set(free.tolist())) == num_free, "a block is twice in the free list"
  assert np.all((free >= 0) & (free < n)), f"bad ids in the free list: {free}"
  assert np.all(refs[free] == 0), (
      f"blocks both free and referenced: {free[refs[free] != 0].tolist()}")
  used = int(np.sum(refs > 0))
  assert used + num_free == n, (
      f"free ({num_free}) + used ({used}) != num_blocks ({n})")


def held_blocks(state: GroupedBlockState) -> np.ndarray:
  """Host side: `int[num_groups, max_seqs]` blocks each sequence holds per
  group (reclaimed columns excluded)."""
  tables = np.asarray(state.block_tables)
  lens = np.asarray(state.seq_lens)
  cols = np.arange(state.max_blocks_per_seq)
  inside = cols[None, None, :] < (-(-lens // state.block_size))[None, :, None]
  return np.sum(inside & (tables >= 0), axis=-1)
