"""Host tier: device + host pools against a plain-Python model, and edge cases."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_jax import block_manager as bm
from paged_jax import host_tier as ht
from paged_jax.block_manager import NULL_BLOCK

NUM_BLOCKS, NUM_HOST, BLOCK_SIZE, MAX_SEQS, WIDTH = 10, 7, 4, 5, 4
# Mostly live-able slots, sometimes an out-of-range one.
seq_id = st.one_of(st.integers(0, MAX_SEQS - 1), st.integers(0, MAX_SEQS - 1),
                   st.integers(-1, MAX_SEQS))
seq_ids = st.lists(seq_id, max_size=3)

_reserve = jax.jit(bm.reserve)
_release = jax.jit(bm.release)
_fork = jax.jit(bm.fork)
_register = jax.jit(bm.register)
_swap_out = jax.jit(ht.swap_out)
_swap_in = jax.jit(ht.swap_in)
_drop = jax.jit(ht.drop)


def _padded(xs, size, pad):
  """A non-empty batch `xs` padded with `pad` (a request on slot -1, which
  fails and changes nothing) to `size` entries: each op compiles for two
  batch shapes (empty, whose path is static, and `size`), not one per length.
  The rules check the padding's results too."""
  return list(xs) + [pad] * (size - len(xs)) if len(xs) else xs


def _cdiv(a, b):
  return -(-a // b)


def _ids(values):
  return jnp.asarray(np.asarray(values, np.int32).reshape(-1))


class Model:
  """Device and host pools in plain Python.

  Each sequence carries a list of content labels, one per logical block; the
  simulated caches (`dev`, `host`: block -> label) are updated only through
  the copy pairs the ops return, so a wrong pair or table shows up as a
  sequence whose blocks no longer hold its labels.
  """

  def __init__(self):
    self.lens = [0] * MAX_SEQS
    self.rows = [[] for _ in range(MAX_SEQS)]  # device blocks
    self.labels = [[] for _ in range(MAX_SEQS)]  # expected content per block
    self.refs = [0] * NUM_BLOCKS
    self.host_lens = [0] * MAX_SEQS
    self.host_rows = [[] for _ in range(MAX_SEQS)]
    self.dev = {}  # device block -> label (simulated K/V)
    self.host = {}
    self.next_label = 0

  @property
  def dev_available(self):
    return sum(r == 0 for r in self.refs)

  @property
  def host_free(self):
    return NUM_HOST - sum(len(r) for r in self.host_rows)

  def label(self):
    self.next_label += 1
    return self.next_label


class TierMachine(RuleBasedStateMachine):
  prefix_caching = False

  def __init__(self):
    super().__init__()
    self.state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH,
                         prefix_caching=self.prefix_caching)
    self.tier = ht.init(self.state, num_host_blocks=NUM_HOST)
    self.m = Model()

  @rule(reqs=st.lists(st.tuples(seq_id, st.integers(0, 9)), max_size=3))
  def reserve(self, reqs):
    m = self.m
    # A swapped-out slot stays unused on the device (the caller's duty).
    reqs = [(-1 if 0 <= s < MAX_SEQS and m.host_lens[s] else s, n)
            for s, n in reqs]
    batch = _padded(reqs, 3, (-1, 0))
    self.state, res = _reserve(self.state, _ids([r[0] for r in batch]),
                               _ids([r[1] for r in batch]))
    assert not np.asarray(res.ok)[len(reqs):].any()
    tables = np.asarray(self.state.block_tables)
    for i, (sid, n) in enumerate(reqs):
      if not bool(res.ok[i]):
        continue
      cow = int(res.copy_src[i]) >= 0
      if cow:  # the copy-on-write copy, through the pair
        m.refs[int(res.copy_src[i])] -= 1
        m.dev[int(res.copy_dst[i])] = m.dev[int(res.copy_src[i])]
      old = len(m.rows[sid])
      m.lens[sid] += n
      new_row = tables[sid, :_cdiv(m.lens[sid], BLOCK_SIZE)].tolist()
      for b in new_row[old - cow:]:
        m.refs[b] += 1
      for b in new_row[old:]:  # fresh blocks get fresh content
        lab = m.label()
        m.dev[b] = lab
        m.labels[sid].append(lab)
      m.rows[sid] = new_row

  @rule(ids=seq_ids)
  def release(self, ids):
    self.state, ok = _release(self.state, _ids(_padded(ids, 3, -1)))
    assert not np.asarray(ok)[len(ids):].any()
    for i, (sid, good) in enumerate(zip(ids, np.asarray(ok).tolist())):
      want = (0 <= sid < MAX_SEQS and self.m.lens[sid] > 0
              and sid not in ids[:i])
      assert good == want, (ids, ok)
      if good:
        for b in self.m.rows[sid]:
          self.m.refs[b] -= 1
        self.m.rows[sid], self.m.labels[sid], self.m.lens[sid] = [], [], 0

  @rule(parent=st.integers(0, MAX_SEQS - 1), child=st.integers(0, MAX_SEQS - 1))
  def fork(self, parent, child):
    m = self.m
    if m.host_lens[child]:
      return  # a swapped-out slot stays unused on the device (the caller's duty)
    self.state, ok = _fork(self.state, _ids([parent]), _ids([child]))
    want = m.lens[parent] > 0 and m.lens[child] == 0 and parent != child
    assert bool(ok[0]) == want
    if want:
      for b in m.rows[parent]:
        m.refs[b] += 1
      m.rows[child] = list(m.rows[parent])
      m.labels[child] = list(m.labels[parent])
      m.lens[child] = m.lens[parent]

  @rule(sid=st.integers(0, MAX_SEQS - 1), col=st.integers(0, WIDTH - 1))
  def register(self, sid, col):
    if self.prefix_caching:
      self.state, _ = _register(self.state, _ids([sid]), _ids([col]))

  @rule(ids=seq_ids)
  def swap_out(self, ids):
    m = self.m
    self.state, self.tier, out = _swap_out(self.state, self.tier,
                                           _ids(_padded(ids, 3, -1)))
    assert not np.asarray(out.ok)[len(ids):].any()
    free, seen = m.host_free, set()
    for i, sid in enumerate(ids):
      need = _cdiv(m.lens[sid], BLOCK_SIZE) if 0 <= sid < MAX_SEQS else 0
      want = (0 <= sid < MAX_SEQS and m.lens[sid] > 0 and m.host_lens[sid] == 0
              and sid not in seen and need <= free)
      seen.add(sid)
      assert bool(out.ok[i]) == want, (ids, i, out.ok)
      src, dst = np.asarray(out.src[i]), np.asarray(out.dst[i])
      if not want:
        assert np.all(src == NULL_BLOCK) and np.all(dst == NULL_BLOCK)
        continue
      free -= need
      assert src[:need].tolist() == m.rows[sid], (src, m.rows[sid])
      assert np.all(src[need:] == NULL_BLOCK) and np.all(dst[need:] == NULL_BLOCK)
      held = {b for r in m.host_rows for b in r}
      assert not held & set(dst[:need].tolist()), "a held host block reused"
      for s, d in zip(src[:need].tolist(), dst[:need].tolist()):
        m.host[d] = m.dev[s]  # the copy
        m.refs[s] -= 1
      m.host_rows[sid], m.host_lens[sid] = dst[:need].tolist(), m.lens[sid]
      m.rows[sid], m.lens[sid] = [], 0

  @rule(ids=seq_ids)
  def swap_in(self, ids):
    m = self.m
    self.state, self.tier, back = _swap_in(self.state, self.tier,
                                           _ids(_padded(ids, 3, -1)))
    assert not np.asarray(back.ok)[len(ids):].any()
    avail, seen = m.dev_available, set()
    for i, sid in enumerate(ids):
      need = _cdiv(m.host_lens[sid], BLOCK_SIZE) if 0 <= sid < MAX_SEQS else 0
      want = (0 <= sid < MAX_SEQS and m.host_lens[sid] > 0 and m.lens[sid] == 0
              and sid not in seen and need <= avail)
      seen.add(sid)
      assert bool(back.ok[i]) == want, (ids, i, back.ok)
      if not want:
        assert np.all(np.asarray(back.src[i]) == NULL_BLOCK)
        continue
      avail -= need
      src = np.asarray(back.src[i])[:need].tolist()
      dst = np.asarray(back.dst[i])[:need].tolist()
      assert src == m.host_rows[sid]
      for s, d in zip(src, dst):
        assert m.refs[d] == 0, f"device block {d} handed out while referenced"
        m.refs[d] = 1
        m.dev[d] = m.host[s]
      m.rows[sid], m.lens[sid] = dst, m.host_lens[sid]
      m.host_rows[sid], m.host_lens[sid] = [], 0

  @rule(ids=st.lists(st.integers(-1, MAX_SEQS), max_size=2))
  def drop(self, ids):
    self.tier, ok = _drop(self.tier, _ids(_padded(ids, 2, -1)))
    assert not np.asarray(ok)[len(ids):].any()
    for sid, good in zip(ids, np.asarray(ok).tolist()):
      if good:
        self.m.host_rows[sid], self.m.host_lens[sid] = [], 0
        self.m.labels[sid] = []

  @invariant()
  def agrees_with_model(self):
    m = self.m
    ht.check_invariants(self.tier, self.state)
    assert np.asarray(self.state.seq_lens).tolist() == m.lens
    assert np.asarray(self.state.refcounts).tolist() == m.refs
    assert np.asarray(self.tier.seq_lens).tolist() == m.host_lens
    assert int(self.tier.num_free) == m.host_free
    tables, host = np.asarray(self.state.block_tables), np.asarray(self.tier.tables)
    for s in range(MAX_SEQS):
      assert tables[s, :len(m.rows[s])].tolist() == m.rows[s]
      assert host[s, :len(m.host_rows[s])].tolist() == m.host_rows[s]
      # Every sequence's blocks hold its content, wherever it lives.
      where = [m.dev[b] for b in m.rows[s]] + [m.host[b] for b in m.host_rows[s]]
      assert where == m.labels[s], (s, where, m.labels[s])

  def teardown(self):
    """Every block returns to its pool: release and drop everything."""
    state, _ = _release(self.state, _ids(range(MAX_SEQS)))
    tier, _ = _drop(self.tier, _ids(range(MAX_SEQS)))
    ht.check_invariants(tier, state)
    assert int(state.num_available) == NUM_BLOCKS
    assert int(state.num_used) == 0
    assert int(tier.num_free) == NUM_HOST
    assert sorted(np.asarray(tier.free_stack).tolist()) == list(range(NUM_HOST))


class CachingTierMachine(TierMachine):
  prefix_caching = True


def _settings(examples, steps):
  return hypothesis.settings(
      max_examples=examples, stateful_step_count=steps, deadline=None,
      derandomize=True, suppress_health_check=list(hypothesis.HealthCheck))


TestTierModel = TierMachine.TestCase
TestTierModel.settings = _settings(8, 20)
TestCachingTierModel = CachingTierMachine.TestCase
TestCachingTierModel.settings = _settings(8, 20)


@pytest.mark.slow
class TestTierModelLong(TierMachine.TestCase):
  settings = _settings(300, 40)


@pytest.mark.slow
class TestCachingTierModelLong(CachingTierMachine.TestCase):
  settings = _settings(300, 40)


def _pool(prefix_caching=False):
  state = bm.init(num_blocks=8, block_size=4, max_seqs=4, max_blocks_per_seq=4,
                  prefix_caching=prefix_caching)
  return state, ht.init(state, num_host_blocks=8)


def test_shared_blocks_stay_on_the_device_and_are_copied():
  state, tier = _pool()
  state, _ = bm.reserve(state, _ids([0]), _ids([6]))  # blocks 0, 1
  state, _ = bm.fork(state, _ids([0]), _ids([1]))  # 1 shares both
  state, tier, out = ht.swap_out(state, tier, _ids([1]))
  assert bool(out.ok[0])
  assert out.src[0, :2].tolist() == [0, 1]  # shared blocks are copied too
  assert np.asarray(state.refcounts)[:2].tolist() == [1, 1]  # parent keeps them
  assert int(state.num_free) == 6  # nothing freed: the parent holds both
  state, tier, back = ht.swap_in(state, tier, _ids([1]))
  assert bool(back.ok[0])
  new = back.dst[0, :2].tolist()
  assert not set(new) & {0, 1}  # fresh, exclusively owned copies
  assert np.asarray(state.refcounts)[new].tolist() == [1, 1]
  # No copy-on-write pending: the swapped-in row is writable, the parent too.
  slots = bm.slot_mapping(state, _ids([0, 1]), _ids([5, 5]))
  assert np.all(np.asarray(slots) >= 0)
  ht.check_invariants(tier, state)


def test_cached_blocks_of_a_swapped_sequence_stay_hittable():
  state, tier = _pool(prefix_caching=True)
  state, _ = bm.reserve(state, _ids([0]), _ids([6]))
  state, _ = bm.register(state, _ids([0]), _ids([0]))  # block 0: full, hashed
  state, tier, out = ht.swap_out(state, tier, _ids([0]))
  assert bool(out.ok[0])
  assert bm.cached_blocks(state) == [0] and int(state.num_free) == 7
  state, ok = bm.share(state, _ids([2]), jnp.array([[0]]), _ids([1]))  # a hit
  assert bool(ok[0])
  ht.check_invariants(tier, state)


def test_a_sequence_that_does_not_fit_is_not_moved():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=4, max_blocks_per_seq=4)
  tier = ht.init(state, num_host_blocks=3)
  state, _ = bm.reserve(state, _ids([0, 1, 2]), _ids([16, 5, 4]))  # 4, 2, 1
  before = (state, tier)
  state, tier, out = ht.swap_out(state, tier, _ids([0, 1, 2]))
  assert np.asarray(out.ok).tolist() == [False, True, True]  # in order, skip
  assert np.asarray(state.block_tables[0]).tolist() == np.asarray(
      before[0].block_tables[0]).tolist()
  assert np.all(np.asarray(out.src[0]) == NULL_BLOCK)
  assert int(tier.seq_lens[0]) == 0 and int(tier.num_free) == 0
  # Back in: the pool has room for both; slot 1 is refused once live again.
  state, _ = bm.reserve(state, _ids([1]), _ids([1]))
  state, tier, back = ht.swap_in(state, tier, _ids([1, 2, 2]))
  assert np.asarray(back.ok).tolist() == [False, True, False]
  bm.check_invariants(state)
  with pytest.raises(AssertionError, match="live on the device and swapped"):
    ht.check_invariants(tier, state)  # slot 1's misuse is caught


def test_swap_in_reports_evicted_cached_blocks():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=4,
                  prefix_caching=True)
  tier = ht.init(state, num_host_blocks=4)
  state, _ = bm.reserve(state, _ids([0]), _ids([12]))  # 3 blocks
  state, tier, _ = ht.swap_out(state, tier, _ids([0]))
  state, _ = bm.reserve(state, _ids([1]), _ids([16]))  # all 4 blocks
  state, _ = bm.register(state, _ids([1, 1, 1]), _ids([0, 1, 2]))
  cacheable = np.asarray(state.block_tables[1, :3]).tolist()
  state, _ = bm.release(state, _ids([1]))  # 3 cached, 1 free
  state, tier, back = ht.swap_in(state, tier, _ids([0]))  # 1 free + 2 evicted
  assert bool(back.ok[0])
  evicted = np.asarray(back.evicted[0])
  evicted = evicted[evicted >= 0].tolist()
  assert len(evicted) == 2 and set(evicted) <= set(cacheable)
  assert set(evicted) <= set(np.asarray(back.dst[0]).tolist())
  assert int(state.num_cached) == 1
  ht.check_invariants(tier, state)


def test_pack_pairs_puts_real_pairs_first():
  src = jnp.array([[3, -1, 5], [-1, -1, -1], [7, 8, -1]])
  dst = jnp.array([[0, -1, 1], [-1, -1, -1], [2, 3, -1]])
  s, d, count = ht.pack_pairs(src, dst)
  assert int(count) == 4
  assert s.tolist()[:4] == [3, 5, 7, 8] and d.tolist()[:4] == [0, 1, 2, 3]
  assert np.all(np.asarray(s[4:]) == -1) and np.all(np.asarray(d[4:]) == -1)


def test_empty_batches_and_errors():
  state, tier = _pool()
  none = jnp.zeros((0,), jnp.int32)
  s2, t2, out = ht.swap_out(state, tier, none)
  assert out.ok.shape == (0,) and out.src.shape == (0, 4)
  s2, t2, back = ht.swap_in(state, tier, none)
  assert back.ok.shape == (0,)
  with pytest.raises(ValueError, match="num_host_blocks must be a positive"):
    ht.init(state, num_host_blocks=0)
  with pytest.raises(ValueError, match="host cache slots"):
    ht.init(state, num_host_blocks=2**30)
  other = bm.init(num_blocks=8, block_size=8, max_seqs=4, max_blocks_per_seq=4)
  with pytest.raises(ValueError, match="must match the device state"):
    ht.swap_out(other, tier, _ids([0]))
  with pytest.raises(ValueError, match="1-D"):
    ht.swap_in(state, tier, jnp.zeros((2, 2), jnp.int32))


def test_check_invariants_catches_a_doubly_held_host_block():
  state, tier = _pool()
  state, _ = bm.reserve(state, _ids([0]), _ids([4]))
  state, tier, _ = ht.swap_out(state, tier, _ids([0]))
  bad = tier.replace(num_free=tier.num_free + 1)  # held block 0 also "free"
  with pytest.raises(AssertionError, match="both held and free|held .* free"):
    ht.check_invariants(bad, state)
