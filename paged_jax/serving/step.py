"""The engine's device step: one jitted function per compiled shape.

`device_step` is pure: the cache, the block state and the last sampled token
of every sequence slot go in and come out, and nothing else changes; each
slot's sampling parameters (`slot_state.SlotState`) are read there too. It
runs on a `(data, model)` device mesh of any shape -- one device is a 1x1
mesh -- with every data shard's block state, last tokens, slot state and
inputs stacked on a leading `[data]` axis: the bookkeeping runs once per data
shard (`vmap`), the model is tensor-parallel, and the cache writes, copies and
attention run under `shard_map`, each device on its own KV heads of its own
shard's pool. Its order is

  register (blocks to cache) -> release (finished, preempted) -> fork (new
  samples / beams) -> release (finished fork parents) -> share (prefix-cache
  hits) -> reserve (this step's tokens) -> copy-on-write ->
  the input tokens (the host's, or the last token sampled for a slot) ->
  `step_metadata` (once for every layer) -> `model.paged_forward` -> logits of
  the rows to sample -> `logit_bias`, bans -> sampling and top log-probs ->
  the sampled tokens stored per slot -> with `state.window`, the blocks no
  future query can see given back (`window_reclaim`).

Storing the sampled tokens on the device is what makes the engine's steps
asynchronous: the host builds and dispatches step N+1 before step N's tokens
reach it, and step N+1 reads them from `last_tokens` (`StepInputs.token_slots`).

The host has already applied the same bookkeeping to its exact NumPy model of
the block state (`host_pool.HostPool`), so every reservation in a step
succeeds; a refused one would leave that sequence's state as it was, its rows
writing and attending to nothing (`step_metadata(active=...)`), and the host
would raise on `ok` or on the state's fingerprint (`state_fingerprint`).

The step variants that serve one pool on one device (`multistep.py`,
`pooled_step.py`, `swap_step.py`, `spec_step.py`) are written for one pool;
`on_one_pool` runs them on the stacked arrays of a 1x1 mesh.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import sharding
from paged_jax import step_metadata as step_metadata_lib
from paged_jax import window_reclaim
from paged_jax.serving import sampling
from paged_jax.serving import slot_state as slot_state_lib


class ModelDef:
  """The model's static structure, as the jitted step's static argument.

  Holds the `nnx.GraphDef` and the tree structure of the parameters, which
  the engine passes as a flat list of arrays. jit hashes its static arguments
  on every call: a GraphDef hashes by walking the whole module graph (about a
  millisecond per step for a small model on CPU), so the hash is computed
  once here. Equal structures compare equal, so engines of the same model
  share the compiled steps.
  """

  def __init__(self, graphdef, params):
    self.graphdef = graphdef
    self.treedef = jax.tree.structure(params)
    self._hash = hash((graphdef, self.treedef))

  def merge(self, leaves):
    """The model, from the flat parameter arrays."""
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (
        isinstance(other, ModelDef) and self._hash == other._hash
        and self.graphdef == other.graphdef and self.treedef == other.treedef)


@flax.struct.dataclass
class StepInputs:
  """One step's host-built arrays (`num_tokens`, `num_seqs`: the bucket's).

  The prefix-cache arrays (`register_*`, `share_*`) have zero rows when the
  pool has no prefix caching (`R`, `H`: `register_rows`, `share_rows`).
  """

  register_seqs: jax.Array  # i32[R]  slot of each block to register; -1 = none
  register_cols: jax.Array  # i32[R]  its block-table column
  release_early: jax.Array  # i32[max_seqs]  before forks; -1 = none
  release_late: jax.Array  # i32[max_seqs]   after forks (finished fork parents)
  fork_parents: jax.Array  # i32[max_batch]
  fork_children: jax.Array  # i32[max_batch]
  share_seqs: jax.Array  # i32[H]  empty slot starting on a cached prefix; -1 = none
  share_blocks: jax.Array  # i32[H, max_blocks_per_seq]  its cached blocks
  share_counts: jax.Array  # i32[H]  blocks shared (>= 1 on a real row)
  seq_ids: jax.Array  # i32[num_seqs]  entries in priority order, -1 padding
  q_lens: jax.Array  # i32[num_seqs]
  tokens: jax.Array  # i32[num_tokens]  ragged layout (host-known tokens)
  token_slots: jax.Array  # i32[num_tokens]  -1: `tokens`; else last_tokens[slot]
  sample_slots: jax.Array  # i32[num_seqs]  slot each sample row's token sets, -1 none
  sample_rows: jax.Array  # i32[num_seqs]  token row each sample reads
  # The sampling parameters live on the device (`slot_state.SlotState`):
  sample_seqs: jax.Array  # i32[num_seqs]  slot whose parameters and position a sample row reads, -1 none
  seed_offsets: jax.Array  # i32[num_seqs]  added to that slot's seed (a prompt's other samples)


@flax.struct.dataclass
class StepOutputs:
  tokens: jax.Array  # i32[num_seqs]  sampled token per sample row
  top_logprobs: jax.Array  # f32[num_seqs, num_logprobs]
  top_ids: jax.Array  # i32[num_seqs, num_logprobs]
  ok: jax.Array  # bool[num_seqs]  reservation per entry (the host knew it)
  fork_ok: jax.Array  # bool[max_batch]  (the host knew it too)
  token_logprobs: jax.Array  # f32[num_seqs]  log-prob of each sampled token
  fingerprint: jax.Array  # u32[5]  `state_fingerprint` after the bookkeeping


def device_step(model_def: ModelDef, params, cache: kv_cache_lib.KVCache,
                states: bm.BlockState, last_tokens: jax.Array,
                slots: slot_state_lib.SlotState, x: StepInputs, *,
                mesh: Mesh, decode_only: bool, num_logprobs: int):
  """The serving step on a `(data, model)` mesh (pure; jit it with the
  cache, states and last tokens donated; `slots` is read only): every data
  shard runs its own step on its own pool and sequences, the model is
  tensor-parallel. One device is a 1x1 mesh.

  Args:
    model_def: the model's `ModelDef` (static); on a mesh with a model axis
      over 1, of the model laid out by its `shard(mesh)`.
    params: the model's parameter arrays, `jax.tree.leaves` of its state.
    cache: the `KVCache`, sharded `paged_jax.sharding.cache_spec()`.
    states: the data shards' `BlockState`s stacked on a leading axis
      (`paged_jax.sharding.init_block_states`), sharded over `data`.
    last_tokens: i32[data, max_seqs], the last token sampled for each
      sequence slot of each data shard.
    slots: the data shards' `slot_state.SlotState`s stacked (`[data,
      max_seqs, ...]`): each slot's sampling parameters.
    x: `StepInputs` with a leading `[data]` axis on every array, row `i` for
      data shard `i` (its own slots, rows and block ids).
    mesh: static; the mesh.
    decode_only: static; the decode layout (one token row per entry).
    num_logprobs: static; top log-probs returned per sample row.

  Returns:
    `(cache, states, last_tokens, StepOutputs)`, the outputs with a leading
    `[data]` axis.
  """
  model = model_def.merge(params)
  data = mesh.shape[sharding.DATA]
  states, fork_ok, res = over_pools(mesh, _bookkeeping, states, x)
  cache = sharding.copy_blocks_sharded(mesh, cache, res.copy_src, res.copy_dst)
  num_tokens = x.tokens.shape[1]
  meta = step_metadata_lib.step_metadata(
      states, x.seq_ids, x.q_lens, num_tokens=num_tokens, active=res.ok,
      decode_only=decode_only, mesh=mesh)
  tokens_in = jax.vmap(input_tokens)(last_tokens, x)
  hidden, cache = model.paged_forward(tokens_in.reshape(-1), meta, cache)
  if states.window is not None:  # blocks no future query sees go back
    states = jax.vmap(functools.partial(
        window_reclaim.reclaim, max_new_tokens=num_tokens,
        # register rows >= max_tokens_per_step // block_size (`prefix.register_rows`)
        deferred_columns=x.register_seqs.shape[1] + 1))(
            states, x.seq_ids, x.q_lens, res.ok)
  # Each shard's sample rows index its own token rows: gather locally.
  hidden = hidden.reshape(data, num_tokens, -1)
  hidden = jnp.take_along_axis(hidden, x.sample_rows[..., None], axis=1)
  logits = model.logits(hidden)  # [data, max_batch, vocab]
  if logits.shape[-1] % mesh.shape[sharding.MODEL] == 0:
    # Vocab-parallel logits: gather the logits, never the LM head.
    logits = jax.lax.with_sharding_constraint(
        logits, NamedSharding(mesh, P(sharding.DATA, None, sharding.MODEL)))

  # Each data shard samples its own rows (its own `lax.cond`s, no
  # communication across data shards; the vocab is gathered over `model`).
  def local_sample(logits, rows):
    rows = jax.tree.map(lambda a: a[0], rows)
    return jax.tree.map(lambda a: a[None], _sample(logits[0], rows, num_logprobs))

  by_data = P(sharding.DATA)
  rows = jax.vmap(sample_rows)(slots, states, x)
  tokens, top_lp, top_ids, token_lp = jax.shard_map(
      local_sample, mesh=mesh, in_specs=(by_data, by_data), out_specs=by_data,
      check_vma=False)(logits, rows)
  cache = jax.lax.with_sharding_constraint(
      cache, jax.tree.map(lambda a: NamedSharding(mesh, sharding.spec_of(a)),
                          cache))
  states = jax.lax.with_sharding_constraint(states, NamedSharding(mesh, by_data))
  last_tokens = jax.lax.with_sharding_constraint(
      jax.vmap(store_tokens)(last_tokens, x.sample_slots, tokens),
      NamedSharding(mesh, by_data))
  return cache, states, last_tokens, StepOutputs(tokens, top_lp, top_ids, res.ok,
                                                 fork_ok, token_lp,
                                                 jax.vmap(state_fingerprint)(states))


_JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])


def over_pools(mesh: Mesh, fn, states, *args, **kwargs):
  """`fn(state, *args, **kwargs)` once per data shard of `mesh`, each on its
  own devices: `shard_map` over `data` of `states` and of every array in
  `args` (leading `[data]` axes), `fn` on one pool's arrays. `fn`'s
  `lax.cond`s stay conds (each shard's predicate is its own, no data shard
  talks to another), where under `vmap` their batched predicates would make
  them selects that run both branches: an empty release or fork costs
  nothing, on one device as on a mesh."""
  if (mesh.shape[sharding.DATA] > 1 and (0, 11) <= _JAX_VERSION < (0, 12)
      and getattr(states, "prefix_caching", False)):
    # jaxlib 0.11.2's XLA CPU crashes (a segfault in compile) on this
    # `shard_map` over two or more data shards when the pools cache prefixes
    # (their eviction `while_loop`s; tests/examples/test_sharded.py, found
    # 2026-12-06; 0.10.2 and 0.12 compile it): there the shards' bookkeeping
    # is `vmap`ped, as before the one step path (its conds become selects).
    return jax.vmap(lambda st, *a: fn(st, *a, **kwargs))(states, *args)

  def local(states, *args):
    states, args = jax.tree.map(lambda a: a[0], (states, args))
    return jax.tree.map(lambda a: a[None], fn(states, *args, **kwargs))
  by_data = P(sharding.DATA)
  return jax.shard_map(local, mesh=mesh, in_specs=(by_data,) * (1 + len(args)),
                       out_specs=by_data, check_vma=False)(states, *args)


def on_one_pool(fn, args: tuple[int, ...], outs: tuple[int, ...]):
  """`fn`, a step written for one pool on one device, on the runner's arrays
  of a 1x1 mesh (stacked per data shard, `[1, ...]`): its positional
  arguments at `args` lose their leading axis, its outputs at `outs` (a
  tuple) gain it back. Inside jit both are reshapes."""
  @functools.wraps(fn)
  def wrapped(*a, **kwargs):
    a = list(a)
    for i in args:
      a[i] = jax.tree.map(lambda v: v[0], a[i])
    out = list(fn(*a, **kwargs))
    for i in outs:
      out[i] = jax.tree.map(lambda v: v[None], out[i])
    return tuple(out)
  return wrapped


def sample_rows(slots: slot_state_lib.SlotState, state: bm.BlockState,
                x: StepInputs) -> slot_state_lib.SampleRows:
  """The sample rows' parameters: their slots' rows of `slots`, the
  position of each one's token being sampled from `state` (after this
  step's bookkeeping: the slot's tokens so far, this step's included)."""
  return slot_state_lib.gather(slots, state.seq_lens, x.sample_seqs,
                               x.seed_offsets)


def bookkeeping_step(state: bm.BlockState, x: StepInputs, *, num_logprobs: int):
  """A step with no entries (only releases, registrations, forks to run:
  e.g. the sequences that finished in the last step): `device_step`'s
  bookkeeping and nothing else -- no model, no sampling (pure; jit it with
  the state donated). With every entry padding nothing is reserved, so no
  block is copied and the cache is untouched.

  Returns:
    `(state, StepOutputs)`, the outputs of `x.seq_ids.shape[0]` rows, all
    padding (`ok` False, no tokens).
  """
  state, fork_ok, res = _bookkeeping(state, x)
  return state, bookkeeping_outputs(res.ok, fork_ok, state_fingerprint(state),
                                    num_logprobs=num_logprobs)


def bookkeeping_outputs(ok: jax.Array, fork_ok: jax.Array, fingerprint: jax.Array,
                        *, num_logprobs: int) -> StepOutputs:
  """The outputs of a bookkeeping-only step (every pool layout's
  `bookkeeping_step`): its reservation and fork results and fingerprint, no
  tokens (zeros) for its `S = ok.shape[0]` rows."""
  S = ok.shape[0]
  return StepOutputs(
      jnp.zeros((S,), jnp.int32), jnp.zeros((S, num_logprobs), jnp.float32),
      jnp.zeros((S, num_logprobs), jnp.int32), ok, fork_ok,
      jnp.zeros((S,), jnp.float32), fingerprint)


def input_tokens(last_tokens: jax.Array, x: StepInputs) -> jax.Array:
  """i32[num_tokens]: the host's `x.tokens`, or where `x.token_slots >= 0`
  the last token sampled for that slot (a token the host has not seen yet)."""
  slots = x.token_slots
  return jnp.where(slots >= 0, last_tokens[jnp.maximum(slots, 0)], x.tokens)


def store_tokens(last_tokens: jax.Array, slots: jax.Array, tokens: jax.Array
                 ) -> jax.Array:
  """`last_tokens` with `tokens[i]` stored at `slots[i]` (-1: dropped)."""
  idx = jnp.where(slots >= 0, slots, last_tokens.shape[0])  # past the end: drop
  return last_tokens.at[idx].set(tokens, mode="drop")


BOOKKEEPING_FIELDS = ("register_seqs", "register_cols", "release_early",
                      "fork_parents", "fork_children", "release_late",
                      "share_seqs", "share_blocks", "share_counts", "seq_ids",
                      "q_lens")


def bookkeeping(state: bm.BlockState, register_seqs, register_cols,
                release_early, fork_parents, fork_children, release_late,
                share_seqs, share_blocks, share_counts, seq_ids, q_lens, *,
                present: tuple[bool, bool, bool] = (True, True, True)):
  """A step's block bookkeeping on one pool: register -> release -> fork ->
  release -> share -> reserve (the arrays of `StepInputs` of the same names,
  in `BOOKKEEPING_FIELDS` order).

  Registering first lets a sequence released in this step leave its full
  blocks cached; sharing before reserving keeps a hit's blocks out of this
  step's evictions. Without prefix caching (`state.prefix_caching` False)
  the register and share arrays are empty and skipped. Padding rows (-1)
  change nothing.

  `present` (static) says which of `release_early`, the forks and
  `release_late` hold any entry; an empty one (all -1) changes nothing, so
  leaving it out gives the same result with less work (the device step runs
  all three).

  The one function that decides blocks: the device step runs it, and the
  host applies the same transitions to its exact NumPy model of the pool
  first (`host_pool.HostPool.bookkeeping`, in `scheduler.Scheduler._fit`),
  so the host plans with exactly what the device will grant.

  Returns:
    `(state, fork_ok bool[max_batch], Reservation, cache_ok bool[R + H])`:
    `cache_ok` is the register and share rows' `ok` (True on padding rows).
  """
  early, forks, late = present
  cache_ok = jnp.ones((0,), bool)
  if state.prefix_caching:
    state, reg_ok = _unless_empty(bm.register, state, register_seqs, register_cols)
    cache_ok = reg_ok | (register_seqs < 0)
  if early:
    state, _ = _unless_empty(bm.release, state, release_early)
  if forks:
    state, fork_ok = _unless_empty(bm.fork, state, fork_parents, fork_children)
  else:
    fork_ok = jnp.zeros(fork_parents.shape, bool)
  if late:
    state, _ = _unless_empty(bm.release, state, release_late)
  if state.prefix_caching:
    # Padding rows ask for 1 block of slot -1: refused, nothing changes.
    if state.window is None:
      state, share_ok = _unless_empty(bm.share, state, share_seqs, share_blocks,
                                      jnp.maximum(share_counts, 1))
    else:  # only the hit's last window (`window_reclaim.share`)
      state, share_ok = _unless_empty(window_reclaim.share, state, share_seqs,
                                      share_blocks, share_counts)
    cache_ok = jnp.concatenate([cache_ok, share_ok | (share_seqs < 0)])
  state, res = bm.reserve(state, seq_ids, q_lens)
  return state, fork_ok, res, cache_ok


def _unless_empty(op, state: bm.BlockState, ids, *args):
  """`op(state, ids, *args)`, skipped (`(state, all False)`) when every id is
  padding (-1). Such a call changes nothing -- for `share` given that
  `lru_len` is already 0 whenever nothing is cached, which holds between
  steps because every `reserve` resets it -- but it still costs its full
  work: `release` sorts `len(ids) * max_blocks_per_seq` entries (measured:
  most of a stub model's decode step at batch 256 on CPU). A `lax.cond`, so
  only the taken branch runs (the step runs it per data shard under
  `shard_map`, `over_pools`: under `vmap` it would become a select that
  runs both)."""
  n = ids.shape[0]
  if n == 0:
    return op(state, ids, *args)
  return jax.lax.cond(jnp.any(ids >= 0), lambda st: op(st, ids, *args),
                      lambda st: (st, jnp.zeros((n,), bool)), state)


def state_fingerprint(state: bm.BlockState) -> jax.Array:
  """u32[5], a cheap checksum of one pool's block state: `(num_free,
  num_cached, sum w*seq_lens, sum w*refcounts, sum w*(block_tables + 1))`,
  wrapping mod 2**32, with odd weights `w = 2 * index + 1`. The scheduler's
  NumPy model of the pool (`host_pool.HostPool.fingerprint`) computes the
  same, and compares them when the step's results arrive."""
  u32 = jnp.uint32

  def weighted(a):
    a = a.reshape(-1).astype(u32)
    return jnp.sum(a * (2 * jnp.arange(a.shape[0], dtype=u32) + 1), dtype=u32)

  num_cached = (state.num_cached if state.prefix_caching
                else jnp.zeros((), jnp.int32))
  return jnp.stack([state.num_free.astype(u32), num_cached.astype(u32),
                    weighted(state.seq_lens), weighted(state.refcounts),
                    weighted(state.block_tables + 1)])


def bookkeeping_args(x: StepInputs) -> tuple:
  """`x`'s arguments of `bookkeeping`, in order."""
  return tuple(getattr(x, f) for f in BOOKKEEPING_FIELDS)


def _bookkeeping(state: bm.BlockState, x: StepInputs):
  state, fork_ok, res, _ = bookkeeping(state, *bookkeeping_args(x))
  return state, fork_ok, res


def _sample(logits, p: slot_state_lib.SampleRows, num_logprobs: int):
  """Sampled tokens, top log-probs and the sampled tokens' log-probs of the
  sample rows' logits (`p`: their parameters), after `logit_bias` and then
  the bans (so a banned id stays banned whatever its bias); the log-probs
  are of these logits. The top log-probs (a top-k over the vocabulary) are
  computed only when some row reads them (`p.wants_top`, a `lax.cond`;
  zeros otherwise, and the host then does not fetch them)."""
  logits = sampling.add_bias(logits, p.bias_ids, p.bias_values)
  logits = sampling.ban_tokens(logits, p.bans())
  tokens = sampling.sample_tokens(logits, p.temperature, p.top_k, p.top_p,
                                  p.seeds, p.positions)
  if p.wants_top is None:
    top_lp, top_ids = sampling.top_logprobs(logits, num_logprobs)
  else:
    top = functools.partial(sampling.top_logprobs, k=num_logprobs)
    none = lambda lg: jax.tree.map(  # noqa: E731
        lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(top, lg))
    top_lp, top_ids = jax.lax.cond(jnp.any(p.wants_top > 0), top, none, logits)
  return tokens, top_lp, top_ids, sampling.token_logprobs(logits, tokens)
