"""The static set of step shapes ("buckets") the engine compiles.

A step computes `num_tokens` token rows and `num_seqs` sequence rows. Rather
than always padding to the largest step (`max_tokens_per_step` rows, or
`max_batch` for decode), each step takes the smallest bucket that holds its
real work, so padding stays small, and every bucket compiles once.

The set, for `EngineConfig(max_batch=B, max_tokens_per_step=T,
min_bucket=m, bucket_midpoints=h)`:

* decode buckets (one token row per sequence, the decode kernel):
  `num_tokens == num_seqs` in `sizes(B, m, h)`;
* mixed buckets (prefill chunks and decodes, the ragged kernel):
  `num_tokens` in `sizes(T, max(m, B), h)`, `num_seqs = min(B, num_tokens)`
  (a step never has more sequences than tokens, and never more than `B`).
  They start at `B` token rows: a mixed step with fewer is rare (a few
  sequences and a short chunk) and costs little when padded;

where `sizes(n, m, h)` is the powers of two from `m` below `n` and, with
`h` (the default), their 1.5x midpoints, then `n` itself:
`sizes(32, 1, True) = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)`. A decode step,
or a mixed step of at least `B` rows, then computes less than 1.5x (powers of
two alone: 2x) its real rows, and on a
ShareGPT-like workload (B = 32, T = 256: 10 + 7 = 17 shapes) about 1.12x in
all (powers of two alone: 1.28x; measured 2026-12-01: 128 requests at
scale 1/6, EOS ignored, 4,096 KV tokens in 32-token blocks).

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


def sizes(n: int, min_bucket: int, midpoints: bool = True) -> tuple[int, ...]:
  """Powers of two `b` with `min_bucket <= b < n` (and `1.5 * b` with
  `midpoints`), then `n`.

  >>> sizes(256, 8, midpoints=False)
  (8, 16, 32, 64, 128, 256)
  >>> sizes(24, 4)
  (4, 6, 8, 12, 16, 24)
  """
  if n < 1 or min_bucket < 1:
    raise ValueError(f"sizes need n >= 1 and min_bucket >= 1, got {n=}, {min_bucket=}")
  out, b = set(), 1
  while b < n:
    for size in ((b, b * 3 // 2) if midpoints and b >= 2 else (b,)):
      if min_bucket <= size < n:
        out.add(size)
    b *= 2
  return tuple(sorted(out)) + (n,)


def bucket_set(max_batch: int, max_tokens_per_step: int, min_bucket: int,
               midpoints: bool = True) -> tuple[Bucket, ...]:
  """Every step shape of an engine (see the module docstring), smallest first
  within each kind: the decode buckets, then the mixed ones."""
  decode = tuple(Bucket(b, b, True) for b in sizes(max_batch, min_bucket, midpoints))
  mixed = tuple(Bucket(t, min(max_batch, t), False)
                for t in sizes(max_tokens_per_step, max(min_bucket, max_batch),
                               midpoints))
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
