"""Shared fixtures for the example tests: one tiny model, one set of sizes.

Every engine in these tests uses the same model structure and the sizes in
`SIZES` (or `SMALL_POOL`), so the jitted steps compile once per process.
"""

from __future__ import annotations

import collections
import contextlib
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import block_manager as bm
from paged_jax.models.llama import model as model_lib
from paged_jax.serving import compiler
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from tests import conftest as root_conftest

# Which step programs a worker keeps when it passes the memory-map high water
# (`tests/conftest.py`, whose fixture of this name this one replaces here):
# those that two or more modules of this process asked for (the shared
# sizes' steps, which the next module of the same xdist work unit,
# tests/conftest.py's `work_unit`, will ask for again) stay, the rest go. If
# what stays still holds more than half the high water, everything goes, as
# there.
_MODULES_ASKING: collections.Counter = collections.Counter()


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():  # pylint: disable=protected-access
  before = compiler.use_counts()
  yield
  for key, n in compiler.use_counts().items():
    if n > before.get(key, 0):
      _MODULES_ASKING[key] += 1
  if root_conftest._map_count() > root_conftest._MAPS_HIGH_WATER:
    compiler.clear(keep=lambda key: _MODULES_ASKING[key] >= 2)
    jax.clear_caches()
    gc.collect()
    if root_conftest._map_count() > root_conftest._MAPS_HIGH_WATER // 2:
      compiler.clear()
      gc.collect()


SIZES = dict(block_size=4, max_batch=4, max_tokens_per_step=16, max_model_len=64,
             min_bucket=8, bucket_midpoints=False)  # decode 4; mixed 8, 16
BIG_POOL = 64
SMALL_POOL = 12
ORACLE_LEN = 64  # dense oracle pads every sequence to this length


@pytest.fixture(scope="session")
def model():
  return model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)


def make_engine(model, num_blocks=BIG_POOL, **kw) -> Engine:
  return Engine(model, EngineConfig(num_blocks=num_blocks, **{**SIZES, **kw}))


@contextlib.contextmanager
def count_lowerings():
  """Counts the programs JAX lowers inside the block (any jit, an eager op's
  first use of a shape too; a persistent-cache hit is still lowered), by
  JAX's own compile events: yields a list that ends up holding one entry
  per lowering."""
  seen = []

  def listen(event, duration, **_):
    del duration
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      seen.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def random_requests(seed, count, *, vocab=512, prompt=(3, 24), new=(1, 14),
                    **params) -> list[Request]:
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    p = rng.integers(3, vocab, size=int(rng.integers(*prompt))).tolist()
    sp = SamplingParams(max_new_tokens=int(rng.integers(*new)), **params)
    out.append(Request(i, p, sp))
  return out


def assert_mirror_is_the_device_state(engine: Engine):
  """The schedulers' host mirrors equal the device block state, exactly."""
  pools = engine._pools  # pylint: disable=protected-access
  state = engine.block_state
  for i, pool in enumerate(pools):
    device = state if engine.mesh is None else jax.tree.map(lambda x, i=i: x[i], state)
    for a, b in zip(jax.tree.leaves(pool.mirror_state()), jax.tree.leaves(device)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_pool_empty(engine: Engine):
  """Nothing left: the block state's invariants hold, the host's pool model
  equals the device state, every block is free and no request runs."""
  bm.check_invariants(engine.block_state)
  assert_mirror_is_the_device_state(engine)
  assert int(engine.block_state.num_free) == engine.config.num_blocks
  assert not engine.has_unfinished()


def serve(engine: Engine, requests) -> dict:
  for r in requests:
    assert engine.add_request(r) is None, r
  return {o.request_id: o for o in engine.run_until_done()}


class DenseOracle:
  """Greedy decoding and beam search with the dense (non-paged) forward."""

  def __init__(self, model):
    graphdef, params = nnx.split(model)
    self._params = params
    self._logits = jax.jit(
        lambda p, t: nnx.merge(graphdef, p).dense_logits(t))
    self.eos = set(model.config.eos_token_ids)

  def next_logits(self, tokens) -> np.ndarray:
    padded = np.zeros((1, ORACLE_LEN), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(self._logits(self._params, jnp.asarray(padded))[0, len(tokens) - 1])

  def greedy(self, prompt, max_new_tokens, eos=None):
    eos = self.eos if eos is None else set(eos)
    toks = list(prompt)
    for _ in range(max_new_tokens):
      t = int(np.argmax(self.next_logits(toks)))
      toks.append(t)
      if t in eos:
        break
    return toks[len(prompt):]


@pytest.fixture(scope="session")
def oracle(model):
  return DenseOracle(model)
