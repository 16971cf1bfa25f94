"""Per-step attention metadata ("plan"), computed once and shared by every layer.

`step_metadata` turns the block state (`paged_jax.block_manager`) and the
step's layout (which sequences run, how many new tokens each) into a
`StepMetadata` pytree: write slots, positions, block tables, lengths. Nothing
here depends on Flax or on a model; `paged_jax.flax_attention.PagedAttention`
and any other model's attention layer consume it.

Token layout (vLLM-style ragged batch): the step's `num_tokens` rows hold the
new tokens of sequence 0, then sequence 1, ... (`cu_q_lens` gives the
boundaries); rows past `cu_q_lens[num_seqs]` are padding. A decode-only step
(`decode_only=True`) has `num_tokens == num_seqs_max` and row `i` is the one new
token of sequence `i`; it uses the decode kernel, every other step the ragged
one.

Example:

    state, res = block_manager.reserve(state, seq_ids, q_lens)
    meta = step_metadata(state, seq_ids, q_lens, num_tokens=tokens.shape[0])
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import _int32
from paged_jax import block_manager
from paged_jax.sharding import DATA

NULL_BLOCK = block_manager.NULL_BLOCK


@flax.struct.dataclass
class StepMetadata:
  """Per-step attention inputs shared by all layers.

  Attributes:
    positions: `i32[num_tokens]` absolute position of each token row (0 for
      padding rows).
    slots: `i32[num_tokens]` flat cache slot (`block * block_size + offset`)
      each row's K/V is written to; -1 for padding rows, which are dropped.
    block_tables: `i32[max_seqs_per_step, max_blocks_per_seq]`; rows of padding
      or inactive sequences hold `NULL_BLOCK`.
    kv_lens: `i32[max_seqs_per_step]` tokens in cache after this step's writes;
      0 for padding or inactive sequences (their rows attend to nothing).
    cu_q_lens: `i32[max_seqs_per_step + 1]` row boundaries of each sequence.
    num_seqs: `i32[1]` number of leading sequence entries in use.
    block_size: static; the block state's `block_size` (slots and tables
      index pages of this block size).
    total_blocks: static; the blocks of the pool the slots and tables index
      (every data shard's pool in the mesh layout). `write_and_attend` checks
      both against the pages (`kv_cache.check_compatible`).
    decode_only: static; every sequence has exactly one row, row `i` belonging
      to sequence `i`, and the decode kernel is used.
    mesh: static; None for one pool used without a mesh. On a `(data,
      model)` mesh (`step_metadata(..., mesh=mesh)`, a 1x1 mesh for one
      device included) every array is the concatenation of the data
      shards' own arrays (shard `i` owns rows `i * num_tokens / data ...`,
      its own `cu_q_lens` starting at 0, one `num_seqs` entry; slots and block
      ids are local to its pool), and the K/V write and attention run under
      `shard_map` (`paged_jax.sharding`).
  """

  positions: jax.Array
  slots: jax.Array
  block_tables: jax.Array
  kv_lens: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  block_size: int = flax.struct.field(pytree_node=False)
  total_blocks: int = flax.struct.field(pytree_node=False)
  decode_only: bool = flax.struct.field(pytree_node=False, default=False)
  mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)


def step_metadata(
    state: block_manager.BlockState,
    seq_ids: jax.Array,  # i32[max_seqs_per_step], on a mesh [data, ...]
    q_lens: jax.Array,  # i32[max_seqs_per_step], on a mesh [data, ...]
    *,
    num_tokens: int,
    active: jax.Array | None = None,  # bool[max_seqs_per_step], on a mesh [data, ...]
    decode_only: bool = False,
    mesh: Mesh | None = None,
) -> StepMetadata:
  """Computes the step's metadata from the block state (after `reserve`).

  One function for one pool and for a `(data, model)` mesh of any shape
  (one device is a 1x1 mesh): on a mesh every data shard's metadata is
  computed from its own block state and its own rows of the arguments
  (`vmap`), and concatenated in the mesh layout (`StepMetadata.mesh`).

  Args:
    state: block state in which every active sequence already holds the slots
      for its `q_lens` new tokens (its `seq_lens` counts them). On a mesh:
      the data shards' states stacked on a leading axis
      (`sharding.init_block_states`).
    seq_ids: `int[max_seqs_per_step]` block-state sequence slot of each entry;
      entries in use come first, the rest are padding (any id, `q_lens` 0).
      An id outside `[0, state.max_seqs)` (int64 ones outside int32
      included) writes nothing and attends to nothing. On a mesh
      `[data, max_seqs_per_step]`, row `i` for data shard `i` (its own
      sequence slots); so are `q_lens` and `active`.
    q_lens: `int[max_seqs_per_step]` new tokens of each entry (0 for padding).
      An entry's rows in the layout are `clip(q_lens, 0, num_tokens)`, so
      `cu_q_lens` never decreases or wraps; an entry whose `q_lens` exceeds
      its sequence's length or `num_tokens` writes nothing and attends to
      nothing.
    num_tokens: static number of token rows in the step (padded budget; on
      a mesh, of each data shard).
    active: optional `bool[max_seqs_per_step]`; an inactive entry keeps its
      rows in the layout but writes nothing and attends to nothing (its rows
      come out as zeros). Use it for entries whose `reserve` failed.
    decode_only: static; the decode layout (see module docstring). Requires
      `num_tokens == max_seqs_per_step` and every `q_lens` in {0, 1}.
    mesh: static; a `(data, model)` mesh (`paged_jax.sharding.make_mesh`),
      or None for one pool without a mesh.

  Returns:
    A `StepMetadata`; on a mesh in the mesh layout (see its `mesh`
    attribute): arrays `[data * ...]`, sharded over `data`, `total_blocks`
    counting every data shard's pool, as the mesh's pages do.

  Raises:
    ValueError: on inconsistent static shapes (on a mesh: `seq_ids` not
      `[data, max_seqs_per_step]`), ids that are not integers, or
      `max_seqs_per_step * num_tokens >= 2**31` (int32 `cu_q_lens`).
  """
  if mesh is None:
    return _pool_metadata(state, seq_ids, q_lens, num_tokens=num_tokens,
                          active=active, decode_only=decode_only)
  data = mesh.shape[DATA]
  shape = np.shape(seq_ids)
  if len(shape) != 2 or shape[0] != data:
    raise ValueError(f"seq_ids must be [data={data}, max_seqs_per_step], got "
                     f"shape {shape}")
  # Here, not in the vmapped per-shard call: vmap would truncate int64.
  seq_ids = _int32.as_int32("seq_ids", seq_ids, ndim=2)
  q_lens = _int32.as_int32("q_lens", q_lens, ndim=2)
  if active is None:
    active = jnp.ones(seq_ids.shape, bool)
  per_shard = jax.vmap(lambda st, ids, ql, act: _pool_metadata(
      st, ids, ql, num_tokens=num_tokens, active=act, decode_only=decode_only))
  meta = per_shard(state, seq_ids, q_lens, active)
  spec = NamedSharding(mesh, P(DATA))
  flat = jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(
          x.reshape((-1,) + x.shape[2:]), spec), meta)
  return flat.replace(mesh=mesh, total_blocks=state.total_blocks)


def sharded_step_metadata(mesh: Mesh, states: block_manager.BlockState,
                          seq_ids: jax.Array, q_lens: jax.Array, *,
                          num_tokens: int, active: jax.Array | None = None,
                          decode_only: bool = False) -> StepMetadata:
  """`step_metadata(states, seq_ids, q_lens, ..., mesh=mesh)` (the older
  spelling, kept for callers)."""
  return step_metadata(states, seq_ids, q_lens, num_tokens=num_tokens,
                       active=active, decode_only=decode_only, mesh=mesh)


def _pool_metadata(
    state: block_manager.BlockState,
    seq_ids: jax.Array,  # i32[max_seqs_per_step]
    q_lens: jax.Array,  # i32[max_seqs_per_step]
    *,
    num_tokens: int,
    active: jax.Array | None = None,  # bool[max_seqs_per_step]
    decode_only: bool = False,
) -> StepMetadata:
  """`step_metadata` of one pool (no mesh)."""
  seq_ids = _int32.as_int32("seq_ids", seq_ids)
  q_lens = _int32.as_int32("q_lens", q_lens)
  (max_seqs,) = seq_ids.shape
  if q_lens.shape != (max_seqs,):
    raise ValueError(f"q_lens shape {q_lens.shape} must be {(max_seqs,)} like seq_ids")
  if decode_only and num_tokens != max_seqs:
    raise ValueError(
        f"decode_only needs one row per sequence: {num_tokens=} != {max_seqs=}")
  _int32.check_fits("cu_q_lens", max_seqs_per_step=max_seqs,
                    num_tokens=num_tokens)
  in_use = (q_lens > 0) & (seq_ids >= 0) & (seq_ids < state.max_seqs)
  if active is not None:
    in_use = in_use & jnp.asarray(active, bool)
  safe_ids = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  tables, kv_lens = block_manager.gather_tables(state, safe_ids)
  # More new tokens than the sequence holds, or than the step has rows: a
  # caller's mistake; such an entry must not write (its positions would be
  # negative or past its rows). Clamped, no cumsum below can wrap.
  in_use &= q_lens <= jnp.minimum(kv_lens, num_tokens)
  q_lens = jnp.clip(q_lens, 0, num_tokens)
  kv_lens = jnp.where(in_use, kv_lens, 0)
  tables = jnp.where(in_use[:, None], tables, NULL_BLOCK)
  cu_q_lens = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
  num_seqs = jnp.sum(seq_ids >= 0, dtype=jnp.int32).reshape(1)

  rows = jnp.arange(num_tokens, dtype=jnp.int32)
  if decode_only:
    row_seq = rows
  else:
    row_seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
  row_seq_c = jnp.clip(row_seq, 0, max_seqs - 1)
  row_valid = (rows < cu_q_lens[-1]) & in_use[row_seq_c]
  offset = rows - cu_q_lens[row_seq_c]
  positions = kv_lens[row_seq_c] - q_lens[row_seq_c] + offset
  positions = jnp.where(row_valid, positions, 0)
  slots = block_manager.slot_mapping(state, safe_ids[row_seq_c], positions)
  slots = jnp.where(row_valid, slots, -1)
  return StepMetadata(
      positions=positions, slots=slots, block_tables=tables, kv_lens=kv_lens,
      cu_q_lens=cu_q_lens, num_seqs=num_seqs, block_size=state.block_size,
      total_blocks=state.total_blocks, decode_only=decode_only)
