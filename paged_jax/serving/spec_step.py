"""The device side of speculative decoding: one verification step.

In a steady decode state with `EngineConfig.speculative_config` set (see
`spec_host.spec_ok`), the host proposes up to `k` draft tokens per row
(n-gram prompt lookup, `spec_host.ngram_drafts`) and the engine runs ONE
jitted program per decode bucket of `S` rows and draft budget `D`
(`draft_budgets`: at most `NUM_BUDGETS` sizes per bucket, the smallest
that holds this step's drafts):

1. the step's ordinary bookkeeping (`step.bookkeeping`: releases, forks,
   the reserve of one token per row, exactly as a decode step), then a
   second `block_manager.reserve` of each row's `d <= k` draft slots, and
   the copy-on-write copies of both;
2. the target model on the ragged (mixed) layout of `T = S + D` token rows:
   row `i` runs `1 + d_i` query rows, its last token then its drafts (a row
   without drafts one, as in a decode step);
3. `verify`: after every query row the ordinary sampler's token
   (`sampling.sample_tokens`, after `logit_bias` and the bans) with the key
   the plain step would use for that position, `(seed, position)`, then
   `speculative.greedy_accept` of the drafts against those tokens: a draft
   is accepted iff the draw equals it, and the draw at the first mismatch
   is emitted. At temperature 0 the draw is the argmax (greedy). At
   temperature > 0, for a point-mass draft (n-gram) this is exactly
   rejection sampling (Leviathan et al. with `q` one-hot: the draft `x` is
   accepted with probability `p(x)`, and a rejection's token follows
   `p` without `x`, renormalised); and because the key depends only on
   `(seed, position)`, the tokens are exactly those that plain decoding
   samples for the same seed;
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

import time

import flax
import jax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import speculative
from paged_jax import step_metadata as step_metadata_lib
from paged_jax.serving import compiler, sampling, spec_draft
from paged_jax.serving import slot_state as slot_state_lib
from paged_jax.serving.step import (ModelDef, StepInputs, bookkeeping,
                                    on_one_pool,
                                    bookkeeping_args, state_fingerprint,
                                    store_tokens)

NUM_BUDGETS = 5  # verification sizes compiled per decode bucket


def draft_budgets(num_seqs: int, k: int) -> tuple[int, ...]:
  """The draft-token budgets `D` compiled for a decode bucket of `num_seqs`
  rows and `k` drafts per row, smallest first: `ceil(num_seqs * k / 2**i)`
  for `i < NUM_BUDGETS` (at most `NUM_BUDGETS` sizes; the largest holds
  every row's `k` drafts).

  Raises:
    ValueError: if `num_seqs` or `k` is not a positive int.

  Example:
    >>> draft_budgets(16, 4)
    (4, 8, 16, 32, 64)
  """
  for name, v in (("num_seqs", num_seqs), ("k", k)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  return tuple(sorted({-(-num_seqs * k // 2 ** i) for i in range(NUM_BUDGETS)}))


def choose_budget(budgets: tuple[int, ...], num_drafts: int) -> int:
  """The smallest budget of `budgets` (ascending) that holds `num_drafts`.

  Raises:
    ValueError: if none does.
  """
  for b in budgets:
    if b >= num_drafts:
      return b
  raise ValueError(f"num_drafts={num_drafts} exceeds the largest draft budget "
                   f"{budgets[-1]} (budgets {budgets})")


@flax.struct.dataclass
class SpecInputs:
  """A verification step's inputs besides the decode `StepInputs` (`S`: the
  decode bucket's rows, `k`: `num_speculative_tokens`, `T = S + D`: token
  rows, `D` the step's draft budget)."""

  drafts: jax.Array  # i32[S, k]  draft tokens, -1 past num_draft
  num_draft: jax.Array  # i32[S]  drafts of each row (0 on padding rows)
  tokens: jax.Array  # i32[T]  ragged layout: row i's last token, its drafts
  query_rows: jax.Array  # i32[S, 1 + k]  token row of each query (0 past it)
  row_entry: jax.Array  # i32[T]  the row each token row belongs to, -1 padding
  row_offset: jax.Array  # i32[T]  its query index j in [0, num_draft]


@flax.struct.dataclass
class SpecOutputs:
  tokens: jax.Array  # i32[S, 1 + k]  emitted tokens per row, -1 past a + 1
  token_logprobs: jax.Array  # f32[S, 1 + k]  their log-probs
  accepted: jax.Array  # i32[S]  drafts accepted per row (a)
  ok: jax.Array  # bool[S]  the one-token reservations (the host knew them)
  fork_ok: jax.Array  # bool[max_batch]
  draft_ok: jax.Array  # bool[S]  the draft reservations (the host knew them)
  fingerprint: jax.Array  # u32[5]  `state_fingerprint` after the truncate
  drafts: jax.Array  # i32[S, k]  the drafts verified (a draft model's own)


def query_sample_rows(rows: slot_state_lib.SampleRows, num_draft: jax.Array,
                      row_entry: jax.Array, row_offset: jax.Array
                      ) -> slot_state_lib.SampleRows:
  """The sampling parameters of every token row of a verification layout.

  Args:
    rows: the `S` rows' `SampleRows`, `positions` the position of the token
      after the row's LAST query (the block state's `seq_lens` after the
      draft reserve, `L + 1 + d`).
    num_draft: i32[S], each row's drafts `d`.
    row_entry: i32[T], the row of each token row (-1: padding, greedy).
    row_offset: i32[T], its query index `j`.

  Returns:
    `SampleRows` of `T` rows: token row `(i, j)` has row `i`'s parameters
    and position `L + 1 + j`, the position of the token that query `j`
    samples -- the position the plain step's sampler would use for it.
  """
  e = jnp.maximum(row_entry, 0)
  t = jax.tree.map(lambda a: a[e], rows)
  real = row_entry >= 0
  return t.replace(
      temperature=jnp.where(real, t.temperature, 0.0),
      positions=t.positions - num_draft[e] + row_offset)


def sample_queries(logits: jax.Array, rows: slot_state_lib.SampleRows
                   ) -> tuple[jax.Array, jax.Array]:
  """`(tokens i32[T], logprobs f32[T])`: the ordinary sampler's token after
  each query row (`logits` f32[T, V]) and its log-prob, after `logit_bias`
  and the bans, exactly as `step.device_step` samples."""
  logits = sampling.add_bias(logits, rows.bias_ids, rows.bias_values)
  logits = sampling.ban_tokens(logits, rows.bans())
  tokens = sampling.sample_tokens(logits, rows.temperature, rows.top_k,
                                  rows.top_p, rows.seeds, rows.positions)
  return tokens, sampling.token_logprobs(logits, tokens)


def verify(logits: jax.Array, rows: slot_state_lib.SampleRows,
           drafts: jax.Array, num_draft: jax.Array, query_rows: jax.Array,
           row_entry: jax.Array, row_offset: jax.Array
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws the target's token after every query row and accepts the drafts
  that equal the draws (see the module docstring, step 3).

  Args:
    logits: f32[T, V], the target's logits after each token row.
    rows: the `S` rows' `SampleRows` (see `query_sample_rows`).
    drafts: i32[S, k]; num_draft: i32[S] (0: verifies nothing, emits one).
    query_rows, row_entry, row_offset: as in `SpecInputs`.

  Returns:
    `(tokens i32[S, 1 + k], accepted i32[S], logprobs f32[S, 1 + k])`, as
    `speculative.greedy_accept`, and the emitted tokens' log-probs (0 past
    them).
  """
  sampled, lps = sample_queries(
      logits, query_sample_rows(rows, num_draft, row_entry, row_offset))
  emitted, accepted = speculative.greedy_accept(drafts, sampled[query_rows],
                                                num_draft)
  # Every emitted token is its query row's draw (accepted drafts equal it).
  return emitted, accepted, jnp.where(emitted >= 0, lps[query_rows], 0.0)


def spec_device_step(model_def: ModelDef, params, cache: kv_cache_lib.KVCache,
                     state: bm.BlockState, last_tokens: jax.Array,
                     slots: slot_state_lib.SlotState, x: StepInputs,
                     s: SpecInputs):
  """One verification step (see the module docstring); pure, jit it with
  the cache, state and last tokens donated (`slots` is read only).

  Args:
    model_def, params, cache, state, last_tokens, slots: as in
      `step.device_step`.
    x: the decode bucket's `StepInputs` (its bookkeeping and sample rows;
      entry `i` is row `i`, one token each). Its token arrays are not used.
    s: the rows' `SpecInputs`.

  Returns:
    `(cache, state, last_tokens, SpecOutputs)`.
  """
  model = model_def.merge(params)
  state, fork_ok, res, _ = bookkeeping(state, *bookkeeping_args(x))
  cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
  real = x.seq_ids >= 0
  state, dres = bm.reserve(state, x.seq_ids, s.num_draft)
  cache = kv_cache_lib.copy_blocks(cache, dres.copy_src, dres.copy_dst)
  active = res.ok & dres.ok
  num_draft = jnp.where(active, s.num_draft, 0)
  q_lens = jnp.where(real, 1 + s.num_draft, 0)
  meta = step_metadata_lib.step_metadata(
      state, x.seq_ids, q_lens, num_tokens=s.tokens.shape[0], active=active)
  drafts = s.drafts
  if isinstance(model, spec_draft.DraftPair):  # static: the draft proposes here
    drafts, draft_cache = spec_draft.propose(
        model.draft, cache[1], state, x.seq_ids, s.tokens[s.query_rows[:, 0]],
        num_draft, active, drafts.shape[1])
    hidden, target_cache = model.target.paged_forward(
        spec_draft.fill_layout(s.tokens, s.query_rows, drafts, num_draft),
        meta, cache[0])
    cache = (target_cache, draft_cache)
  else:
    hidden, cache = model.paged_forward(s.tokens, meta, cache)
  rows = slot_state_lib.gather(slots, state.seq_lens, x.sample_seqs,
                               x.seed_offsets)
  emitted, accepted, lps = verify(
      model.logits(hidden), rows, drafts, num_draft, s.query_rows,
      s.row_entry, s.row_offset)
  sid = jnp.clip(x.seq_ids, 0, state.max_seqs - 1)
  keep = state.seq_lens[sid] - (s.num_draft - jnp.maximum(accepted, 0))
  state, _ = bm.truncate(state, jnp.where(real & active, x.seq_ids, -1), keep)
  last = jnp.take_along_axis(emitted, jnp.maximum(accepted, 0)[:, None],
                             axis=1)[:, 0]
  last_tokens = store_tokens(last_tokens, jnp.where(real & active, x.seq_ids, -1),
                             last)
  return cache, state, last_tokens, SpecOutputs(
      emitted, lps, accepted, res.ok, fork_ok, dres.ok, state_fingerprint(state),
      drafts)


_DONATE = (2, 3, 4)  # cache, block state, last tokens
# On the runner's arrays of a 1x1 mesh (state, last tokens, slots `[1, ...]`).
_spec_on_pool = on_one_pool(spec_device_step, args=(3, 4, 5), outs=(1, 2))


def _jit_for(runner, bucket, k: int, budget: int):
  """The jitted verification step for `(bucket, k, budget)`, named after
  them (`spec_3_step_4_budget_12`)."""

  def spec_step(model_def, params, cache, state, last_tokens, slots, x, s):
    return _spec_on_pool(model_def, params, cache, state, last_tokens, slots,
                         x, s)

  spec_step.__name__ = f"spec_{k}_step_{bucket.num_seqs}_budget_{budget}"
  return jax.jit(spec_step, static_argnums=(0,), donate_argnums=_DONATE)


def _budget(x: StepInputs, s: SpecInputs) -> int:
  return s.tokens.shape[0] - x.seq_ids.shape[0]


def _lowerer(runner, b, x: StepInputs, s: SpecInputs):
  """A function lowering the verification step of bucket `b` for inputs of
  `x`'s and `s`'s shapes (the runner's arrays as `Runner.arg_spec`)."""
  specs = jax.tree.map(compiler.spec, (x, s))
  held = [runner.arg_spec(n) for n in ("cache", "state", "last_tokens", "slots")]
  return lambda: _jit_for(runner, b, s.drafts.shape[1], _budget(x, s)).lower(
      runner._model_def, runner._params, *held, *specs)  # pylint: disable=protected-access


def compile_spec(runner, inputs: list) -> float:
  """Compiles the verification step of every `(bucket, StepInputs,
  SpecInputs)` in `inputs` that `runner` lacks (keyed by bucket, `k` and
  draft budget), in parallel; runs nothing. Returns the seconds spent
  (added to `runner.compile_seconds`)."""
  if runner.mesh.size > 1:
    raise ValueError("speculative decoding runs on one device, not on a mesh")
  steps = runner.__dict__.setdefault("_spec_steps", {})
  jobs = {}
  for b, x, s in inputs:
    key = (b, s.drafts.shape[1], _budget(x, s))
    if key not in steps:
      jobs[(runner._key, "spec") + key] = _lowerer(runner, b, x, s)  # pylint: disable=protected-access
  done, seconds = runner.compile_jobs(jobs)
  for (_, _, *key), exe in done.items():
    steps[tuple(key)] = exe
  runner.compile_seconds += seconds
  return seconds


def dispatch_spec(runner, bucket, x: StepInputs, s: SpecInputs) -> SpecOutputs:
  """Launches the verification step on `runner`'s arrays (compiling it first
  if needed); returns its `SpecOutputs`, still on the device."""
  key = (bucket, s.drafts.shape[1], _budget(x, s))
  steps = runner.__dict__.setdefault("_spec_steps", {})
  exe = steps.get(key)
  if exe is None:
    compile_spec(runner, [(bucket, x, s)])
    exe = steps[key]
  runner.cache, runner.state, runner.last_tokens, out = exe(
      runner._params, runner.cache, runner.state, runner.last_tokens,  # pylint: disable=protected-access
      runner.slots, x, s)
  return out


# Timed calls of each program at warm-up (`time_programs`; the fastest kept).
COST_CALLS = 2


def time_programs(runner, bucket, x: StepInputs, spec_inputs: dict,
                  calls: int = COST_CALLS) -> dict:
  """Seconds per call of decode bucket `bucket`'s plain step (key 0) and of
  its verification step with each `spec_inputs[D]` (key `D`, its draft
  budget), all compiled, on `x`: one untimed call each, then `calls` rounds
  of one call each (the programs interleaved, so a burst of load slows them
  alike), the fastest kept. With all-padding inputs the calls change no
  slot, block or token."""
  run = {0: lambda: runner.dispatch(bucket, [x])}
  run.update({d: (lambda si=si: dispatch_spec(runner, bucket, x, si))
              for d, si in spec_inputs.items()})
  best = dict.fromkeys(run, float("inf"))
  for i in range(1 + calls):
    for d, f in run.items():
      t = time.perf_counter()
      jax.block_until_ready(f())
      if i:
        best[d] = min(best[d], time.perf_counter() - t)
  return best


def fetch_spec(out: SpecOutputs) -> SpecOutputs:
  """Waits for a verification step's outputs; returns them on the host."""
  return jax.device_get(out)
