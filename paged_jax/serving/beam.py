"""Beam search rules (pure host logic, shared by the scheduler and the tests).

The device step returns each beam row's top log-probabilities
(`sampling.top_logprobs`); `beam_search_step` expands the live beams from them
and `rank_finished` orders the finished hypotheses. The scheduler
(`scheduler.py`) turns an expansion into forks and retirements of sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass
class Beam:
  """A live or finished beam hypothesis (host side)."""

  tokens: list[int]  # generated tokens only
  logprob: float = 0.0
  finish_reason: str | None = None

  def score(self, length_penalty: float) -> float:
    return self.logprob / max(len(self.tokens), 1) ** length_penalty


def beam_search_step(
    beams: Sequence[Beam],
    candidates: Sequence[tuple[Sequence[float], Sequence[int]]],
    *,
    width: int,
    eos_token_ids: Sequence[int],
) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
  """One beam-search expansion (pure host logic, shared by engine and tests).

  Every (beam `i`, candidate token `t`) pair is scored
  `beams[i].logprob + logprob(t)`; pairs are taken best first (ties: lower
  beam index, then better rank). A pair ending in EOS becomes a finished
  hypothesis if it ranks among the best `width` pairs; others become live
  beams until there are `width` of them.

  Args:
    beams: the live beams.
    candidates: per beam, `(logprobs, token ids)` best first (at least
      `2 * width` of them so that EOS cannot starve the live set).
    width: beam width.
    eos_token_ids: stop tokens.

  Returns:
    `(live, finished)`: lists of `(parent beam index, token, new logprob)`.
  """
  pairs = []
  for i, (lps, ids) in enumerate(candidates):
    for rank, (lp, t) in enumerate(zip(lps, ids)):
      pairs.append((-(beams[i].logprob + float(lp)), i, rank, int(t)))
  pairs.sort()
  live, finished = [], []
  eos = set(eos_token_ids)
  for order, (neg, i, _, t) in enumerate(pairs):
    if t in eos:
      if order < width:
        finished.append((i, t, -neg))
      continue
    live.append((i, t, -neg))
    if len(live) == width:
      break
  return live, finished


def rank_finished(hypotheses: Sequence[tuple[float, list[int], str]], *,
                  width: int, length_penalty: float
                  ) -> list[tuple[float, list[int], str]]:
  """The best `width` of `(logprob, tokens, finish_reason)` hypotheses, best
  first, by `logprob / len(tokens) ** length_penalty` (stable for ties)."""
  ranked = sorted(hypotheses,
                  key=lambda b: -b[0] / max(len(b[1]), 1) ** length_penalty)
  return list(ranked[:width])
