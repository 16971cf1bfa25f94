"""The host side of speculation inside the multi-step loop (`spec_loop.py`):
when a dispatch runs it, keeping the device's token history in sync, and
replaying the loop on the host's pool model once its results arrive.

A decode step runs the loop when `num_scheduler_steps > 1`, the method is
"ngram", the plan is one that both a K-step dispatch
(`MultiStep.multistep_ok`) and a verification step (`spec_host.spec_ok`)
accept, and the speculation policy lets some row propose
(`spec_host.propose(..., on_device=True)`: the rows sitting out decode one
token per iteration). Otherwise the engine runs as before: a plain K-step
dispatch, or one verification step per dispatch with K = 1.

The device history (`spec_loop.history`, i32[max_seqs, max_model_len])
holds each slot's tokens for the proposer. Only the loop writes it: on the
device, each accepted token as it is emitted; and from the host
(`sync_history`), before a dispatch, each row's tokens that the history
lacks (the whole sequence the first time a sequence runs the loop in its
slot, then only what steps outside the loop appended), in fixed-size
writes (`spec_loop.HISTORY_WRITE_ROWS`). The host remembers, per slot,
which sequence the history holds and how many of its tokens.

At resolve the host replays each iteration on its pool model in the
device's order: the one-token reserve of the rows that ran it (iteration
>= 1), the draft reserve, the rollback (`spec_host.truncate`); it checks
the device's answers and fingerprint against the model's, then applies
iteration 0's token (`Scheduler.resolve`) and every later one
(`MultiStep.apply_later_tokens`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from paged_jax.serving import spec_host, spec_loop
from paged_jax.serving.step import StepOutputs


def applies(engine, plans, bucket, num_steps: int) -> bool:
  """Whether this step may run the speculative loop (before the policy)."""
  spec = engine.config.speculative_config
  return (spec is not None and spec.method == "ngram" and num_steps > 1
          and len(plans) == 1 and bucket.decode_only
          and spec_host.spec_ok(engine._pools[0], plans[0]))  # pylint: disable=protected-access


@dataclasses.dataclass
class _History:
  """The host's knowledge of the device history: per slot, the sequence
  whose tokens it holds (None: nobody's) and how many."""

  owner: list
  length: np.ndarray  # i64[max_seqs]


def _history(engine) -> _History:
  h = engine.__dict__.get("_spec_history")
  if h is None:
    ms = engine._pools[0].max_seqs  # pylint: disable=protected-access
    h = engine._spec_history = _History([None] * ms, np.zeros(ms, np.int64))  # pylint: disable=protected-access
  return h


def width(engine) -> int:
  """The history's tokens per slot: the longest sequence."""
  return engine.max_model_len


def sync_history(engine, records) -> int:
  """Writes each row's tokens the device history lacks (`records`:
  `Pending.records` of a step just built; each row's last token is its
  pending one, left out). Returns the tokens written."""
  h = _history(engine)
  slots, positions, tokens = [], [], []
  for _, t, _ in records:
    known = t.tokens[:-1]  # the pending token is the loop's to write
    s = t.slot
    start = int(h.length[s]) if h.owner[s] is t else 0
    if start < len(known):
      new = known[start:]
      slots += [s] * len(new)
      positions += range(start, len(known))
      tokens += new
    h.owner[s], h.length[s] = t, len(known)
  engine.__dict__["_history_writes"] = (engine.__dict__.get("_history_writes", 0)
                                       + len(tokens))
  if tokens:
    spec_loop.write_history_rows(engine._runner, width(engine), np.asarray(slots),  # pylint: disable=protected-access
                                 np.asarray(positions), np.asarray(tokens))
  return len(tokens)


@dataclasses.dataclass
class LoopPending:
  """What `resolve` needs of a speculative loop dispatch besides `Pending`.

  Attributes:
    seq_ids: i32[S], each row's slot (-1 padding).
    budget: i32[S], the most tokens each row could emit.
    may: bool[S], the rows that could propose.
  """

  seq_ids: np.ndarray
  budget: np.ndarray
  may: np.ndarray


def warmup(engine, buckets) -> None:
  """Compiles the loop of every decode bucket of `buckets` (and the history
  write); nothing unless the loop may run."""
  spec, k = engine.config.speculative_config, engine.config.num_scheduler_steps
  if spec is None or spec.method != "ngram" or k < 2:
    return
  sched = engine._pools[0]  # pylint: disable=protected-access
  inputs = [(b, x, m) for b, (x, m) in sched.multistep_padding(buckets).items()]
  spec_loop.compile_loops(engine._runner, inputs, k, spec, width(engine))  # pylint: disable=protected-access


def dispatch(engine, built, bucket, num_steps: int, may: list):
  """Syncs the history, packs and launches the loop. Returns
  `(SpecLoopOutputs on the device, [LoopPending])`."""
  ((x, pending),) = built
  sched = engine._pools[0]  # pylint: disable=protected-access
  t0 = time.perf_counter()
  sync_history(engine, pending.records)
  engine.stats.spec_draft_seconds += time.perf_counter() - t0
  m, ms = sched.multistep_inputs(pending, x)
  S = x.seq_ids.shape[0]
  may_arr = np.zeros(S, bool)
  may_arr[:len(may)] = may
  out = spec_loop.dispatch_loop(engine._runner, bucket, num_steps,  # pylint: disable=protected-access
                                engine.config.speculative_config, width(engine),
                                x, m, may_arr)
  engine.stats.multisteps += 1
  return out, [LoopPending(ms.seq_ids, ms.budget, may_arr)]


def is_loop(flight) -> bool:
  """Whether the dispatched step `flight` (`engine.InFlight`) is a loop."""
  return flight.multi is not None and isinstance(flight.multi[0], LoopPending)


def _replay(sched, lp: LoopPending, out) -> None:
  """Replays the loop's reservations and rollbacks on the pool model, in
  the device's order, checking its answers (see the module docstring)."""
  pool, index = sched._pool, sched.prefix_index  # pylint: disable=protected-access
  seq = lp.seq_ids

  def reserve(rows, grow):
    res = pool.reserve(np.where(rows, seq, -1), np.where(rows, grow, 0))
    if index is not None and res.evicted is not None:
      ev = res.evicted
      sched.stats.prefix_blocks_evicted += index.evict(ev[ev >= 0])
    return res.ok

  for j in range(out.ran.shape[0]):
    ran = out.ran[j]
    if not ran.any():
      break
    if j:
      ok = reserve(ran, 1)
      if not np.array_equal(ok[ran], out.one_ok[j][ran]):
        raise RuntimeError("the device's one-token reservations inside the "
                           "speculative loop differ from the host model's "
                           "(engine bug)")
    live = ran & out.one_ok[j]
    want = live & (out.proposed[j] > 0)
    ok = reserve(want, out.proposed[j])
    if not np.array_equal(ok[want], out.draft_ok[j][want]):
      raise RuntimeError("the device's draft reservations inside the "
                         "speculative loop differ from the host model's "
                         "(engine bug)")
    d = np.where(want & out.draft_ok[j], out.proposed[j], 0)
    roll = live & (d > 0)
    a = out.accepted[j].astype(np.int64)
    if (a[live] > d[live]).any():
      raise RuntimeError("a row accepted more drafts than it verified (engine bug)")
    keep = pool.lens[np.clip(seq, 0, pool.max_seqs - 1)] - (d - a)
    ids = np.where(roll, seq, -1)
    if not spec_host.truncate(pool, ids, np.where(roll, keep, 0))[roll].all():
      raise RuntimeError("the rollback of a speculative loop was refused "
                         "(engine bug)")


def resolve(engine, flight) -> float:
  """Waits for a loop's results and applies them (see the module
  docstring). Returns the seconds spent waiting."""
  t0 = time.perf_counter()
  (sched,), (pending,), (lp,) = engine._pools, flight.pending, flight.multi  # pylint: disable=protected-access
  out = spec_loop.fetch(flight.out)
  now = time.perf_counter()
  counts = out.counts.astype(np.int64)
  if (counts > lp.budget).any() or (counts[lp.seq_ids < 0] > 0).any():
    raise RuntimeError("a speculative loop row emitted past its budget (engine bug)")
  _replay(sched, lp, out)
  sched._fingerprint = sched._pool.fingerprint()  # pylint: disable=protected-access
  pending.fingerprint = sched._fingerprint  # pylint: disable=protected-access
  sched.resolve(pending, StepOutputs(out.tokens[0], None, None, out.ok,
                                     out.fork_ok, out.token_logprobs[0],
                                     out.fingerprint), now)
  st = engine.stats
  iterations = int(out.ran.any(axis=1).sum())
  extra = int(np.sum(np.maximum(counts - 1, 0)))
  d = np.where(out.draft_ok, out.proposed, 0)
  st.spec_steps += iterations
  st.spec_proposed += int(d.sum())
  st.spec_accepted += int(out.accepted.sum())
  st.spec_rows += int(np.count_nonzero(d))
  st.computed_tokens += extra
  st.multistep_tokens += extra
  st.multistep_refused += int(np.count_nonzero(out.refused))
  T = lp.seq_ids.shape[0] * out.tokens.shape[0] // out.ran.shape[0]
  st.padded_rows += T * iterations - lp.seq_ids.shape[0]
  pol, h = spec_host.policy(engine), _history(engine)
  for r, t, _ in pending.records:
    if lp.may[r]:  # one record per dispatch (the policy ticks per dispatch)
      pol.record(t.slot, t, int(d[:, r].sum()), int(out.accepted[:, r].sum()))
  sched.apply_later_tokens(pending, out.tokens.tolist(),
                           out.token_logprobs.tolist(), counts, now)
  for r, t, _ in pending.records:  # the device wrote every emitted token
    s = int(lp.seq_ids[r])
    if t.done or h.owner[s] is not t:
      h.owner[s] = None
    else:
      h.length[s] = len(t.tokens)
  return now - t0
