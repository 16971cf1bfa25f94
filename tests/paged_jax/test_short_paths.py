"""The block manager's short paths, each against the long one it skips:

* `release`, `fork`, `truncate` and `share` (`block_manager._leading_rows`):
  a call whose entries all sit in its first `LEADING_ROWS` rows does only
  their work, and must give exactly what the whole call gives, wherever the
  entries are, jitted and under `vmap`;
* `reserve` without its in-order scan when no siblings grow into one shared
  block and the pool holds every request: exactly what the scan gives."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm

MAX_SEQS, WIDTH, BS = 24, 6, 4
K = bm.LEADING_ROWS
_JIT = {f: jax.jit(f) for f in (bm.release, bm._release, bm.fork, bm._fork,
                                bm.truncate, bm._truncate, bm.share, bm._share,
                                bm.reserve, bm.register)}
_RESERVE_IN_ORDER = jax.jit(functools.partial(bm._reserve, ordered=True))


def _state(rng: np.random.Generator, caching: bool) -> bm.BlockState:
  """A pool with live, forked, registered and cached blocks."""
  state = bm.init(num_blocks=96, block_size=BS, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=WIDTH, prefix_caching=caching)
  live = rng.choice(MAX_SEQS, size=14, replace=False).astype(np.int32)
  lens = rng.integers(1, WIDTH * BS - 4, size=live.size).astype(np.int32)
  state, res = _JIT[bm.reserve](state, jnp.asarray(live[:10]), jnp.asarray(lens[:10]))
  assert bool(jnp.all(res.ok))
  state, ok = _JIT[bm.fork](state, jnp.asarray(live[:4]), jnp.asarray(live[10:]))
  assert bool(jnp.all(ok))
  if caching:
    full = np.asarray(state.seq_lens)[live[:10]] // BS
    seqs = np.repeat(live[:10], np.maximum(full, 0))
    cols = np.concatenate([np.arange(f) for f in full]).astype(np.int32)
    state, ok = _JIT[bm.register](state, jnp.asarray(seqs), jnp.asarray(cols))
    assert bool(jnp.all(ok))
    state, _ = _JIT[bm.release](state, jnp.asarray(live[4:6]))  # cached blocks
  return state


def _ids(rng: np.random.Generator, n: int, trailing: bool) -> np.ndarray:
  """`n` ids, padding (-1) but for a few entries: in the first `K` rows, or
  (trailing) one of them past them; slot 0 and out-of-range ids included."""
  ids = np.full(n, -1, np.int32)
  pool = np.concatenate([np.arange(MAX_SEQS), [MAX_SEQS, 10**6, -5]])
  lead = rng.choice(min(K, n), size=min(3, n), replace=False)
  ids[lead] = rng.choice(pool, size=lead.size)
  if trailing:
    ids[rng.integers(K, n)] = rng.choice([0, *rng.integers(1, MAX_SEQS, 3)])
  return ids


def _cases(rng, state, n, trailing):
  """(name, public op, whole op, args) for each op at batch `n`."""
  ids = _ids(rng, n, trailing)
  other = np.where(ids >= 0, rng.permutation(MAX_SEQS)[:n] if n <= MAX_SEQS
                   else rng.integers(0, MAX_SEQS, n), -1).astype(np.int32)
  lens = np.asarray(state.seq_lens)[np.clip(ids, 0, MAX_SEQS - 1)]
  cut = (lens * rng.uniform(0, 1.2, n)).astype(np.int32)
  cases = [("release", bm.release, bm._release, (ids,)),
           ("fork", bm.fork, bm._fork, (ids, other)),
           ("truncate", bm.truncate, bm._truncate, (ids, cut))]
  if state.prefix_caching:
    blocks = np.asarray(bm.cached_blocks(state), np.int32)
    m = 3
    rows = rng.choice(np.concatenate([blocks, [-1, 0, 95]]), size=(n, m))
    counts = rng.integers(0, m + 1, n).astype(np.int32)
    cases.append(("share", bm.share, bm._share, (other, rows, counts)))
  return cases


def _assert_same(a, b, what):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b, what
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


@pytest.mark.parametrize("caching", [False, True])
def test_the_short_path_gives_the_whole_calls_result(caching):
  rng = np.random.default_rng(7 + caching)
  hits = {"short": 0, "whole": 0}
  for trial in range(4):
    state = _state(rng, caching)
    for n in (3 * K,):
      trailing = trial % 2 == 1
      for name, op, whole, args in _cases(rng, state, n, trailing):
        args = tuple(jnp.asarray(a) for a in args)
        got = _JIT[op](state, *args)
        want = _JIT[whole](state, *args)
        _assert_same(got, want, f"{name} n={n} trailing={trailing}")
        hits["whole" if trailing else "short"] += 1
  assert hits["short"] and hits["whole"]


def test_under_vmap_each_shard_gets_its_own_answer():
  """One shard with an entry past the first rows, one without: the loop runs
  for both, and each keeps exactly its own whole call's result."""
  rng = np.random.default_rng(3)
  states = [_state(rng, True), _state(rng, True)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
  n = 2 * K
  for name in ("release", "fork", "truncate", "share"):
    per_shard = [dict((c[0], c) for c in _cases(rng, s, n, trailing=t))[name]
                 for s, t in zip(states, (True, False))]
    _, op, whole, _ = per_shard[0]
    args = tuple(jnp.stack([jnp.asarray(a) for a in col])
                 for col in zip(*(c[3] for c in per_shard)))
    got = jax.jit(jax.vmap(op))(stacked, *args)
    want = jax.jit(jax.vmap(whole))(stacked, *args)
    _assert_same(got, want, name)


def _sort_sizes(jaxpr, into_conds: bool = True) -> list[int]:
  """The operand sizes of the `sort`s in `jaxpr` and its sub-jaxprs (those
  of `cond`s too, unless `into_conds` is False)."""
  sizes = []
  for e in jaxpr.eqns:
    if e.primitive.name == "sort":
      sizes.append(int(np.prod(e.invars[0].aval.shape)))
    if e.primitive.name == "cond" and not into_conds:
      continue
    for sub in _sub_jaxprs(e.params):
      sizes += _sort_sizes(sub, into_conds)
  return sizes


def _sub_jaxprs(params) -> list:
  """The jaxprs among an equation's parameters (`ClosedJaxpr`s unwrapped)."""
  out = []
  for v in params.values():
    for x in v if isinstance(v, (list, tuple)) else (v,):
      x = getattr(x, "jaxpr", x)  # ClosedJaxpr -> Jaxpr
      if hasattr(x, "eqns"):
        out.append(x)
  return out


def test_padding_past_the_first_rows_costs_only_the_first_rows():
  """`release` of `MAX_SEQS` rows sorts `MAX_SEQS * WIDTH` entries only in the
  branch taken when a row past the first `K` holds an id; the other branch
  sorts `K * WIDTH`, and nothing outside the `cond` sorts at all."""
  state = _state(np.random.default_rng(0), False)
  ids = jax.ShapeDtypeStruct((MAX_SEQS,), jnp.int32)
  jaxpr = jax.make_jaxpr(bm.release)(state, ids).jaxpr
  assert not _sort_sizes(jaxpr, into_conds=False)
  (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
  whole, short = (_sort_sizes(b.jaxpr) for b in cond.params["branches"][::-1])
  assert short == [K * WIDTH] and whole == [MAX_SEQS * WIDTH], (short, whole)



# The batch sizes `reserve` is compiled for below: fewer rows than slots, and
# more (every slot, out-of-range ids and repeats).
_RESERVE_BATCHES = (8, MAX_SEQS + 3)


@pytest.mark.parametrize("caching", [False, True])
def test_reserve_without_the_scan_gives_the_scans_result(caching):
  """Random requests on pools with forked siblings (their shared partial last
  blocks: copy-on-write, where one sibling's copy changes the other's need)
  and requests that outgrow the pool; both paths must be taken."""
  rng = np.random.default_rng(11 + caching)
  paths = {"scan": 0, "direct": 0, "siblings": 0}
  for _ in range(12):
    state = _state(rng, caching)
    n = int(rng.integers(1, MAX_SEQS + 4))
    ids = rng.choice(np.arange(-1, MAX_SEQS + 1), size=n).astype(np.int32)
    big = rng.random() < 0.3
    counts = rng.integers(0, 40 if big else 6, n).astype(np.int32)
    # Padded with empty requests (id -1, 0 tokens: they fail and take
    # nothing) to one of `_RESERVE_BATCHES`, so that the 12 batches compile
    # 2 shapes instead of one per `n`.
    pad = min(b for b in _RESERVE_BATCHES if b >= n) - n
    args = (jnp.asarray(np.pad(ids, (0, pad), constant_values=-1)),
            jnp.asarray(np.pad(counts, (0, pad))))
    got = _JIT[bm.reserve](state, *args)
    want = _RESERVE_IN_ORDER(state, *args)
    _assert_same(got, want, f"ids={ids} counts={counts}")
    # Which path ran: the scan's condition, in NumPy.
    lens = np.asarray(state.seq_lens)
    first = np.array([i not in ids[:k] for k, i in enumerate(ids)])
    sid = np.clip(ids, 0, MAX_SEQS - 1)
    valid = (ids >= 0) & (ids < MAX_SEQS) & first & (
        counts <= WIDTH * BS - lens[sid])
    old = lens[sid]
    last = np.asarray(state.block_tables)[sid, np.maximum(-(-old // BS) - 1, 0)]
    cow = valid & (counts > 0) & (old % BS != 0) & (
        np.asarray(state.refcounts)[np.clip(last, 0, None)] > 1)
    need = np.where(valid, -(-(old + counts) // BS) - (-(-old // BS)) + cow, 0)
    siblings = len(set(last[cow])) < cow.sum()
    scan = siblings or need.sum() > int(state.num_available)
    paths["scan" if scan else "direct"] += 1
    paths["siblings"] += siblings
  assert paths["scan"] and paths["direct"] and paths["siblings"], paths
