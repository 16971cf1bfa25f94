"""The device n-gram proposer of the speculative loop (`spec_loop.
history_drafts`) is exactly the host's (`spec_host.ngram_drafts`), row by
row, over ragged histories in a slot-indexed buffer with junk past each
length, padding rows, budget caps and rows with no match; and the history
write drops what is out of range."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.serving import spec_host, spec_loop
from paged_jax.speculative import NO_TOKEN

MAX_SEQS, WIDTH = 6, 24


@functools.partial(jax.jit, static_argnames=("k", "lo", "hi"))
def _drafts(history, seq_ids, lens, room, *, k, lo, hi):
  return spec_loop.history_drafts(history, seq_ids, lens, room,
                                  num_speculative_tokens=k,
                                  prompt_lookup_min=lo, prompt_lookup_max=hi)


@hypothesis.settings(max_examples=50, deadline=None, derandomize=True)
@hypothesis.given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=WIDTH), min_size=1,
                  max_size=MAX_SEQS),
    rooms=st.lists(st.integers(-1, 6), min_size=MAX_SEQS, max_size=MAX_SEQS),
    k=st.integers(1, 4), lo=st.integers(1, 3), extra=st.integers(0, 2),
    junk=st.integers(0, 3), data=st.data())
def test_history_drafts_are_the_host_proposers(seqs, rooms, k, lo, extra, junk,
                                               data):
  hi = lo + extra
  history = np.full((MAX_SEQS, WIDTH), junk, np.int32)  # junk past each length
  slots = data.draw(st.permutations(range(MAX_SEQS)))[:len(seqs)]
  for s, seq in zip(slots, seqs):
    history[s, :len(seq)] = seq
  # Rows in any slot order, and a padding row (-1) that proposes nothing.
  seq_ids = np.array(list(slots) + [-1], np.int32)
  lens = np.array([len(s) for s in seqs] + [WIDTH], np.int32)
  room = np.array(rooms[:len(seqs)] + [k], np.int32)
  draft, count = _drafts(jnp.asarray(history), seq_ids, lens, room, k=k, lo=lo,
                         hi=hi)
  draft, count = np.asarray(draft), np.asarray(count)
  for r, seq in enumerate(seqs):
    want = (spec_host.ngram_drafts(np.asarray(seq, np.int64), k=min(k, room[r]),
                                   n_min=lo, n_max=hi).tolist()
            if room[r] > 0 else [])
    assert count[r] == len(want), (seq, room[r], want, draft[r])
    assert draft[r].tolist() == want + [NO_TOKEN] * (k - len(want)), (seq, want)
  assert count[-1] == 0 and (draft[-1] == NO_TOKEN).all()


def test_history_drafts_examples():
  history = np.zeros((3, 10), np.int32)
  history[0, :7] = [5, 6, 7, 8, 5, 6, 7]  # "5 6 7" earlier: drafts 8 5 6
  history[1, :6] = [1, 2, 3, 4, 5, 6]  # no repeat: no draft
  history[2, :4] = [9, 9, 9, 9]  # overlapping match, capped by room
  d, n = _drafts(jnp.asarray(history), np.array([0, 1, 2], np.int32),
                 np.array([7, 6, 4], np.int32), np.array([3, 3, 1], np.int32),
                 k=3, lo=1, hi=3)
  assert n.tolist() == [3, 0, 1]
  assert d.tolist() == [[8, 5, 6], [-1, -1, -1], [9, -1, -1]]


def test_write_history_drops_out_of_range_writes():
  h = jnp.zeros((2, 4), jnp.int32)
  out = spec_loop.write_history(h, jnp.array([0, 1, -1, 2, 1, 0]),
                                jnp.array([1, 3, 0, 0, 4, -1]),
                                jnp.array([7, 8, 9, 9, 9, 9]))
  assert out.tolist() == [[0, 7, 0, 0], [0, 0, 0, 8]]
