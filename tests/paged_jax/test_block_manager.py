"""Block manager: model-based test against a plain Python model, plus edge cases."""

from __future__ import annotations

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_jax import block_manager as bm
from paged_jax.block_manager import NULL_BLOCK

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, WIDTH = 12, 4, 5, 4
I32_MAX = 2**31 - 1

_reserve = jax.jit(bm.reserve)
_release = jax.jit(bm.release)
_fork = jax.jit(bm.fork)
_slot_mapping = jax.jit(bm.slot_mapping)


def _host(values):
  """int64 host array, converted as an eager call converts it (under `jit`
  without x64, JAX would truncate int64 arguments before the op sees them)."""
  return bm._as_ids("ids", np.asarray(values, np.int64))


def _padded(xs, size, pad):
  """A non-empty batch `xs` padded with `pad` (a request on slot -1, which
  fails and changes nothing) to `size` entries: each op compiles for two
  batch shapes (empty, whose path is static, and `size`), not one per length.
  The rules check the padding's results too."""
  return xs + [pad] * (size - len(xs)) if xs else xs


def _cdiv(a, b):
  return -(-a // b)


class PyModel:
  """The block manager in plain Python: lists and dicts, one request at a time."""

  def __init__(self):
    self.lens = [0] * MAX_SEQS
    self.rows = [[] for _ in range(MAX_SEQS)]
    self.refs = [0] * NUM_BLOCKS

  @property
  def num_free(self):
    return sum(r == 0 for r in self.refs)

  def reserve(self, sid, n, real_row, seen):
    """Returns (ok, copy_pair or None); takes new block ids from `real_row`."""
    if not 0 <= sid < MAX_SEQS or n < 0 or sid in seen:
      return False, None
    length = self.lens[sid]
    if length + n > WIDTH * BLOCK_SIZE:
      return False, None
    cur, new = _cdiv(length, BLOCK_SIZE), _cdiv(length + n, BLOCK_SIZE)
    row = self.rows[sid]
    cow = n > 0 and length % BLOCK_SIZE != 0 and self.refs[row[-1]] > 1
    need = new - cur + cow
    if need > self.num_free:
      return False, None
    first = cur - cow
    taken = list(real_row[first:new])
    assert len(taken) == need and len(set(taken)) == need, (real_row, first, new)
    for b in taken:
      assert self.refs[b] == 0, f"block {b} handed out while referenced"
      self.refs[b] = 1
    pair = None
    if cow:
      old = row[-1]
      self.refs[old] -= 1
      pair = (old, taken[0])
    self.rows[sid] = row[:first] + taken
    self.lens[sid] = length + n
    return True, pair

  def release(self, sid):
    if not 0 <= sid < MAX_SEQS or self.lens[sid] == 0:
      return False
    for b in self.rows[sid]:
      self.refs[b] -= 1
    self.rows[sid], self.lens[sid] = [], 0
    return True

  def fork(self, pairs):
    """All pairs are judged against the state at the start of the call."""
    lens, rows = list(self.lens), [list(r) for r in self.rows]
    oks, claimed = [], set()
    for parent, child in pairs:
      ok = (0 <= parent < MAX_SEQS and 0 <= child < MAX_SEQS
            and lens[parent] > 0 and lens[child] == 0 and parent != child
            and child not in claimed)
      claimed.add(child)
      if ok:
        for b in rows[parent]:
          self.refs[b] += 1
        self.rows[child] = list(rows[parent])
        self.lens[child] = lens[parent]
      oks.append(ok)
    return oks


# int32 and int64 extremes: ids and counts that wrapped, or overflowed a
# length, before the int32-safe arithmetic. Drawn about one time in four.
EXTREMES = [I32_MAX, I32_MAX - 1, 2**31 - 5, 2**30, -2**31, -2**31 - 1, 2**31,
            2**32, 2**32 + 1, 2**32 + 2, 2**63 - 1, -2**63]
_hostile = st.sampled_from(EXTREMES)
seq_id = st.one_of(*[st.integers(-1, MAX_SEQS)] * 3, _hostile)
count = st.one_of(*[st.integers(-2, 9)] * 3, _hostile)
position = st.one_of(*[st.integers(-1, WIDTH * BLOCK_SIZE)] * 3, _hostile)


class BlockManagerMachine(RuleBasedStateMachine):

  def __init__(self):
    super().__init__()
    self.state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH)
    self.model = PyModel()

  @rule(reqs=st.lists(st.tuples(seq_id, count), max_size=4))
  def reserve(self, reqs):
    batch = _padded(reqs, 4, (-1, 0))
    ids = _host([r[0] for r in batch])
    ns = _host([r[1] for r in batch])
    self.state, res = _reserve(self.state, ids, ns)
    assert not np.asarray(res.ok)[len(reqs):].any()
    tables = np.asarray(self.state.block_tables)
    seen = set()
    for i, (sid, n) in enumerate(reqs):
      row = tables[sid] if 0 <= sid < MAX_SEQS else None
      ok, pair = self.model.reserve(sid, n, row, seen)
      seen.add(sid)
      assert bool(res.ok[i]) == ok, (reqs, i, res.ok)
      got = (int(res.copy_src[i]), int(res.copy_dst[i]))
      assert got == (pair or (NULL_BLOCK, NULL_BLOCK)), (reqs, i, got, pair)

  @rule(ids=st.lists(seq_id, max_size=4))
  def release(self, ids):
    self.state, ok = _release(self.state, _host(_padded(ids, 4, -1)))
    assert not np.asarray(ok)[len(ids):].any()
    ok = ok[:len(ids)]
    expected = [self.model.release(s) for s in ids]
    assert np.asarray(ok).tolist() == expected, (ids, ok, expected)

  @rule(pairs=st.lists(st.tuples(seq_id, seq_id), max_size=3))
  def fork(self, pairs):
    batch = _padded(pairs, 3, (-1, -1))
    parents = _host([p for p, _ in batch])
    children = _host([c for _, c in batch])
    self.state, ok = _fork(self.state, parents, children)
    assert not np.asarray(ok)[len(pairs):].any()
    ok = ok[:len(pairs)]
    expected = self.model.fork(pairs)
    assert np.asarray(ok).tolist() == expected, (pairs, ok, expected)

  @rule(tokens=st.lists(st.tuples(seq_id, position), max_size=4))
  def slot_mapping(self, tokens):
    batch = _padded(tokens, 4, (-1, 0))
    slots = _slot_mapping(self.state, _host([t[0] for t in batch]),
                          _host([t[1] for t in batch]))
    assert np.all(np.asarray(slots)[len(tokens):] == -1)
    m = self.model
    for (sid, pos), got in zip(tokens, np.asarray(slots).tolist()):
      writable = (0 <= sid < MAX_SEQS and 0 <= pos < m.lens[sid]
                  and m.refs[m.rows[sid][pos // BLOCK_SIZE]] == 1)
      want = (m.rows[sid][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
              if writable else -1)
      assert got == want, (tokens, slots)

  @invariant()
  def agrees_with_model(self):
    bm.check_invariants(self.state)
    assert np.asarray(self.state.seq_lens).tolist() == self.model.lens
    assert np.asarray(self.state.refcounts).tolist() == self.model.refs
    assert int(self.state.num_free) == self.model.num_free
    tables = np.asarray(self.state.block_tables)
    for s in range(MAX_SEQS):
      row = self.model.rows[s]
      assert tables[s, :len(row)].tolist() == row
      assert np.all(tables[s, len(row):] == NULL_BLOCK)


TestBlockManagerModel = BlockManagerMachine.TestCase
TestBlockManagerModel.settings = hypothesis.settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    derandomize=True, suppress_health_check=list(hypothesis.HealthCheck))


@pytest.fixture
def jit_ops(monkeypatch):
  """The block-manager ops, jitted (op-by-op dispatch of the eager versions is
  slow on a small CPU; `test_jitted_and_unjitted_agree` covers eager mode)."""
  for name in ("reserve", "release", "fork", "slot_mapping", "gather_tables"):
    monkeypatch.setattr(bm, name, jax.jit(getattr(bm, name)))


def test_jitted_and_unjitted_agree():
  rng = np.random.default_rng(1)
  s_jit = s_eager = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                            max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH)
  for _ in range(30):
    ids = jnp.asarray(rng.integers(-1, MAX_SEQS + 1, 3), jnp.int32)
    op = rng.integers(3)
    if op == 0:
      ns = jnp.asarray(rng.integers(-1, 8, 3), jnp.int32)
      s_jit, r1 = _reserve(s_jit, ids, ns)
      with jax.disable_jit():
        s_eager, r2 = bm.reserve(s_eager, ids, ns)
      chex.assert_trees_all_equal(r1, r2)
    elif op == 1:
      s_jit, _ = _release(s_jit, ids)
      with jax.disable_jit():
        s_eager, _ = bm.release(s_eager, ids)
    else:
      kids = jnp.asarray(rng.integers(-1, MAX_SEQS + 1, 3), jnp.int32)
      s_jit, _ = _fork(s_jit, ids, kids)
      with jax.disable_jit():
        s_eager, _ = bm.fork(s_eager, ids, kids)
    chex.assert_trees_all_equal(s_jit, s_eager)


def test_jitted_step_compiles_once_over_a_long_random_run():
  """A donated reserve/release/fork step never retraces when only values change."""

  @chex.assert_max_traces(n=1)
  def step(state, ids, ns, parents, children):
    state, res = bm.reserve(state, ids, ns)
    state, forked = bm.fork(state, parents, children)
    state, released = bm.release(state, children)
    return state, (res.ok, forked, released)

  step = jax.jit(step, donate_argnums=0)
  state = bm.init(num_blocks=64, block_size=8, max_seqs=16,
                  max_blocks_per_seq=8)
  rng = np.random.default_rng(0)
  for _ in range(200):
    args = [jnp.asarray(rng.integers(0, 16, 4), jnp.int32),
            jnp.asarray(rng.integers(0, 12, 4), jnp.int32),
            jnp.asarray(rng.integers(0, 16, 2), jnp.int32),
            jnp.asarray(rng.integers(0, 16, 2), jnp.int32)]
    state, _ = step(state, *args)
  bm.check_invariants(state)


def test_copy_on_write_only_for_partial_shared_blocks(jit_ops):
  state = bm.init(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=4)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([8]))  # 2 full blocks
  state, ok = bm.fork(state, jnp.array([0]), jnp.array([1]))
  assert ok.tolist() == [True]
  state, res = bm.reserve(state, jnp.array([1]), jnp.array([1]))
  # Full shared blocks are never copied: the child just takes a new block.
  assert res.copy_src.tolist() == [NULL_BLOCK] and res.ok.tolist() == [True]
  state, _ = bm.fork(state, jnp.array([1]), jnp.array([2]))  # 9 tokens, shared
  state, res = bm.reserve(state, jnp.array([2, 1]), jnp.array([2, 1]))
  # The first sibling copies; the second then owns the block alone.
  assert res.copy_src.tolist() == [2, NULL_BLOCK]
  assert int(res.copy_dst[0]) not in (0, 1, 2)
  bm.check_invariants(state)


def test_failed_requests_leave_state_untouched(jit_ops):
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, res = bm.reserve(state, jnp.array([0, 1, 2]), jnp.array([8, 9, 4]))
  assert res.ok.tolist() == [True, False, True]  # 9 > 2 blocks of 4
  assert state.seq_lens.tolist() == [8, 0, 4]
  # Pool exhausted: a request that does not fit changes nothing.
  before = state
  state, res = bm.reserve(state, jnp.array([1]), jnp.array([5]))  # 2 blocks
  assert res.ok.tolist() == [False]
  chex.assert_trees_all_equal(before, state)
  # Bad ids and requests come back as ok=False.
  state, res = bm.reserve(state, jnp.array([-1, 3, 0]), jnp.array([1, 1, -1]))
  assert res.ok.tolist() == [False, False, False]
  state, ok = bm.release(state, jnp.array([1, 7, -3]))
  assert ok.tolist() == [False, False, False]
  # A slot listed twice in one call is served once.
  state2, res = bm.reserve(state, jnp.array([2, 2]), jnp.array([1, 1]))
  assert res.ok.tolist() == [True, False] and state2.seq_lens.tolist() == [8, 0, 5]
  state, ok = bm.fork(state, jnp.array([0, 1, 0]), jnp.array([2, 2, 0]))
  assert ok.tolist() == [False, False, False]  # live child, empty parent, self
  chex.assert_trees_all_equal(before, state)


def test_slot_mapping_and_tables(jit_ops):
  state = bm.init(num_blocks=8, block_size=4, max_seqs=3, max_blocks_per_seq=4)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([6]))
  slots = bm.slot_mapping(state, jnp.array([0, 0, 0, 1, 5]),
                          jnp.array([0, 5, 6, 0, 0]))
  t = state.block_tables
  assert slots.tolist() == [int(t[0, 0]) * 4, int(t[0, 1]) * 4 + 1, -1, -1, -1]
  # Positions in a shared block are never writable.
  state, _ = bm.fork(state, jnp.array([0]), jnp.array([1]))
  assert bm.slot_mapping(state, jnp.array([1]), jnp.array([5])).tolist() == [-1]
  tables, lens = bm.gather_tables(state, jnp.array([1, -1]))
  assert lens.tolist() == [6, 0]
  assert tables[1].tolist() == [NULL_BLOCK] * 4
  assert bm.usage(state) == dict(blocks_used=2, blocks_total=8, fraction=0.25,
                                 live_seqs=2, tokens=12)


def test_check_invariants_catches_corruption():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([5]))
  bad = state.replace(refcounts=state.refcounts.at[0].add(1))
  with pytest.raises(AssertionError, match="refcounts != table references"):
    bm.check_invariants(bad)
  bad = state.replace(num_free=state.num_free + 1)
  with pytest.raises(AssertionError):
    bm.check_invariants(bad)


def test_check_invariants_checks_stacked_shards_one_by_one():
  state = bm.init(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([5]))
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), state)
  bm.check_invariants(stacked)
  bad = stacked.replace(refcounts=stacked.refcounts.at[1, 0].add(1))
  with pytest.raises(AssertionError, match=r"data shard \(1,\): refcounts != "
                     "table references"):
    bm.check_invariants(bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=0), "num_blocks must be a positive int, got num_blocks=0"),
    (dict(block_size=2.5), "block_size must be a positive int, got 2.5"),
    (dict(max_seqs=-1), "max_seqs must be a positive int"),
    (dict(max_blocks_per_seq=True), "max_blocks_per_seq must be a positive int"),
])
def test_init_errors(kwargs, match):
  args = dict(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    bm.init(**args)


def test_argument_errors():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=2)
  with pytest.raises(ValueError, match=r"seq_ids must be a 1-D integer array, "
                     r"got shape \(1, 1\)"):
    bm.reserve(state, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="num_new_tokens must have an integer "
                     "dtype, got float32"):
    bm.reserve(state, jnp.zeros((1,), jnp.int32), jnp.zeros((1,)))
  with pytest.raises(ValueError, match=r"seq_ids and num_new_tokens must have "
                     r"the same shape"):
    bm.reserve(state, jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="parent_ids and child_ids must have"):
    bm.fork(state, jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="seq_ids and positions must have"):
    bm.slot_mapping(state, jnp.zeros((2,), jnp.int32),
                    jnp.zeros((1,), jnp.int32))


# Hostile inputs: int32 extremes, int64 ids, empty batches. Each of these
# corrupted the pool (or raised) before the int32-safe arithmetic.

I32_MAX = 2**31 - 1


def test_reserve_cannot_overflow_a_length():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([1]))
  before = state
  for n in (I32_MAX, I32_MAX - 3, 2**31 - 5, 2**30):
    state, res = _reserve(state, jnp.array([0]), jnp.array([n]))
    assert res.ok.tolist() == [False], n
    chex.assert_trees_all_equal(before, state)


@pytest.mark.parametrize("parent_len", [5, 7])
def test_fork_then_huge_reserve_never_makes_a_shared_block_writable(parent_len):
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([parent_len]))
  state, ok = bm.fork(state, jnp.array([0]), jnp.array([1]))
  assert ok.tolist() == [True]
  before = state
  for n in (2**31 - 5, I32_MAX):  # parent_len + n wraps negative in int32
    state, res = _reserve(state, jnp.array([1]), jnp.array([n]))
    assert res.ok.tolist() == [False]
    chex.assert_trees_all_equal(before, state)
  bm.check_invariants(state)
  # The shared blocks stay read-only for both holders.
  slots = bm.slot_mapping(state, jnp.array([0, 1, 0, 1]), jnp.array([0, 0, 4, 4]))
  assert slots.tolist() == [-1] * 4


def test_block_counts_do_not_overflow_for_a_large_block_size():
  bs = 2**30 + 2**29  # (len + bs - 1) overflows int32 for len > 2**29
  state = bm.init(num_blocks=1, block_size=bs, max_seqs=2, max_blocks_per_seq=1)
  state, res = _reserve(state, jnp.array([0]), jnp.array([bs]))
  assert res.ok.tolist() == [True]
  assert state.block_tables.tolist() == [[0], [NULL_BLOCK]]
  assert int(state.num_free) == 0
  bm.check_invariants(state)
  state, res = _reserve(state, jnp.array([1]), jnp.array([5]))
  assert res.ok.tolist() == [False]  # the pool is empty
  state, ok = _release(state, jnp.array([0]))
  assert ok.tolist() == [True] and int(state.num_free) == 1
  bm.check_invariants(state)


@pytest.mark.parametrize("sizes, match", [
    # Token positions are int32: a sequence must fit.
    ((4, 2**20, 2, 2**11), r"max_blocks_per_seq \* block_size = 2147483648 must "
     r"be < 2\*\*31 \(int32 token positions\), got max_blocks_per_seq=2048, block_size=1048576"),
    # Flat slots (block * block_size + offset) are int32: the pool must fit.
    ((2, 2**30 + 2**29, 1, 1), r"num_blocks \* block_size = 3221225472 must be "
     r"< 2\*\*31 \(int32 cache slots\), got num_blocks=2, block_size=1610612736"),
    ((2**31, 1, 1, 1), r"num_blocks \* block_size = 2147483648 must be"),
    ((4, 4, 2**31, 1), r"max_seqs=2147483648 must be < 2\*\*31 \(int32 sequence ids\)"),
    ((np.int64(2**40), np.int64(1), 1, 1), r"num_blocks \* block_size = "
     r"1099511627776 must be"),
])
def test_init_refuses_sizes_past_int32(sizes, match):
  names = ("num_blocks", "block_size", "max_seqs", "max_blocks_per_seq")
  with pytest.raises(ValueError, match=match):
    bm.init(**dict(zip(names, sizes)))


def test_ids_and_counts_outside_int32_fail_instead_of_wrapping():
  """Eager calls with host int64/uint64 arrays (wrapped to valid int32 ids and
  counts before); the model-based test covers the same values under jit."""
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3,
                  max_blocks_per_seq=2)
  state, _ = bm.reserve(state, jnp.array([0, 1]), jnp.array([1, 2]))
  before = state
  i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
  # 2**32 + 1 wraps to slot 1 / 1 token, 2**32 to slot 0 / 0 tokens.
  for ids, ns in [(i64(2**32 + 1, 2**32, -2**40), i64(1, 0, 1)),
                  (i64(0, 1, 2), i64(2**32 + 1, -2**40, 2**32)),
                  (np.array([2**63, 2**32 + 2], np.uint64), [1, 1])]:
    state, res = bm.reserve(state, ids, ns)
    assert res.ok.tolist() == [False] * len(ns), (ids, ns)
    chex.assert_trees_all_equal(before, state)
  state, ok = bm.release(state, i64(2**32, 2**32 + 1))
  assert ok.tolist() == [False, False]
  state, ok = bm.fork(state, i64(2**32, 0), i64(2, 2**32 + 2))
  assert ok.tolist() == [False, False]
  chex.assert_trees_all_equal(before, state)
  slots = bm.slot_mapping(state, i64(0, 2**32), i64(2**32, 0))
  assert slots.tolist() == [-1, -1]
  tables, lens = bm.gather_tables(state, i64(2**32 + 1))
  assert tables.tolist() == [[NULL_BLOCK] * 2] and lens.tolist() == [0]


def test_python_ints_past_int64_are_a_value_error():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  with pytest.raises(ValueError, match="seq_ids must have an integer dtype, "
                     "got object"):
    bm.reserve(state, [2**70], [1])


def _enable_x64():
  fn = getattr(jax, "enable_x64", None)
  if fn is None:  # older JAX
    fn = jax.experimental.enable_x64
  return fn(True)


def test_int64_ids_fail_under_jit_with_x64():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, jnp.array([0, 1]), jnp.array([1, 2]))
  before = state
  with _enable_x64():
    big = jnp.array([2**32 + 1], jnp.int64)
    state, res = jax.jit(bm.reserve)(state, big, jnp.array([1], jnp.int64))
    assert res.ok.tolist() == [False]
    state, res = jax.jit(bm.reserve)(state, jnp.array([1]), big)
    assert res.ok.tolist() == [False]
    state, ok = jax.jit(bm.release)(state, big)
    assert ok.tolist() == [False]
    slots = jax.jit(bm.slot_mapping)(state, jnp.array([1]), big)
    assert slots.tolist() == [-1]
  chex.assert_trees_all_equal(before, state)
  bm.check_invariants(state)


@pytest.mark.parametrize("jit", [False, True])
def test_every_op_accepts_an_empty_batch(jit):
  wrap = jax.jit if jit else (lambda f: f)
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([5]))
  before = state
  none = jnp.zeros((0,), jnp.int32)
  state, res = wrap(bm.reserve)(state, none, none)
  assert res.ok.shape == res.copy_src.shape == res.copy_dst.shape == (0,)
  state, ok = wrap(bm.release)(state, none)
  assert ok.shape == (0,)
  state, ok = wrap(bm.fork)(state, none, none)
  assert ok.shape == (0,)
  assert wrap(bm.slot_mapping)(state, none, none).shape == (0,)
  tables, lens = wrap(bm.gather_tables)(state, none)
  assert tables.shape == (0, 2) and lens.shape == (0,)
  chex.assert_trees_all_equal(before, state)


def test_usage_counts_tokens_past_int32():
  state = bm.init(num_blocks=1, block_size=2**30, max_seqs=3,
                  max_blocks_per_seq=1)
  state, res = bm.reserve(state, jnp.array([0]), jnp.array([2**30]))
  state, ok = bm.fork(state, jnp.array([0, 0]), jnp.array([1, 2]))
  assert res.ok.tolist() == [True] and ok.tolist() == [True, True]
  assert bm.usage(state) == dict(blocks_used=1, blocks_total=1, fraction=1.0,
                                 live_seqs=3, tokens=3 * 2**30)


def test_slot_mapping_at_int32_extremes():
  state = bm.init(num_blocks=4, block_size=4, max_seqs=3, max_blocks_per_seq=2)
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([5]))
  ids = jnp.array([0, 0, 0, I32_MAX, -2**31, 0])
  pos = jnp.array([I32_MAX, -2**31, -1, 0, 0, 4])
  t = state.block_tables
  assert bm.slot_mapping(state, ids, pos).tolist() == [-1] * 5 + [int(t[0, 1]) * 4]
