"""The grouped block manager (`paged_jax.block_groups`) against a plain-Python
model: windows, forks with copy-on-write per group, atomic refusal across
groups, reclamation, release; and reclaimed blocks never read by attention."""

from __future__ import annotations

import functools
import math

import hypothesis
import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_groups as bg
from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, WIDTH = 22, 4, 4, 6
WINDOWS = (None, 5, 3)  # a global group and two local ones

_reserve = jax.jit(bg.reserve)
_release = jax.jit(bg.release)
_fork = jax.jit(bg.fork)
_reclaim = jax.jit(bg.reclaim)
_truncate = jax.jit(bg.truncate)
_slot_mapping = jax.jit(bg.slot_mapping, static_argnums=1)


def _ids(xs):
  return np.asarray(xs, np.int64).astype(np.int32) if xs else np.zeros(0, np.int32)


def _padded(xs, size, pad):
  """A non-empty batch `xs` padded with `pad` (a request on slot -1, which
  fails and changes nothing) to `size` entries: the ops compile for two
  batch shapes (empty, whose path is static, and `size`), not one per length.
  The tests check the padding's results too."""
  return xs + [pad] * (size - len(xs)) if xs else xs


def _cut(w, length):
  return 0 if w is None else max(length - w + 1, 0) // BLOCK_SIZE


class Model:
  """Lengths, and per group per slot the list of block ids (None where
  reclaimed); block ids are adopted from the real state when handed out,
  after checking that they were free."""

  def __init__(self):
    self.lens = [0] * MAX_SEQS
    self.rows = [[[] for _ in range(MAX_SEQS)] for _ in WINDOWS]

  def refs(self):
    out = [0] * NUM_BLOCKS
    for g in self.rows:
      for row in g:
        for b in row:
          if b is not None:
            out[b] += 1
    return out

  @property
  def num_free(self):
    return sum(r == 0 for r in self.refs())

  def reclaim_one(self, s, length):
    for g, w in enumerate(WINDOWS):
      row = self.rows[g][s]
      for j in range(min(_cut(w, length), len(row))):
        row[j] = None


def _valid(sid):
  return 0 <= sid < MAX_SEQS


class GroupsMachine(RuleBasedStateMachine):

  def __init__(self):
    super().__init__()
    self.state = bg.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH,
                         windows=WINDOWS)
    self.model = Model()

  @rule(reqs=st.lists(st.tuples(st.integers(-1, MAX_SEQS),
                                st.integers(-1, 9)), max_size=4))
  def reserve(self, reqs):
    m = self.model
    batch = _padded(reqs, 4, (-1, 0))
    self.state, res = _reserve(self.state, _ids([r[0] for r in batch]),
                               _ids([r[1] for r in batch]))
    assert not np.asarray(res.ok)[len(reqs):].any()
    tables = np.asarray(self.state.block_tables)
    seen, valid = set(), []
    for sid, n in reqs:  # reclamation first, for every valid live request
      valid.append(_valid(sid) and n >= 0 and sid not in seen)
      seen.add(sid)
      if valid[-1] and m.lens[sid] > 0:
        m.reclaim_one(sid, m.lens[sid])
    for i, (sid, n) in enumerate(reqs):
      ok = valid[i] and n <= WIDTH * BLOCK_SIZE - m.lens[sid]
      src = dst = [NULL_BLOCK] * len(WINDOWS)
      if ok:
        old = m.lens[sid]
        cur, new = -(-old // BLOCK_SIZE), -(-(old + n) // BLOCK_SIZE)
        refs = m.refs()
        cows = [n > 0 and old % BLOCK_SIZE != 0
                and refs[m.rows[g][sid][cur - 1]] > 1
                for g in range(len(WINDOWS))]
        need = sum(new - cur + c for c in cows)
        ok = need <= m.num_free
      assert bool(res.ok[i]) == ok, (reqs, i, res.ok)
      if not ok:
        continue
      free = {b for b, r in enumerate(m.refs()) if r == 0}
      src, dst = [], []
      for g in range(len(WINDOWS)):
        row, real = m.rows[g][sid], tables[g, sid]
        fresh = list(range(cur - cows[g], new))
        for j in fresh:
          assert int(real[j]) in free, (g, sid, j, real, free)
          free.discard(int(real[j]))
        src.append(row[cur - 1] if cows[g] else NULL_BLOCK)
        dst.append(int(real[cur - 1]) if cows[g] else NULL_BLOCK)
        m.rows[g][sid] = row[:cur - cows[g]] + [int(real[j]) for j in fresh]
      m.lens[sid] = old + n
      assert np.asarray(res.copy_src[i]).tolist() == src, (reqs, i)
      assert np.asarray(res.copy_dst[i]).tolist() == dst, (reqs, i)

  @rule(ids=st.lists(st.integers(-1, MAX_SEQS), max_size=3))
  def release(self, ids):
    self.state, ok = _release(self.state, _ids(_padded(ids, 3, -1)))
    assert not np.asarray(ok)[len(ids):].any()
    ok = ok[:len(ids)]
    m, seen, want = self.model, set(), []
    for s in ids:
      want.append(_valid(s) and m.lens[s] > 0 and s not in seen)
      seen.add(s)
      if want[-1]:
        m.lens[s] = 0
        for g in m.rows:
          g[s] = []
    assert np.asarray(ok).tolist() == want, (ids, ok)

  @rule(pairs=st.lists(st.tuples(st.integers(-1, MAX_SEQS),
                                 st.integers(-1, MAX_SEQS)), max_size=3))
  def fork(self, pairs):
    batch = _padded(pairs, 3, (-1, -1))
    self.state, ok = _fork(self.state, _ids([p for p, _ in batch]),
                           _ids([c for _, c in batch]))
    assert not np.asarray(ok)[len(pairs):].any()
    ok = ok[:len(pairs)]
    m, children, want = self.model, set(), []
    lens = list(m.lens)
    for p, c in pairs:
      want.append(_valid(p) and _valid(c) and lens[p] > 0 and lens[c] == 0
                  and p != c and c not in children)
      children.add(c)
    for (p, c), w in zip(pairs, want):
      if w:
        m.lens[c] = lens[p]
        for g in m.rows:
          g[c] = list(g[p])
    assert np.asarray(ok).tolist() == want, (pairs, ok)

  @rule(ids=st.lists(st.integers(-1, MAX_SEQS), max_size=3))
  def reclaim(self, ids):
    self.state, ok = _reclaim(self.state, _ids(_padded(ids, 3, -1)))
    assert not np.asarray(ok)[len(ids):].any()
    ok = ok[:len(ids)]
    m, seen, want = self.model, set(), []
    for s in ids:
      want.append(_valid(s) and m.lens[s] > 0 and s not in seen)
      seen.add(s)
      if want[-1]:
        m.reclaim_one(s, m.lens[s])
    assert np.asarray(ok).tolist() == want, (ids, ok)
    held = bg.held_blocks(self.state)
    for s, w in zip(ids, want):
      for g, win in enumerate(WINDOWS):
        if w and win is not None:  # O(window) blocks, however long
          assert held[g, s] <= math.ceil((win - 1) / BLOCK_SIZE) + 1, (g, s, held)

  @rule(reqs=st.lists(st.tuples(st.integers(-1, MAX_SEQS),
                                st.integers(-1, WIDTH * BLOCK_SIZE)), max_size=3))
  def truncate(self, reqs):
    batch = _padded(reqs, 3, (-1, 0))
    self.state, ok = _truncate(self.state, _ids([r[0] for r in batch]),
                               _ids([r[1] for r in batch]))
    assert not np.asarray(ok)[len(reqs):].any()
    ok = ok[:len(reqs)]
    m, seen, want = self.model, set(), []
    for s, n in reqs:
      w = (_valid(s) and m.lens[s] > 0 and 0 <= n <= m.lens[s]
           and s not in seen)
      seen.add(s)
      if w:  # no reclaimed block that a query at n would see
        for g, win in enumerate(WINDOWS):
          prefix = sum(b is None for b in m.rows[g][s])
          w &= prefix <= _cut(win, n)
      want.append(w)
      if w:
        m.lens[s] = n
        for g in m.rows:
          g[s] = g[s][:-(-n // BLOCK_SIZE)]
    assert np.asarray(ok).tolist() == want, (reqs, ok)

  @rule(g=st.integers(0, len(WINDOWS) - 1),
        tokens=st.lists(st.tuples(st.integers(-1, MAX_SEQS),
                                  st.integers(-1, WIDTH * BLOCK_SIZE)),
                        max_size=4))
  def slot_mapping(self, g, tokens):
    # Writes go only to a block the sequence holds alone in that group:
    # never to a reclaimed column, a shared block or past seq_lens.
    batch = _padded(tokens, 4, (-1, 0))
    slots = _slot_mapping(self.state, g, _ids([t[0] for t in batch]),
                          _ids([t[1] for t in batch]))
    assert np.all(np.asarray(slots)[len(tokens):] == -1)
    slots = slots[:len(tokens)]
    m, refs = self.model, self.model.refs()
    for (sid, pos), got in zip(tokens, np.asarray(slots).tolist()):
      block = (m.rows[g][sid][pos // BLOCK_SIZE]
               if _valid(sid) and 0 <= pos < m.lens[sid] else None)
      want = (block * BLOCK_SIZE + pos % BLOCK_SIZE
              if block is not None and refs[block] == 1 else -1)
      assert got == want, (g, tokens, slots)

  @invariant()
  def agrees_with_model(self):
    bg.check_invariants(self.state)
    m = self.model
    assert np.asarray(self.state.seq_lens).tolist() == m.lens
    assert np.asarray(self.state.refcounts).tolist() == m.refs()
    assert int(self.state.num_free) == m.num_free
    tables = np.asarray(self.state.block_tables)
    for g in range(len(WINDOWS)):
      for s in range(MAX_SEQS):
        row = [NULL_BLOCK if b is None else b for b in m.rows[g][s]]
        assert tables[g, s, :len(row)].tolist() == row, (g, s, tables[g, s])
        assert np.all(tables[g, s, len(row):] == NULL_BLOCK)

  def teardown(self):
    # Every block back in the pool at the end.
    self.state, _ = _release(self.state, _ids(list(range(MAX_SEQS))))
    bg.check_invariants(self.state)
    assert int(self.state.num_free) == NUM_BLOCKS


TestGroupsModel = GroupsMachine.TestCase
TestGroupsModel.settings = hypothesis.settings(
    max_examples=40, stateful_step_count=20, deadline=None,
    derandomize=True, suppress_health_check=list(hypothesis.HealthCheck))


def test_refusal_is_atomic_across_groups():
  # The global group alone would fit, the local one too, both together not.
  state = bg.init(num_blocks=5, block_size=4, max_seqs=2, max_blocks_per_seq=4,
                  windows=(None, 4))
  state, res = _reserve(state, _ids([0]), _ids([8]))  # 2 + 2 blocks
  assert bool(res.ok[0]) and int(state.num_free) == 1
  before = jax.tree.map(np.asarray, state)
  state, res = _reserve(state, _ids([1]), _ids([4]))  # needs 1 + 1
  assert not bool(res.ok[0])
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, np.asarray(b))
  # Seq 0's next token: the local group first reclaims block 0 (positions
  # 0..3 are invisible to the query at 8 with w=4: it sees 5..8), so the
  # step needs 2 new blocks and finds 1 + 1 reclaimed.
  state, res = _reserve(state, _ids([0]), _ids([1]))
  assert bool(res.ok[0]) and int(state.num_free) == 0
  assert bg.held_blocks(state)[:, 0].tolist() == [3, 2]
  bg.check_invariants(state)


def test_fork_copies_on_write_per_group():
  state = bg.init(num_blocks=12, block_size=4, max_seqs=2, max_blocks_per_seq=4,
                  windows=(None, 3))
  state, _ = _reserve(state, _ids([0]), _ids([6]))
  state, ok = _fork(state, _ids([0]), _ids([1]))
  assert bool(ok[0])
  state, res = _reserve(state, _ids([1]), _ids([1]))
  src, dst = np.asarray(res.copy_src[0]), np.asarray(res.copy_dst[0])
  tables = np.asarray(state.block_tables)
  for g in range(2):  # each group copied its own shared partial block
    assert src[g] == tables[g, 0, 1] and dst[g] == tables[g, 1, 1] != src[g]
  bg.check_invariants(state)


def test_reclaimed_blocks_are_never_read_by_attention():
  # A local group after prefill and reclaim: the freed blocks are reused by
  # another sequence and filled with NaN; attention through the local
  # group's table (NULL_BLOCK there) equals the reference on the full K/V.
  from pallas_kernels.gpu import paged_decode  # pylint: disable=import-outside-toplevel
  w, bs = 6, 4
  state = bg.init(num_blocks=16, block_size=bs, max_seqs=2,
                  max_blocks_per_seq=8, windows=(w,))
  state, _ = _reserve(state, _ids([0]), _ids([27]))
  full_table = np.asarray(state.block_tables[0, 0])
  state, _ = _reclaim(state, _ids([0]))
  state, _ = _reserve(state, _ids([1]), _ids([20]))  # takes the freed blocks
  table = np.asarray(state.block_tables[0, 0])
  assert (table[:5] == NULL_BLOCK).all() and (table[5:7] >= 0).all()
  rng = np.random.default_rng(0)
  k = rng.standard_normal((2, 16, bs, 16)).astype(np.float32)
  v = rng.standard_normal((2, 16, bs, 16)).astype(np.float32)
  q = jnp.asarray(rng.standard_normal((1, 4, 16)), jnp.float32)
  kv_lens = jnp.asarray([27], jnp.int32)
  ref = reference.paged_attention_reference(
      q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(full_table[None]),
      kv_lens, sliding_window=w)
  reused = np.asarray(state.block_tables[0, 1, :5])
  k[:, reused], v[:, reused] = np.nan, np.nan  # another sequence's now
  out = jax.jit(functools.partial(
      paged_decode.paged_decode, interpret=True, sliding_window=w,
      config=paged_decode.PagedDecodeConfig(pages_per_compute_block=4)))(
          q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(table[None]), kv_lens)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("windows,match", [
    ((), "windows must be a non-empty"), ((None, 0), "windows must be"),
    ((True,), "windows must be")])
def test_init_refuses_bad_windows(windows, match):
  with pytest.raises(ValueError, match=match):
    bg.init(num_blocks=4, block_size=4, max_seqs=1, max_blocks_per_seq=2,
            windows=windows)


def test_siblings_growing_together_copy_once_per_group():
  # Both holders of shared partial blocks grow in one call: the first copies
  # in each group, the last keeps the originals (as block_manager.reserve),
  # so the pool's last 2 blocks are enough for both.
  state = bg.init(num_blocks=6, block_size=4, max_seqs=2, max_blocks_per_seq=4,
                  windows=(None, 8))
  state, _ = _reserve(state, _ids([0]), _ids([6]))
  state, _ = _fork(state, _ids([0]), _ids([1]))
  state, res = _reserve(state, _ids([0, 1]), _ids([1, 1]))
  assert np.asarray(res.ok).tolist() == [True, True]
  assert (np.asarray(res.copy_src[0]) >= 0).all()
  assert (np.asarray(res.copy_src[1]) == NULL_BLOCK).all()
  assert int(state.num_free) == 0
  bg.check_invariants(state)


def test_each_op_traces_once_per_shape():
  traces = []

  def step(state, ids, n):
    traces.append(1)  # runs at trace time only
    state, res = bg.reserve(state, ids, n)
    state, _ = bg.reclaim(state, ids)
    return state, res.ok

  step = jax.jit(step, donate_argnums=0)
  state = bg.init(num_blocks=32, block_size=4, max_seqs=3, max_blocks_per_seq=8,
                  windows=(None, 5, None))
  for n in ([7, 1, 0], [1, 1, 9], [1, 3, 1], [2, 2, 2]):
    state, ok = step(state, _ids([0, 1, 2]), _ids(n))
    assert np.asarray(ok).all()
  assert len(traces) == 1
  bg.check_invariants(state)
