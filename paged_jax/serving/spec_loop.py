"""Speculative decoding inside the multi-step loop: up to K verification
iterations in one dispatch, the n-gram drafts proposed on the device.

With `EngineConfig.num_scheduler_steps = K > 1` and an n-gram
`speculative_config`, a steady decode step whose rows may speculate
(`spec_host.spec_ok`, `multistep_host.MultiStep.multistep_ok`) runs ONE
jitted program (`spec_loop_device_step`):

* the step's ordinary bookkeeping (`step.bookkeeping`: releases, forks, the
  reserve of one token per row, all applied by the host's pool model
  before dispatch), then a `lax.while_loop` of at most K iterations, each:
  1. (iterations >= 1) `block_manager.reserve` of one token per row still
     active; a refused row stops (a full pool), as in `multistep.py`;
  2. `history_drafts`: prompt lookup over the row's token history, kept on
     the device (`history`, i32[max_seqs, T]), the drafts capped so that
     the row's emitted tokens stay within its budget;
  3. `block_manager.reserve` of the drafts; a refused row verifies none
     this iteration (it still decodes its one token);
  4. the target on `S * (1 + k)` token rows (row `i`: its last token, then
     its drafts), laid out as decode entries (`_grid`), `spec_step.verify` (the ordinary
     sampler after every query row, greedy or sampled, with the plain
     step's `(seed, position)` keys: the tokens of plain decoding), and
     `block_manager.truncate` back to the kept tokens (rejected slots
     return at once; a shared block is never freed by it);
  5. the emitted tokens are appended to the row's history and its count; a
     row stops on a stop id, on its budget, or on a refused reservation.

The host learns each iteration's reservations, drafts and acceptances
(`SpecLoopOutputs`) and replays them on its pool model
(`spec_loop_host.resolve`), so the fingerprint check holds as for any step.
No block holding an unverified token is ever registered: the rollback runs
in the iteration that reserved it.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import speculative
from paged_jax import step_metadata as step_metadata_lib
from paged_jax.serving import compiler
from paged_jax.serving import slot_state as slot_state_lib
from paged_jax.serving.multistep import MultiStepInputs, is_stop
from paged_jax.serving.spec_step import verify
from paged_jax.serving.step import (ModelDef, StepInputs, bookkeeping,
                                    bookkeeping_args, input_tokens, on_one_pool,
                                    state_fingerprint, store_tokens)

HISTORY_WRITE_ROWS = 1024  # (slot, position, token) triples per history write


def history_drafts(history: jax.Array, seq_ids: jax.Array, lens: jax.Array,
                   room: jax.Array, *, num_speculative_tokens: int,
                   prompt_lookup_min: int, prompt_lookup_max: int
                   ) -> tuple[jax.Array, jax.Array]:
  """The n-gram drafts of `S` rows from the device's token history.

  Exactly the host proposer (`spec_host.ngram_drafts`, itself
  `speculative.ngram_propose`): for each row, the longest `n` in
  `[prompt_lookup_min, prompt_lookup_max]` whose last `n` tokens occur
  earlier in the sequence (the earliest such occurrence; the suffix itself
  never matches), and the up to `min(k, room)` tokens after it (fewer when
  the sequence ends first); no draft when nothing matches. Pure, jittable.

  Args:
    history: i32[max_seqs, T], each slot's tokens (prompt and generated,
      the last sampled one included); entries past the row's length are
      ignored.
    seq_ids: i32[S], the slot of each row; -1 (padding) proposes nothing.
    lens: i32[S], each row's sequence length (clipped to `[0, T]`).
    room: i32[S], the most drafts each row may take (<= 0: none).
    num_speculative_tokens, prompt_lookup_min, prompt_lookup_max: static,
      as in `speculative.SpeculativeConfig`.

  Returns:
    `(drafts i32[S, k], num_draft i32[S])`: `drafts[i, :num_draft[i]]` are
    row `i`'s drafts, `speculative.NO_TOKEN` after.

  Example:
    >>> history = jnp.array([[1, 2, 3, 4, 2, 3, 0, 0]])
    >>> d, n = history_drafts(history, jnp.array([0]), jnp.array([6]),
    ...                       jnp.array([9]), num_speculative_tokens=4,
    ...                       prompt_lookup_min=2, prompt_lookup_max=3)
    >>> d.tolist(), n.tolist()
    ([[4, 2, 3, -1]], [3])
  """
  real = seq_ids >= 0
  rows = history[jnp.clip(seq_ids, 0, history.shape[0] - 1)]
  lens = jnp.where(real, lens, 0)
  room = jnp.where(real, jnp.maximum(room, 0), 0)
  return speculative.ngram_propose(
      rows, lens, num_speculative_tokens=num_speculative_tokens,
      prompt_lookup_min=prompt_lookup_min,
      prompt_lookup_max=prompt_lookup_max, max_len=lens + room)


def write_history(history: jax.Array, slots: jax.Array, positions: jax.Array,
                  tokens: jax.Array) -> jax.Array:
  """`history` with `tokens[i]` at `[slots[i], positions[i]]` (i32[N] each;
  a slot or position out of range, e.g. -1: dropped). Pure; jit it with
  `history` donated."""
  ms, t = history.shape
  ok = (slots >= 0) & (slots < ms) & (positions >= 0) & (positions < t)
  return history.at[jnp.where(ok, slots, ms), positions].set(tokens, mode="drop")


@flax.struct.dataclass
class SpecLoopOutputs:
  """What one speculative K-iteration dispatch returns (`S` rows, `K`
  iterations, `k` drafts, `E = K * (1 + k)` emitted tokens at most)."""

  tokens: jax.Array  # i32[E, S]  row i's emitted tokens in order, -1 past counts
  token_logprobs: jax.Array  # f32[E, S]
  counts: jax.Array  # i32[S]  tokens emitted per row (iteration 0's included)
  ok: jax.Array  # bool[S]  the bookkeeping's reservations (the host knew them)
  fork_ok: jax.Array  # bool[max_batch]
  ran: jax.Array  # bool[K, S]  the row was active at the start of iteration j
  one_ok: jax.Array  # bool[K, S]  its one-token reservation (j = 0: bookkeeping's)
  proposed: jax.Array  # i32[K, S]  drafts it asked to reserve
  draft_ok: jax.Array  # bool[K, S]  that reservation (True when none asked)
  accepted: jax.Array  # i32[K, S]  drafts accepted (0 where none verified)
  refused: jax.Array  # bool[S]  stopped on a refused one-token reservation
  fingerprint: jax.Array  # u32[5]  `state_fingerprint` after the last iteration


def _grid(state: bm.BlockState, seq_ids, last, drafts, num_draft, live):
  """The verification of one iteration as a DECODE layout: entry `i * (1 +
  k) + j` is row `i`'s query `j` (its last token, then its drafts), a
  one-row entry that sees its sequence's first `L + 1 + j` tokens (`L`: the
  row's cached tokens before the iteration; the block state already holds
  its `1 + d` new slots). Every query writes its K/V before any attends, so
  query `j` sees queries `< j`, exactly as the ragged layout's causal mask.
  One layout serves both widths of an iteration (`S * (1 + k)` rows when
  some row verifies drafts, `S` when none does); on SmolLM2 (CPU, 5 rows)
  it cost about what the ragged layout did (the specloop note).

  Returns:
    `(StepMetadata, tokens i32[T], query_rows i32[S, 1 + k], row_entry
    i32[T], row_offset i32[T])`, `T = S * (1 + k)`, the last four as
    `spec_step.SpecInputs`' (entries past a row's drafts: inert).
  """
  S, k = drafts.shape
  T = S * (1 + k)
  cols = jnp.arange(1 + k, dtype=jnp.int32)[None, :]
  use = (live[:, None] & (cols <= num_draft[:, None])).reshape(T)
  sid = jnp.repeat(jnp.clip(seq_ids, 0, state.max_seqs - 1), 1 + k)
  tables, lens = bm.gather_tables(state, sid)  # lens: L + 1 + d
  kv_lens = jnp.where(use, lens - jnp.repeat(num_draft, 1 + k)
                      + jnp.tile(cols[0], S), 0)
  positions = jnp.where(use, kv_lens - 1, 0)
  slots = jnp.where(use, bm.slot_mapping(state, sid, positions), -1)
  meta = step_metadata_lib.StepMetadata(
      positions=positions, slots=slots,
      block_tables=jnp.where(use[:, None], tables, step_metadata_lib.NULL_BLOCK),
      kv_lens=kv_lens, cu_q_lens=jnp.arange(T + 1, dtype=jnp.int32),
      num_seqs=jnp.full((1,), T, jnp.int32), block_size=state.block_size,
      total_blocks=state.total_blocks, decode_only=True)
  tokens = jnp.where(use, jnp.concatenate([last[:, None], drafts], 1).reshape(T), 0)
  entry = jnp.repeat(jnp.arange(S, dtype=jnp.int32), 1 + k)
  return (meta, tokens, jnp.arange(T, dtype=jnp.int32).reshape(S, 1 + k),
          jnp.where(use, entry, -1), jnp.tile(cols[0], S))


def spec_loop_device_step(model_def: ModelDef, params,
                          cache: kv_cache_lib.KVCache, state: bm.BlockState,
                          last_tokens: jax.Array, history: jax.Array,
                          slots: slot_state_lib.SlotState, x: StepInputs,
                          m: MultiStepInputs, may_propose: jax.Array, *,
                          num_steps: int, spec):
  """Up to `num_steps` verification iterations in one program (see the
  module docstring); pure, jit it with the cache, state, last tokens and
  history donated.

  Args:
    model_def, params, cache, state, last_tokens, slots: one pool's, as in
      `multistep.multistep_device_step`.
    history: i32[max_seqs, T], each slot's tokens (see `history_drafts`);
      row `i`'s first `seq_lens + 1` tokens must be in it (the host writes
      them before the dispatch, `spec_loop_host.sync_history`).
    x: the decode bucket's `StepInputs` (entry `i` is row `i`, one known
      token each).
    m: the rows' `MultiStepInputs` (`budget`: tokens the row may emit here).
    may_propose: bool[S], rows that may propose drafts (the others decode
      one token per iteration).
    num_steps: static K >= 1.
    spec: static, the `speculative.SpeculativeConfig` (method "ngram").

  Returns:
    `(cache, state, last_tokens, history, SpecLoopOutputs)`.
  """
  model = model_def.merge(params)
  k = spec.num_speculative_tokens
  S = x.seq_ids.shape[0]
  K, E = num_steps, num_steps * (1 + k)
  state, fork_ok, res, _ = bookkeeping(state, *bookkeeping_args(x))
  cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
  seq_ids = x.seq_ids
  real = seq_ids >= 0
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  ms = history.shape[0]
  rows_s = jnp.arange(S)
  # Iteration 0's input tokens (known to the host, or sampled last step).
  last_tokens = store_tokens(last_tokens, seq_ids, input_tokens(last_tokens, x))
  cols = jnp.arange(1 + k, dtype=jnp.int32)[None, :]

  def cond(c):
    return (c["j"] < K) & jnp.any(c["active"])

  def body(c):
    j, state, cache, active = c["j"], c["state"], c["cache"], c["active"]
    grow = active & (j > 0)
    state, r1 = bm.reserve(state, jnp.where(grow, seq_ids, -1),
                           grow.astype(jnp.int32))
    cache = kv_cache_lib.copy_blocks(cache, r1.copy_src, r1.copy_dst)
    one_ok = active & (r1.ok | ~grow)
    live = one_ok
    n = state.seq_lens[sid]  # the row's tokens, its last (uncached) one included
    room = jnp.minimum(m.budget - c["count"] - 1, k)
    drafts, d = history_drafts(
        c["history"], jnp.where(live & may_propose, seq_ids, -1), n, room,
        num_speculative_tokens=k, prompt_lookup_min=spec.prompt_lookup_min,
        prompt_lookup_max=spec.prompt_lookup_max)
    want = live & (d > 0)
    asked = jnp.where(want, d, 0)
    state, r2 = bm.reserve(state, jnp.where(want, seq_ids, -1), asked)
    cache = kv_cache_lib.copy_blocks(cache, r2.copy_src, r2.copy_dst)
    d = jnp.where(want & r2.ok, d, 0)
    last = c["last_tokens"][sid]
    rows = slot_state_lib.gather(slots, state.seq_lens, x.sample_seqs,
                                 x.seed_offsets)
    drafts = jnp.where(jnp.arange(k)[None, :] < d[:, None], drafts, -1)

    def verify_with(width):  # static: queries per row laid out
      def run(cache):
        dr = drafts[:, :width]
        meta, tokens, query_rows, row_entry, row_offset = _grid(
            state, seq_ids, last, jnp.maximum(dr, 0), d, live)
        hidden, cache = model.paged_forward(tokens, meta, cache)
        emitted, accepted, lps = verify(model.logits(hidden), rows, dr, d,
                                        query_rows, row_entry, row_offset)
        pad = ((0, 0), (0, k - width))
        return (cache, jnp.pad(emitted, pad, constant_values=-1), accepted,
                jnp.pad(lps, pad))
      return run

    # An iteration where no row verifies a draft runs S rows, not S * (1 + k).
    cache, emitted, accepted, lps = jax.lax.cond(
        jnp.any(d > 0), verify_with(k), verify_with(0), cache)
    a = jnp.where(live, jnp.maximum(accepted, 0), 0)
    roll = live & (d > 0)
    state, _ = bm.truncate(state, jnp.where(roll, seq_ids, -1),
                           state.seq_lens[sid] - (d - a))
    # The emitted tokens: the row's count onward, and in its history.
    valid = live[:, None] & (cols <= a[:, None])
    pos = c["count"][:, None] + cols
    toks = c["toks"].at[jnp.where(valid, pos, E), rows_s[:, None]].set(
        emitted, mode="drop")
    tlps = c["lps"].at[jnp.where(valid, pos, E), rows_s[:, None]].set(
        lps, mode="drop")
    history = c["history"].at[jnp.where(valid, sid[:, None], ms),
                              n[:, None] + cols].set(emitted, mode="drop")
    new_last = jnp.take_along_axis(emitted, a[:, None], axis=1)[:, 0]
    last_tokens = store_tokens(c["last_tokens"], jnp.where(live, seq_ids, -1),
                               new_last)
    count = c["count"] + jnp.where(live, a + 1, 0)
    stopped = jnp.zeros((S,), bool)
    for i in range(1 + k):  # static: a stop id among the emitted tokens
      stopped |= valid[:, i] & is_stop(emitted[:, i], m.stop_ids)
    return dict(
        j=j + 1, state=state, cache=cache, last_tokens=last_tokens,
        history=history, active=live & ~stopped & (count < m.budget),
        count=count, toks=toks, lps=tlps,
        refused=c["refused"] | (grow & ~r1.ok),
        ran=c["ran"].at[j].set(active), one_ok=c["one_ok"].at[j].set(one_ok),
        proposed=c["proposed"].at[j].set(asked),
        draft_ok=c["draft_ok"].at[j].set(r2.ok | ~want),
        accepted=c["accepted"].at[j].set(a))

  carry = dict(
      j=jnp.int32(0), state=state, cache=cache, last_tokens=last_tokens,
      history=history, active=real & res.ok & (m.budget > 0),
      count=jnp.zeros((S,), jnp.int32), toks=jnp.full((E, S), -1, jnp.int32),
      lps=jnp.zeros((E, S), jnp.float32), refused=jnp.zeros((S,), bool),
      ran=jnp.zeros((K, S), bool), one_ok=jnp.zeros((K, S), bool),
      proposed=jnp.zeros((K, S), jnp.int32), draft_ok=jnp.ones((K, S), bool),
      accepted=jnp.zeros((K, S), jnp.int32))
  c = jax.lax.while_loop(cond, body, carry)
  return c["cache"], c["state"], c["last_tokens"], c["history"], SpecLoopOutputs(
      c["toks"], c["lps"], c["count"], res.ok, fork_ok, c["ran"], c["one_ok"],
      c["proposed"], c["draft_ok"], c["accepted"], c["refused"],
      state_fingerprint(c["state"]))


# ------------------------------------------------------- the runner's programs

_DONATE = (2, 3, 4, 5)  # cache, block state, last tokens, history
# On the runner's arrays of a 1x1 mesh (state, last tokens, slots `[1, ...]`;
# the history has no data axis: one device only).
_loop_on_pool = on_one_pool(spec_loop_device_step, args=(3, 4, 6), outs=(1, 2))


def history(runner, width: int) -> jax.Array:
  """The runner's token history, i32[max_seqs, width] (made on first use,
  zeros; dropped with the pool on a resize: `Runner.replace_pool`)."""
  h = runner.__dict__.get("_spec_history")
  if h is None:
    ms = runner.state.seq_lens.shape[-1]
    h = runner.__dict__["_spec_history"] = jnp.zeros((ms, width), jnp.int32)
  return h


def _write_jit(runner):
  w = runner.__dict__.get("_spec_history_writer")
  if w is None:
    w = runner.__dict__["_spec_history_writer"] = jax.jit(
        write_history, donate_argnums=(0,))
  return w


def _jit_for(runner, bucket, num_steps: int, spec):
  """The jitted loop of `bucket` (`spec_loop_4_steps_4`)."""

  def loop(model_def, params, cache, state, last_tokens, history, slots, x, m,
           may):
    return _loop_on_pool(model_def, params, cache, state, last_tokens, history,
                         slots, x, m, may, num_steps=num_steps, spec=spec)

  loop.__name__ = f"spec_loop_{num_steps}_steps_{bucket.num_seqs}"
  return jax.jit(loop, static_argnums=(0,), donate_argnums=_DONATE)


def compile_loops(runner, inputs: list, num_steps: int, spec, width: int
                  ) -> float:
  """Compiles the loop of every `(bucket, StepInputs, MultiStepInputs)` in
  `inputs` not compiled yet (keyed by bucket and K), and the history write,
  in parallel; runs nothing. Returns the seconds spent (added to
  `runner.compile_seconds`)."""
  if runner.mesh.size > 1:
    raise ValueError("speculative decoding runs on one device, not on a mesh")
  progs = runner.__dict__.setdefault("_spec_loops", {})
  h = compiler.spec(history(runner, width))
  jobs = {}
  for b, x, m in inputs:
    key = (b, num_steps)
    if key in progs:
      continue
    specs = jax.tree.map(compiler.spec, (x, m))
    may = jax.ShapeDtypeStruct(x.seq_ids.shape, jnp.bool_)
    held = [runner.arg_spec(n) for n in ("cache", "state", "last_tokens")]
    jobs[(runner._key, "spec_loop", spec) + key] = (  # pylint: disable=protected-access
        lambda b=b, held=held, specs=specs, may=may: _jit_for(
            runner, b, num_steps, spec).lower(
                runner._model_def, runner._params, *held, h,  # pylint: disable=protected-access
                runner.arg_spec("slots"), *specs, may))
  if "_spec_history_write" not in runner.__dict__:
    n = jax.ShapeDtypeStruct((HISTORY_WRITE_ROWS,), jnp.int32)
    jobs[(runner._key, "spec_history", h)] = lambda: _write_jit(runner).lower(  # pylint: disable=protected-access
        h, n, n, n)
  # XLA's default CPU options (YNNPACK dots), not the decode steps'
  # (`compiler.CPU_COMPILER_OPTIONS`): on SmolLM2 the loop's 5-row
  # iterations took 2.6x the CPU time with those (the specloop note).
  done, seconds = runner.compile_jobs(jobs)
  for key, exe in done.items():
    if key[1] == "spec_history":
      runner._spec_history_write = exe  # pylint: disable=protected-access
    else:
      progs[key[-2:]] = exe
  runner.compile_seconds += seconds
  return seconds


def write_history_rows(runner, width: int, slots, positions, tokens) -> int:
  """Writes `tokens[i]` at `[slots[i], positions[i]]` of the runner's
  history (NumPy int arrays of one length), `HISTORY_WRITE_ROWS` at a time.
  Returns the dispatches made."""
  h = history(runner, width)
  if "_spec_history_write" not in runner.__dict__:
    compile_loops(runner, [], 1, None, width)
  exe = runner._spec_history_write  # pylint: disable=protected-access
  n, R = len(slots), HISTORY_WRITE_ROWS
  calls = 0
  for i in range(0, n, R):
    pad = lambda a: np.pad(np.asarray(a[i:i + R], np.int32), (0, R - len(a[i:i + R])),  # noqa: E731
                           constant_values=-1)
    h = exe(h, pad(slots), pad(positions), pad(tokens))
    calls += 1
  runner._spec_history = h  # pylint: disable=protected-access
  return calls


def dispatch_loop(runner, bucket, num_steps: int, spec, width: int,
                  x: StepInputs, m: MultiStepInputs, may) -> SpecLoopOutputs:
  """Launches the loop on `runner`'s arrays (compiling it first if needed);
  returns its `SpecLoopOutputs`, still on the device."""
  progs = runner.__dict__.setdefault("_spec_loops", {})
  exe = progs.get((bucket, num_steps))
  if exe is None:
    compile_loops(runner, [(bucket, x, m)], num_steps, spec, width)
    exe = progs[bucket, num_steps]
  h = history(runner, width)
  runner.cache, runner.state, runner.last_tokens, h, out = exe(
      runner._params, runner.cache, runner.state, runner.last_tokens, h,  # pylint: disable=protected-access
      runner.slots, x, m, may)
  runner._spec_history = h  # pylint: disable=protected-access
  return out


def fetch(out: SpecLoopOutputs) -> SpecLoopOutputs:
  """Waits for a loop's outputs; returns them on the host."""
  return jax.device_get(out)
