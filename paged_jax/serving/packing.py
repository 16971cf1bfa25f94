"""Input packing: a planned step's arrays (`StepInputs`) from the scheduler's
entries: the plan's steady decode rows (`Plan.decode_rows`) with whole-array
operations, the other entries in one pass over them. The sample rows' parameters are not packed:
they live on the device per slot (`slot_state.SlotState`, written when a
sequence gets a slot, `Scheduler._bind`), and a sample row names its slot.
A mixin of `scheduler.Scheduler` (it reads the scheduler's queues and pool
model).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from paged_jax.serving.buckets import Bucket
from paged_jax.serving.requests import PENDING, Seq
from paged_jax.serving.step import StepInputs


# One entry of a step's plan: a sequence and the tokens it runs (plain
# tuples: a plan has a row per running sequence, rebuilt every step).
Entry = tuple[Seq, int]


class Plan(list):
  """A step's entries (a list of `Entry`), and how many of them, from the
  first, are steady decode rows: each runs one token, its last (so it
  samples once, in its own lane), and is neither a beam-search row nor a
  prompt whose `n` samples are still to fork. Those rows are packed and
  committed with whole-array operations (`InputPacking._build`,
  `Results._commit`); only the rest go through the per-entry loops.

  Attributes:
    decode_rows: the leading steady decode entries (0: none known).
  """

  decode_rows: int = 0


class Samples(NamedTuple):
  """A step's sample rows, by column (row `i` of each list is sample row
  `i`): the token row whose logits it samples, the entry's sequence, and the
  sample it is for (its index; a prompt's other samples, `n > 1`, are
  sampled in its row and forked)."""

  token_rows: list[int]
  seqs: list[Seq]
  lanes: list[int]

  def __len__(self) -> int:
    return len(self.seqs)


class Bookkeeping(NamedTuple):
  """The inputs of `step.bookkeeping` (the `StepInputs` fields of the same
  names, in `step.BOOKKEEPING_FIELDS` order)."""

  register_seqs: np.ndarray  # i32[R]
  register_cols: np.ndarray  # i32[R]
  release_early: np.ndarray  # i32[max_seqs]
  fork_parents: np.ndarray  # i32[max_batch]
  fork_children: np.ndarray  # i32[max_batch]
  release_late: np.ndarray  # i32[max_seqs]
  share_seqs: np.ndarray  # i32[H]
  share_blocks: np.ndarray  # i32[H, max_blocks_per_seq]
  share_counts: np.ndarray  # i32[H]
  seq_ids: np.ndarray  # i32[num_seqs]
  q_lens: np.ndarray  # i32[num_seqs]

  def cut(self, num_seqs: int) -> "Bookkeeping":
    """The same inputs with `num_seqs` entry rows (the rest are padding)."""
    return self._replace(seq_ids=self.seq_ids[:num_seqs],
                         q_lens=self.q_lens[:num_seqs])


class SteadyInputs(NamedTuple):
  """The inputs of a steady decode step (`InputPacking._bookkeeping_inputs`):
  every entry a steady decode row (`Plan.decode_rows`) and nothing released,
  forked, registered or shared. Asynchronously, each row's last token is
  then the one the step in flight samples (`PENDING`), so the step's inputs
  depend only on the rows' slots and the bucket: built once, read only, and
  sent again while the running rows stay the same (a steady decode step
  builds no array).

  Attributes:
    slots: the rows' slots, in plan order (the key).
    book: their `Bookkeeping` (`max_batch` entry rows).
    steps: `{bucket: StepInputs}` of the steps built from it whose every
      row's last token was `PENDING`.
  """

  slots: list[int]
  book: Bookkeeping
  steps: dict


class InputPacking:
  """`Scheduler`'s input packing (see the module docstring)."""

  @classmethod
  def work(cls, plan) -> tuple[int, int]:
    """`(token rows, sequence rows)` that `plan` needs: its tokens, and the
    larger of its entries and its sample rows."""
    k = getattr(plan, "decode_rows", 0)  # one token and one sample each
    tokens = samples = k
    for s, n in plan[k:] if k else plan:
      tokens += n
      if s.num_cached + n == len(s.tokens):
        g = s.group
        samples += g.params.n if (g.unborn and not g.is_beam) else 1
    return tokens, max(len(plan), samples)

  def _bookkeeping_inputs(self, plan, num_seqs: int) -> Bookkeeping:
    """The arguments of `step.bookkeeping` for `plan` with `num_seqs` entry
    rows. Padding entries (-1, 0 tokens) change nothing, so every row count
    gives the same state."""
    c = self.config
    register_seqs, register_cols, share_seqs, share_blocks, share_counts = (
        self._no_cache_rows())
    if self._registering:
      register_seqs = register_seqs.copy()
      register_cols = register_cols.copy()
      for i, (slot, col, _, _) in enumerate(self._registering):
        register_seqs[i], register_cols[i] = slot, col
    if self._shares:
      share_seqs, share_blocks, share_counts = (
          share_seqs.copy(), share_blocks.copy(), share_counts.copy())
      for i, (seq, blocks) in enumerate(self._shares.items()):
        share_seqs[i], share_counts[i] = seq.slot, len(blocks)
        share_blocks[i, :len(blocks)] = blocks
    no_seqs, no_batch = self._no_rows(self.max_seqs), self._no_rows(c.max_batch)
    release_early = release_late = no_seqs
    if self._release_next:
      release_early = no_seqs.copy()
      release_early[:len(self._release_next)] = self._release_next
    if self._release_late_next:
      release_late = no_seqs.copy()
      release_late[:len(self._release_late_next)] = self._release_late_next
    fork_parents = fork_children = no_batch
    forks = self._forks()
    if forks:
      fork_parents, fork_children = no_batch.copy(), no_batch.copy()
      for i, s in enumerate(forks):
        fork_parents[i] = s.fork_from
        fork_children[i] = s.slot
    k, d = len(plan), getattr(plan, "decode_rows", 0)
    slots = [s.slot for s, _ in plan]
    steady = (d == k > 0 and release_early is no_seqs and release_late is no_seqs
              and fork_parents is no_batch and register_seqs is self._no_cache_rows()[0]
              and share_seqs is self._no_cache_rows()[2])
    cached = self._steady_inputs
    if steady and cached is not None and cached.slots == slots and (
        cached.book.seq_ids.shape[0] == num_seqs):
      return cached.book  # the same as the last steady decode step's
    seq_ids = np.full(num_seqs, -1, np.int32)
    q_lens = np.zeros(num_seqs, np.int32)
    if plan:
      seq_ids[:k] = slots
      q_lens[:d] = 1
      if d < k:
        q_lens[d:k] = [n for _, n in plan[d:]]
    book = Bookkeeping(register_seqs, register_cols, release_early, fork_parents,
                       fork_children, release_late, share_seqs, share_blocks,
                       share_counts, seq_ids, q_lens)
    if steady:  # kept for the next steps while the running rows stay the same
      seq_ids.flags.writeable = q_lens.flags.writeable = False
      self._steady_inputs = SteadyInputs(slots, book, {})
    return book

  def _no_rows(self, n: int) -> np.ndarray:
    """A read-only `i32[n]` of -1 (no release, no fork), made once per `n`
    (copied before any row is written)."""
    rows = self.__dict__.setdefault("_empty_rows", {})
    out = rows.get(n)
    if out is None:
      out = np.full(n, -1, np.int32)
      out.flags.writeable = False
      rows[n] = out
    return out

  def _no_cache_rows(self) -> tuple[np.ndarray, ...]:
    """The register and share rows of a step that registers and shares
    nothing, built once and read-only (a step without prefix-cache work --
    most of them -- then allocates and fills none of the `[H,
    max_blocks_per_seq]` share table; the arrays are copied before any
    row is written)."""
    rows = getattr(self, "_empty_cache_rows", None)
    if rows is None:
      R, H, width = self._register_rows, self._share_rows, self._pool.width
      rows = (np.full(R, -1, np.int32), np.zeros(R, np.int32),
              np.full(H, -1, np.int32), np.full((H, width), -1, np.int32),
              np.zeros(H, np.int32))
      for a in rows:
        a.flags.writeable = False
      self._empty_cache_rows = rows
    return rows

  def _build(self, plan, bucket: Bucket, book: Bookkeeping | None = None):
    """`(StepInputs, Samples)` of `plan` in shape `bucket` (the sample rows
    by column). `book`: the
    bookkeeping inputs `_fit` accepted for `plan` (`max_batch` entry rows;
    cut to the bucket's here, the rows past the plan being padding), else
    built. Changes nothing.

    One pass over the entries (each one's tokens, or the slot whose last
    sampled token the device holds); the sample rows name their slots
    (`sample_seqs`), whose sampling parameters are on the device
    (`slot_state.SlotState`, written when the slot was taken)."""
    num_tokens, S = bucket.num_tokens, bucket.num_seqs
    steady = self._steady_inputs
    if steady is None or book is not steady.book:
      steady = None
    book = self._bookkeeping_inputs(plan, S) if book is None else book.cut(S)
    k = getattr(plan, "decode_rows", 0)
    if steady is not None and k == len(plan):  # a steady decode step
      seqs = [s for s, _ in plan]
      if max([s.tokens[-1] for s in seqs]) == PENDING:  # all in flight
        x = steady.steps.get(bucket)
        if x is None:
          x = steady.steps[bucket] = self._build_arrays(plan, bucket, book)[0]
          for a in x.__dict__.values():
            a.flags.writeable = False
        return x, Samples(list(range(k)), seqs, [s.index for s in seqs])
    return self._build_arrays(plan, bucket, book)

  def _build_arrays(self, plan, bucket: Bucket, book: Bookkeeping):
    """`_build` of `plan` with its `book` cut to the bucket's rows."""
    num_tokens, S = bucket.num_tokens, bucket.num_seqs
    tokens = np.zeros(num_tokens, np.int32)
    token_slots = np.full(num_tokens, -1, np.int32)
    sample_seqs = np.full(S, -1, np.int32)
    sample_slots = np.full(S, -1, np.int32)
    seed_offsets = np.zeros(S, np.int32)
    k = getattr(plan, "decode_rows", 0)
    if k:  # steady decode rows: token row = sample row = entry row
      seqs = [s for s, _ in plan[:k]]
      token_rows = list(range(k))
      lanes = [s.index for s in seqs]
      slots = book.seq_ids[:k]
      last = [s.tokens[-1] for s in seqs]
      if max(last) == PENDING:  # all sampled by the step in flight: on the device
        token_slots[:k] = slots
      else:
        last = np.array(last, np.int32)
        pending = last == PENDING  # sampled by the step in flight: on the device
        tokens[:k] = np.where(pending, 0, last)
        token_slots[:k] = np.where(pending, slots, -1)
      sample_seqs[:k] = slots
      sample_slots[:k] = slots  # each row's token goes to its own slot
    else:
      token_rows, seqs, lanes = [], [], []
    row = k
    for s, n in plan[k:] if k else plan:
      toks, start = s.tokens, s.num_cached
      end = start + n
      if toks[end - 1] == PENDING:  # sampled by the step in flight: on the device
        if n != 1 or end != len(toks):
          raise RuntimeError("a pending token outside a decode row (engine bug)")
        token_slots[row] = s.slot
      else:
        tokens[row:row + n] = toks[start:end]
      row += n
      if end == len(toks):  # the entry samples after this step
        g = s.group
        j = len(seqs)
        if g.unborn and not g.is_beam:  # the prompt's n samples, one row
          n_samples = g.params.n
          token_rows += [row - 1] * n_samples
          seqs += [s] * n_samples
          lanes += range(n_samples)
          sample_seqs[j:j + n_samples] = s.slot
          seed_offsets[j:j + n_samples] = np.arange(n_samples) - s.index
        else:
          sample_seqs[j] = s.slot
          token_rows.append(row - 1)
          seqs.append(s)
          lanes.append(s.index)
    sample_rows = np.zeros(S, np.int32)
    sample_rows[:len(token_rows)] = token_rows
    x = StepInputs(**book._asdict(), tokens=tokens, token_slots=token_slots,
                   sample_slots=sample_slots, sample_rows=sample_rows,
                   sample_seqs=sample_seqs, seed_offsets=seed_offsets)
    return x, Samples(token_rows, seqs, lanes)
