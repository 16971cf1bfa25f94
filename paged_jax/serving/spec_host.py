"""The host side of speculative decoding (`spec_step.py`): when a step
verifies drafts, the n-gram proposals, the draft reservations on the pool
model, and replaying the device's rollback once the results arrive.

With `EngineConfig.speculative_config` set (method "ngram"), a step waits
for the previous step's results (the proposer needs every row's tokens, as
`multistep_host` does for its budgets) whenever it may speculate
(`wants_results`; with `adaptive`, while every row sits out or the cost
rule would verify nothing, the steps run asynchronously as without
speculation). A pool's
step is a
verification step when `spec_ok` accepts its plan (a steady decode of rows
that need nothing else of the step: no top log-probs, no stop strings;
greedy or sampled, `logit_bias` and `min_tokens` bans included, since the
verification samples exactly as the plain step does) in a decode bucket,
some row got a draft, and the `spec_policy.SpecPolicy` keeps some (rows
that keep missing sit out; the cost rule keeps the drafts whose expected
acceptance pays for the rows they add, from each step program's seconds
measured at warm-up, `measure_costs`, trimming the tail drafts to a smaller
budget when that pays more); otherwise it is an ordinary step.

Each row of `L` cached tokens whose last token `t` is known gets up to `k`
drafts by prompt lookup over its tokens (`ngram_drafts`, the NumPy twin of
`speculative.ngram_propose`), capped so that the `1 + d` tokens it may emit
stay within `max_new_tokens` and `max_model_len`. The host model applies the
step's ordinary bookkeeping (`_fit`, one token per row) and then the draft
reserve, dropping the drafts of any row it refuses (a full pool) and trying
again, so the device grants every reservation. At resolve, `truncate` (the
NumPy twin of `block_manager.truncate`) replays the device's rollback to
`L + 1 + a` from the accepted counts, and the fingerprints are compared as
for every step.

The verification layout has `S + D` token rows, `D` the smallest of the
bucket's draft budgets (`spec_step.draft_budgets`) that holds the step's
drafts; each budget is compiled at warm-up.

With method "draft_model" (`spec_draft.py`) the host only sizes each
row's drafts (`room` above) and the draft model proposes them inside the
verification step; every ordinary step also runs the draft over its
tokens (`spec_draft.DraftPair`), so its KV stays level with the target's.

With prefix caching, the step's bookkeeping registers only blocks full
within `seq_lens` before the step (no draft is in one yet), the draft
reserve's evictions leave the host index as every reserve's do, and the
rollback runs in the same program, so no later step can register a block
holding a rejected draft; `truncate` models the cached-block ring and
would refuse (as the device does) a new end inside a registered block.

With `num_scheduler_steps > 1` (method "ngram" only) a step that may
speculate runs up to K verification iterations in one dispatch, the drafts
proposed on the device (`spec_loop.py`, `spec_loop_host.py`).

Refused with speculation, by name: beam search (`max_beam_width > 1`,
`beam_width > 1`), `n > 1`, multi-step decode with a draft model, the
prefix cache's host level (`kv_offloading_size`) and a device mesh.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from paged_jax.serving import spec_policy
from paged_jax.serving.requests import PENDING
from paged_jax.serving.spec_step import (SpecInputs, SpecOutputs, choose_budget,
                                         compile_spec, dispatch_spec,
                                         draft_budgets, fetch_spec, time_programs)
from paged_jax.serving.step import StepOutputs


# ------------------------------------------------------------ configuration


def check_config(config):
  """Raises ValueError naming the first `EngineConfig` setting that cannot
  be combined with its `speculative_config` (None: nothing to check)."""
  from paged_jax.speculative import SpeculativeConfig  # pylint: disable=import-outside-toplevel
  spec = config.speculative_config
  if spec is None:
    return
  if not isinstance(spec, SpeculativeConfig):
    raise ValueError("speculative_config must be a SpeculativeConfig (e.g. "
                     f"SpeculativeConfig.from_json(...)), got {spec!r}")
  for bad, name in ((config.max_beam_width > 1, f"max_beam_width={config.max_beam_width} "
                     "(beam search)"),
                    (config.num_scheduler_steps > 1 and spec.method != "ngram",
                     f"num_scheduler_steps={config.num_scheduler_steps} for "
                     f"method={spec.method!r}")):
    if bad:
      raise ValueError(f"speculative_config cannot be combined with {name}; "
                       "speculative decoding supports single-sample "
                       "requests on one device, and several steps per "
                       "dispatch (the loop of spec_loop.py) with method "
                       "'ngram' only")


def check_mesh(config, mesh):
  if config.speculative_config is not None and mesh is not None:
    raise ValueError("speculative_config cannot be combined with a device mesh; "
                     "speculative decoding runs on one device")


def rejection(request) -> str | None:
  """Why an engine with speculation cannot serve `request`, or None."""
  p = request.params
  if p.beam_width > 1:
    return f"beam_width={p.beam_width} is not supported with speculative decoding"
  if p.n > 1:
    return f"n={p.n} is not supported with speculative decoding"
  return None


# ----------------------------------------------------------------- proposing


def ngram_drafts(tokens: np.ndarray, *, k: int, n_min: int, n_max: int
                 ) -> np.ndarray:
  """Prompt lookup on one sequence, as `speculative.ngram_propose`: the up to
  `k` tokens after the earliest of the longest earlier occurrences (length in
  `[n_min, n_max]`) of the sequence's last tokens.

  Args:
    tokens: i64[L], the sequence (its last token included).

  Returns:
    i64[d], `d <= k` drafts (empty when nothing matches).
  """
  L = tokens.shape[0]
  if L < 2:
    return tokens[:0]
  ends = np.arange(L)
  run = ends <= L - 2
  length = np.zeros(L, np.int64)
  for i in range(min(n_max, L)):
    run &= (ends >= i) & (tokens[np.clip(ends - i, 0, L - 1)] == tokens[L - 1 - i])
    if not run.any():
      break
    length += run
  best = int(length.max())
  if best < n_min:
    return tokens[:0]
  start = int(np.argmax(length == best)) + 1
  return tokens[start:start + k]


def spec_ok(sched, plan) -> bool:
  """Whether `plan` (before `build_step`) may run as a verification step:
  every entry decodes one known token of a row that needs nothing else of
  the step (no top log-probs, no stop strings)."""
  if not plan or sched._fork_pending:  # pylint: disable=protected-access
    return False
  for s, n in plan:
    g = s.group
    p = g.params
    if (n != 1 or g.is_beam or g.unborn or p.stop or s.fork_from >= 0
        or p.logprobs or s.num_cached < g.prompt_len
        or s.num_cached + 1 != len(s.tokens) or s.tokens[-1] == PENDING):
      return False
  return True


def policy(engine) -> spec_policy.SpecPolicy:
  """The engine's `SpecPolicy` (made on first use)."""
  pol = engine.__dict__.get("_spec_policy")
  if pol is None:
    pol = engine.__dict__["_spec_policy"] = spec_policy.SpecPolicy(
        engine._pools[0].max_seqs)  # pylint: disable=protected-access
  return pol


@dataclasses.dataclass
class _Timing:
  """The decode step being timed for the cost rule: from its `propose` to
  the next step's (`SpecPolicy.observe`)."""

  key: int  # the decode bucket's rows
  budget: int  # its draft budget (0: a plain step)
  t0: float
  compile0: float  # the runner's compile seconds at t0 (left out)


def _observe_previous(engine, now: float):
  t = engine.__dict__.pop("_spec_timing", None)
  if t is not None:
    compiled = engine._runner.compile_seconds - t.compile0  # pylint: disable=protected-access
    policy(engine).observe(t.key, t.budget, now - t.t0 - compiled)


def wants_results(engine) -> bool:
  """Whether the next step should wait for the step in flight: only then
  are its rows' last tokens known, so that it can propose (with
  `SpeculativeConfig.adaptive`, while every row sits out or the cost rule
  would verify nothing, the engine runs asynchronously, as without
  speculation)."""
  spec = engine.config.speculative_config
  if spec is None:
    return False
  return not spec.adaptive or engine.__dict__.get("_spec_want", True)


def propose(engine, plans, bucket, *, on_device: bool = False) -> list | None:
  """Each row's drafts for this step (`[np.ndarray]` in plan order), or None
  when the step is an ordinary one (see the module docstring); with
  `adaptive`, the drafts the policy's cost rule keeps (`SpecPolicy.choose`:
  the tail drafts trimmed). Times the previous decode step for the cost
  rule, and this one, and decides whether the next step waits for this
  one's results (`wants_results`). With `on_device` (the speculative loop,
  `spec_loop_host`: the device proposes) each row's `bool`, whether it may
  propose, instead of drafts; the loop runs when the cost rule would
  verify `k` drafts of every such row in the loop's layout (the largest
  budget)."""
  spec = engine.config.speculative_config
  if spec is None:
    return None
  now = time.perf_counter()
  _observe_previous(engine, now)
  engine._spec_want = True  # pylint: disable=protected-access
  if len(plans) != 1 or not bucket.decode_only or not plans[0]:
    return None
  pol = policy(engine)
  key = bucket.num_seqs
  if engine.config.num_scheduler_steps == 1:  # one step per dispatch: timed
    engine._spec_timing = _Timing(key, 0, now, engine._runner.compile_seconds)  # pylint: disable=protected-access
  sched = engine._pools[0]  # pylint: disable=protected-access
  adaptive, k = spec.adaptive, spec.num_speculative_tokens
  slots = [s.slot for s, _ in plans[0]]
  may = [pol.may_propose(s.slot, s) or not adaptive for s, _ in plans[0]]
  pol.tick()
  drafts = None
  if any(may) and spec_ok(sched, plans[0]):
    if on_device:
      drafts = may if not adaptive or pol.choose(
          key, slots, [k if m else 0 for m in may], largest=True).any() else None
    else:
      drafts = _drafts(engine, plans[0], may)
      if drafts is not None and adaptive:
        keep = pol.choose(key, slots, [d.size for d in drafts])
        drafts = [d[:m] for d, m in zip(drafts, keep)] if keep.any() else None
  engine._spec_want = not adaptive or pol.would_verify(  # pylint: disable=protected-access
      key, slots, [k if pol.may_propose(s.slot, s) else 0 for s, _ in plans[0]],
      largest=on_device)
  return drafts


def _drafts(engine, plan, may) -> list | None:
  """The drafts of `plan`'s rows (those that `may` propose), or None if
  none found any; a row that looks and finds none misses. With a draft
  model each row gets `room` placeholder drafts (zeros), the number it may
  emit; the device's draft model fills them (`spec_draft.propose`)."""
  spec = engine.config.speculative_config
  sched, pol = engine._pools[0], policy(engine)  # pylint: disable=protected-access
  t0 = time.perf_counter()
  drafts = []
  for (s, _), ok in zip(plan, may):
    g = s.group
    n = len(s.tokens)
    room = min(spec.num_speculative_tokens,
               g.params.max_new_tokens - (n - g.prompt_len) - 1,
               sched.max_model_len - n - 1) if ok else 0
    if spec.method == "draft_model":  # the draft proposes on the device
      drafts.append(np.zeros(max(room, 0), np.int64))  # placeholders
      continue
    d = (ngram_drafts(np.asarray(s.tokens, np.int64), k=room,
                      n_min=spec.prompt_lookup_min, n_max=spec.prompt_lookup_max)
         if room > 0 else np.zeros(0, np.int64))
    if room > 0 and not d.size:  # found nothing: a miss
      pol.record(s.slot, s, 0, 0)
    drafts.append(d)
  engine.stats.spec_draft_seconds += time.perf_counter() - t0
  return drafts if any(d.size for d in drafts) else None


def _inputs(x, drafts, num_draft: np.ndarray, k: int, budget: int) -> SpecInputs:
  """The `SpecInputs` of a decode bucket's `x` with `drafts` (per entry; the
  first `num_draft[i]` of each verified) in a layout of `S + budget` rows."""
  S = x.seq_ids.shape[0]
  T = S + budget
  tokens = np.zeros(T, np.int32)
  query_rows = np.zeros((S, 1 + k), np.int32)
  draft_arr = np.full((S, k), -1, np.int32)
  row_entry = np.full(T, -1, np.int32)
  row_offset = np.zeros(T, np.int32)
  row = 0
  for r, dr in enumerate(drafts):
    n = int(num_draft[r])
    tokens[row] = x.tokens[r]  # the row's last token (known: `spec_ok`)
    tokens[row + 1:row + 1 + n] = dr[:n]
    draft_arr[r, :n] = dr[:n]
    query_rows[r, :1 + n] = np.arange(row, row + 1 + n)
    row_entry[row:row + 1 + n] = r
    row_offset[row:row + 1 + n] = np.arange(1 + n)
    row += 1 + n
  return SpecInputs(drafts=draft_arr, num_draft=num_draft, tokens=tokens,
                    query_rows=query_rows, row_entry=row_entry,
                    row_offset=row_offset)


def warmup(engine, buckets) -> None:
  """Compiles the verification step of every decode bucket of `buckets`
  and each of its draft budgets (all-padding inputs), then, with
  `adaptive`, times them and the plain step for the policy's cost rule
  (`measure_costs`). Nothing without speculation."""
  spec = engine.config.speculative_config
  if spec is None:
    return
  k = spec.num_speculative_tokens
  programs = _padding_programs(engine, buckets, k)
  compile_spec(engine._runner, [(b, x, si) for b, x, sis in programs  # pylint: disable=protected-access
                                for si in sis.values()])
  if spec.adaptive:
    measure_costs(engine, programs)


def _padding_programs(engine, buckets, k: int) -> list:
  """`[(bucket, StepInputs, {budget: SpecInputs})]`: every decode bucket of
  `buckets` on all-padding inputs, with each draft budget's layout."""
  out = []
  for b in buckets:
    if b.decode_only:
      x = engine._pools[0]._build([], b)[0]  # pylint: disable=protected-access
      S = x.seq_ids.shape[0]
      out.append((b, x, {budget: _inputs(x, [], np.zeros(S, np.int32), k, budget)
                         for budget in draft_budgets(S, k)}))
  return out


def measure_costs(engine, programs) -> None:
  """Times each decode bucket's plain step and verification steps (every
  draft budget; `spec_step.time_programs`) on all-padding inputs, which
  change no slot, block or token, and gives the policy their seconds per
  step (`SpecPolicy.set_costs`)."""
  pol = policy(engine)
  for b, x, sis in programs:
    pol.set_costs(b.num_seqs, time_programs(engine._runner, b, x, sis))  # pylint: disable=protected-access


# ------------------------------------------------------------------ the pool


def truncate(pool, seq_ids, new_lens) -> np.ndarray:
  """`block_manager.truncate` on a `HostPool`, in place: each sequence keeps
  its first `new_lens[i]` slots and the blocks holding them; a block past
  them drops this sequence's reference and, at zero, goes back on the free
  stack (ascending block ids, as the device pushes them) or, with prefix
  caching and registered (`cacheable`), to the tail of the cached-block
  ring (entries in call order, each one's blocks last first, a block that
  several entries drop counted at the last: `release`'s order). With
  prefix caching a new end inside a cacheable block is refused, as on the
  device. Journaled like every `HostPool` change (`begin` / `rollback`).

  Args:
    pool: the `HostPool`.
    seq_ids: int[n] slots (-1: padding).
    new_lens: int[n] lengths to keep.

  Returns:
    bool[n] `ok`, as `block_manager.truncate`'s.
  """
  seq_ids = np.asarray(seq_ids, np.int64)
  new_lens = np.asarray(new_lens, np.int64)
  ms, bs, width = pool.max_seqs, pool.block_size, pool.width
  put = pool._set  # pylint: disable=protected-access  (journaled writes)
  sid = np.clip(seq_ids, 0, ms - 1)
  length = pool.lens[sid].astype(np.int64)
  first = np.zeros(seq_ids.shape, bool)
  seen = set()
  for i, s in enumerate(seq_ids.tolist()):
    first[i] = s not in seen
    seen.add(s)
  ok = ((seq_ids >= 0) & (seq_ids < ms) & (length > 0) & (new_lens >= 0)
        & (new_lens <= length) & first)
  keep = -(-np.clip(new_lens, 0, length) // bs)  # blocks kept
  if pool.caching:  # registered content is immutable: no new end inside it
    end = pool.tables[sid, np.maximum(keep - 1, 0)]
    ok &= ~((new_lens % bs != 0)
            & pool.cacheable[np.clip(end, 0, pool.num_blocks - 1)])
  idx = np.flatnonzero(ok)
  if not idx.size:
    return ok
  have = -(-length // bs)
  n = have[idx] - keep[idx]  # blocks each entry drops
  rows = np.repeat(idx, n)
  cols = np.repeat(keep[idx], n) + (np.arange(int(n.sum()))
                                    - np.repeat(np.cumsum(n) - n, n))
  blocks = pool.tables[sid[rows], cols]
  if blocks.size:
    put(pool.tables, (sid[rows], cols), -1)
  put(pool.lens, sid[idx], new_lens[idx].astype(np.int32))
  if not blocks.size:
    return ok
  pool._add_refs(blocks, -1)  # pylint: disable=protected-access
  ids = np.unique(blocks)
  freed = ids[pool.refs[ids] == 0]  # ascending block ids
  kept = freed[:0]
  if pool.caching and freed.size:
    kept, freed = freed[pool.cacheable[freed]], freed[~pool.cacheable[freed]]
  if freed.size:
    put(pool.stack, np.arange(pool.num_free, pool.num_free + freed.size), freed)
    pool.num_free += int(freed.size)
  if kept.size:  # release order: entries as given, each one's blocks last first
    last = np.full(pool.num_blocks, -1, np.int64)
    np.maximum.at(last, blocks, rows * width + (width - 1 - cols))
    ring = pool._append_ring  # pylint: disable=protected-access
    ring(kept[np.argsort(last[kept], kind="stable")])
  return ok


# ---------------------------------------------------------------- the step


@dataclasses.dataclass
class SpecPending:
  """What `resolve` needs of a verification step besides `Pending`.

  Attributes:
    seq_ids: i32[S], each row's slot (-1 padding).
    num_draft: i32[S], the drafts each row verified.
  """

  seq_ids: np.ndarray
  num_draft: np.ndarray


def dispatch(engine, built, bucket, drafts):
  """Reserves the drafts on the pool model, packs and launches the
  verification step. Returns `(SpecOutputs on the device, SpecPending)`."""
  ((x, _),) = built
  sched = engine._pools[0]  # pylint: disable=protected-access
  k = engine.config.speculative_config.num_speculative_tokens
  S = x.seq_ids.shape[0]
  d = np.zeros(S, np.int32)
  d[:len(drafts)] = [a.size for a in drafts]
  pool = sched._pool  # pylint: disable=protected-access
  while True:  # a full pool refuses some rows' drafts: they verify none
    pool.begin()
    res = pool.reserve(x.seq_ids, d)
    bad = (x.seq_ids >= 0) & ~res.ok
    if not bad.any():
      pool.commit()
      break
    pool.rollback()
    if not (d[bad] > 0).any():
      raise RuntimeError("a reservation of 0 drafts was refused (engine bug)")
    d[bad] = 0
  index = sched.prefix_index
  if index is not None and res.evicted is not None:  # cached blocks the drafts took
    engine.stats.prefix_blocks_evicted += index.evict(res.evicted[res.evicted >= 0])
  budget = choose_budget(draft_budgets(S, k), int(d.sum()))
  timing = engine.__dict__.get("_spec_timing")
  if timing is not None:
    timing.budget = budget
  si = _inputs(x, drafts, d, k, budget)
  out = dispatch_spec(engine._runner, bucket, x, si)  # pylint: disable=protected-access
  st = engine.stats
  st.spec_steps += 1
  st.spec_proposed += int(d.sum())
  st.padded_rows += budget  # the layout's rows past the decode bucket's
  return out, [SpecPending(x.seq_ids.copy(), d)]


def is_spec(flight) -> bool:
  """Whether the dispatched step `flight` (`engine.InFlight`) verifies drafts."""
  return flight.multi is not None and isinstance(flight.multi[0], SpecPending)


def resolve(engine, flight) -> float:
  """Waits for a verification step's results and applies them: replays the
  rollback on the pool model, checks the device's refusals and fingerprint
  against the model's (`Scheduler.resolve`), then appends each row's
  accepted tokens. Returns the seconds spent waiting."""
  t0 = time.perf_counter()
  (sched,), (pending,), (sp,) = engine._pools, flight.pending, flight.multi  # pylint: disable=protected-access
  out: SpecOutputs = fetch_spec(flight.out)
  now = time.perf_counter()
  real = sp.seq_ids >= 0
  if not out.draft_ok[real].all():
    raise RuntimeError("the device refused a draft reservation the host model "
                       "granted (engine bug)")
  accepted = np.asarray(out.accepted, np.int64)
  if (accepted[real] < 0).any() or (accepted[real] > sp.num_draft[real]).any():
    raise RuntimeError("a row accepted more drafts than it verified (engine bug)")
  pool = sched._pool  # pylint: disable=protected-access
  ids = np.where(real, sp.seq_ids, -1)
  keep = pool.lens[np.clip(ids, 0, pool.max_seqs - 1)] - (sp.num_draft - accepted)
  if not truncate(pool, ids, np.where(real, keep, 0))[real].all():
    raise RuntimeError("the rollback of a verification step was refused (a new "
                       "end inside a registered block: engine bug)")
  sched._fingerprint = pool.fingerprint()  # pylint: disable=protected-access
  pending.fingerprint = sched._fingerprint  # pylint: disable=protected-access
  sched.resolve(pending, StepOutputs(out.tokens[:, 0], None, None, out.ok,
                                     out.fork_ok, out.token_logprobs[:, 0],
                                     out.fingerprint), now)
  st = engine.stats
  st.spec_accepted += int(accepted[real].sum())
  st.spec_rows += int(np.count_nonzero(sp.num_draft))
  pol = policy(engine)
  for r, t, _ in pending.records:
    if sp.num_draft[r]:
      pol.record(t.slot, t, int(sp.num_draft[r]), int(accepted[r]))
  # Accepted drafts: row r's tokens 1..accepted[r] (`out.tokens` is [S, 1 + k]).
  extra = sched.apply_later_tokens(pending, out.tokens.T.tolist(),
                                   out.token_logprobs.T.tolist(), accepted + 1, now)
  st.computed_tokens += extra
  return now - t0
