"""Synthetic traces: seeded, means near the published targets, clipped."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paged_jax import traces

# Means of a 10,000-request trace must land within this fraction of the target
# (the sampling error of the ShareGPT-like prompt mean is ~1.3% at this size).
MEAN_RTOL = 0.05
N = 10_000


@pytest.mark.parametrize("name, prompt_mean, output_mean", [
    ("sharegpt", 161, 338),
    ("alpaca", 19, 58),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_means_near_targets(name, prompt_mean, output_mean, seed):
  t = traces.make_trace(name, N, seed=seed)
  assert t.prompt_lens.mean() == pytest.approx(prompt_mean, rel=MEAN_RTOL)
  assert t.output_lens.mean() == pytest.approx(output_mean, rel=MEAN_RTOL)
  assert t.prompt_lens.dtype == np.int32 and t.output_lens.dtype == np.int32
  assert t.prompt_lens.min() >= 1 and t.output_lens.min() >= 1


def test_sharegpt_is_right_skewed_and_clipped():
  t = traces.make_trace("sharegpt", N, seed=0)
  for lens in (t.prompt_lens, t.output_lens):
    assert np.median(lens) < 0.8 * lens.mean()  # Long right tail.
  assert t.total_lens.max() == 2048  # The tail reaches the clip...
  assert (t.total_lens <= 2048).all()  # ...and never passes it.


def test_seeded():
  a = traces.make_trace("sharegpt", 500, request_rate=5.0, seed=3)
  b = traces.make_trace("sharegpt", 500, request_rate=5.0, seed=3)
  c = traces.make_trace("sharegpt", 500, request_rate=5.0, seed=4)
  np.testing.assert_array_equal(a.prompt_lens, b.prompt_lens)
  np.testing.assert_array_equal(a.arrival_times, b.arrival_times)
  assert not np.array_equal(a.prompt_lens, c.prompt_lens)


def test_poisson_arrivals():
  rate = 4.0
  t = traces.make_trace("alpaca", N, request_rate=rate, seed=0)
  gaps = np.diff(t.arrival_times, prepend=0.0)
  assert (gaps >= 0).all()
  assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
  assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # Exponential: sd = mean.
  assert (traces.make_trace("alpaca", 10).arrival_times == 0).all()  # rate inf


def test_custom_spec_clip():
  spec = traces.TraceSpec("tiny", prompt_mean=50, output_mean=50,
                          prompt_sigma=1.0, output_sigma=1.0, max_total_len=64)
  t = traces.make_trace(spec, 2000, seed=0)
  assert t.total_lens.max() == 64 and (t.output_lens >= 1).all()
  assert len(t) == 2000


@pytest.mark.parametrize("kwargs, match", [
    (dict(spec="lmsys", num_requests=1), "unknown trace 'lmsys'"),
    (dict(spec="alpaca", num_requests=0), "num_requests=0 must be >= 1"),
    (dict(spec="alpaca", num_requests=1, request_rate=0.0), "request_rate=0.0 must be > 0"),
    (dict(spec="alpaca", num_requests=1, request_rate=math.nan), "request_rate=nan must be > 0"),
])
def test_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    traces.make_trace(**kwargs)
