"""The device side of the engine: parameters, cache, block state, compiled steps.

`Runner` owns the arrays that live on the device(s) and one jitted step per
bucket (`buckets.py`). `dispatch` places a step's host-built inputs (on a mesh:
each process only its own devices' shards) and launches the step without
waiting; `fetch` brings a dispatched step's small outputs to the host (on
several hosts, gathered from every process first). The cache and the block
state are donated to every step, so they are updated in place.
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import sharding
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.step import (ModelDef, StepInputs, StepOutputs,
                                    device_step, mesh_device_step,
                                    shared_mesh_step, shared_step)


class Runner:
  """Device arrays and compiled steps of one engine.

  Args:
    model: a `ServingModel` (already laid out over `mesh` when one is given).
    config: the `EngineConfig`.
    blocks_per_seq: block-table width.
    max_seqs: sequence slots per pool.
    num_logprobs: top log-probs returned per sample row (static).
    mesh: optional `(data, model)` mesh.
  """

  def __init__(self, model, config, *, blocks_per_seq: int, max_seqs: int,
               num_logprobs: int, mesh: Mesh | None = None):
    self.config = config
    self.mesh = mesh
    self.num_logprobs = num_logprobs
    bs = config.block_size
    graphdef, params = nnx.split(model)
    self._model_def = ModelDef(graphdef, params)
    self._params = jax.tree.leaves(params)  # flat: cheap to pass every step
    mc = model.config
    if mesh is None:
      self.state = bm.init(num_blocks=config.num_blocks, block_size=bs,
                           max_seqs=max_seqs, max_blocks_per_seq=blocks_per_seq)
      self.cache = model.make_cache(config.num_blocks, bs, config.cache_dtype)
      self._step_fn, self._shared = device_step, shared_step
    else:
      self.state = sharding.init_block_states(
          mesh, num_blocks_per_shard=config.num_blocks, block_size=bs,
          max_seqs_per_shard=max_seqs, max_blocks_per_seq=blocks_per_seq)
      self.cache = sharding.create_cache(
          mesh, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
          num_blocks_per_shard=config.num_blocks, block_size=bs,
          head_dim=mc.head_dim,
          dtype=kv_cache_lib.cache_dtype(config.cache_dtype, mc.jnp_dtype))
      self._step_fn = functools.partial(mesh_device_step, mesh=mesh)
      self._shared = functools.partial(shared_mesh_step, mesh=mesh)
    self._steps: dict[Bucket, functools.partial] = {}

  def _step(self, bucket: Bucket):
    """The jitted step of `bucket` (made on first use)."""
    fn = self._steps.get(bucket)
    if fn is not None:
      return fn
    if self.config.check_traces:
      step_fn = self._step_fn

      def traced(model_def, params, cache, state, x, *, decode_only, num_logprobs):
        return step_fn(model_def, params, cache, state, x,
                       decode_only=decode_only, num_logprobs=num_logprobs)
      kind = "decode" if bucket.decode_only else "mixed"
      traced.__name__ = f"{kind}_step_{bucket.num_tokens}x{bucket.num_seqs}"
      jitted = jax.jit(chex.assert_max_traces(traced, n=1), donate_argnums=(2, 3),
                       static_argnums=(0,),
                       static_argnames=("decode_only", "num_logprobs"))
    else:
      jitted = self._shared
    fn = functools.partial(jitted, self._model_def, decode_only=bucket.decode_only,
                           num_logprobs=self.num_logprobs)
    self._steps[bucket] = fn
    return fn

  @property
  def compiled_buckets(self) -> tuple[Bucket, ...]:
    """The buckets whose step this runner has used, smallest first."""
    return tuple(sorted(self._steps))

  def place(self, xs: list[StepInputs]) -> StepInputs:
    """The pools' inputs as the step's argument (stacked and placed per data
    shard on a mesh; every process builds the same inputs and places only the
    shards its own devices hold)."""
    if self.mesh is None:
      (x,) = xs
      return x
    x = jax.tree.map(lambda *a: np.stack(a), *xs)
    s = NamedSharding(self.mesh, P(sharding.DATA))
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), x)

  def lower(self, bucket: Bucket, xs: list[StepInputs]) -> jax.stages.Lowered:
    """The step of `bucket`, lowered for inspection; runs nothing."""
    fn = self._step(bucket)
    return fn.func.lower(*fn.args, self._params, self.cache, self.state,
                         self.place(xs), **fn.keywords)

  def dispatch(self, bucket: Bucket, xs: list[StepInputs]) -> StepOutputs:
    """Launches the step on the pools' inputs; returns its outputs, still on
    the device (JAX dispatch is asynchronous: this does not wait)."""
    fn = self._step(bucket)
    self.cache, self.state, out = fn(self._params, self.cache, self.state,
                                     self.place(xs))
    return out

  def fetch(self, out: StepOutputs, num_pools: int) -> list[StepOutputs]:
    """Waits for a dispatched step's outputs; returns each pool's, on the host."""
    if not all(a.is_fully_addressable for a in jax.tree.leaves(out)):
      out = multihost_utils.process_allgather(out, tiled=True)  # several hosts
    out = jax.device_get(out)
    if self.mesh is None:
      return [out]
    return [jax.tree.map(lambda a, i=i: a[i], out) for i in range(num_pools)]
