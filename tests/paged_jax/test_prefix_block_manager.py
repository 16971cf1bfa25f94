"""Block manager with prefix caching: model-based test (register, share, LRU
eviction, fork, release, reserve) against a plain Python model, plus the
eviction-safety, ordering, compaction and compile-once tests."""

from __future__ import annotations

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_jax import attention
from paged_jax import block_manager as bm
from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, WIDTH = 8, 2, 5, 4

_reserve = jax.jit(bm.reserve)
_release = jax.jit(bm.release)
_fork = jax.jit(bm.fork)
_register = jax.jit(bm.register)
_share = jax.jit(bm.share)
_slot_mapping = jax.jit(bm.slot_mapping)


def _i32(values):
  return jnp.asarray(np.asarray(values, np.int64).reshape(-1), jnp.int32)


def _cdiv(a, b):
  return -(-a // b)


class CacheModel:
  """The pool in plain Python: empty set, cacheable set, LRU list of cached
  blocks (next evicted first), one request at a time."""

  def __init__(self):
    self.lens = [0] * MAX_SEQS
    self.rows = [[] for _ in range(MAX_SEQS)]
    self.refs = [0] * NUM_BLOCKS
    self.free = set(range(NUM_BLOCKS))
    self.lru = []
    self.cacheable = set()

  def reserve(self, sid, n, real_row, seen):
    """Returns (ok, copy pair or None, evicted blocks); checks the ids taken."""
    if not 0 <= sid < MAX_SEQS or n < 0 or sid in seen:
      return False, None, []
    length = self.lens[sid]
    if length + n > WIDTH * BLOCK_SIZE:
      return False, None, []
    cur, new = _cdiv(length, BLOCK_SIZE), _cdiv(length + n, BLOCK_SIZE)
    row = self.rows[sid]
    cow = n > 0 and length % BLOCK_SIZE != 0 and self.refs[row[-1]] > 1
    need = new - cur + cow
    if need > len(self.free) + len(self.lru):
      return False, None, []
    first = cur - cow
    taken = [int(b) for b in real_row[first:new]]
    assert len(taken) == need, (real_row, first, new)
    evicted = []
    for b in taken:  # empty blocks first, then the least recently released
      if self.free:
        assert b in self.free, f"block {b} taken, but it is not empty"
        self.free.remove(b)
      else:
        assert b == self.lru[0], f"evicted {b}, expected {self.lru[0]}"
        evicted.append(self.lru.pop(0))
      self.refs[b] = 1
      self.cacheable.discard(b)
    pair = None
    if cow:
      self.refs[row[-1]] -= 1
      pair = (row[-1], taken[0])
    self.rows[sid] = row[:first] + taken
    self.lens[sid] = length + n
    return True, pair, evicted

  def release(self, sid):
    if not 0 <= sid < MAX_SEQS or self.lens[sid] == 0:
      return False
    for b in reversed(self.rows[sid]):  # a sequence's last block first
      self.refs[b] -= 1
      if self.refs[b] == 0:
        (self.lru.append if b in self.cacheable else self.free.add)(b)
    self.rows[sid], self.lens[sid] = [], 0
    return True

  def fork(self, pairs):
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
        self.rows[child], self.lens[child] = list(rows[parent]), lens[parent]
      oks.append(ok)
    return oks

  def register(self, sid, col):
    if not (0 <= sid < MAX_SEQS and 0 <= col < self.lens[sid] // BLOCK_SIZE):
      return False
    self.cacheable.add(self.rows[sid][col])
    return True

  def share(self, reqs):
    """`reqs`: (sid, blocks, count); judged against the state at the start."""
    lens, oks, seen = list(self.lens), [], set()
    for sid, blocks, count in reqs:
      prefix = blocks[:count]
      ok = (0 <= sid < MAX_SEQS and lens[sid] == 0 and sid not in seen
            and 1 <= count <= WIDTH and len(set(prefix)) == len(prefix)
            and all(b in self.cacheable for b in prefix))
      seen.add(sid)
      if ok:
        for b in prefix:
          self.refs[b] += 1
          if b in self.lru:
            self.lru.remove(b)
        self.rows[sid], self.lens[sid] = list(prefix), count * BLOCK_SIZE
      oks.append(ok)
    return oks


seq_id = st.integers(-1, MAX_SEQS)


class PrefixCacheMachine(RuleBasedStateMachine):

  def __init__(self):
    super().__init__()
    self.state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH,
                         prefix_caching=True)
    self.model = CacheModel()

  @rule(reqs=st.lists(st.tuples(seq_id, st.integers(-1, 8)), min_size=1,
                      max_size=3))
  def reserve(self, reqs):
    self.state, res = _reserve(self.state, _i32([r[0] for r in reqs]),
                               _i32([r[1] for r in reqs]))
    tables = np.asarray(self.state.block_tables)
    evicted = np.asarray(res.evicted)
    seen = set()
    for i, (sid, n) in enumerate(reqs):
      row = tables[sid] if 0 <= sid < MAX_SEQS else None
      ok, pair, ev = self.model.reserve(sid, n, row, seen)
      seen.add(sid)
      assert bool(res.ok[i]) == ok, (reqs, i, res.ok)
      got = (int(res.copy_src[i]), int(res.copy_dst[i]))
      assert got == (pair or (NULL_BLOCK, NULL_BLOCK)), (reqs, i, got, pair)
      assert evicted[i][evicted[i] >= 0].tolist() == ev, (evicted[i], ev)

  @rule(data=st.data())
  def release(self, data):
    """Live sequences mostly; sometimes any id."""
    live = [s for s in range(MAX_SEQS) if self.model.lens[s]] or [-1]
    ids = data.draw(st.lists(st.one_of(st.sampled_from(live), seq_id),
                             min_size=1, max_size=3))
    self.state, ok = _release(self.state, _i32(ids))
    assert np.asarray(ok).tolist() == [self.model.release(s) for s in ids]

  @rule(pairs=st.lists(st.tuples(seq_id, seq_id), max_size=2))
  def fork(self, pairs):
    self.state, ok = _fork(self.state, _i32([p for p, _ in pairs]),
                           _i32([c for _, c in pairs]))
    assert np.asarray(ok).tolist() == self.model.fork(pairs)

  @rule(data=st.data())
  def register(self, data):
    """Full blocks of live sequences mostly; sometimes any (seq, column)."""
    full = [(s, c) for s in range(MAX_SEQS)
            for c in range(self.model.lens[s] // BLOCK_SIZE)] or [(0, 0)]
    entry = st.one_of(st.sampled_from(full), st.sampled_from(full),
                      st.tuples(seq_id, st.integers(-1, WIDTH)))
    entries = data.draw(st.lists(entry, max_size=4))
    self.state, ok = _register(self.state, _i32([e[0] for e in entries]),
                               _i32([e[1] for e in entries]))
    assert np.asarray(ok).tolist() == [self.model.register(*e)
                                       for e in entries]

  @rule(data=st.data())
  def share(self, data):
    """Hits on cacheable blocks mostly; sometimes empty or live ones."""
    pool = sorted(self.model.cacheable) or [0]
    block = st.one_of(st.sampled_from(pool), st.sampled_from(pool),
                      st.integers(-1, NUM_BLOCKS))
    empty = [s for s in range(MAX_SEQS) if not self.model.lens[s]] or [0]
    prefix = st.permutations(pool + [-1] * WIDTH).map(lambda p: p[:WIDTH])
    reqs = data.draw(st.lists(st.tuples(
        st.one_of(st.sampled_from(empty), seq_id),
        st.one_of(prefix, st.lists(block, min_size=WIDTH, max_size=WIDTH)),
        st.integers(0, WIDTH + 1)), min_size=1, max_size=2))
    blocks = np.array([r[1] for r in reqs], np.int64).reshape(len(reqs), WIDTH)
    self.state, ok = _share(self.state, _i32([r[0] for r in reqs]),
                            jnp.asarray(blocks, jnp.int32),
                            _i32([r[2] for r in reqs]))
    assert np.asarray(ok).tolist() == self.model.share(reqs), reqs

  @rule(data=st.data())
  def finish(self, data):
    """The engine's pattern: a live sequence registers its full blocks, then
    is released (its blocks become cached)."""
    live = [s for s in range(MAX_SEQS) if self.model.lens[s]]
    if not live:
      return
    sid = data.draw(st.sampled_from(live))
    cols = list(range(self.model.lens[sid] // BLOCK_SIZE))
    self.state, ok = _register(self.state, _i32([sid] * len(cols)),
                               _i32(cols))
    assert np.asarray(ok).tolist() == [self.model.register(sid, c)
                                       for c in cols]
    self.state, ok = _release(self.state, _i32([sid]))
    assert np.asarray(ok).tolist() == [self.model.release(sid)]

  @rule(data=st.data())
  def admit(self, data):
    """The engine's pattern: a hit on cached blocks, then the rest reserved."""
    empty = [s for s in range(MAX_SEQS) if not self.model.lens[s]]
    pool = self.model.lru + sorted(self.model.cacheable - set(self.model.lru))
    if not empty or not pool:
      return
    sid = data.draw(st.sampled_from(empty))
    blocks = data.draw(st.permutations(pool))[:WIDTH]
    count = data.draw(st.integers(1, len(blocks)))
    row = np.full((1, WIDTH), NULL_BLOCK, np.int32)
    row[0, :len(blocks)] = blocks
    self.state, ok = _share(self.state, _i32([sid]), jnp.asarray(row),
                            _i32([count]))
    assert np.asarray(ok).tolist() == self.model.share(
        [(sid, list(row[0]), count)])
    self.reserve([(sid, data.draw(st.integers(0, BLOCK_SIZE * 2)))])

  @rule(tokens=st.lists(st.tuples(seq_id, st.integers(0, WIDTH * BLOCK_SIZE)),
                        max_size=3))
  def slot_mapping(self, tokens):
    slots = _slot_mapping(self.state, _i32([t[0] for t in tokens]),
                          _i32([t[1] for t in tokens]))
    m = self.model
    for (sid, pos), got in zip(tokens, np.asarray(slots).tolist()):
      block = (m.rows[sid][pos // BLOCK_SIZE]
               if 0 <= sid < MAX_SEQS and pos < m.lens[sid] else None)
      writable = (block is not None and m.refs[block] == 1
                  and block not in m.cacheable)
      assert got == (block * BLOCK_SIZE + pos % BLOCK_SIZE if writable
                     else -1), (tokens, slots)

  @invariant()
  def agrees_with_model(self):
    bm.check_invariants(self.state)
    m = self.model
    assert np.asarray(self.state.seq_lens).tolist() == m.lens
    assert np.asarray(self.state.refcounts).tolist() == m.refs
    assert int(self.state.num_free) == len(m.free)
    assert int(self.state.num_cached) == len(m.lru)
    assert bm.cached_blocks(self.state) == m.lru
    assert set(np.nonzero(np.asarray(self.state.cacheable))[0].tolist()) == (
        m.cacheable)
    tables = np.asarray(self.state.block_tables)
    for s in range(MAX_SEQS):
      assert tables[s, :len(m.rows[s])].tolist() == m.rows[s]


TestPrefixCacheModel = PrefixCacheMachine.TestCase
TestPrefixCacheModel.settings = hypothesis.settings(
    max_examples=20, stateful_step_count=30, deadline=None,
    derandomize=True, suppress_health_check=list(hypothesis.HealthCheck))


def _pool(num_blocks=8, block_size=2, max_seqs=4, width=4):
  return bm.init(num_blocks=num_blocks, block_size=block_size,
                 max_seqs=max_seqs, max_blocks_per_seq=width,
                 prefix_caching=True)


def _cached_seq(state, sid, num_tokens):
  """`sid` reserves `num_tokens`, registers its full blocks, and returns them."""
  state, res = _reserve(state, _i32([sid]), _i32([num_tokens]))
  assert res.ok.tolist() == [True]
  full = num_tokens // state.block_size
  state, ok = _register(state, _i32([sid] * full), _i32(range(full)))
  assert all(ok.tolist())
  return state, np.asarray(state.block_tables[sid, :full]).tolist()


def test_eviction_takes_empty_blocks_first_then_lru_tail_first():
  state = _pool()
  state, a = _cached_seq(state, 0, 6)  # 3 blocks
  state, b = _cached_seq(state, 1, 4)  # 2 blocks
  state, _ = _release(state, _i32([0]))
  state, _ = _release(state, _i32([1]))
  assert bm.cached_blocks(state) == a[::-1] + b[::-1]
  assert int(state.num_free) == 3 and int(state.num_cached) == 5
  state, res = _reserve(state, _i32([2]), _i32([8]))  # 4 blocks: 3 empty + 1
  assert res.ok.tolist() == [True]
  assert res.evicted[0][res.evicted[0] >= 0].tolist() == [a[2]]
  assert bm.cached_blocks(state) == [a[1], a[0]] + b[::-1]
  # A hit takes a block out of the middle of the order; the rest keep theirs.
  state, ok = _share(state, _i32([3]), jnp.array([[a[0], a[1], -1, -1]]),
                     _i32([1]))  # only a[0]: a[1] is past num_shared
  assert ok.tolist() == [True] and bm.cached_blocks(state) == [a[1]] + b[::-1]
  state, res = _reserve(state, _i32([3]), _i32([4]))
  assert res.evicted[0][res.evicted[0] >= 0].tolist() == [a[1], b[1]]
  bm.check_invariants(state)
  # The pool is full: nothing fits any more, and a failed reserve evicts nothing.
  before = state
  state, res = _reserve(state, _i32([0]), _i32([4]))
  assert res.ok.tolist() == [False] and int(state.num_available) == 1
  assert res.evicted.tolist() == [[NULL_BLOCK] * 4]
  chex.assert_trees_all_equal(before, state)


def test_a_stale_hit_fails_and_cached_content_is_read_only():
  state = _pool()
  state, a = _cached_seq(state, 0, 5)  # 2 full blocks, a third partial one
  # Only full blocks register; the partial last one does not.
  state, ok = _register(state, _i32([0, 0, 1]), _i32([2, -1, 0]))
  assert ok.tolist() == [False, False, False]
  # Registered blocks are never written, even by their only holder.
  slots = _slot_mapping(state, _i32([0, 0, 0]), _i32([0, 3, 4]))
  assert slots.tolist()[:2] == [-1, -1] and slots.tolist()[2] >= 0
  state, _ = _release(state, _i32([0]))
  state, res = _reserve(state, _i32([1, 2]), _i32([8, 8]))  # the whole pool
  assert res.ok.tolist() == [True, True] and int(state.num_cached) == 0
  state, _ = _release(state, _i32([2]))
  state, ok = _share(state, _i32([2]), jnp.array([a + [-1, -1]]), _i32([2]))
  assert ok.tolist() == [False]  # the index entry is stale: refused
  bm.check_invariants(state)


def test_a_hit_on_a_live_block_shares_it():
  state = _pool()
  state, a = _cached_seq(state, 0, 4)
  state, ok = _share(state, _i32([1, 2, 1]), jnp.array([a + [-1, -1]] * 3),
                     _i32([2, 1, 2]))
  assert ok.tolist() == [True, True, False]  # the slot is claimed once
  assert np.asarray(state.refcounts)[a].tolist() == [3, 2]
  state, _ = _release(state, _i32([0, 1, 2]))
  assert bm.cached_blocks(state) == a[::-1] and int(state.num_used) == 0
  bm.check_invariants(state)


def test_the_ring_compacts_after_many_hits_without_eviction():
  """Hit-and-release cycles leave tombstones; the ring (2 x num_blocks slots)
  compacts itself and the order and invariants survive."""
  state = _pool(num_blocks=6, width=3)
  state, a = _cached_seq(state, 0, 6)
  state, b = _cached_seq(state, 1, 4)
  state, _ = _release(state, _i32([0, 1]))
  order = a[::-1] + b[::-1]
  assert bm.cached_blocks(state) == order
  for i in range(14):  # a hit on a[0] then its release: one tombstone each
    state, ok = _share(state, _i32([2]), jnp.array([a]), _i32([1]))
    assert ok.tolist() == [True]
    state, _ = _release(state, _i32([2]))
    order = [x for x in order if x != a[0]] + [a[0]]
    assert bm.cached_blocks(state) == order, i
    bm.check_invariants(state)
  tombstones = int(state.lru_len) - int(state.num_cached)
  assert tombstones < 14  # compacted along the way


def test_evicted_blocks_refilled_with_nan_are_never_read():
  """A live sequence with a hit keeps attending to exactly its own K/V while
  the cached blocks around it are evicted, handed to another sequence and
  refilled with NaN (every block that sequence does not own is NaN)."""
  rng = np.random.default_rng(0)
  kvh, qh, d, bs, n = 2, 4, 16, 4, 12
  state = _pool(num_blocks=n, block_size=bs, max_seqs=4, width=6)
  k = jnp.asarray(rng.standard_normal((kvh, n, bs, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((kvh, n, bs, d)), jnp.float32)
  state, a = _cached_seq(state, 0, 16)  # 4 cached blocks of shared prefix
  state, _ = _release(state, _i32([0]))
  # A hit on the first 2; its own tokens 8..10 go to fresh blocks.
  state, ok = _share(state, _i32([1]), jnp.array([a[:2] + [-1] * 4]), _i32([2]))
  state, res = _reserve(state, _i32([1]), _i32([3]))
  assert ok.tolist() == [True] and res.ok.tolist() == [True]
  # Another sequence takes every other block: the rest of the cache evicted.
  state, res = _reserve(state, _i32([2, 3]), _i32([24, 12]))
  assert res.ok.tolist() == [True, True] and int(state.num_available) == 0
  evicted = np.asarray(res.evicted)
  assert evicted[evicted >= 0].tolist() == [a[3], a[2]]  # the tail first
  bm.check_invariants(state)
  tables, lens = bm.gather_tables(state, _i32([1]))
  owned = np.asarray(tables[0, :3])
  assert owned[:2].tolist() == a[:2]
  poison = np.ones(n, bool)
  poison[owned] = False
  k = k.at[:, poison].set(jnp.nan)
  v = v.at[:, poison].set(jnp.nan)
  q = jnp.asarray(rng.standard_normal((1, qh, d)), jnp.float32)
  got = attention.paged_attention(q, k, v, tables, lens)
  want = reference.paged_attention_reference(q, k, v, tables, lens)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_step_with_caching_compiles_once():

  @chex.assert_max_traces(n=1)
  def step(state, ids, ns, cols, hit_seq, hit_blocks, hit_n, done):
    state, _ = bm.release(state, done)
    state, hit = bm.share(state, hit_seq, hit_blocks, hit_n)
    state, res = bm.reserve(state, ids, ns)
    state, reg = bm.register(state, ids, cols)
    return state, (res.ok, res.evicted, hit, reg)

  step = jax.jit(step, donate_argnums=0)
  state = bm.init(num_blocks=32, block_size=4, max_seqs=8, max_blocks_per_seq=6,
                  prefix_caching=True)
  rng = np.random.default_rng(0)
  for _ in range(60):
    cacheable = np.nonzero(np.asarray(state.cacheable))[0]
    pick = rng.choice(cacheable, (2, 6)) if len(cacheable) else np.zeros((2, 6))
    args = [rng.integers(0, 8, 4), rng.integers(0, 9, 4), rng.integers(0, 6, 4),
            rng.integers(0, 8, 2), pick, rng.integers(1, 3, 2),
            rng.integers(0, 8, 2)]
    state, _ = step(state, *[jnp.asarray(a, jnp.int32) for a in args])
  bm.check_invariants(state)


def test_share_errors():
  state = _pool(width=4)
  with pytest.raises(ValueError, match=r"block_ids must have shape "
                     r"\[len\(seq_ids\)=1, m\] with m <= max_blocks_per_seq=4, "
                     r"got \(1, 5\)"):
    bm.share(state, _i32([0]), jnp.zeros((1, 5), jnp.int32), _i32([1]))
  with pytest.raises(ValueError, match=r"block_ids must have shape"):
    bm.share(state, _i32([0, 1]), jnp.zeros((1, 2), jnp.int32), _i32([1, 1]))
  with pytest.raises(ValueError, match=r"block_ids must be a 2-D integer array"):
    bm.share(state, _i32([0]), _i32([0]), _i32([1]))
  with pytest.raises(ValueError, match="seq_ids and num_shared must have"):
    bm.share(state, _i32([0]), jnp.zeros((1, 2), jnp.int32), _i32([1, 1]))
  with pytest.raises(ValueError, match="seq_ids and block_cols must have"):
    bm.register(state, _i32([0]), _i32([1, 1]))


def test_init_refuses_a_ring_past_int32():
  with pytest.raises(ValueError, match=r"ring_per_block \* num_blocks = "
                     r"2147483648 must be < 2\*\*31 \(int32 cached-block ring "
                     r"slots\)"):
    bm.init(num_blocks=2**30, block_size=1, max_seqs=1, max_blocks_per_seq=1,
            prefix_caching=True)


_POOL_WIDE = ("reduce_sum", "reduce_max", "reduce_min", "reduce_or",
              "reduce_and", "argmin", "argmax", "cumsum", "cummax", "sort",
              "scan")


def _pool_wide_ops(jaxpr, sizes, skip_compaction):
  """Primitives that scan, sort or reduce an operand with a pool-sized axis."""
  found = []
  for eqn in jaxpr.eqns:
    subs = [p for v in eqn.params.values()
            for p in (v if isinstance(v, (tuple, list)) else [v])
            if hasattr(p, "jaxpr") or hasattr(p, "eqns")]
    if eqn.primitive.name == "while" and skip_compaction:
      body = eqn.params["body_jaxpr"].jaxpr
      if any(e.primitive.name == "iota" and e.params["shape"][0] == sizes[1]
             for e in body.eqns):
        continue  # `_compact_if_full`: at most once per num_blocks hits
    for sub in subs:
      found += _pool_wide_ops(getattr(sub, "jaxpr", sub), sizes,
                              skip_compaction)
    if eqn.primitive.name in _POOL_WIDE:
      shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
      if any(set(s) & set(sizes) for s in shapes):
        found.append((eqn.primitive.name, shapes))
  return found


def test_no_operation_scans_the_pool():
  """The cost claim, checked on the traced programs: no reduction, cumsum,
  sort or scan over a pool-sized axis (num_blocks or the ring's 2 x
  num_blocks) in any operation, except the ring's rare compaction."""
  n = 1009  # a size no other axis has
  state = bm.init(num_blocks=n, block_size=4, max_seqs=6, max_blocks_per_seq=5,
                  prefix_caching=True)
  ids, cnt = jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.int32)
  calls = {
      "reserve": (bm.reserve, (state, ids, cnt)),
      "release": (bm.release, (state, ids)),
      "fork": (bm.fork, (state, ids, ids)),
      "register": (bm.register, (state, ids, ids)),
      "share": (bm.share, (state, ids, jnp.zeros((3, 5), jnp.int32), cnt)),
      "slot_mapping": (bm.slot_mapping, (state, ids, ids)),
  }
  for name, (fn, args) in calls.items():
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    assert not _pool_wide_ops(jaxpr, (n, 2 * n), True), name
  # The detector itself sees a pool scan: the compaction is one.
  jaxpr = jax.make_jaxpr(bm.release)(state, ids).jaxpr
  assert _pool_wide_ops(jaxpr, (n, 2 * n), False)


# --- Prefix caching off (the default): the plain allocator, nothing more. ---


def _main_reserve(state, seq_ids, num_new_tokens):
  """`reserve` as it was before prefix caching (the reference for the jaxpr
  comparison below; results are not used), its decision of who is served
  now `bm._serve` (the scan, skipped when nothing needs it)."""
  seq_ids = bm._as_ids("seq_ids", seq_ids)
  num_new_tokens = bm._as_ids("num_new_tokens", num_new_tokens)
  bs = state.block_size
  num_blocks, max_seqs, width = (state.num_blocks, state.max_seqs,
                                 state.max_blocks_per_seq)
  valid = ((seq_ids >= 0) & (seq_ids < max_seqs) & (num_new_tokens >= 0)
           & bm._first_occurrence(seq_ids))
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  old_len = state.seq_lens[sid]
  rows = state.block_tables[sid]
  valid &= num_new_tokens <= state.max_seq_len - old_len
  new_len = old_len + jnp.where(valid, num_new_tokens, 0)
  cur_blocks = bm._cdiv(old_len, bs)
  new_blocks = bm._cdiv(new_len, bs)
  last = jnp.take_along_axis(rows, jnp.maximum(cur_blocks - 1, 0)[:, None],
                             axis=1)[:, 0]
  partial = valid & (num_new_tokens > 0) & (old_len % bs != 0)
  last_refs = state.refcounts[jnp.clip(last, 0, num_blocks - 1)]

  # Who is served: the one decision both allocators share (`bm._serve`).
  num_free, ok, cow, need = bm._serve(valid, partial, last, last_refs,
                                      new_blocks - cur_blocks, state.num_free)
  offset = jnp.cumsum(need) - need
  first = cur_blocks - cow.astype(jnp.int32)
  k = jnp.arange(width, dtype=jnp.int32)[None, :] - first[:, None]
  taking = ok[:, None] & (k >= 0) & (k < need[:, None])
  pos = state.num_free - 1 - offset[:, None] - k
  new_ids = state.free_stack[jnp.clip(pos, 0, num_blocks - 1)]
  new_rows = jnp.where(taking, new_ids, rows)
  refs = bm._scatter_add(state.refcounts, new_ids, taking, 1)
  refs = bm._scatter_add(refs, last, cow, -1)
  write = jnp.where(ok, sid, max_seqs)
  tables = state.block_tables.at[write].set(new_rows, mode="drop")
  lens = state.seq_lens.at[write].set(new_len, mode="drop")
  dst = jnp.take_along_axis(new_rows, jnp.maximum(first, 0)[:, None],
                            axis=1)[:, 0]
  new_state = state.replace(block_tables=tables, seq_lens=lens, refcounts=refs,
                            num_free=num_free)
  return new_state, bm.Reservation(
      ok=ok, copy_src=jnp.where(cow, last, NULL_BLOCK),
      copy_dst=jnp.where(cow, dst, NULL_BLOCK), evicted=None)


def _main_release(state, seq_ids):
  """`release` as it was before prefix caching (reference, as above)."""
  seq_ids = bm._as_ids("seq_ids", seq_ids)
  bs = state.block_size
  num_blocks, max_seqs, width = (state.num_blocks, state.max_seqs,
                                 state.max_blocks_per_seq)
  sid = jnp.clip(seq_ids, 0, max_seqs - 1)
  length = state.seq_lens[sid]
  ok = ((seq_ids >= 0) & (seq_ids < max_seqs) & (length > 0)
        & bm._first_occurrence(seq_ids))
  rows = state.block_tables[sid]
  cols = jnp.arange(width, dtype=jnp.int32)
  owned = ok[:, None] & (cols[None, :] < bm._cdiv(length, bs)[:, None])
  refs = bm._scatter_add(state.refcounts, rows, owned, -1)
  flat = jnp.sort(jnp.where(owned, rows, num_blocks).reshape(-1))
  fresh = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]])
  freed = fresh & (flat < num_blocks)
  freed &= refs[jnp.clip(flat, 0, num_blocks - 1)] == 0
  pos = state.num_free + jnp.cumsum(freed.astype(jnp.int32)) - 1
  stack = state.free_stack.at[jnp.where(freed, pos, num_blocks)].set(
      flat, mode="drop")
  num_free = state.num_free + jnp.sum(freed, dtype=jnp.int32)
  write = jnp.where(ok, sid, max_seqs)
  tables = state.block_tables.at[write].set(NULL_BLOCK, mode="drop")
  lens = state.seq_lens.at[write].set(0, mode="drop")
  return state.replace(block_tables=tables, seq_lens=lens, refcounts=refs,
                       free_stack=stack, num_free=num_free), ok


def _primitives(jaxpr) -> dict:
  """Multiset of primitive names in `jaxpr` and all its sub-jaxprs."""
  counts = {}
  for eqn in jaxpr.eqns:
    counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    for v in eqn.params.values():
      for p in (v if isinstance(v, (tuple, list)) else [v]):
        if hasattr(p, "jaxpr") or hasattr(p, "eqns"):
          for name, c in _primitives(getattr(p, "jaxpr", p)).items():
            counts[name] = counts.get(name, 0) + c
  return counts


def test_without_caching_reserve_and_release_trace_the_plain_allocator():
  """Off, `reserve` and `release` trace to the same jaxpr (same equations in
  the same order) as the allocator before prefix caching: no release-order sort, no
  eviction or compaction `while`, no ring scatter. On, they do not (the
  comparison can tell the two apart)."""
  sizes = dict(num_blocks=64, block_size=4, max_seqs=6, max_blocks_per_seq=5)
  ids, cnt = jnp.arange(3, dtype=jnp.int32), jnp.ones(3, jnp.int32)
  off = bm.init(**sizes)
  on = bm.init(**sizes, prefix_caching=True)
  for op, ref, args in ((bm.reserve, _main_reserve, (ids, cnt)),
                        (bm.release, _main_release, (ids,))):
    # The very same program, equation for equation:
    assert (str(jax.make_jaxpr(op)(off, *args))
            == str(jax.make_jaxpr(ref)(off, *args))), op.__name__
    want = _primitives(jax.make_jaxpr(ref)(off, *args).jaxpr)
    got = _primitives(jax.make_jaxpr(op)(off, *args).jaxpr)
    assert got == want, op.__name__
    if op is bm.release:  # (reserve's `_serve` has its own while and sort)
      assert "while" not in got and got.get("sort", 0) <= 1, op.__name__
    cached = _primitives(jax.make_jaxpr(op)(on, *args).jaxpr)
    assert cached.get("while", 0) > got.get("while", 0) and cached != want, op.__name__
  # And they compute the same thing.
  s_ref, s_new = off, off
  for _ in range(3):
    s_ref, r_ref = _main_reserve(s_ref, ids, jnp.array([3, 5, 1], jnp.int32))
    s_new, r_new = bm.reserve(s_new, ids, jnp.array([3, 5, 1], jnp.int32))
    chex.assert_trees_all_equal((s_ref, r_ref), (s_new, r_new))
  s_ref, ok_ref = _main_release(s_ref, ids[:2])
  s_new, ok_new = bm.release(s_new, ids[:2])
  chex.assert_trees_all_equal((s_ref, ok_ref), (s_new, ok_new))
  bm.check_invariants(s_new)


def test_without_caching_the_state_has_no_cache():
  state = bm.init(num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=2)
  assert not state.prefix_caching
  assert state.cacheable is None and state.lru is None
  assert len(jax.tree.leaves(state)) == 5  # the plain allocator's arrays
  state, res = _reserve(state, _i32([0]), _i32([3]))
  assert res.evicted is None and bm.cached_blocks(state) == []
  assert int(state.num_used) == 2 and int(state.num_available) == 2
  state, _ = _release(state, _i32([0]))
  assert int(state.num_free) == 4
  bm.check_invariants(state)
  on = bm.init(num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=2,
               prefix_caching=True)
  assert on.prefix_caching and len(jax.tree.leaves(on)) == 11


def test_register_and_share_refuse_a_state_without_caching():
  state = bm.init(num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=2)
  state, _ = _reserve(state, _i32([0]), _i32([2]))
  msg = (r"{} needs a state with prefix caching \(init\(\.\.\., "
         r"prefix_caching=True\)\), got one without \(its cache fields are "
         r"None\)")
  with pytest.raises(ValueError, match=msg.format("register")):
    bm.register(state, _i32([0]), _i32([0]))
  with pytest.raises(ValueError, match=msg.format("share")):
    bm.share(state, _i32([1]), jnp.zeros((1, 1), jnp.int32), _i32([1]))


def test_init_prefix_caching_must_be_a_bool():
  with pytest.raises(ValueError, match="prefix_caching must be a bool, got 1"):
    bm.init(num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=2,
            prefix_caching=1)


def test_check_invariants_refuses_a_half_cache():
  state = bm.init(num_blocks=4, block_size=2, max_seqs=2, max_blocks_per_seq=2,
                  prefix_caching=True)
  with pytest.raises(AssertionError, match=r"prefix-caching fields \['lru'\] "
                     r"are None but the others are not"):
    bm.check_invariants(state.replace(lru=None))
