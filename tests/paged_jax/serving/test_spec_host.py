"""The host side of speculative decoding: `spec_host.truncate` is exactly
`block_manager.truncate` on the host pool model, with and without prefix
caching (the model-based tests of `test_host_pool.py`, with truncates mixed
in, and a long random run that must hit every case), and `spec_host.ngram_drafts`
is exactly `speculative.ngram_propose`."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis.stateful import rule

from paged_jax import block_manager as bm
from paged_jax import speculative
from paged_jax.serving import spec_host
from paged_jax.serving.host_pool import HostPool
from tests.paged_jax.serving.test_host_pool import (BLOCK_SIZE, MAX_SEQS, N,
                                                    NUM_BLOCKS, WIDTH, PoolMachine,
                                                    _fork, _pad, _register, _release,
                                                    _reserve, _SETTINGS, _share,
                                                    assert_same, ids)

_truncate = jax.jit(bm.truncate)


class TruncatingPoolMachine(PoolMachine):
  """`PoolMachine` (reserve, release, fork; no prefix caching) plus
  truncates: mostly valid rollbacks of live sequences, some out of range."""

  @rule(seqs=ids, lens=st.lists(st.integers(-1, 12), min_size=N, max_size=N))
  def truncate_any(self, seqs, lens):
    self.truncate(_pad(seqs), np.array(lens, np.int32))

  @rule(data=st.data())
  def truncate_live(self, data):
    live = self._live()
    if not live:
      return
    seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=N, unique=True))
    lens = [data.draw(st.integers(0, int(self.pool.lens[s]))) for s in seqs]
    self.truncate(_pad(seqs), _pad(lens, 0))

  def truncate(self, x, lens):
    undo = self.pool.lens.copy()
    self.pool.begin()  # journaled: a rollback restores the model exactly
    spec_host.truncate(self.pool, x, lens)
    self.pool.rollback()
    np.testing.assert_array_equal(self.pool.lens, undo)
    got = spec_host.truncate(self.pool, x, lens)
    self.state, want = _truncate(self.state, x, lens)
    np.testing.assert_array_equal(got, want)


TestTruncatingHostPool = TruncatingPoolMachine.TestCase
TestTruncatingHostPool.settings = _SETTINGS


class CachingTruncatingPoolMachine(TruncatingPoolMachine):
  """The same with prefix caching: registrations, hits and evictions mixed
  with the truncates (cut ends inside registered blocks are refused,
  registered blocks past the end go to the ring)."""

  caching = True


TestCachingTruncatingHostPool = CachingTruncatingPoolMachine.TestCase
TestCachingTruncatingHostPool.settings = _SETTINGS


def test_long_random_run_with_prefix_caching_covers_every_truncate_case():
  """Mostly valid reserves, registrations, hits, releases, forks and
  truncates on a small caching pool, compared after each with the device;
  the run must have refused a cut inside a registered block, sent a
  registered block to the ring by truncating, freed a shared block only
  at its last reference, and evicted (checked, so the comparison covers
  them)."""
  rng = np.random.default_rng(3)
  state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=True)
  pool = HostPool(state)
  seen = dict(refused=0, to_ring=0, kept_shared=0, evictions=0)
  for _ in range(600):
    live = np.flatnonzero(pool.lens > 0)
    free = np.flatnonzero(pool.lens == 0)
    op = rng.choice(["reserve", "release", "fork", "register", "share", "truncate"],
                    p=[0.3, 0.08, 0.1, 0.12, 0.15, 0.25])
    if op == "reserve":
      x = _pad(rng.choice(MAX_SEQS, rng.integers(1, N + 1), replace=False))
      q = rng.integers(0, 4, N).astype(np.int32)
      got = pool.reserve(x, q)
      state, want = _reserve(state, x, q)
      np.testing.assert_array_equal(got.ok, want.ok)
      np.testing.assert_array_equal(got.evicted, want.evicted)
      seen["evictions"] += int(np.sum(got.evicted >= 0))
    elif op == "release" and len(live):
      x = _pad(rng.choice(live, 1))
      pool.release(x)
      state, _ = _release(state, x)
    elif op == "fork" and len(live) and len(free):
      p, c = _pad(rng.choice(live, 1)), _pad(rng.choice(free, 1))
      pool.fork(p, c)
      state, _ = _fork(state, p, c)
    elif op == "register" and len(live):
      s = int(rng.choice(live))
      full = min(int(pool.lens[s]) // BLOCK_SIZE, N)
      x, c = _pad([s] * full), _pad(range(full), 0)
      pool.register(x, c)
      state, _ = _register(state, x, c)
    elif op == "share" and len(free) and pool.cacheable.any():
      cacheable = np.flatnonzero(pool.cacheable)
      blocks = rng.choice(cacheable, min(len(cacheable), 2), replace=False)
      rows = np.full((N, WIDTH), -1, np.int32)
      rows[0, :len(blocks)] = blocks
      x, counts = _pad([int(rng.choice(free))]), _pad([len(blocks)], 1)
      pool.share(x, rows, counts)
      state, _ = _share(state, x, rows, counts)
    elif op == "truncate" and len(live):
      x = rng.choice(live, min(len(live), int(rng.integers(1, 3))), replace=False)
      lens = np.array([rng.integers(0, pool.lens[s] + 1) for s in x], np.int32)
      cached, refs = pool.num_cached, pool.refs.copy()
      dropped = np.concatenate([pool.tables[s, -(-int(n) // BLOCK_SIZE):
                                            -(-int(pool.lens[s]) // BLOCK_SIZE)]
                                for s, n in zip(x, lens)])
      got = spec_host.truncate(pool, _pad(x), _pad(lens, 0))
      state, want = _truncate(state, _pad(x), _pad(lens, 0))
      np.testing.assert_array_equal(got, want)
      seen["refused"] += int(np.sum(~got[:len(x)]))
      seen["to_ring"] += max(pool.num_cached - cached, 0)
      if got[:len(x)].all():
        seen["kept_shared"] += int(np.sum(refs[dropped] > 1))
    assert_same(pool, state)
  assert all(v > 0 for v in seen.values()), seen


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=14),
                  k=st.integers(1, 4), lo=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_drafts_are_ngram_propose(tokens, k, lo, extra):
  hi = lo + extra
  got = spec_host.ngram_drafts(np.asarray(tokens, np.int64), k=k, n_min=lo, n_max=hi)
  T = 16  # one width past the longest (fewer programs): the length bounds the row
  padded = np.zeros((1, T), np.int32)
  padded[0, :len(tokens)] = tokens
  draft, n = speculative.ngram_propose(padded, np.array([len(tokens)]),
                                       num_speculative_tokens=k,
                                       prompt_lookup_min=lo, prompt_lookup_max=hi)
  assert got.tolist() == np.asarray(draft)[0, :int(n[0])].tolist()
