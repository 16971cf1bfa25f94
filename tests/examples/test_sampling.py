"""The sampler and the beam-search rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.serving import beam as beam_lib
from paged_jax.serving import sampling
from paged_jax.serving.sampling import SamplingParams

sample = jax.jit(sampling.sample_tokens)


def rows(n, vocab=16, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((n, vocab)) * 2,
                     jnp.float32)


def args(n, temperature=0.0, top_k=0, top_p=1.0, seed=0, positions=None):
  return (jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
          jnp.full(n, top_p, jnp.float32), jnp.full(n, seed, jnp.int32),
          jnp.arange(n, dtype=jnp.int32) if positions is None else positions)


def test_greedy_and_degenerate_filters_take_the_argmax():
  logits = rows(64)
  best = np.argmax(logits, axis=-1)
  np.testing.assert_array_equal(sample(logits, *args(64)), best)
  np.testing.assert_array_equal(sample(logits, *args(64, 1.5, top_k=1)), best)
  np.testing.assert_array_equal(sample(logits, *args(64, 1.5, top_p=1e-6)), best)


@pytest.mark.parametrize("seed", range(4))
def test_argmax_is_jnp_argmax_with_ties_infinities_and_nans(seed):
  """`sampling.argmax` is `jnp.argmax` exactly: the first maximum of a row
  with ties, -inf and +inf entries, an all -inf row, and the first NaN of a
  row that has one (NaN-poisoned rows)."""
  rng = np.random.default_rng(seed)
  vocab = int(rng.integers(1, 300)) + (seed % 2) * sampling.SORT_VOCAB
  x = rng.integers(-3, 4, size=(40, vocab)).astype(np.float32)  # many ties
  x[rng.random(x.shape) < 0.05] = -np.inf
  x[rng.random(x.shape) < 0.01] = np.inf
  x[0] = -np.inf
  nan_rows = rng.random(40) < 0.3
  for r in np.flatnonzero(nan_rows):
    x[r, rng.integers(0, vocab, size=int(rng.integers(1, 3)))] = np.nan
  got = np.asarray(jax.jit(sampling.argmax)(jnp.asarray(x)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), -1)))
  np.testing.assert_array_equal(got[~nan_rows], np.argmax(x[~nan_rows], -1))


def _sorted_rule(scaled, top_k, top_p):
  """The top-k then top-p threshold by a full sort, in float64 (the rule
  `sampling.filter_threshold` keeps without sorting), and how close each row's
  stopping mass came to `top_p` (rows within rounding of it are not compared)."""
  vocab = scaled.shape[-1]
  out, margin = [], []
  for row, k, p in zip(scaled.astype(np.float64), top_k, top_p):
    vals = -np.sort(-row)
    k = min(k, vocab) if k > 0 else vocab
    probs = np.exp(vals[:k] - vals[0])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = (before < p) | (p >= 1.0)
    out.append(vals[:k][keep].min() if (k < vocab or p < 1.0) else -np.inf)
    margin.append(np.abs(before - p).min() if p < 1.0 else 1.0)
  return np.array(out), np.array(margin)


@pytest.mark.parametrize("vocab", [300, 3000])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_filter_threshold_is_the_sorted_rule(temperature, vocab):
  """`filter_threshold` keeps what a full sort keeps: over a small vocabulary
  (sorted), and over a large one on rows resolved by each stage (the
  `lax.top_k` prefix of 64, the bisection of top-k and top-p); peaked and
  flat rows, ties (integer-valued rows), banned (-inf) tokens, a top-k
  between the finite tokens' count and the vocabulary."""
  assert 300 <= sampling.SORT_VOCAB < 3000
  rng = np.random.default_rng(int(temperature * 10))
  n = 48
  x = rng.standard_normal((n, vocab)) * rng.choice([0.5, 3.0, 8.0], (n, 1))
  x[::5] = np.round(x[::5])  # ties
  x[rng.random(x.shape) < 0.02] = -np.inf
  scaled = (x / temperature).astype(np.float32)
  top_k = rng.choice([0, 0, 1, 7, 64, 65, vocab // 3, vocab - 1, vocab, 4000], n)
  top_p = rng.choice([1.0, 1.0, 0.9, 0.5, 0.99, 1e-3], n).astype(np.float32)
  got = np.asarray(jax.jit(sampling.filter_threshold)(
      jnp.asarray(scaled), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p)))
  want, margin = _sorted_rule(scaled, top_k, top_p)
  clear = margin > 1e-5
  assert clear.sum() >= n - 4
  kept_got = scaled >= got[:, None]
  kept_want = scaled >= want[:, None].astype(np.float32)
  np.testing.assert_array_equal(kept_got[clear], kept_want[clear])


def test_inverse_cdf_draws_the_softmax_and_never_a_banned_token():
  """Evenly spaced quantiles land on each token in proportion to its
  probability (two levels: 1,100 tokens, blocks of 512 and a padded last
  block; one level: 300 tokens); a -inf token is never drawn; an all -inf
  row gives 0."""
  for vocab in (1100, 300):
    _quantiles_follow_the_softmax(vocab)


def _quantiles_follow_the_softmax(vocab):
  n = 40000
  rng = np.random.default_rng(0)
  row = rng.standard_normal(vocab).astype(np.float32)
  row[rng.random(vocab) < 0.3] = -np.inf
  u = (np.arange(n) + 0.5) / n
  drawn = np.asarray(jax.jit(sampling.inverse_cdf)(
      jnp.tile(jnp.asarray(row)[None], (n, 1)), jnp.asarray(u, jnp.float32)))
  probs = np.exp(row - row[np.isfinite(row)].max())
  probs /= probs.sum()
  counts = np.bincount(drawn, minlength=vocab) / n
  assert counts[~np.isfinite(row)].sum() == 0
  np.testing.assert_allclose(counts, probs, atol=2 / n)
  assert np.all(np.diff(drawn) >= 0)  # quantiles in order, tokens in order
  dead = jnp.full((2, vocab), -jnp.inf)
  assert np.asarray(sampling.inverse_cdf(dead, jnp.array([0.0, 0.99]))).tolist() == [0, 0]


def test_samples_follow_the_filtered_distribution():
  n, vocab = 4000, 8
  logits = jnp.tile(jnp.linspace(0.0, 2.0, vocab)[None], (n, 1))
  probs = np.asarray(jax.nn.softmax(logits[0]))
  counts = np.bincount(sample(logits, *args(n, 1.0)), minlength=vocab) / n
  np.testing.assert_allclose(counts, probs, atol=0.03)
  top3 = np.bincount(sample(logits, *args(n, 1.0, top_k=3)), minlength=vocab) / n
  assert top3[:5].sum() == 0
  np.testing.assert_allclose(top3[5:], probs[5:] / probs[5:].sum(), atol=0.03)
  # top-p 0.5 keeps the smallest head whose mass reaches 0.5: tokens 7, 6, 5.
  assert np.cumsum(probs[::-1])[1] < 0.5 <= np.cumsum(probs[::-1])[2]
  nucleus = np.bincount(sample(logits, *args(n, 1.0, top_p=0.5)), minlength=vocab) / n
  assert nucleus[:5].sum() == 0 and nucleus[5:].min() > 0


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
  logits = rows(4)
  t = jnp.array([0.8, 0.8, 0.0, 1.2])
  seeds = jnp.array([3, 4, 5, 6])
  pos = jnp.array([10, 11, 12, 13])
  plain = sample(logits, t, jnp.zeros(4, jnp.int32), jnp.ones(4), seeds, pos)
  # Another row asks for top-k/top-p (the filtering branch runs): rows 0-2 unchanged.
  mixed = sample(logits, t, jnp.array([0, 0, 0, 3]), jnp.array([1, 1, 1, 0.5]), seeds, pos)
  np.testing.assert_array_equal(plain[:3], mixed[:3])
  again = sample(logits[::-1], t[::-1], jnp.zeros(4, jnp.int32), jnp.ones(4),
                 seeds[::-1], pos[::-1])
  np.testing.assert_array_equal(plain, again[::-1])


def test_top_logprobs():
  logits = rows(2)
  lp, ids = sampling.top_logprobs(logits, 3)
  ref = jax.nn.log_softmax(logits, axis=-1)
  np.testing.assert_array_equal(ids, np.argsort(-np.asarray(ref), axis=-1)[:, :3])
  # float32: the top logits minus the logsumexp, not a log_softmax; equal up to rounding
  np.testing.assert_allclose(lp, np.take_along_axis(np.asarray(ref), np.asarray(ids), -1),
                             rtol=1e-6, atol=1e-6)


def test_beam_search_step_rules():
  beams = [beam_lib.Beam([1], -1.0), beam_lib.Beam([2], -2.0)]
  cands = [([-0.1, -0.5, -3.0], [5, 9, 6]), ([-0.1, -0.2, -4.0], [7, 8, 9])]
  live, finished = beam_lib.beam_search_step(beams, cands, width=2, eos_token_ids=(9,))
  # Scores: (0,5)=-1.1 (0,9)=-1.5 eos (1,7)=-2.1 (1,8)=-2.2 ...
  assert finished == [(0, 9, -1.5)]
  assert live == [(0, 5, pytest.approx(-1.1)), (1, 7, pytest.approx(-2.1))]
  # An EOS outside the best `width` pairs is not a finished hypothesis.
  live, finished = beam_lib.beam_search_step(beams, cands, width=1, eos_token_ids=(9,))
  assert finished == [] and live == [(0, 5, pytest.approx(-1.1))]


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(seed=-1), "seed must be an int in"),
    (dict(n=0), "n must be >= 1"),
    (dict(beam_width=0), "beam_width must be >= 1"),
    (dict(n=2, beam_width=2), "use n or beam_width, not both"),
])
def test_sampling_params_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kw)
