"""The prefix cache's host level in the engine (`kv_offloading_size`,
`prefix_offload.py`): the greedy tokens of caching without it, with host
hits loaded into reused device blocks that are NaN-poisoned just before the
load; the index, the mirror and the device agree after every step; every
block back; bytes counted as dispatched; nothing dispatched when nothing is
evicted; the flag's errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import prefix_tier
from paged_jax.serving.engine import EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests.examples.conftest import SMALL_POOL, make_engine
from tests.examples.test_prefix_engine import TWO_SHAPES, _phases, _poison, _run, _tokens

HOST_BLOCKS = 64


def gib(model, blocks: int) -> float:
  per_block = make_engine(model, num_blocks=4).cache.bytes_per_block
  return blocks * per_block / prefix_tier.GIB


def poisoning_loads(engine, log):
  """Wraps the runner's copies: NaN into every block a load writes, just
  before the load (a load that missed a block leaves NaN there)."""
  runner = engine._runner  # pylint: disable=protected-access
  copy = runner.copy_prefix_blocks

  def poisoned(copies):
    if copies is not None:
      log.append(copies)
      mask = np.zeros(runner.cache.num_blocks, bool)
      mask[copies.back.dst] = True
      runner.cache = _poison(runner.cache, mask)
    copy(copies)
  runner.copy_prefix_blocks = poisoned


def _device_only_tokens(model, phases, off=None) -> dict:
  """The greedy tokens of every phase's requests on the device cache alone
  (`off`, or a new engine with prefix caching and no host level)."""
  if off is None:
    off = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True)
  expected = {}
  for reqs in phases:
    expected.update(_tokens(_run(off, reqs, checked=False)))
  return expected


def test_host_hits_give_the_tokens_of_the_device_cache(model):
  phases = _phases()
  off = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True)
  expected = _device_only_tokens(model, phases, off)
  on = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True,
                   kv_offloading_size=gib(model, HOST_BLOCKS))
  assert on._runner.prefix_host_blocks == HOST_BLOCKS  # pylint: disable=protected-access
  log = []
  poisoning_loads(on, log)
  got = {}
  for reqs in phases:
    got.update(_tokens(_run(on, reqs, checked=True)))
  assert got == expected
  st, (pool,) = on.stats, on._pools  # pylint: disable=protected-access
  assert st.external_prefix_hit_tokens > 0  # hits came from the host
  assert st.prefix_hit_tokens >= off.stats.prefix_hit_tokens
  assert sum(len(c.back.dst) for c in log) * 4 == st.external_prefix_hit_tokens
  # Bytes: the real pairs handed to the copies, x one block's bytes.
  per_block = on.cache.bytes_per_block
  assert st.offload_bytes_to_host == sum(len(c.out.src) for c in log) * per_block > 0
  assert st.offload_bytes_to_device == sum(len(c.back.src) for c in log) * per_block
  # Every block back: nothing live on the device, the host level consistent.
  state = jax.device_get(on.block_state)
  bm.check_invariants(state)
  assert int(state.num_used) == 0
  assert int(state.num_free) + int(state.num_cached) == SMALL_POOL
  pool.host_prefix.check()
  u = on.usage()
  assert 0 < u["host_blocks_used"] == len(pool.host_prefix) <= u["host_blocks_total"]


def test_nothing_is_copied_when_nothing_is_evicted(model):
  # 40 blocks with caching: test_resize_engine.py's pool, whose steps (the
  # host level adds none) compile once for both modules (one xdist unit).
  engine = make_engine(model, num_blocks=40, min_bucket=16, enable_prefix_caching=True,
                       kv_offloading_size=gib(model, HOST_BLOCKS))
  log = []
  poisoning_loads(engine, log)
  prompt = list(range(10, 27))
  _run(engine, [Request(f"x{i}", prompt, SamplingParams(max_new_tokens=3))
                for i in range(3)], checked=False)
  assert log == [] and engine.stats.prefix_hit_tokens > 0
  assert engine.stats.offload_bytes_to_host == 0


@pytest.mark.parametrize("kw, match", [
    (dict(kv_offloading_size=-1.0), "kv_offloading_size must be a number of GiB >= 0, got -1.0"),
    (dict(kv_offloading_size=float("nan")), "must be a number of GiB >= 0, got nan"),
    (dict(kv_offloading_size=True), "must be a number of GiB >= 0, got True"),
    (dict(kv_offloading_size=1.0), "needs enable_prefix_caching=True"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=True, num_scheduler_steps=2),
     "needs num_scheduler_steps=1, got 2"),
])
def test_kv_offloading_size_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig(num_blocks=8, **kw)


def test_a_size_that_holds_no_block_is_refused(model):
  with pytest.raises(ValueError, match="holds no KV block of"):
    make_engine(model, num_blocks=8, enable_prefix_caching=True,
                kv_offloading_size=1e-12)


def test_host_prefix_tier_lru_and_pins():
  tier = prefix_tier.HostPrefixTier(2)
  tier.begin_step()
  assert tier.store([b"a", b"b", b"a"]) == [(b"a", 0), (b"b", 1)]
  assert tier.store([b"c"]) == []  # both written this step: pinned
  tier.begin_step()
  assert tier.lookup([b"b", b"x", b"a"]) == [1]  # pinned for this step
  assert tier.store([b"c"]) == [(b"c", 0)]  # evicts "a", not the pinned "b"
  assert tier.store([b"d"]) == []  # "b" read, "c" written this step: pinned
  tier.begin_step()
  assert tier.store([b"d"]) == [(b"d", 1)]  # the least recent now: "b"
  tier.check()
  with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
    prefix_tier.HostPrefixTier(0)


@pytest.mark.parametrize("argv, match", [
    (["--kv-offloading-size", "-2"],
     "--kv-offloading-size must be a number of GiB >= 0, got -2.0"),
    (["--kv-offloading-size", "1"], "--kv-offloading-size > 0 needs --enable-prefix-caching"),
])
def test_kv_offloading_size_flag_errors(argv, match, capsys):
  from paged_jax.entrypoints import generate  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    generate.parse_and_check(argv)
  assert match in capsys.readouterr().err


def test_blocks_stored_ahead_of_eviction_give_the_right_tokens(model):
  """Stores ahead of eviction (`prefix_offload._store_ahead`): every block
  a step evicts is NaN-poisoned right after the step's copies are
  dispatched (so a copy to the host taken later would hold NaN), every
  block a load writes just before the load, every empty block after every
  step; the greedy tokens are those of the device cache alone, and some
  evictions copied nothing because their blocks were on the host already."""
  phases = _phases(seed=1)[:3]  # the third: host hits
  expected = _device_only_tokens(model, phases)
  on = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True,
                   kv_offloading_size=gib(model, HOST_BLOCKS))
  (pool,), runner = on._pools, on._runner  # pylint: disable=protected-access
  evicted, ahead, at_eviction = [], [], []
  commit, store_ahead = pool._commit_offload, pool._store_ahead  # pylint: disable=protected-access
  store_evicted = pool._store_evicted  # pylint: disable=protected-access

  def counting_commit(gone, admitted):
    evicted.append(np.asarray(gone).copy())
    return commit(gone, admitted)

  def counting_ahead(budget):
    out = store_ahead(budget)
    ahead.extend(b for b, _ in out)
    return out

  def counting_evicted(gone):
    out = store_evicted(gone)
    at_eviction.extend(b for b, _ in out)
    return out
  pool._commit_offload, pool._store_ahead = counting_commit, counting_ahead  # pylint: disable=protected-access
  pool._store_evicted = counting_evicted  # pylint: disable=protected-access
  log = []
  poisoning_loads(on, log)
  copy = runner.copy_prefix_blocks

  def poison_evicted(copies):
    copy(copies)  # the stores read the evicted blocks first
    if evicted and evicted[-1].size:
      mask = np.zeros(runner.cache.num_blocks, bool)
      mask[evicted[-1]] = True
      runner.cache = _poison(runner.cache, mask)
  runner.copy_prefix_blocks = poison_evicted
  got = {}
  for reqs in phases:
    got.update(_tokens(_run(on, reqs, checked=True)))
  assert got == expected
  n_evicted = sum(e.size for e in evicted)
  assert ahead and n_evicted > len(at_eviction)  # some evictions copied nothing
  assert on.stats.external_prefix_hit_tokens > 0
  assert on.stats.offload_bytes_to_host == (len(ahead) + len(at_eviction)) * on.cache.bytes_per_block
  pool.host_prefix.check()


def test_stores_are_batched_when_nothing_hits_the_host(model):
  """At 0% host hits on a pool that keeps evicting, the copies to the host
  are far fewer dispatches than the steps that evict, and every evicted
  block reached the host."""
  engine = make_engine(model, num_blocks=24, min_bucket=16, enable_prefix_caching=True,
                       admission_headroom_steps=0,
                       kv_offloading_size=gib(model, HOST_BLOCKS))
  (pool,) = engine._pools  # pylint: disable=protected-access
  evicting_steps = [0]
  commit = pool._commit_offload  # pylint: disable=protected-access

  def counting_commit(gone, admitted):
    real = np.asarray(gone).reshape(-1)
    real = real[real >= 0]
    evicting_steps[0] += bool(real.size)
    hashes = [pool._index.hash_of(int(b)) for b in real]  # pylint: disable=protected-access
    out = commit(gone, admitted)
    assert all(h in pool.host_prefix for h in hashes)  # on the host by now
    return out
  pool._commit_offload = counting_commit  # pylint: disable=protected-access
  log = []
  poisoning_loads(engine, log)
  rng = np.random.default_rng(3)
  reqs = [Request(f"n{i}", rng.integers(3, 512, size=12).tolist(),
                  SamplingParams(max_new_tokens=12)) for i in range(16)]
  _run(engine, reqs, checked=False)
  stores = [c for c in log if len(c.out.src)]
  assert engine.stats.external_prefix_hit_tokens == 0
  assert evicting_steps[0] >= 8
  assert len(stores) * 2 <= evicting_steps[0], (len(stores), evicting_steps[0])
