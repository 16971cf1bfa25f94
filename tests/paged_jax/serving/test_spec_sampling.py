"""Sampled verification (`spec_step.verify`) on a small vocabulary.

The target is a Markov chain over `V` tokens (logits `W[previous token]`),
so the exact distribution of a sequence's first tokens is known. A driver
runs the verification step the engine runs -- point-mass drafts (each
draft the chain's most likely successor of the one before, as a copying
proposer would make them), `1 + d` query rows per sequence, a random
`d in [0, k]` per row and step -- over many seeds, and checks:

* the tokens are exactly those of plain decoding, the sampler's draw at
  each position with the key `(seed, position)` (`sampling.sample_tokens`);
* the joint distribution of the first `G` tokens passes a chi-square test
  against the exact chain, at temperature 1 and with top-k / top-p;
* deliberately wrong rules fail it by a wide margin: a fixed acceptance
  threshold on `p(x)`, one key for all of a step's query rows, and the
  positions off by one (the first query reusing the key that the plain
  step drew the previous token with; off by one everywhere would only
  relabel the keys, which the exact-tokens test catches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from paged_jax.serving import sampling
from paged_jax.serving import slot_state
from paged_jax.serving import spec_step

V, K, G = 4, 3, 3  # vocabulary, drafts per step, tokens checked
N = 12_000  # sequences (one seed each)
# Rows differ, but not by much: draws that share a key tend to repeat.
W = np.array([[1.0, 0.6, 0.2, -0.3],
              [0.5, 1.0, 0.1, 0.0],
              [0.2, 0.7, 0.9, -0.2],
              [0.8, 0.0, 0.4, 0.6]], np.float32)
FIRST = 0  # the prompt: one token
P_CRIT = 1e-4  # a correct rule passes at this level; wrong ones fail far below


def _exact_next(temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """f64[V, V]: the next-token distribution after each token, filtered as
  `sampling._filtered_logits` filters (temperature, top-k, then top-p)."""
  out = np.zeros((V, V))
  for a in range(V):
    z = W[a].astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(V, bool)
    kk = top_k if top_k > 0 else V
    pk = np.exp(z[order[:kk]] - z[order[:kk]].max())
    pk /= pk.sum()
    before = np.cumsum(pk) - pk
    for r in range(kk):
      if before[r] < top_p or top_p >= 1:
        keep[order[r]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    out[a] = p / p.sum()
  return out


def _rows(n, temperature, top_k, top_p, positions):
  return slot_state.SampleRows(
      temperature=jnp.full((n,), temperature, jnp.float32),
      top_k=jnp.full((n,), top_k, jnp.int32),
      top_p=jnp.full((n,), top_p, jnp.float32),
      seeds=jnp.arange(n, dtype=jnp.int32), positions=positions,
      ban_until=jnp.zeros((n,), jnp.int32),
      banned=jnp.full((n, sampling.MAX_BANNED), -1, jnp.int32),
      bias_ids=jnp.zeros((n, 0), jnp.int32),
      bias_values=jnp.zeros((n, 0), jnp.float32))


def _layout(n):
  """Every row's `1 + K` query rows, in order (`row_entry`, `row_offset`,
  `query_rows` of `SpecInputs`)."""
  entry = np.repeat(np.arange(n), 1 + K).astype(np.int32)
  offset = np.tile(np.arange(1 + K), n).astype(np.int32)
  query_rows = np.arange(n * (1 + K), dtype=np.int32).reshape(n, 1 + K)
  return entry, offset, query_rows


def _threshold_verify(logits, rows, drafts, num_draft, query_rows, entry, offset):
  """WRONG: accepts a draft iff its target probability exceeds 0.3 (no
  randomness in the test), else emits the draw."""
  q = spec_step.query_sample_rows(rows, num_draft, entry, offset)
  sampled, _ = spec_step.sample_queries(logits, q)
  probs = jax.nn.softmax(logits / q.temperature[:, None], axis=-1)
  target = sampled[query_rows]
  p_draft = jnp.take_along_axis(probs[query_rows][:, :K], drafts[..., None],
                                axis=2)[..., 0]
  cols = jnp.arange(K)[None, :]
  ok = (p_draft > 0.3) & (cols < num_draft[:, None])
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  padded = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), -1)], axis=1)
  last = jnp.take_along_axis(target, a[:, None], axis=1)
  c = jnp.arange(K + 1)[None, :]
  emitted = jnp.where(c < a[:, None], padded, jnp.where(c == a[:, None], last, -1))
  return emitted, a, None


def _correct(logits, rows, drafts, num_draft, query_rows, entry, offset):
  return spec_step.verify(logits, rows, drafts, num_draft, query_rows, entry,
                          offset)


def _one_key(logits, rows, drafts, num_draft, query_rows, entry, offset):
  """WRONG: every query row of a step draws with the first one's key."""
  return spec_step.verify(logits, rows, drafts, num_draft, query_rows, entry,
                          jnp.zeros_like(offset))


def _off_by_one(logits, rows, drafts, num_draft, query_rows, entry, offset):
  """WRONG: query `j` draws with position `L + j` (the key of the token
  before the one it samples)."""
  return spec_step.verify(logits, rows, drafts, num_draft, query_rows, entry,
                          offset - 1)


RULES = {"correct": _correct, "threshold": _threshold_verify,
         "one_key": _one_key, "off_by_one": _off_by_one}


def _generate(rule, temperature=1.0, top_k=0, top_p=1.0, n=N, steps=G):
  """i32[n, G]: each sequence's first `G` generated tokens: the first by
  the plain sampler (the engine's prefill step), then `steps` verification
  steps of `rule` (each emits >= 1 token per sequence)."""
  verify = jax.jit(RULES[rule])
  entry, offset, query_rows = _layout(n)
  succ = np.argmax(W, axis=1)  # the point-mass proposer's next token
  rng = np.random.default_rng(0)
  first = _plain(temperature, top_k, top_p, n=n, count=1)[:, 0]
  seqs = [[FIRST, int(t)] for t in first]
  for _ in range(steps):
    last = np.array([s[-1] for s in seqs])
    drafts = np.zeros((n, K), np.int32)
    x = last
    for j in range(K):
      x = succ[x]
      drafts[:, j] = x
    num_draft = rng.integers(0, K + 1, n).astype(np.int32)
    drafts = np.where(np.arange(K)[None, :] < num_draft[:, None], drafts, -1)
    inputs = np.concatenate([last[:, None], np.maximum(drafts, 0)], axis=1)
    logits = jnp.asarray(W[inputs.reshape(-1)])  # [n * (1 + K), V]
    lens = np.array([len(s) for s in seqs], np.int32)
    rows = _rows(n, temperature, top_k, top_p, jnp.asarray(lens + num_draft))
    emitted, accepted, _ = verify(logits, rows, jnp.asarray(drafts),
                                  jnp.asarray(num_draft), query_rows, entry, offset)
    emitted, accepted = np.asarray(emitted), np.asarray(accepted)
    assert (accepted >= 0).all() and (accepted <= num_draft).all()
    for i, s in enumerate(seqs):
      s.extend(emitted[i, :accepted[i] + 1].tolist())
  return np.array([s[1:1 + G] for s in seqs])


def _plain(temperature=1.0, top_k=0, top_p=1.0, n=N, count=G):
  """i32[n, count]: plain decoding, one draw per position (the engine's
  step)."""
  toks = np.full(n, FIRST)
  out = []
  sample = jax.jit(sampling.sample_tokens)
  for pos in range(1, 1 + count):
    toks = np.asarray(sample(jnp.asarray(W[toks]), jnp.full(n, temperature),
                             jnp.full(n, top_k), jnp.full(n, top_p),
                             jnp.arange(n, dtype=jnp.int32),
                             jnp.full(n, pos, jnp.int32)))
    out.append(toks)
  return np.stack(out, axis=1)


def _chi_square(tokens, temperature=1.0, top_k=0, top_p=1.0):
  """(statistic, p-value) of the joint counts of `tokens` (i32[n, G])
  against the exact chain (cells of zero probability: any count fails)."""
  nxt = _exact_next(temperature, top_k, top_p)
  probs = np.ones([V] * G)
  prev = np.full([V] * G, FIRST)
  grids = np.meshgrid(*[np.arange(V)] * G, indexing="ij")
  for g in range(G):
    probs = probs * nxt[prev, grids[g]]
    prev = grids[g]
  idx = np.ravel_multi_index(tokens.T, [V] * G)
  counts = np.bincount(idx, minlength=V ** G)
  want = probs.reshape(-1) * tokens.shape[0]
  if (counts[want == 0] > 0).any():
    return np.inf, 0.0
  live = want > 0
  stat = float(((counts[live] - want[live]) ** 2 / want[live]).sum())
  return stat, float(stats.chi2.sf(stat, live.sum() - 1))


FILTERS = [dict(), dict(temperature=0.7, top_k=3), dict(top_p=0.8)]


@pytest.mark.parametrize("f", FILTERS, ids=["t1", "t0.7-topk3", "topp0.8"])
def test_spec_tokens_are_the_plain_steps_tokens(f):
  n = 2000
  np.testing.assert_array_equal(_generate("correct", n=n, **f), _plain(n=n, **f))


@pytest.mark.parametrize("f", FILTERS, ids=["t1", "t0.7-topk3", "topp0.8"])
def test_the_joint_distribution_is_the_chains(f):
  stat, p = _chi_square(_generate("correct", **f), **f)
  assert p > P_CRIT, (stat, p)


@pytest.mark.parametrize("rule", ["threshold", "one_key", "off_by_one"])
def test_wrong_rules_fail_by_a_wide_margin(rule):
  stat, p = _chi_square(_generate(rule))
  crit = stats.chi2.isf(P_CRIT, V ** G - 1)
  assert stat > 5 * crit, (rule, stat, crit)


def test_the_chi_square_has_the_power_to_see_a_small_bias():
  """The test's own check: a chain with one row's logits nudged by 0.15
  fails, so the passes above mean something."""
  global W  # pylint: disable=global-statement
  saved = W
  try:
    W = W.copy()
    W[0, 1] += 0.15
    tokens = _plain()
  finally:
    W = saved
  assert _chi_square(tokens)[1] < P_CRIT


# ------------------------------------------------------------ draft budgets


def test_draft_budgets_are_at_most_five_and_hold_every_draft():
  assert spec_step.draft_budgets(16, 4) == (4, 8, 16, 32, 64)
  assert spec_step.draft_budgets(1, 4) == (1, 2, 4)
  assert spec_step.draft_budgets(256, 3) == (48, 96, 192, 384, 768)
  for s in (1, 3, 4, 7, 64):
    for k in (1, 2, 5):
      b = spec_step.draft_budgets(s, k)
      assert len(b) <= spec_step.NUM_BUDGETS and b[-1] == s * k
  assert spec_step.choose_budget((4, 8, 16), 0) == 4
  assert spec_step.choose_budget((4, 8, 16), 5) == 8
  assert spec_step.choose_budget((4, 8, 16), 16) == 16


def test_draft_budget_errors_say_expected_and_given():
  with pytest.raises(ValueError, match="num_seqs must be a positive int, got 0"):
    spec_step.draft_budgets(0, 4)
  with pytest.raises(ValueError, match="k must be a positive int, got 2.0"):
    spec_step.draft_budgets(4, 2.0)
  with pytest.raises(ValueError, match=r"num_drafts=17 exceeds the largest "
                     r"draft budget 16 \(budgets \(4, 8, 16\)\)"):
    spec_step.choose_budget((4, 8, 16), 17)


def test_the_layout_gives_rows_without_drafts_one_token_row():
  from paged_jax.serving import spec_host  # pylint: disable=import-outside-toplevel

  class X:  # the decode bucket's inputs that `_inputs` reads
    seq_ids = np.array([3, 1, 0, -1], np.int32)
    tokens = np.array([11, 12, 13, 0], np.int32)

  drafts = [np.array([5, 6]), np.zeros(0, np.int64), np.array([7])]
  d = np.array([2, 0, 1, 0], np.int32)
  s = spec_host._inputs(X, drafts, d, 3, 4)  # pylint: disable=protected-access
  assert s.tokens.tolist() == [11, 5, 6, 12, 13, 7, 0, 0]  # S + budget rows
  assert s.row_entry.tolist() == [0, 0, 0, 1, 2, 2, -1, -1]
  assert s.row_offset.tolist() == [0, 1, 2, 0, 0, 1, 0, 0]
  assert s.query_rows.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 0, 0],
                                   [0, 0, 0, 0]]
  assert s.drafts.tolist() == [[5, 6, -1], [-1, -1, -1], [7, -1, -1],
                               [-1, -1, -1]]
