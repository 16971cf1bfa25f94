"""The host side of speculative decoding: `spec_host.truncate` is exactly
`block_manager.truncate` on the host pool model (the model-based test of
`test_host_pool.py`, with truncates mixed in), and `spec_host.ngram_drafts`
is exactly `speculative.ngram_propose`."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis.stateful import rule

from paged_jax import block_manager as bm
from paged_jax import speculative
from paged_jax.serving import spec_host
from paged_jax.serving.host_pool import HostPool
from tests.paged_jax.serving.test_host_pool import (N, PoolMachine,
                                                    _pad, _SETTINGS, ids)

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


def test_truncate_refuses_a_caching_pool():
  state = bm.init(num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=2,
                  prefix_caching=True)
  with pytest.raises(ValueError, match="without prefix caching"):
    spec_host.truncate(HostPool(state), [0], [0])


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=14),
                  k=st.integers(1, 4), lo=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_drafts_are_ngram_propose(tokens, k, lo, extra):
  hi = lo + extra
  got = spec_host.ngram_drafts(np.asarray(tokens, np.int64), k=k, n_min=lo, n_max=hi)
  T = max(len(tokens), 1)
  padded = np.zeros((1, T), np.int32)
  padded[0, :len(tokens)] = tokens
  draft, n = speculative.ngram_propose(padded, np.array([len(tokens)]),
                                       num_speculative_tokens=k,
                                       prompt_lookup_min=lo, prompt_lookup_max=hi)
  assert got.tolist() == np.asarray(draft)[0, :int(n[0])].tolist()
