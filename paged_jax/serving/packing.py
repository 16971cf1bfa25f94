"""Input packing: a planned step's arrays (`StepInputs`) from the scheduler's
entries, in one pass over them. The sample rows' parameters are not packed:
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


class InputPacking:
  """`Scheduler`'s input packing (see the module docstring)."""

  @classmethod
  def work(cls, plan) -> tuple[int, int]:
    """`(token rows, sequence rows)` that `plan` needs: its tokens, and the
    larger of its entries and its sample rows."""
    tokens = samples = 0
    for s, n in plan:
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
      for i, r in enumerate(self._registering):
        register_seqs[i], register_cols[i] = r.slot, r.col
    if self._shares:
      share_seqs, share_blocks, share_counts = (
          share_seqs.copy(), share_blocks.copy(), share_counts.copy())
      for i, (seq, blocks) in enumerate(self._shares.items()):
        share_seqs[i], share_counts[i] = seq.slot, len(blocks)
        share_blocks[i, :len(blocks)] = blocks
    release_early = np.full(self.max_seqs, -1, np.int32)
    release_late = np.full(self.max_seqs, -1, np.int32)
    release_early[:len(self._release_next)] = self._release_next
    release_late[:len(self._release_late_next)] = self._release_late_next
    fork_parents = np.full(c.max_batch, -1, np.int32)
    fork_children = np.full(c.max_batch, -1, np.int32)
    for i, s in enumerate(self._forks()):
      fork_parents[i] = s.fork_from
      fork_children[i] = s.slot
    seq_ids = np.full(num_seqs, -1, np.int32)
    q_lens = np.zeros(num_seqs, np.int32)
    if plan:
      seq_ids[:len(plan)] = [s.slot for s, _ in plan]
      q_lens[:len(plan)] = [n for _, n in plan]
    return Bookkeeping(register_seqs, register_cols, release_early, fork_parents,
                       fork_children, release_late, share_seqs, share_blocks,
                       share_counts, seq_ids, q_lens)

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
    by column). `book`: the bookkeeping inputs `_fit` accepted for `plan`
    (`max_batch` entry rows; cut to the bucket's here, the rows past the plan
    being padding), else built. Changes nothing.

    By column: each entry's cached and total token counts are read once,
    the layout is NumPy; only entries whose tokens the host holds (prompts,
    chunks) copy them, and a decode row whose token is still on the device
    names its slot (`token_slots`). The sample rows name their slots
    (`sample_seqs`), whose sampling parameters are on the device
    (`slot_state.SlotState`, written when the slot was taken)."""
    num_tokens, S = bucket.num_tokens, bucket.num_seqs
    book = self._bookkeeping_inputs(plan, S) if book is None else book.cut(S)
    tokens = np.zeros(num_tokens, np.int32)
    token_slots = np.full(num_tokens, -1, np.int32)
    sample_seqs = np.full(S, -1, np.int32)
    seed_offsets = np.zeros(S, np.int32)
    sample_rows = np.zeros(S, np.int32)
    m = len(plan)
    if not m:
      x = StepInputs(**book._asdict(), tokens=tokens, token_slots=token_slots,
                     sample_slots=np.full(S, -1, np.int32), sample_rows=sample_rows,
                     sample_seqs=sample_seqs, seed_offsets=seed_offsets)
      return x, Samples([], [], [])
    # By column: one cheap read per entry and field, the rest in NumPy.
    seqs = [s for s, _ in plan]
    slots, ns = book.seq_ids[:m], book.q_lens[:m]
    starts = np.fromiter((s.num_cached for s in seqs), np.int32, m)
    lens = np.fromiter((len(s.tokens) for s in seqs), np.int32, m)
    ends = starts + ns
    row_ends = np.cumsum(ns, dtype=np.int32)
    row_starts = row_ends - ns
    samples = ends == lens  # the entries that sample after this step
    # A token sampled by the step in flight (`PENDING`, always a sequence's
    # last) is on the device: read from that slot's last token.
    pending = samples & np.fromiter((s.tokens[-1] == PENDING for s in seqs), bool, m)
    if (ns[pending] != 1).any():
      raise RuntimeError("a pending token outside a decode row (engine bug)")
    token_slots[row_starts[pending]] = slots[pending]
    for i in np.flatnonzero(~pending).tolist():  # prompts, chunks, known tokens
      toks, a, b = seqs[i].tokens, int(starts[i]), int(ends[i])
      if toks[b - 1] == PENDING:
        raise RuntimeError("a pending token outside a decode row (engine bug)")
      tokens[row_starts[i]:row_ends[i]] = toks[a:b]
    idx = np.flatnonzero(samples)
    seqs = [seqs[i] for i in idx.tolist()]
    lanes = [s.index for s in seqs]
    # A prompt that samples `n` (its first token: nothing generated yet)
    # samples its n samples in its one row, each with its own seed.
    reps = np.ones(idx.size, np.int32)
    first = np.flatnonzero(lens[idx] == np.fromiter(
        (s.group.prompt_len for s in seqs), np.int32, idx.size))
    for j in first.tolist():
      g = seqs[j].group
      if g.unborn and not g.is_beam and g.params.n > 1:
        reps[j] = g.params.n
    k = int(reps.sum())
    sample_seqs[:k] = np.repeat(slots[idx], reps)
    sample_rows[:k] = np.repeat(row_ends[idx] - 1, reps)
    if k > idx.size:  # the expanded rows: lanes 0..n-1 of a root (index 0)
      at = np.cumsum(reps) - reps  # each entry's first sample row
      for j in np.flatnonzero(reps > 1).tolist():
        n_samples, r0 = int(reps[j]), int(at[j])
        seed_offsets[r0:r0 + n_samples] = np.arange(n_samples)
      seqs = [s for s, r in zip(seqs, reps.tolist()) for _ in range(r)]
      lanes = [lane for j, r in enumerate(reps.tolist())
               for lane in (range(r) if r > 1 else [lanes[j]])]
    token_rows = sample_rows[:k].tolist()
    x = StepInputs(**book._asdict(), tokens=tokens, token_slots=token_slots,
                   sample_slots=np.full(S, -1, np.int32), sample_rows=sample_rows,
                   sample_seqs=sample_seqs, seed_offsets=seed_offsets)
    return x, Samples(token_rows, seqs, lanes)
