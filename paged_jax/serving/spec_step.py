"""The device side of speculative decoding: one verification step.

In a steady decode state with `EngineConfig.speculative_config` set (see
`spec_host.spec_ok`), the host proposes up to `k` draft tokens per row
(n-gram prompt lookup, `spec_host.ngram_drafts`) and the engine runs ONE
jitted program per decode bucket of `S` rows:

1. the step's ordinary bookkeeping (`step.bookkeeping`: releases, forks,
   the reserve of one token per row, exactly as a decode step), then a
   second `block_manager.reserve` of each row's `d <= k` draft slots, and
   the copy-on-write copies of both;
2. the target model on the ragged (mixed) layout of `S * (1 + k)` token
   rows: row `i` runs `1 + d_i` query rows, its last token then its drafts;
3. the greedy token after every query row (argmax, the ordinary step's
   temperature-0 choice) and `speculative.greedy_accept`: `a_i <= d_i`
   drafts accepted, `a_i + 1` tokens emitted;
4. `block_manager.truncate` of each row to `L + 1 + a_i` tokens: the slots
   of rejected drafts go back in the same program, before any later step
   could register a block for the prefix cache, so no block holding an
   unverified token is ever registered.

The host applies the first reserve (`_fit`) and the draft reserve
(`spec_host.dispatch`) to its pool model before dispatch, and replays the
truncate from `accepted` when the results arrive (`spec_host.resolve`), so
the fingerprint check holds as for any step.
"""

from __future__ import annotations

import chex
import flax
import jax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import speculative
from paged_jax import step_metadata as step_metadata_lib
from paged_jax.serving import compiler, sampling
from paged_jax.serving.step import (ModelDef, StepInputs, bookkeeping,
                                    bookkeeping_args, state_fingerprint,
                                    store_tokens)


@flax.struct.dataclass
class SpecInputs:
  """A verification step's inputs besides the decode `StepInputs` (`S`: the
  decode bucket's rows, `k`: `num_speculative_tokens`, `T = S * (1 + k)`)."""

  drafts: jax.Array  # i32[S, k]  draft tokens, -1 past num_draft
  num_draft: jax.Array  # i32[S]  drafts of each row (0 on padding rows)
  tokens: jax.Array  # i32[T]  ragged layout: row i's last token, its drafts
  query_rows: jax.Array  # i32[S, 1 + k]  token row of each query (0 past it)


@flax.struct.dataclass
class SpecOutputs:
  tokens: jax.Array  # i32[S, 1 + k]  emitted tokens per row, -1 past a + 1
  token_logprobs: jax.Array  # f32[S, 1 + k]  their log-probs
  accepted: jax.Array  # i32[S]  drafts accepted per row (a)
  ok: jax.Array  # bool[S]  the one-token reservations (the host knew them)
  fork_ok: jax.Array  # bool[max_batch]
  draft_ok: jax.Array  # bool[S]  the draft reservations (the host knew them)
  fingerprint: jax.Array  # u32[5]  `state_fingerprint` after the truncate


def spec_device_step(model_def: ModelDef, params, cache: kv_cache_lib.KVCache,
                     state: bm.BlockState, last_tokens: jax.Array,
                     x: StepInputs, s: SpecInputs):
  """One verification step (see the module docstring); pure, jit it with
  the cache, state and last tokens donated.

  Args:
    model_def, params, cache, state, last_tokens: as in `step.device_step`.
    x: the decode bucket's `StepInputs` (its bookkeeping; entry `i` is row
      `i`, one token each). Its token and sampling arrays are not used.
    s: the rows' `SpecInputs`.

  Returns:
    `(cache, state, last_tokens, SpecOutputs)`.
  """
  model = model_def.merge(params)
  S, k = s.drafts.shape
  state, fork_ok, res, _ = bookkeeping(state, *bookkeeping_args(x))
  cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
  real = x.seq_ids >= 0
  state, dres = bm.reserve(state, x.seq_ids, s.num_draft)
  cache = jax.lax.cond(jnp.any(dres.copy_src >= 0),
                       lambda c: kv_cache_lib.copy_blocks(c, dres.copy_src,
                                                          dres.copy_dst),
                       lambda c: c, cache)
  active = res.ok & dres.ok
  q_lens = jnp.where(real, 1 + s.num_draft, 0)
  meta = step_metadata_lib.step_metadata(
      state, x.seq_ids, q_lens, num_tokens=s.tokens.shape[0], active=active)
  hidden, cache = model.paged_forward(s.tokens, meta, cache)
  logits = model.logits(hidden[s.query_rows.reshape(-1)])  # [S * (1 + k), V]
  target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  emitted, accepted = speculative.greedy_accept(
      s.drafts, target.reshape(S, 1 + k), jnp.where(active, s.num_draft, 0))
  # The log-prob of each emitted token under its query row's logits.
  lps = sampling.token_logprobs(logits, jnp.maximum(emitted, 0).reshape(-1))
  lps = jnp.where(emitted >= 0, lps.reshape(S, 1 + k), 0.0)
  sid = jnp.clip(x.seq_ids, 0, state.max_seqs - 1)
  keep = state.seq_lens[sid] - (s.num_draft - jnp.maximum(accepted, 0))
  state, _ = bm.truncate(state, jnp.where(real & active, x.seq_ids, -1), keep)
  last = jnp.take_along_axis(emitted, jnp.maximum(accepted, 0)[:, None],
                             axis=1)[:, 0]
  last_tokens = store_tokens(last_tokens, jnp.where(real & active, x.seq_ids, -1),
                             last)
  return cache, state, last_tokens, SpecOutputs(
      emitted, lps, accepted, res.ok, fork_ok, dres.ok, state_fingerprint(state))


_DONATE = (2, 3, 4)  # cache, block state, last tokens
_spec_jit = jax.jit(spec_device_step, static_argnums=(0,), donate_argnums=_DONATE)


def _jit_for(runner, bucket, k: int):
  """The shared jitted verification step, or with `config.check_traces` this
  runner's own trace-counted one for `bucket`."""
  if not runner.config.check_traces:
    return _spec_jit

  def traced(model_def, params, cache, state, last_tokens, x, s):
    return spec_device_step(model_def, params, cache, state, last_tokens, x, s)

  traced.__name__ = f"spec_{k}_step_{bucket.num_seqs}"
  return jax.jit(chex.assert_max_traces(traced, n=1), static_argnums=(0,),
                 donate_argnums=_DONATE)


def compile_spec(runner, inputs: dict, k: int) -> float:
  """Compiles the verification step of every bucket in `inputs` (`{bucket:
  (StepInputs, SpecInputs)}`) that `runner` lacks, in parallel; runs
  nothing. Returns the seconds spent (added to `runner.compile_seconds`)."""
  if runner.mesh is not None:
    raise ValueError("speculative decoding runs on one device, not on a mesh")
  steps = runner.__dict__.setdefault("_spec_steps", {})

  def lowerer(b, x, s):
    specs = jax.tree.map(compiler.spec, (x, s))
    return lambda: _jit_for(runner, b, k).lower(
        runner._model_def, runner._params, runner.cache, runner.state,  # pylint: disable=protected-access
        runner.last_tokens, *specs)

  jobs = {(runner._key, "spec", k, b): lowerer(b, x, s)  # pylint: disable=protected-access
          for b, (x, s) in inputs.items() if (b, k) not in steps}
  done, seconds = compiler.compile_all(jobs)
  for (_, _, kk, b), exe in done.items():
    steps[b, kk] = exe
  runner.compile_seconds += seconds
  return seconds


def dispatch_spec(runner, bucket, x: StepInputs, s: SpecInputs) -> SpecOutputs:
  """Launches the verification step on `runner`'s arrays (compiling it first
  if needed); returns its `SpecOutputs`, still on the device."""
  k = s.drafts.shape[1]
  steps = runner.__dict__.setdefault("_spec_steps", {})
  exe = steps.get((bucket, k))
  if exe is None:
    compile_spec(runner, {bucket: (x, s)}, k)
    exe = steps[bucket, k]
  runner.cache, runner.state, runner.last_tokens, out = exe(
      runner._params, runner.cache, runner.state, runner.last_tokens, x, s)  # pylint: disable=protected-access
  return out


def fetch_spec(out: SpecOutputs) -> SpecOutputs:
  """Waits for a verification step's outputs; returns them on the host."""
  return jax.device_get(out)
