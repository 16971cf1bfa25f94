"""One step path for one device and for a mesh (`step.device_step`; one
device is a 1x1 mesh): the bookkeeping's empty operations stay `lax.cond`s
when it runs once per data shard, and an engine with no mesh runs on a 1x1
mesh of its device."""

import jax
import jax.extend
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import sharding
from paged_jax import step_metadata as step_metadata_lib
from paged_jax.models.llama.model import LlamaConfig, init_model
from paged_jax.serving import step as step_lib
from paged_jax.serving.engine import Engine, EngineConfig

MAX_SEQS, BLOCKS_PER_SEQ, BATCH = 4, 4, 2


def _inputs(data: int) -> step_lib.StepInputs:
  none = lambda *shape: np.full((data,) + shape, -1, np.int32)  # noqa: E731
  return step_lib.StepInputs(
      register_seqs=none(0), register_cols=none(0),
      release_early=none(MAX_SEQS), release_late=none(MAX_SEQS),
      fork_parents=none(BATCH), fork_children=none(BATCH),
      share_seqs=none(0), share_blocks=none(0, BLOCKS_PER_SEQ),
      share_counts=none(0), seq_ids=none(BATCH),
      q_lens=np.zeros((data, BATCH), np.int32), tokens=np.zeros((data, BATCH), np.int32),
      token_slots=none(BATCH), sample_slots=none(BATCH),
      sample_rows=np.zeros((data, BATCH), np.int32), sample_seqs=none(BATCH),
      seed_offsets=np.zeros((data, BATCH), np.int32))


def _states(data: int) -> bm.BlockState:
  state = bm.init(num_blocks=8, block_size=4, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=BLOCKS_PER_SEQ)
  return jax.tree.map(lambda a: np.broadcast_to(a, (data,) + a.shape), state)


def _count(jaxpr, name: str) -> int:
  """Equations of primitive `name` in `jaxpr` and its sub-jaxprs."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count(sub, name)
  return n


@pytest.mark.parametrize("data", [1, 2])
def test_bookkeeping_per_shard_keeps_its_conds(data):
  """`over_pools` runs the bookkeeping per data shard under `shard_map`, so
  the two releases and the fork stay conds (an empty one costs nothing) and
  no data shard talks to another; a plain `vmap` batches the predicates and
  XLA would run both branches."""
  mesh = sharding.make_mesh(data, 1)
  step = lambda s, x: step_lib.bookkeeping_step(s, x, num_logprobs=1)  # noqa: E731
  args = (_states(data), _inputs(data))
  one_path = jax.jit(lambda s, x: step_lib.over_pools(mesh, step, s, x))
  # One pool's bookkeeping alone: the two releases, the fork and reserve's
  # decision of who is served (`block_manager._serve`) are conds.
  one_pool = jax.tree.map(lambda a: a[0], args)
  conds = _count(jax.make_jaxpr(step)(*one_pool).jaxpr, "cond")
  assert conds >= 3
  assert _count(one_path.trace(*args).jaxpr.jaxpr, "cond") == conds
  assert _count(jax.make_jaxpr(jax.vmap(step))(*args).jaxpr, "cond") == 0
  if data > 1:
    hlo = one_path.lower(*args).compile().as_text()
    assert "all-reduce" not in hlo and "all-gather" not in hlo


def test_step_metadata_on_a_mesh_is_each_pool_s_metadata():
  """`step_metadata(..., mesh=)` on a 1x1 mesh is the one pool's metadata
  with the mesh recorded (and `sharded_step_metadata` is the same call)."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1),
                           ("data", "model"))
  state = bm.init(num_blocks=8, block_size=4, max_seqs=MAX_SEQS,
                  max_blocks_per_seq=BLOCKS_PER_SEQ)
  ids, q = np.array([0, 1], np.int32), np.array([3, 2], np.int32)
  state, _ = bm.reserve(state, ids, q)
  one = jax.jit(lambda s: step_metadata_lib.step_metadata(
      s, ids, q, num_tokens=6))(state)
  stacked = jax.tree.map(lambda a: a[None], state)
  on_mesh = jax.jit(lambda s: step_metadata_lib.step_metadata(
      s, ids[None], q[None], num_tokens=6, mesh=mesh))(stacked)
  old = jax.jit(lambda s: step_metadata_lib.sharded_step_metadata(
      mesh, s, ids[None], q[None], num_tokens=6))(stacked)
  assert one.mesh is None and on_mesh.mesh is mesh and old.mesh is mesh
  for got in (on_mesh, old):
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_engine_without_a_mesh_runs_on_a_1x1_mesh():
  model = init_model(LlamaConfig.tiny())
  engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, max_batch=2,
                                      max_tokens_per_step=8))
  runner = engine._runner  # pylint: disable=protected-access
  assert engine.mesh is None
  assert dict(runner.mesh.shape) == {"data": 1, "model": 1}
  assert runner.state.num_free.shape == (1,)  # the one data shard, stacked
  assert engine.block_state.num_free.shape == ()  # the public view: one pool
