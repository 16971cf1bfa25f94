"""The static bucket set and the bounded statistics (no model needed)."""

from __future__ import annotations

import pytest

from paged_jax.serving import buckets
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.stats import EngineStats, Gauge, Latency


def test_sizes_are_powers_of_two_and_midpoints_then_the_maximum():
  assert buckets.sizes(256, 8, midpoints=False) == (8, 16, 32, 64, 128, 256)
  assert buckets.sizes(24, 8, midpoints=False) == (8, 16, 24)
  assert buckets.sizes(4, 8) == (4,)
  assert buckets.sizes(16, 3, midpoints=False) == (4, 8, 16)
  assert buckets.sizes(1, 1) == (1,)
  assert buckets.sizes(32, 1) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
  assert buckets.sizes(20, 3) == (3, 4, 6, 8, 12, 16, 20)


def test_sizes_errors():
  with pytest.raises(ValueError, match="n=0, min_bucket=8"):
    buckets.sizes(0, 8)


def test_bucket_set_and_choice():
  assert len(buckets.bucket_set(32, 256, 1)) == 10 + 7
  bs = buckets.bucket_set(max_batch=32, max_tokens_per_step=256, min_bucket=8,
                          midpoints=False)
  decode = [b for b in bs if b.decode_only]
  mixed = [b for b in bs if not b.decode_only]
  assert [(b.num_tokens, b.num_seqs) for b in decode] == [(8, 8), (16, 16), (32, 32)]
  assert [(b.num_tokens, b.num_seqs) for b in mixed] == [
      (32, 32), (64, 32), (128, 32), (256, 32)]  # from max_batch
  choose = lambda **kw: buckets.choose(bs, **kw)  # noqa: E731
  assert choose(num_tokens=5, num_seqs=5, decode_only=True) == Bucket(8, 8, True)
  assert choose(num_tokens=17, num_seqs=17, decode_only=True) == Bucket(32, 32, True)
  assert choose(num_tokens=65, num_seqs=3, decode_only=False) == Bucket(128, 32, False)
  assert choose(num_tokens=5, num_seqs=1, decode_only=False) == Bucket(32, 32, False)
  # A 1-token prompt forking 4 samples needs 4 sample rows.
  small = buckets.bucket_set(4, 16, 1, midpoints=False)
  assert [b.num_tokens for b in small] == [1, 2, 4, 4, 8, 16]
  assert buckets.choose(small, num_tokens=1, num_seqs=4,
                        decode_only=False) == Bucket(4, 4, False)
  with pytest.raises(ValueError, match="no mixed bucket holds num_tokens=300"):
    choose(num_tokens=300, num_seqs=1, decode_only=False)


def test_statistics_stay_bounded_over_a_long_run():
  lat = Latency(window=100)
  gauge = Gauge()
  for i in range(100_000):
    lat.add(i * 1e-6)
    gauge.add(i % 7)
  assert lat.count == 100_000 and len(lat.recent) == 100
  assert lat.mean == pytest.approx(0.0499995)
  assert lat.percentile(50) == pytest.approx(0.09995, abs=1e-6)  # the window
  assert gauge.peak == 6 and gauge.count == 100_000
  st = EngineStats()
  assert all(not isinstance(v, list) for v in vars(st).values())
  with pytest.raises(ValueError, match="window must be >= 1, got 0"):
    Latency(window=0)
