"""Shared fixtures for the example tests: one tiny model, one set of sizes.

Every engine in these tests uses the same model structure and the sizes in
`SIZES` (or `SMALL_POOL`), so the jitted steps compile once per process.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import block_manager as bm
from paged_jax.models.llama import model as model_lib
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

# Which worker runs what (`--dist loadgroup`, pyproject's addopts): each
# distinct engine configuration compiles its step programs once per process
# (`paged_jax.serving.compiler`); a second worker pays the tracing and
# lowering again (about half a step's compile on CPU; the persistent cache
# saves only XLA's part). So the modules whose engines share sizes (`SIZES`,
# `BIG_POOL`, `SMALL_POOL`, the CLI's 32-block pool of test_generate.SMALL)
# run on one worker, one after another, and every other module runs whole on
# one worker (its own configurations compile once). On 2026-12-04 (loaded
# 2-core AMD EPYC, JAX 0.10.2) the default `load` compiled 43 step programs
# of tests/examples on both workers; see BUILD.md's suite section.
SHARED_SIZES_GROUP = "examples-shared-sizes"
SHARED_SIZES_MODULES = frozenset({
    "test_async", "test_engine", "test_engine_model", "test_engine_text_support",
    "test_generate", "test_generate_text", "test_multihost", "test_multistep",
    "test_prefix_engine", "test_prefix_offload_engine", "test_resize_engine",
    "test_serving_api", "test_spec_engine", "test_swap_engine"})


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
  del config
  here = pathlib.Path(__file__).parent
  for item in items:
    if item.path.parent != here:
      continue
    name = item.path.stem
    item.add_marker(pytest.mark.xdist_group(
        SHARED_SIZES_GROUP if name in SHARED_SIZES_MODULES else f"examples-{name}"))


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
