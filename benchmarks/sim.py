"""Memory-only serving simulations: a trace through a KV allocator, step by step.

One step is one decode iteration of a continuous-batching engine:

  1. finished sequences are released;
  2. arrived requests are admitted first-come first-served while memory allows
     (a request's prompt is reserved; its first decode happens next step);
  3. every sequence that was already running gains one token (the one this
     step generates), taking a new block first if its last block is full. If
     the pool runs dry, the most recently admitted sequences are preempted
     (released and requeued at the front, to be re-admitted with prompt +
     tokens generated so far: vLLM's recompute preemption) until the rest fit;
  4. the step is measured: sequences running, token slots holding tokens,
     token slots allocated.

A request holds prompt + output tokens when it finishes. Compute is not
modelled: a step is `step_s` seconds of arrival time, whatever the batch.

`simulate_paged` runs through the real block manager (`paged_jax.block_manager`
reserve/release, jitted with the state donated, one vectorised call per step
for the sequences that need a block), and reads allocated slots back from the
block state. `simulate_contiguous` is the baseline: each admitted sequence
holds a fixed contiguous reservation (max_model_len, or its exact final
length) for its whole life, so it never grows and is never preempted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager
from paged_jax.traces import Trace


@dataclasses.dataclass
class SimResult:
  """Per-step measurements of one simulation.

  Attributes:
    running: i64[steps] sequences holding KV at the end of each step.
    tokens: i64[steps] token slots holding real tokens.
    slots: i64[steps] token slots allocated (reserved).
    waiting: i64[steps] arrived requests not yet admitted.
    finished: requests completed.
    preemptions: sequences preempted (paged only).
    host_s: wall time of the whole simulation (host + device calls).
    manager_s: of which in block-manager calls (paged only; includes the
      transfer of their results and per-step state statistics).
    step_s: f64[steps] wall time of each step (paged only).
  """
  running: np.ndarray
  tokens: np.ndarray
  slots: np.ndarray
  waiting: np.ndarray
  finished: int
  preemptions: int = 0
  host_s: float = 0.0
  manager_s: float = 0.0
  step_s: np.ndarray | None = None

  @property
  def steps(self) -> int:
    return len(self.running)

  def utilisation(self) -> float:
    """Share of allocated KV slots holding real tokens, summed over all steps."""
    return float(self.tokens.sum() / max(self.slots.sum(), 1))

  def saturated(self) -> np.ndarray:
    """bool[steps]: steps with requests waiting, i.e. memory-bound steps."""
    return self.waiting > 0

  def mean_running_saturated(self) -> float:
    sat = self.saturated()
    return float(self.running[sat].mean()) if sat.any() else float("nan")

  def summary(self) -> dict:
    return {
        "steps": self.steps, "finished": self.finished,
        "preemptions": self.preemptions,
        "utilisation": self.utilisation(),
        "mean_running_saturated": self.mean_running_saturated(),
        "saturated_steps": int(self.saturated().sum()),
        "max_running": int(self.running.max(initial=0)),
        "host_s": self.host_s,
        "manager_s": self.manager_s,
    }


def _arrival_steps(trace: Trace, step_s: float) -> np.ndarray:
  return np.floor(trace.arrival_times / step_s).astype(np.int64)


# ----------------------------------------------------------------------------
# Paged: the real block manager.


@functools.partial(jax.jit, donate_argnums=0)
def _reserve(state, seq_ids, num_new_tokens):
  return block_manager.reserve(state, seq_ids, num_new_tokens)


@functools.partial(jax.jit, donate_argnums=0)
def _release(state, seq_ids):
  return block_manager.release(state, seq_ids)


@jax.jit
def _stats(state):
  """(free blocks, reserved token slots, live sequences) in one transfer."""
  return (state.num_free, jnp.sum(state.seq_lens),
          jnp.sum(state.seq_lens > 0))


@functools.partial(jax.jit, static_argnames=("max_len",))
def _engine_metadata(state, seq_ids, positions, max_len):
  """What an engine derives per step for attention: slots and tables."""
  del max_len
  slots = block_manager.slot_mapping(state, seq_ids, positions)
  tables, kv_lens = block_manager.gather_tables(state, seq_ids)
  return slots, tables, kv_lens


def _bucket(n: int, max_seqs: int) -> int:
  """Call sizes 16, 32, 64, ... up to max_seqs: few shapes, little padding."""
  size = 16
  while size < n:
    size *= 2
  return min(size, max(max_seqs, n))


def simulate_paged(trace: Trace, *, block_size: int, num_blocks: int,
                   max_seqs: int, max_model_len: int = 2048,
                   step_s: float = 0.02, watermark: float = 0.01,
                   engine_metadata: bool = False,
                   max_steps: int | None = None) -> SimResult:
  """Runs `trace` through `paged_jax.block_manager`.

  Slots are reserved a block at a time, as vLLM's block manager allocates: a
  prompt reserves `ceil(prompt / block_size)` blocks, and a sequence whose
  tokens fill its last block reserves one more block's worth of slots when it
  generates its next token. Only those sequences go to `reserve` in a step
  (in one call, padded to 16, 32, 64, ... or max_seqs ids); the others
  already own the slot their token goes into. Tokens are counted on the host;
  allocated slots come from the block state (`num_free`), and every step the
  host checks that the manager's reserved slots equal the block-rounded token
  counts, and that it grants every admission the host sized.

  Args:
    trace: requests (prompt + output must fit max_model_len).
    block_size: tokens per block.
    num_blocks: blocks in the pool.
    max_seqs: sequence slots (an upper bound on concurrency).
    max_model_len: longest sequence; sizes the block table.
    step_s: seconds of arrival time per step.
    watermark: admission leaves at least this share of blocks free, so that
      running sequences can grow (vLLM's default is 1%).
    engine_metadata: also compute `slot_mapping` and `gather_tables` for the
      running batch each step, as an engine would (for host-overhead timing).
    max_steps: stop after this many steps.

  Returns:
    A `SimResult`; at the end the block state passes `check_invariants` and
    every block is free again.

  Raises:
    ValueError: a request longer than max_model_len, or one that would not fit
      in the pool on its own (it would wait forever).
  """
  longest = int(trace.total_lens.max())
  if longest > max_model_len:
    raise ValueError(f"trace has a sequence of {longest} tokens > {max_model_len=}")
  bs = block_size
  watermark_blocks = int(math.ceil(watermark * num_blocks))
  if -(-longest // bs) > num_blocks - watermark_blocks:
    raise ValueError(f"a {longest}-token request does not fit in {num_blocks=} "
                     f"of {block_size=} (less the {watermark_blocks}-block watermark)")
  width = -(-max_model_len // bs)
  state = block_manager.init(num_blocks=num_blocks, block_size=bs,
                             max_seqs=max_seqs, max_blocks_per_seq=width)
  arrive = _arrival_steps(trace, step_s)
  total = trace.total_lens.astype(np.int64)
  prompt = trace.prompt_lens.astype(np.int64)

  # Host bookkeeping: which request sits in which slot, and its token count.
  req_of = np.full(max_seqs, -1, np.int64)
  length = np.zeros(max_seqs, np.int64)
  admitted_at = np.zeros(max_seqs, np.int64)  # admission order, for preemption
  progress = np.zeros(len(trace), np.int64)  # tokens a request holds or held
  free_slots = list(range(max_seqs - 1, -1, -1))
  waiting: collections.deque[int] = collections.deque()
  next_arrival = admissions = finished = preemptions = 0
  num_free = num_blocks

  manager_s = 0.0

  def call(fn, ids, *rest):
    """`fn(state, ids, *rest)` padded to a bucket; returns ok[:len(ids)]."""
    nonlocal state, manager_s
    t = time.perf_counter()
    size = _bucket(len(ids), max_seqs)
    padded = [np.full(size, max_seqs, np.int32)]  # out of range: left alone
    padded[0][:len(ids)] = ids
    for x in rest:
      padded.append(np.zeros(size, np.int32))
      padded[-1][:len(ids)] = x
    state, out = fn(state, *padded)
    ok = out.ok if isinstance(out, block_manager.Reservation) else out
    ok = np.asarray(ok)[:len(ids)]
    manager_s += time.perf_counter() - t
    return ok

  def release(slots):
    ok = call(_release, slots)
    assert ok.all(), "release refused a live slot"
    for s in slots:
      req_of[s], length[s] = -1, 0
      free_slots.append(int(s))

  rec = collections.defaultdict(list)
  t0 = time.perf_counter()
  step = 0
  while next_arrival < len(trace) or waiting or (req_of >= 0).any():
    if max_steps is not None and step >= max_steps:
      break
    step_start = time.perf_counter()
    while next_arrival < len(trace) and arrive[next_arrival] <= step:
      waiting.append(next_arrival)
      next_arrival += 1
    # 1. Release finished sequences.
    live = req_of >= 0
    done = np.nonzero(live & (length >= total[np.maximum(req_of, 0)]))[0]
    if len(done):
      finished += len(done)
      release(done)
      t = time.perf_counter()
      num_free = int(_stats(state)[0])
      manager_s += time.perf_counter() - t
    growing = req_of >= 0  # Admitted before this step: these decode now.
    at_boundary = growing & (length % bs == 0)
    # 2. Admit FCFS while slots and blocks allow, keeping the watermark and the
    #    blocks this step's decodes take.
    room = num_free - watermark_blocks - int(at_boundary.sum())
    cand, lens, need_blocks = [], [], 0
    for r in waiting:
      if len(cand) == len(free_slots):
        break
      l = int(max(progress[r], prompt[r]))
      need = -(-l // bs)
      if need_blocks + need > room:
        break
      cand.append(r)
      lens.append(l)
      need_blocks += need
    if cand:
      slots = [free_slots.pop() for _ in cand]
      ok = call(_reserve, slots, [-(-l // bs) * bs for l in lens])
      # The host's block arithmetic and the manager must agree.
      assert ok.all(), f"block manager refused an admission the host sized: {ok}"
      for s, r, l in zip(slots, cand, lens):
        waiting.popleft()
        req_of[s], length[s], admitted_at[s] = r, l, admissions
        progress[r] = l
        admissions += 1
    # 3. Decode: every sequence admitted before this step gains a token; those
    #    whose last block is full first reserve a new block.
    need = np.nonzero(at_boundary)[0]
    while len(need):
      ok = call(_reserve, need, np.full(len(need), bs))
      need = need[~ok]
      if not len(need):
        break
      # Out of blocks: preempt the youngest sequence, then retry the rest.
      live = np.nonzero(req_of >= 0)[0]
      victim = live[np.argmax(admitted_at[live])]
      waiting.appendleft(int(req_of[victim]))
      preemptions += 1
      growing[victim] = False
      need = need[need != victim]
      release([victim])
    length[growing] += 1
    progress[req_of[growing]] += 1
    # 4. Measure: allocated slots from the block state.
    t = time.perf_counter()
    num_free, reserved, live_seqs = (int(x) for x in _stats(state))
    live = req_of >= 0
    assert reserved == (-(-length[live] // bs) * bs).sum(), "manager and host disagree"
    if engine_metadata:
      ids = np.nonzero(live)[0].astype(np.int32)
      size = _bucket(len(ids), max_seqs)
      ids = np.concatenate([ids, np.full(size - len(ids), -1, np.int32)])
      pos = np.maximum(length[np.maximum(ids, 0)] - 1, 0).astype(np.int32)
      jax.block_until_ready(_engine_metadata(state, ids, pos, width))
    manager_s += time.perf_counter() - t
    rec["running"].append(live_seqs)
    rec["tokens"].append(int(length.sum()))
    rec["slots"].append((num_blocks - num_free) * bs)
    rec["waiting"].append(len(waiting))
    rec["step_s"].append(time.perf_counter() - step_start)
    step += 1
  host_s = time.perf_counter() - t0
  if max_steps is None:
    block_manager.check_invariants(state)
    assert int(state.num_free) == num_blocks, "blocks leaked"
  return SimResult(
      running=np.asarray(rec["running"], np.int64),
      tokens=np.asarray(rec["tokens"], np.int64),
      slots=np.asarray(rec["slots"], np.int64),
      waiting=np.asarray(rec["waiting"], np.int64),
      finished=finished, preemptions=preemptions, host_s=host_s,
      manager_s=manager_s, step_s=np.asarray(rec["step_s"]))


# ----------------------------------------------------------------------------
# Contiguous baselines.


def simulate_contiguous(trace: Trace, *, kv_budget_tokens: int,
                        reservation: str, max_model_len: int = 2048,
                        step_s: float = 0.02,
                        max_seqs: int | None = None) -> SimResult:
  """Runs `trace` with one contiguous reservation per sequence.

  Args:
    trace: requests.
    kv_budget_tokens: token slots in the KV budget.
    reservation: "max_length" (every sequence reserves `max_model_len` slots)
      or "exact" (an oracle that reserves prompt + output, known in advance).
    max_model_len: the max-length reservation.
    step_s: seconds of arrival time per step.
    max_seqs: optional cap on concurrency.

  Returns:
    A `SimResult`.
  """
  if reservation not in ("max_length", "exact"):
    raise ValueError(f"{reservation=} must be 'max_length' or 'exact'")
  arrive = _arrival_steps(trace, step_s)
  total = trace.total_lens.astype(np.int64)
  prompt = trace.prompt_lens.astype(np.int64)
  size = (np.full(len(trace), max_model_len, np.int64)
          if reservation == "max_length" else total)
  if (size > kv_budget_tokens).any():
    raise ValueError("a single reservation exceeds the KV budget")
  cap = max_seqs or len(trace)
  running_req = np.zeros(0, np.int64)
  running_len = np.zeros(0, np.int64)
  reserved = 0
  waiting: collections.deque[int] = collections.deque()
  next_arrival = finished = 0
  rec = collections.defaultdict(list)
  t0 = time.perf_counter()
  step = 0
  while next_arrival < len(trace) or waiting or len(running_req):
    while next_arrival < len(trace) and arrive[next_arrival] <= step:
      waiting.append(next_arrival)
      next_arrival += 1
    done = running_len >= total[running_req]
    if done.any():
      finished += int(done.sum())
      reserved -= int(size[running_req[done]].sum())
      running_req, running_len = running_req[~done], running_len[~done]
    running_len = running_len + 1  # Sequences already running decode.
    new = []
    while (waiting and len(running_req) + len(new) < cap
           and reserved + size[waiting[0]] <= kv_budget_tokens):
      r = waiting.popleft()
      reserved += int(size[r])
      new.append(r)
    if new:
      running_req = np.concatenate([running_req, new])
      running_len = np.concatenate([running_len, prompt[new]])
    rec["running"].append(len(running_req))
    rec["tokens"].append(int(running_len.sum()))
    rec["slots"].append(reserved)
    rec["waiting"].append(len(waiting))
    step += 1
  return SimResult(
      running=np.asarray(rec["running"], np.int64),
      tokens=np.asarray(rec["tokens"], np.int64),
      slots=np.asarray(rec["slots"], np.int64),
      waiting=np.asarray(rec["waiting"], np.int64),
      finished=finished, host_s=time.perf_counter() - t0)
