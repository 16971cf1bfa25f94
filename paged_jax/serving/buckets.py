"""The static set of step shapes ("buckets") the engine compiles.

A step computes `num_tokens` token rows and `num_seqs` sequence rows. Rather
than always padding to the largest step (`max_tokens_per_step` rows, or
`max_batch` for decode), each step takes the smallest bucket that holds its
real work, so padding stays small, and every bucket compiles once.

The set, for `EngineConfig(max_batch=B, max_tokens_per_step=T,
min_bucket=m)`:

* decode buckets (one token row per sequence, the decode kernel):
  `num_tokens == num_seqs` in `sizes(B, m)`;
* mixed buckets (prefill chunks and decodes, the ragged kernel):
  `num_tokens` in `sizes(T, m)`, `num_seqs = min(B, num_tokens)` (a step
  never has more sequences than tokens, and never more than `B`);

where `sizes(n, m)` is the powers of two from `min(m, n)` below `n`, then `n`
itself: e.g. `sizes(256, 8) = (8, 16, 32, 64, 128, 256)`. With B = 32 and
T = 256 that is 3 + 6 = 9 shapes (min_bucket 8).

Sequence rows also bound the sample rows (one per sequence that samples,
`n` for a prompt that forks `n` samples), so a bucket is chosen for
`max(entries, samples)` sequence rows.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
  """One compiled step shape.

  Attributes:
    num_tokens: token rows of the step.
    num_seqs: sequence (and sample) rows.
    decode_only: the decode layout (row `i` is sequence `i`'s one token).
  """

  num_tokens: int
  num_seqs: int
  decode_only: bool


def sizes(n: int, min_bucket: int) -> tuple[int, ...]:
  """Powers of two from `min(min_bucket, n)` below `n`, then `n`.

  >>> sizes(256, 8)
  (8, 16, 32, 64, 128, 256)
  >>> sizes(24, 8)
  (8, 16, 24)
  """
  if n < 1 or min_bucket < 1:
    raise ValueError(f"sizes need n >= 1 and min_bucket >= 1, got {n=}, {min_bucket=}")
  out, b = [], 1
  while b < min(min_bucket, n):
    b *= 2
  b = min(b, n)
  while b < n:
    out.append(b)
    b *= 2
  return tuple(out) + (n,)


def bucket_set(max_batch: int, max_tokens_per_step: int,
               min_bucket: int) -> tuple[Bucket, ...]:
  """Every step shape of an engine (see the module docstring), smallest first
  within each kind: the decode buckets, then the mixed ones."""
  decode = tuple(Bucket(b, b, True) for b in sizes(max_batch, min_bucket))
  mixed = tuple(Bucket(t, min(max_batch, t), False)
                for t in sizes(max_tokens_per_step, min_bucket))
  return decode + mixed


def choose(buckets: tuple[Bucket, ...], *, num_tokens: int, num_seqs: int,
           decode_only: bool) -> Bucket:
  """The smallest bucket of the kind holding `num_tokens` token rows and
  `num_seqs` sequence rows.

  Raises:
    ValueError: if no bucket holds them (a scheduler bug: plans fit the
      largest bucket by construction).
  """
  for b in buckets:
    if (b.decode_only == decode_only and b.num_tokens >= num_tokens
        and b.num_seqs >= num_seqs):
      return b
  raise ValueError(f"no {'decode' if decode_only else 'mixed'} bucket holds "
                   f"{num_tokens=} and {num_seqs=}; buckets are {buckets}")
