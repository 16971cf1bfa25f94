"""Multi-step decode on the device: K decode steps in one dispatch.

In a steady decode state (nothing waits for admission, every entry decodes
one generated token; see `multistep_host.MultiStep.multistep_ok`) the engine
runs `EngineConfig.num_scheduler_steps` decode steps in ONE jitted program:

* iteration 0 is the ordinary `step.device_step` on the host-built
  `StepInputs` (its bookkeeping -- releases, registrations, the reserve of
  one token per row -- already applied to the host's pool model);
* iterations 1..K-1 run in a `lax.while_loop` on the device alone: each
  reserves one token for every row still active (`block_manager.reserve`,
  rows in the same priority order, so blocks are taken on the device as rows
  cross block boundaries), copies a shared partial block if needed, computes
  the rows' next token from the one sampled before and samples.

With a sliding window on the pool (`window_reclaim`), each iteration gives
back, after the model, the blocks its rows made invisible, as a single step
does.

A row stops inside the loop (its later iterations reserve, write and attend
nothing) when it samples one of its stop ids (`SamplingParams.stop_ids`),
when it reaches its budget (`max_new_tokens`, `max_model_len`: the host's
`MultiStepInputs.budget`), or when its reservation is refused (the pool is
full: `refused`). A row whose input token of iteration 0 is a stop id (an
EOS sampled by the step still in flight, so iteration 0's token is void)
runs iteration 0 only, as a single step would. The loop ends early when
every row has stopped.

The host learns what happened from `counts` (tokens sampled per row) and
`refused`, and replays the same reserves on its pool model
(`multistep_host.MultiStep.resolve_multistep`), so the fingerprint check
still holds. Allocation on the device inside a loop is possible because the
allocator is a pure function in jit: vLLM's engine, whose allocator lives on
the host, cannot do it.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import step_metadata as step_metadata_lib
from paged_jax import window_reclaim
from paged_jax.serving.step import (ModelDef, StepInputs, _sample, device_step,
                                    input_tokens, sample_rows,
                                    state_fingerprint, store_tokens)

MAX_STOP_IDS = 8  # stop ids per row the loop checks; a row with more: K = 1
MAX_STEPS = 64  # most decode steps per dispatch (`num_scheduler_steps`)


@flax.struct.dataclass
class MultiStepInputs:
  """Per-row inputs of the loop (`S`: the decode bucket's rows, row `i` is
  entry `i` of `StepInputs` and its sample row). The rows' sampling
  parameters (`min_tokens` bans included) are their slots' on the device
  (`slot_state.SlotState`)."""

  budget: jax.Array  # i32[S]  most tokens the row samples here (>= 1; 0 padding)
  stop_ids: jax.Array  # i32[S, MAX_STOP_IDS]  ids that end the row, -1 = none


@flax.struct.dataclass
class MultiStepOutputs:
  """What one K-step dispatch returns (`K` = `num_steps`, `L` = top
  log-probs). The fields that share `step.StepOutputs`' names mean the same,
  with a leading `[K]` axis for the per-iteration ones."""

  tokens: jax.Array  # i32[K, S]  token sampled per iteration and row, -1 none
  top_logprobs: jax.Array  # f32[K, S, L]
  top_ids: jax.Array  # i32[K, S, L]
  ok: jax.Array  # bool[S]  iteration 0's reservations
  fork_ok: jax.Array  # bool[max_batch]  iteration 0's forks
  token_logprobs: jax.Array  # f32[K, S]
  fingerprint: jax.Array  # u32[5]  `state_fingerprint` after the last iteration
  counts: jax.Array  # i32[S]  tokens sampled per row (iteration 0 included)
  refused: jax.Array  # bool[S]  the row stopped on a refused reservation


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """bool[S]: `tokens[i]` is one of row `i`'s stop ids (-1 matches none)."""
  return jnp.any((tokens[:, None] == stop_ids) & (stop_ids >= 0), axis=1)


def multistep_device_step(model_def: ModelDef, params,
                          cache: kv_cache_lib.KVCache, state: bm.BlockState,
                          last_tokens: jax.Array, slots, x: StepInputs,
                          m: MultiStepInputs, *, mesh: Mesh, num_steps: int,
                          num_logprobs: int):
  """Up to `num_steps` decode steps in one program (see the module
  docstring); pure, jit it with the cache, state and last tokens donated.

  Args:
    model_def, params, cache: as in `step.device_step`.
    state, last_tokens, slots: one pool's (no `[data]` axis; the runner's
      arrays of a 1x1 mesh go through `step.on_one_pool`).
    x: the decode bucket's `StepInputs` for iteration 0 (entry `i` is sample
      row `i`, every real entry one token that samples).
    m: the rows' `MultiStepInputs`.
    mesh: static; the 1x1 mesh of the device (iteration 0 is
      `step.device_step` on it).
    num_steps: static K >= 1, iterations at most.
    num_logprobs: static; top log-probs per row and iteration.

  Returns:
    `(cache, state, last_tokens, MultiStepOutputs)`.
  """
  rows = x.seq_ids.shape[0]
  prev = input_tokens(last_tokens, x)  # iteration 0's inputs (decode layout)
  one = lambda t: jax.tree.map(lambda v: v[None], t)  # noqa: E731  # a 1x1 mesh's
  cache, states, last_tokens, out0 = device_step(
      model_def, params, cache, one(state), one(last_tokens), one(slots), one(x),
      mesh=mesh, decode_only=True, num_logprobs=num_logprobs)
  state, last_tokens, out0 = jax.tree.map(lambda v: v[0],
                                          (states, last_tokens, out0))
  # Iteration 0's parameters; iteration j samples at position + j.
  rows0 = sample_rows(slots, state, x)
  model = model_def.merge(params)
  real = (x.seq_ids >= 0) & out0.ok
  count = real.astype(jnp.int32)
  active = (real & ~is_stop(prev, m.stop_ids) & ~is_stop(out0.tokens, m.stop_ids)
            & (count < m.budget))
  K = num_steps
  toks = jnp.full((K, rows), -1, jnp.int32).at[0].set(out0.tokens)
  lps = jnp.zeros((K, rows), jnp.float32).at[0].set(out0.token_logprobs)
  top_lp = jnp.zeros((K,) + out0.top_logprobs.shape, jnp.float32).at[0].set(
      out0.top_logprobs)
  top_ids = jnp.zeros((K,) + out0.top_ids.shape, jnp.int32).at[0].set(out0.top_ids)
  refused = jnp.zeros((rows,), bool)
  safe_slots = jnp.maximum(x.seq_ids, 0)

  def cond(carry):
    j, active = carry[0], carry[4]
    return (j < K) & jnp.any(active)

  def body(carry):
    j, cache, state, last_tokens, active, count, refused, toks, lps, top_lp, top_ids = carry
    seq = jnp.where(active, x.seq_ids, -1)
    state, res = bm.reserve(state, seq, active.astype(jnp.int32))
    ok = res.ok & active
    cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
    # Every real row keeps its row in the layout (entries in use first);
    # a stopped one writes and attends to nothing (`active`).
    meta = step_metadata_lib.step_metadata(
        state, x.seq_ids, x.q_lens, num_tokens=rows, active=ok,
        decode_only=True)
    hidden, cache = model.paged_forward(last_tokens[safe_slots], meta, cache)
    if state.window is not None:  # as `step.device_step`: after the model
      # Each iteration grows a row by one token, so its stop column moves by
      # at most one: one deferred column is the bound here (iteration 0,
      # `device_step`, reclaimed what earlier steps deferred).
      state = window_reclaim.reclaim(state, seq, active.astype(jnp.int32), ok,
                                     max_new_tokens=1, deferred_columns=1)
    tok, tlp, tid, tok_lp = _sample(model.logits(hidden),
                                    rows0.replace(positions=rows0.positions + j),
                                    num_logprobs)
    last_tokens = store_tokens(last_tokens, jnp.where(ok, x.seq_ids, -1), tok)
    toks = toks.at[j].set(jnp.where(ok, tok, -1))
    lps = lps.at[j].set(tok_lp)
    top_lp = top_lp.at[j].set(tlp)
    top_ids = top_ids.at[j].set(tid)
    refused = refused | (active & ~res.ok)
    count = count + ok.astype(jnp.int32)
    active = ok & ~is_stop(tok, m.stop_ids) & (count < m.budget)
    return (j + 1, cache, state, last_tokens, active, count, refused, toks, lps,
            top_lp, top_ids)

  carry = (jnp.int32(1), cache, state, last_tokens, active, count, refused, toks,
           lps, top_lp, top_ids)
  (_, cache, state, last_tokens, _, count, refused, toks, lps, top_lp,
   top_ids) = jax.lax.while_loop(cond, body, carry)
  return cache, state, last_tokens, MultiStepOutputs(
      toks, top_lp, top_ids, out0.ok, out0.fork_ok, lps, state_fingerprint(state),
      count, refused)

