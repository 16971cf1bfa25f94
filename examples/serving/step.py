"""The engine's device step: one jitted function per compiled shape.

`device_step` is pure: the cache and the block state go in and come out, and
nothing else changes. Its order is

  release (finished, preempted) -> fork (new samples / beams) -> release
  (finished fork parents) -> reserve (this step's tokens) -> copy-on-write ->
  `step_metadata` (once for every layer) -> `Llama.paged_forward` -> logits of
  the rows to sample -> sampling and top log-probs.

A refused reservation leaves that sequence's state as it was, its rows write
nothing and attend to nothing (`step_metadata(active=...)`), and the host sees
`ok == False`.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from examples.serving import sampling
from paged_jax import block_manager as bm
from paged_jax import flax_attention
from paged_jax import kv_cache as kv_cache_lib


@flax.struct.dataclass
class StepInputs:
  """One step's host-built arrays (shapes fixed by `EngineConfig`)."""

  release_early: jax.Array  # i32[max_seqs]  before forks; -1 = none
  release_late: jax.Array  # i32[max_seqs]   after forks (finished fork parents)
  fork_parents: jax.Array  # i32[max_batch]
  fork_children: jax.Array  # i32[max_batch]
  seq_ids: jax.Array  # i32[max_batch]  entries in priority order, -1 padding
  q_lens: jax.Array  # i32[max_batch]
  tokens: jax.Array  # i32[num_tokens]  ragged layout
  sample_rows: jax.Array  # i32[max_batch]  token row each sample reads
  temperature: jax.Array  # f32[max_batch]
  top_k: jax.Array  # i32[max_batch]
  top_p: jax.Array  # f32[max_batch]
  seeds: jax.Array  # i32[max_batch]
  positions: jax.Array  # i32[max_batch]  position of the token being sampled


@flax.struct.dataclass
class StepOutputs:
  tokens: jax.Array  # i32[max_batch]  sampled token per sample row
  top_logprobs: jax.Array  # f32[max_batch, num_logprobs]
  top_ids: jax.Array  # i32[max_batch, num_logprobs]
  ok: jax.Array  # bool[max_batch]  reservation per entry
  fork_ok: jax.Array  # bool[max_batch]
  num_free: jax.Array  # i32[]
  exclusive_blocks: jax.Array  # i32[max_seqs]  blocks releasing the slot frees
  tail_shared: jax.Array  # bool[max_seqs]  next write into the slot copies


def device_step(graphdef, params, cache: kv_cache_lib.KVCache,
                state: bm.BlockState, x: StepInputs, *, decode_only: bool,
                num_logprobs: int):
  """The serving step (pure; jit it with the cache and state donated).

  Args:
    graphdef: the model's `nnx.GraphDef` (static).
    params: the model's state from `nnx.split`.
    cache: the `KVCache`.
    state: the `BlockState`.
    x: the step's `StepInputs`.
    decode_only: static; the decode layout (one token row per entry).
    num_logprobs: static; top log-probs returned per sample row.

  Returns:
    `(cache, state, StepOutputs)`.
  """
  model = nnx.merge(graphdef, params)
  state, _ = bm.release(state, x.release_early)
  state, fork_ok = bm.fork(state, x.fork_parents, x.fork_children)
  state, _ = bm.release(state, x.release_late)
  state, res = bm.reserve(state, x.seq_ids, x.q_lens)
  cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
  meta = flax_attention.step_metadata(
      state, x.seq_ids, x.q_lens, num_tokens=x.tokens.shape[0], active=res.ok,
      decode_only=decode_only)
  hidden, cache = model.paged_forward(x.tokens, meta, cache)
  logits = model.logits(hidden[x.sample_rows])
  tokens = sampling.sample_tokens(logits, x.temperature, x.top_k, x.top_p,
                                  x.seeds, x.positions)
  top_lp, top_ids = sampling.top_logprobs(logits, num_logprobs)
  exclusive, tail_shared = sharing(state)
  return cache, state, StepOutputs(tokens, top_lp, top_ids, res.ok, fork_ok,
                                   state.num_free, exclusive, tail_shared)


def sharing(state: bm.BlockState) -> tuple[jax.Array, jax.Array]:
  """Per sequence slot: blocks only it references (what releasing it frees),
  and whether its partial last block is shared (its next write copies it).

  The host plans admissions and preemptions with these exact figures.

  Returns:
    `(i32[max_seqs], bool[max_seqs])`.
  """
  tables = state.block_tables
  refs = state.refcounts[jnp.clip(tables, 0, state.num_blocks - 1)]
  exclusive = jnp.sum((tables >= 0) & (refs == 1), axis=1, dtype=jnp.int32)
  bs = state.block_size
  last = jnp.maximum((state.seq_lens + bs - 1) // bs - 1, 0)
  tail_refs = jnp.take_along_axis(refs, last[:, None], axis=1)[:, 0]
  return exclusive, (state.seq_lens % bs != 0) & (tail_refs > 1)


# One jitted step shared by every engine: engines with the same model structure
# and sizes reuse the compiled executables (the graphdef is a static argument).
shared_step = jax.jit(device_step, static_argnums=(0,), donate_argnums=(2, 3),
                      static_argnames=("decode_only", "num_logprobs"))
