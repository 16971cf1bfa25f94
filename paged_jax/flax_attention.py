"""Paged attention for Flax NNX models.

Two pieces, FlashInfer's plan/run split in pure-JAX form:

* `step_metadata` ("plan") turns the block state and the step's layout (which
  sequences run, how many new tokens each) into a `StepMetadata` pytree: write
  slots, positions, block tables, lengths. It is computed once per step and
  shared by every layer.
* `PagedAttention` ("run") is an NNX module with the q/k/v/o projections of a
  Llama-style attention block. Given hidden states, the metadata and the
  `KVCache`, it applies RoPE, writes the new K/V into the layer's pages, runs
  paged attention and returns the output with the updated cache. The cache goes
  in and comes out explicitly; nothing is stored on the module.

Token layout (vLLM-style ragged batch): the step's `num_tokens` rows hold the
new tokens of sequence 0, then sequence 1, ... (`cu_q_lens` gives the
boundaries); rows past `cu_q_lens[num_seqs]` are padding. A decode-only step
(`decode_only=True`) has `num_tokens == num_seqs_max` and row `i` is the one new
token of sequence `i`; it uses the decode kernel, every other step the ragged
one. Both give the same numbers for a one-token query.

Example (one layer, one step; see `examples/llama/model.py` for a model):

    state, res = block_manager.reserve(state, seq_ids, q_lens)
    meta = step_metadata(state, seq_ids, q_lens, num_tokens=tokens.shape[0])
    for layer, attn in enumerate(attn_layers):
      out, cache = attn(x, meta, cache, layer)
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import _int32
from paged_jax import attention
from paged_jax import block_manager
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import rope as rope_lib
from paged_jax import sharding

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
    mesh: static; None on one device. On a `(data, model)` mesh (from
      `sharded_step_metadata`) every array is the concatenation of the data
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
    seq_ids: jax.Array,  # i32[max_seqs_per_step]
    q_lens: jax.Array,  # i32[max_seqs_per_step]
    *,
    num_tokens: int,
    active: jax.Array | None = None,  # bool[max_seqs_per_step]
    decode_only: bool = False,
) -> StepMetadata:
  """Computes the step's metadata from the block state (after `reserve`).

  Args:
    state: block state in which every active sequence already holds the slots
      for its `q_lens` new tokens (its `seq_lens` counts them).
    seq_ids: `int[max_seqs_per_step]` block-state sequence slot of each entry;
      entries in use come first, the rest are padding (any id, `q_lens` 0).
      An id outside `[0, state.max_seqs)` (int64 ones outside int32
      included) writes nothing and attends to nothing.
    q_lens: `int[max_seqs_per_step]` new tokens of each entry (0 for padding).
      An entry's rows in the layout are `clip(q_lens, 0, num_tokens)`, so
      `cu_q_lens` never decreases or wraps; an entry whose `q_lens` exceeds
      its sequence's length or `num_tokens` writes nothing and attends to
      nothing.
    num_tokens: static number of token rows in the step (padded budget).
    active: optional `bool[max_seqs_per_step]`; an inactive entry keeps its
      rows in the layout but writes nothing and attends to nothing (its rows
      come out as zeros). Use it for entries whose `reserve` failed.
    decode_only: static; the decode layout (see module docstring). Requires
      `num_tokens == max_seqs_per_step` and every `q_lens` in {0, 1}.

  Returns:
    A `StepMetadata`.

  Raises:
    ValueError: on inconsistent static shapes, ids that are not integers,
      or `max_seqs_per_step * num_tokens >= 2**31` (int32 `cu_q_lens`).
  """
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


def sharded_step_metadata(
    mesh: Mesh,
    states: block_manager.BlockState,
    seq_ids: jax.Array,  # i32[data, max_seqs_per_step]
    q_lens: jax.Array,  # i32[data, max_seqs_per_step]
    *,
    num_tokens: int,
    active: jax.Array | None = None,  # bool[data, max_seqs_per_step]
    decode_only: bool = False,
) -> StepMetadata:
  """`step_metadata` for every data shard of a mesh at once.

  Args:
    mesh: a `(data, model)` mesh (`paged_jax.sharding.make_mesh`).
    states: the data shards' block states stacked on a leading axis
      (`sharding.init_block_states`).
    seq_ids, q_lens, active: `[data, max_seqs_per_step]`, row `i` for data
      shard `i` (its own sequence slots), as in `step_metadata`.
    num_tokens: static token rows of each data shard.
    decode_only: static, as in `step_metadata`.

  Returns:
    A `StepMetadata` in the mesh layout (see its `mesh` attribute): arrays
    `[data * ...]`, sharded over `data`; `total_blocks` counts every data
    shard's pool, as the mesh's pages do.

  Raises:
    ValueError: if `seq_ids` is not `[data, max_seqs_per_step]`, or as
      `step_metadata`.
  """
  data = mesh.shape[sharding.DATA]
  shape = np.shape(seq_ids)
  if len(shape) != 2 or shape[0] != data:
    raise ValueError(f"seq_ids must be [data={data}, max_seqs_per_step], got "
                     f"shape {shape}")
  # Here, not in the vmapped per-shard call: vmap would truncate int64.
  seq_ids = _int32.as_int32("seq_ids", seq_ids, ndim=2)
  q_lens = _int32.as_int32("q_lens", q_lens, ndim=2)
  if active is None:
    active = jnp.ones(seq_ids.shape, bool)
  per_shard = jax.vmap(lambda st, ids, ql, act: step_metadata(
      st, ids, ql, num_tokens=num_tokens, active=act, decode_only=decode_only))
  meta = per_shard(states, seq_ids, q_lens, active)
  spec = NamedSharding(mesh, P(sharding.DATA))
  flat = jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(
          x.reshape((-1,) + x.shape[2:]), spec), meta)
  return flat.replace(mesh=mesh, total_blocks=states.total_blocks)


def write_and_attend(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    meta: StepMetadata,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes one layer's new K/V and attends over the pages.

  `q` and `k` must already carry their position encoding.

  Returns:
    `(out [num_tokens, num_q_heads, head_dim] in q.dtype, k_pages, v_pages)`.

  Raises:
    ValueError: if the pages' block size or number of blocks differ from the
      pool `meta` was computed from (`kv_cache.check_compatible`).
  """
  kv_cache_lib.check_compatible(k_pages, meta)
  k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
  kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap,
                sliding_window=sliding_window, implementation=implementation)
  args = (meta.block_tables, meta.kv_lens)
  if not meta.decode_only:
    args += (meta.cu_q_lens, meta.num_seqs)
  if meta.mesh is None:
    k_pages, v_pages = kv_cache_lib.write_kv(k_pages, v_pages, k, v, meta.slots)
    attend = (attention.paged_attention if meta.decode_only
              else attention.ragged_paged_attention)
  else:
    k_pages, v_pages = sharding.write_kv_sharded(
        meta.mesh, k_pages, v_pages, k, v, meta.slots)
    fn = (sharding.sharded_paged_attention if meta.decode_only
          else sharding.sharded_ragged_paged_attention)
    attend = functools.partial(fn, meta.mesh)
  out = attend(q, k_pages, v_pages, *args, **kwargs)
  return out.astype(q.dtype), k_pages, v_pages


class PagedAttention(nnx.Module):
  """Llama-style attention block over a paged KV cache.

  Projections `q_proj`, `k_proj`, `v_proj`, `o_proj` (names as in Hugging Face
  Llama), RoPE on q and k, grouped-query attention (`num_heads` a multiple of
  `num_kv_heads`), any `head_dim` the attention backends accept.
  """

  def __init__(
      self,
      hidden_size: int,
      num_heads: int,
      num_kv_heads: int,
      head_dim: int,
      *,
      rope: rope_lib.RopeConfig | None,
      use_bias: bool = False,
      sm_scale: float | None = None,
      soft_cap: float | None = None,
      sliding_window: int | None = None,
      implementation: str | None = None,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    if num_heads % num_kv_heads:
      raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if rope is not None and rope.head_dim != head_dim:
      raise ValueError(f"{rope.head_dim=} must equal {head_dim=}")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope = rope
    self.sm_scale = sm_scale
    self.soft_cap = soft_cap
    self.sliding_window = sliding_window
    self.implementation = implementation
    linear = lambda i, o: nnx.Linear(  # noqa: E731
        i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)
    self.q_proj = linear(hidden_size, num_heads * head_dim)
    self.k_proj = linear(hidden_size, num_kv_heads * head_dim)
    self.v_proj = linear(hidden_size, num_kv_heads * head_dim)
    self.o_proj = linear(num_heads * head_dim, hidden_size)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """`x [num_tokens, hidden]`, `positions i32[num_tokens]` -> roped q, k, v."""
    t = x.shape[0]
    q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
    if self.rope is not None:
      q = rope_lib.apply_rope(q, positions, self.rope)
      k = rope_lib.apply_rope(k, positions, self.rope)
    return q, k, v

  def __call__(
      self,
      x: jax.Array,  # [num_tokens, hidden]
      meta: StepMetadata,
      cache: kv_cache_lib.KVCache,
      layer: int,
  ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """Paged step: writes this step's K/V into layer `layer` and attends.

    Args:
      x: `[num_tokens, hidden]` hidden states in the step's token layout.
      meta: the step's `StepMetadata` (from `step_metadata`).
      cache: the model's `KVCache` (all layers).
      layer: static layer index into the cache.

    Returns:
      `(out [num_tokens, hidden], cache)` with layer `layer` updated.

    Raises:
      ValueError: if `cache` does not hold the pool `meta` was computed from
        (another block size or number of blocks).
    """
    q, k, v = self.qkv(x, meta.positions)
    out, k_pages, v_pages = write_and_attend(
        q, k, v, cache.k_pages[layer], cache.v_pages[layer], meta,
        sm_scale=self.sm_scale, soft_cap=self.soft_cap,
        sliding_window=self.sliding_window, implementation=self.implementation)
    cache = cache.replace(k_pages=cache.k_pages.at[layer].set(k_pages),
                          v_pages=cache.v_pages.at[layer].set(v_pages))
    return self.o_proj(out.reshape(x.shape[0], -1)), cache

  def dense(self, x: jax.Array) -> jax.Array:
    """Non-paged causal attention over whole sequences (the test oracle).

    Args:
      x: `[batch, seq_len, hidden]`; token `j` of each row sits at position `j`.

    Returns:
      `[batch, seq_len, hidden]`.
    """
    batch, seq_len, hidden = x.shape
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
    q, k, v = self.qkv(x.reshape(batch * seq_len, hidden), positions)
    split = lambda a: a.reshape(batch, seq_len, *a.shape[1:])  # noqa: E731
    o = dense_causal_attention(
        split(q), split(k), split(v), sm_scale=self.sm_scale,
        soft_cap=self.soft_cap, sliding_window=self.sliding_window)
    return self.o_proj(o.astype(x.dtype).reshape(batch, seq_len, -1))


def dense_causal_attention(
    q: jax.Array,  # [batch, seq_len, num_q_heads, head_dim]
    k: jax.Array,  # [batch, seq_len, num_kv_heads, head_dim]
    v: jax.Array,  # [batch, seq_len, num_kv_heads, head_dim]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
  """Plain causal GQA attention over contiguous sequences, softmax in float32.

  Same conventions as `paged_jax.reference` (jittable, unlike the reference).

  Returns:
    float32 `[batch, seq_len, num_q_heads, head_dim]`.
  """
  _, seq_len, num_q_heads, head_dim = q.shape
  group = num_q_heads // k.shape[2]
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32,
                 precision="highest") * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  pos = jnp.arange(seq_len)
  visible = pos[None, :] <= pos[:, None]
  if sliding_window is not None:
    visible &= pos[None, :] > pos[:, None] - sliding_window
  s = jnp.where(visible, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32),
                    precision="highest")
