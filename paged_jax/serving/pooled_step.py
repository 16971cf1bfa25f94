"""The device step of a hybrid model with one KV pool per attention window.

`PooledState` holds one `BlockState` per pool (`window_pool.py` sizes
them; pool `g` serves the layers of window `windows[g]`, None = global). The
step is `step.device_step` with every block operation run once per pool on
the same inputs (every pool holds every sequence, at the same length):

  bookkeeping per pool -> copy-on-write per pool's cache -> `step_metadata`
  per pool -> the model over the pools' caches
  (`models.llama.pooled.paged_forward_pooled`) -> reclamation in the local
  pools (`window_reclaim.reclaim`) -> sampling (the lengths of pool 0,
  which every pool shares) -> fingerprints, `u32[num_pools, 5]`.

A sequence is served only where every pool granted it: the host's model
(`window_pool.PooledHost`) plans so that all pools grant every entry, and a
pool refusing one would show in `ok` and the fingerprints.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import step_metadata as step_metadata_lib
from paged_jax import window_reclaim
from paged_jax.models.llama import pooled as pooled_model
from paged_jax.serving import step as step_lib


@flax.struct.dataclass
class PooledState:
  """One `BlockState` per pool (a pytree). Reads like one state where the
  scheduler asks: no prefix caching, pool 0's block size."""

  states: tuple

  @property
  def prefix_caching(self) -> bool:
    return False

  @property
  def block_size(self) -> int:
    return self.states[0].block_size

  @property
  def windows(self) -> tuple:
    return tuple(s.window for s in self.states)

  @property
  def seq_lens(self) -> jax.Array:
    return self.states[0].seq_lens


def _bookkeeping(states: PooledState, x: step_lib.StepInputs):
  out = [step_lib.bookkeeping(s, *step_lib.bookkeeping_args(x))
         for s in states.states]
  ok = out[0][2].ok
  fork_ok = out[0][1]
  for _, f, r, _ in out[1:]:
    ok &= r.ok
    fork_ok &= f
  return PooledState(tuple(o[0] for o in out)), fork_ok, ok, [o[2] for o in out]


def fingerprint(states: PooledState) -> jax.Array:
  """`u32[num_pools, 5]`: `step.state_fingerprint` of each pool."""
  return jnp.stack([step_lib.state_fingerprint(s) for s in states.states])


def device_step(model_def, params, caches: tuple, states: PooledState,
                last_tokens: jax.Array, slots, x: step_lib.StepInputs, *,
                decode_only: bool, num_logprobs: int):
  """`step.device_step` over the pools (see the module docstring).

  Returns:
    `(caches, states, last_tokens, StepOutputs)`.
  """
  model = model_def.merge(params)
  states, fork_ok, ok, res = _bookkeeping(states, x)
  caches = tuple(kv_cache_lib.copy_blocks(c, r.copy_src, r.copy_dst)
                 for c, r in zip(caches, res))
  metas = [step_metadata_lib.step_metadata(
      s, x.seq_ids, x.q_lens, num_tokens=x.tokens.shape[0], active=ok,
      decode_only=decode_only) for s in states.states]
  hidden, caches = pooled_model.paged_forward_pooled(
      model, step_lib.input_tokens(last_tokens, x), metas, caches)
  states = PooledState(tuple(
      s if s.window is None else window_reclaim.reclaim(
          s, x.seq_ids, x.q_lens, r.ok, max_new_tokens=x.tokens.shape[0])
      for s, r in zip(states.states, res)))
  tokens, top_lp, top_ids, token_lp = step_lib._sample(  # pylint: disable=protected-access
      model.logits(hidden[x.sample_rows]),
      step_lib.sample_rows(slots, states.states[0], x), num_logprobs)
  last_tokens = step_lib.store_tokens(last_tokens, x.sample_slots, tokens)
  return caches, states, last_tokens, step_lib.StepOutputs(
      tokens, top_lp, top_ids, ok, fork_ok, token_lp, fingerprint(states))


def bookkeeping_step(states: PooledState, x: step_lib.StepInputs, *,
                     num_logprobs: int):
  """`step.bookkeeping_step` over the pools."""
  states, fork_ok, ok, _ = _bookkeeping(states, x)
  S = x.seq_ids.shape[0]
  return states, step_lib.StepOutputs(
      jnp.zeros((S,), jnp.int32), jnp.zeros((S, num_logprobs), jnp.float32),
      jnp.zeros((S, num_logprobs), jnp.int32), ok, fork_ok,
      jnp.zeros((S,), jnp.float32), fingerprint(states))


def init(pool_blocks, windows, *, block_size: int, max_seqs: int,
         max_blocks_per_seq: int) -> PooledState:
  """Empty pools: `pool_blocks[g]` blocks for window `windows[g]`."""
  return PooledState(tuple(
      bm.init(num_blocks=n, block_size=block_size, max_seqs=max_seqs,
              max_blocks_per_seq=max_blocks_per_seq, window=w)
      for n, w in zip(pool_blocks, windows)))
