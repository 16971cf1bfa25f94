"""The host side of multi-step decode (`multistep.py`): when a pool may run
K decode steps in one dispatch, the loop's per-row inputs, and replaying the
loop on the host's pool model once its results arrive. A mixin of
`scheduler.Scheduler` (NumPy only: planning touches no device).

Planning around a K-step dispatch: the host cannot know before the results
how many tokens each row took (a stop id, a full pool), so the step after a
multi-step dispatch is planned only once that dispatch's results are
applied (`Engine.step` resolves it first). The host's work for those K
tokens -- scheduling, building, dispatching, replaying, applying -- is done
once, and the device runs the K steps back to back with no host in between.

Where multi-step does not apply the engine runs a single step
(`multistep_ok` says which): something waits for admission, an entry is a
prompt chunk or a prompt's last token, beam search, a fork pending or in
this step, a request with stop strings (matched on the text by the host),
more stop ids than `multistep.MAX_STOP_IDS`; and on a device mesh.

Timestamps: the K tokens of a dispatch reach the host together and are
stamped at that moment (`now` at resolve), as a streaming client sees them:
the inter-token latencies within a dispatch are 0, TTFT and TPOT (from the
first-token and finish times) are unchanged in meaning.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax import window_reclaim
from paged_jax.serving.multistep import (MAX_STOP_IDS, MultiStepInputs,
                                         MultiStepOutputs)
from paged_jax.serving.results import Pending
from paged_jax.serving.step import StepInputs, StepOutputs


@dataclasses.dataclass
class MultiStepPending:
  """What `resolve_multistep` needs of a K-step dispatch, besides `Pending`.

  Attributes:
    seq_ids: i32[S], the slot of each row (-1 padding), as the device's
      reserves saw them.
    budget: i32[S], the most tokens each row could sample.
  """

  seq_ids: np.ndarray
  budget: np.ndarray


class MultiStep:
  """`Scheduler`'s multi-step decode (see the module docstring)."""

  def multistep_ok(self, plan) -> bool:
    """Whether `plan` (before `build_step`) may run as K decode steps: a
    steady decode state where no row needs the host between steps."""
    if not plan or self._waiting or self._fork_pending:
      return False
    for s, n in plan:
      g = s.group
      if (n != 1 or g.is_beam or g.unborn or g.params.stop or s.fork_from >= 0
          or len(g.eos) > MAX_STOP_IDS
          # its input is a generated token, the last one
          or s.num_cached < g.prompt_len or s.num_cached + 1 != len(s.tokens)):
        return False
    return True

  def multistep_inputs(self, pending: Pending, x: StepInputs
                       ) -> tuple[MultiStepInputs, MultiStepPending]:
    """The loop's per-row inputs for a step built (and committed) by
    `build_step` from a plan `multistep_ok` accepted, and what
    `resolve_multistep` will need. Row `r` is entry and sample row `r`."""
    S = x.seq_ids.shape[0]
    budget = np.zeros(S, np.int32)
    stop_ids = np.full((S, MAX_STOP_IDS), -1, np.int32)
    for r, t, _ in pending.records:
      g = t.group
      n = len(t.tokens)  # its pending token (iteration 0's) included
      budget[r] = 1 if t.final else 1 + min(
          g.params.max_new_tokens - (n - g.prompt_len), self.max_model_len - n)
      ids = sorted(g.eos)
      stop_ids[r, :len(ids)] = ids
    m = MultiStepInputs(budget=budget, stop_ids=stop_ids)
    return m, MultiStepPending(x.seq_ids.copy(), budget)

  def num_steps(self, plan, bucket) -> int:
    """Decode steps to run for `plan` in `bucket`: `num_scheduler_steps`
    where multi-step applies (a decode bucket, `multistep_ok`), else 1."""
    k = self.config.num_scheduler_steps
    return k if k > 1 and bucket.decode_only and self.multistep_ok(plan) else 1

  def multistep_padding(self, buckets) -> dict:
    """`{bucket: (StepInputs, MultiStepInputs)}` of all-padding steps, for
    each decode bucket of `buckets` (the K-step programs' warm-up shapes)."""
    out = {}
    for b in buckets:
      if b.decode_only:
        x = self._build([], b)[0]
        S = x.seq_ids.shape[0]
        out[b] = (x, MultiStepInputs(
            budget=np.zeros(S, np.int32),
            stop_ids=np.full((S, MAX_STOP_IDS), -1, np.int32)))
    return out

  def resolve_multistep(self, pending: Pending, ms: MultiStepPending,
                        out: MultiStepOutputs, now: float):
    """Applies a K-step dispatch's results: replays its reserves on the
    pool model (iteration `j` reserves one token for each row that ran it or
    was refused at it, in row order), checks the device's fingerprint and
    refusals against the model's, then applies iteration 0's tokens
    (`resolve`) and each row's later ones, in order."""
    counts, refused = out.counts.astype(np.int64), out.refused
    if (counts > ms.budget).any() or (counts[ms.seq_ids < 0] > 0).any():
      raise RuntimeError("a multi-step row sampled past its budget (engine bug)")
    pool = self._pool
    for j in range(1, int((counts + refused).max(initial=0))):
      tried = (counts > j) | (refused & (counts == j))
      seq, grow = np.where(tried, ms.seq_ids, -1), tried.astype(np.int32)
      res = pool.reserve(seq, grow)
      if pool.window is not None:  # the loop's reclamation (`multistep.py`)
        window_reclaim.reclaim_host(pool, seq, grow, res.ok)
      if not np.array_equal(res.ok[tried], counts[tried] > j):
        raise RuntimeError("the device's reservations inside the multi-step "
                           "loop differ from the host model's (engine bug)")
      if self._index is not None:
        ev = res.evicted
        self.stats.prefix_blocks_evicted += self._index.evict(ev[ev >= 0])
    self._fingerprint = pool.fingerprint()
    pending.fingerprint = self._fingerprint
    top = pending.top
    self.resolve(pending, StepOutputs(
        out.tokens[0], out.top_logprobs[0] if top else None,
        out.top_ids[0] if top else None, out.ok, out.fork_ok,
        out.token_logprobs[0], out.fingerprint), now)
    extra = int(np.sum(np.maximum(counts - 1, 0)))
    st = self.stats
    st.computed_tokens += extra
    st.multistep_tokens += extra
    st.multistep_refused += int(np.count_nonzero(refused))
    # The loop's later iterations computed the bucket's rows too.
    st.padded_rows += ms.seq_ids.shape[0] * (int((counts + refused).max(initial=1)) - 1)
    if not extra:
      return
    top_lp = top_ids = None
    if top:
      top_lp, top_ids = out.top_logprobs.tolist(), out.top_ids.tolist()
    self.apply_later_tokens(pending, out.tokens.tolist(),
                            out.token_logprobs.tolist(), counts, now, top_lp,
                            top_ids)

  def apply_later_tokens(self, pending: Pending, tokens: list, logprobs: list,
                         counts: np.ndarray, now: float, top_lp=None,
                         top_ids=None) -> int:
    """Appends each row's tokens after its first (`tokens[j][r]` for `1 <=
    j < counts[r]`, `[E][S]` lists, and their log-probs) to its sequence,
    in order, as the step that samples each would: a K-step dispatch's
    (`resolve_multistep`), a verification step's accepted drafts
    (`spec_host.resolve`) or a speculative loop's (`spec_loop_host`). A
    row stops at its stop id or budget; its later tokens are void. Returns
    the tokens appended."""
    deltas = self._deltas if self.collect_deltas else None
    itls, appended = [], 0
    for r, t, _ in pending.records:
      g = t.group
      for j in range(1, int(counts[r])):
        if t.done:  # stopped (EOS, the host, an abort): later tokens are void
          break
        tok = tokens[j][r]
        t.num_cached += 1  # the token before it was computed in iteration j
        t.tokens.append(tok)
        appended += 1
        if len(t.tokens) - g.prompt_len >= g.params.max_new_tokens:
          t.final = True
        self._take_token(t, len(t.tokens) - 1, tok, logprobs[j][r],
                         None if top_lp is None else (top_ids[j][r], top_lp[j][r]),
                         now, deltas, itls)
    self.stats.itl.add_many(itls)
    return appended
