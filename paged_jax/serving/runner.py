"""The device side of the engine: parameters, cache, block state, compiled steps.

`Runner` owns the arrays that live on the device(s) -- parameters, cache,
block state, the last sampled token and the sampling parameters of every
sequence slot (`slot_state.SlotState`, written only for the slots the
scheduler changed: `write_slots`) -- and one
compiled step per bucket (`buckets.py`, compiled ahead of time and shared by
engines of equal sizes through `compiler.py`). `dispatch` places a step's
host-built inputs (on a mesh: each process only its own devices' shards) and
launches the step without waiting; `fetch` brings a dispatched step's small
outputs to the host (on several hosts, gathered from every process first).
The cache, the block state and the last tokens are donated to every step, so
they are updated in place, and steps queue on the device in dispatch order.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import block_manager as bm
from paged_jax import host_tier
from paged_jax import prefix_tier
from paged_jax import kv_offload
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import sharding
from paged_jax.serving import compiler
from paged_jax.serving import pooled_step
from paged_jax.serving import shared_pool
from paged_jax.serving import window_pool
from paged_jax.serving import slot_state as slot_state_lib
from paged_jax.serving import step as step_lib
from paged_jax.serving import out_pack, swap_step
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.multistep_runner import DONATE as _DONATE, MultiStepPrograms
from paged_jax.serving.step import ModelDef, StepInputs, StepOutputs, device_step

_STATIC = ("decode_only", "num_logprobs")
_SWAP_DONATE = (2, 3, 4, 5)  # preemption by swap (`swap.py`): the host tier too
# The arrays a runner holds and passes to its programs (`Runner.arg_spec`).
_HELD = ("cache", "state", "tier", "last_tokens", "slots")

# The step variants written for one pool, on a 1x1 mesh's arrays (stacked
# per data shard, `[1, ...]`: `step.on_one_pool`).
_swap_step = step_lib.on_one_pool(swap_step.device_step, args=(3, 5, 6, 7),
                                  outs=(1, 3, 4))
_pooled_step = step_lib.on_one_pool(pooled_step.device_step, args=(3, 4, 5, 6),
                                    outs=(1, 2, 3))  # a hybrid model's pools
_shared_step = step_lib.on_one_pool(shared_pool.device_step, args=(3, 4, 5, 6),
                                    outs=(1, 2, 3))  # its one shared pool


def _bookkeeping_step(states, x, *, mesh, num_logprobs):
  """`step.bookkeeping_step` once per data shard (`step.over_pools`)."""
  return step_lib.over_pools(mesh, step_lib.bookkeeping_step, states, x,
                             num_logprobs=num_logprobs)


_bookkeeping_jit = jax.jit(out_pack.packs(_bookkeeping_step, per_pool=True),
                           donate_argnums=(0,),
                           static_argnames=("mesh", "num_logprobs"))
_pooled_bookkeeping_jit, _shared_bookkeeping_jit = (jax.jit(
    out_pack.packs(step_lib.on_one_pool(fn, args=(0, 1), outs=(0, 1)),
                   per_pool=True),
    donate_argnums=(0,), static_argnames=("num_logprobs",))
    for fn in (pooled_step.bookkeeping_step, shared_pool.bookkeeping_step))


def _shapes(xs) -> tuple:
  """The pools' inputs' leaf shapes and dtypes: what fixes a program."""
  return (len(xs),) + tuple((np.shape(a), np.asarray(a).dtype)
                            for a in jax.tree.leaves(xs[0]))


def _stack(*arrays) -> np.ndarray:
  """The pools' arrays (NumPy) stacked on a leading `[data]` axis (one: a
  view)."""
  return arrays[0][None] if len(arrays) == 1 else np.stack(arrays)


class Runner(MultiStepPrograms):
  """Device arrays and compiled steps of one engine.

  Args:
    model: a `ServingModel` (already laid out over `mesh` when one is given).
    config: the `EngineConfig`.
    blocks_per_seq: block-table width.
    max_seqs: sequence slots per pool.
    num_logprobs: top log-probs returned per sample row (static).
    mesh: optional `(data, model)` mesh; without one, a 1x1 mesh of the
      parameters' device (the same step serves both).
    initial_state: one pool's initial block state, every data shard's
      (`BlockState`, its `window` for reclamation, or on one device a
      hybrid model's `pooled_step.PooledState`: one cache per pool, the
      pooled step; or its `shared_pool.SharedState`: one cache of `G`
      layers, the shared step); default an empty plain pool.
  """

  def __init__(self, model, config, *, blocks_per_seq: int, max_seqs: int,
               num_logprobs: int, mesh: Mesh | None = None,
               initial_state=None):
    self.config = config
    self.num_logprobs = num_logprobs
    bs = config.block_size
    graphdef, params = nnx.split(model)
    self._model_def = ModelDef(graphdef, params)
    self._params = jax.tree.leaves(params)  # flat: cheap to pass every step
    self._xla_dots = compiler.xla_dots_suit(model)  # for its decode steps on CPU
    if mesh is not None:
      for what, on in (("preemption_mode='swap'", config.preemption_mode == "swap"),
                       ("kv_offloading_size > 0", config.kv_offloading_size)):
        if on:
          raise ValueError(f"{what} runs on one device, not a mesh")
    # One device is a 1x1 mesh of the device the parameters are on.
    self.mesh = mesh if mesh is not None else sharding.make_mesh(
        1, 1, devices=[_device_of(self._params)])
    data = self.mesh.shape[sharding.DATA]
    self._x_sharding = NamedSharding(self.mesh, P(sharding.DATA))
    # Each process places only its own devices' shards of the inputs.
    self._one_process = all(d.process_index == jax.process_index()
                            for d in self.mesh.devices.flat)
    initial = initial_state if initial_state is not None else bm.init(
        num_blocks=config.num_blocks, block_size=bs, max_seqs=max_seqs,
        max_blocks_per_seq=blocks_per_seq,
        prefix_caching=config.enable_prefix_caching)
    # Every data shard's state, last tokens and slot state, stacked.
    self.state = self._per_shard(initial)
    self.cache = self._make_cache(model, data)
    self.last_tokens = self._per_shard(jnp.zeros(max_seqs, jnp.int32))
    self.slots = self._per_shard(slot_state_lib.empty(max_seqs, config.max_logit_bias))
    # (out_shardings: jit would give empty fields, e.g. no logit bias, none)
    self._write_slots_jit = jax.jit(jax.vmap(slot_state_lib.write),
                                    donate_argnums=(0,),
                                    out_shardings=self._x_sharding)
    if self._pooled():
      self._step_fn, self._donate = _pooled_step, _DONATE
    elif self._shared():
      self._step_fn, self._donate = _shared_step, _DONATE
    else:
      self._step_fn, self._donate = functools.partial(
          device_step, mesh=self.mesh), _DONATE
    self.tier = self.host_cache = None  # preemption by swap (`swap.py`)
    if config.preemption_mode == "swap":
      self.tier = host_tier.init(initial, num_host_blocks=config.swap_space_blocks)
      self.host_cache = kv_offload.host_cache(self.cache, config.swap_space_blocks)
      self._step_fn, self._donate = _swap_step, _SWAP_DONATE
    # The prefix cache's host level (`prefix_offload.py`): `host_cache` is a
    # `kv_offload.NumpyHostPool` then (swap's is a `KVCache` in host memory).
    self.prefix_host_blocks = 0
    if config.kv_offloading_size:
      self.prefix_host_blocks = prefix_tier.num_host_blocks(
          config.kv_offloading_size, self.cache.bytes_per_block)
      self.host_cache = kv_offload.NumpyHostPool(self.cache, self.prefix_host_blocks)
    self._remember_shardings(_HELD)
    # What fixes the executables besides the bucket (`compiler.signature`;
    # `max_logit_bias` is the width of two step inputs): engines of equal
    # keys share them, trace-checked or not.
    self._key = (self._model_def, self.mesh, num_logprobs, config.max_logit_bias,
                 self._signature())
    # With `config.check_traces`, each program's key part as first asked
    # (`compiler.check_traced_once`).
    self._traced: dict | None = {} if config.check_traces else None
    self._steps: dict[Bucket, jax.stages.Compiled] = {}
    # K-step decode programs (`multistep.py`, one device only), by (bucket, K).
    self._multi: dict[tuple[Bucket, int], jax.stages.Compiled] = {}
    self.compile_seconds = 0.0  # spent compiling in this runner
    self.slot_writes = 0  # `write_slots` dispatches (tests: none when steady)
    self._slot_writers: dict[int, jax.stages.Compiled] = {}  # by row count
    # The bookkeeping-only step (`dispatch_bookkeeping`), by input shapes.
    self._bookkeepers: dict[tuple, jax.stages.Compiled] = {}
    self.moved = [0, 0]  # blocks copied to / from host memory, not yet taken

  def _per_shard(self, tree):
    """`tree` (one pool's arrays) repeated for every data shard on a leading
    axis, placed over `data`."""
    data = self.mesh.shape[sharding.DATA]
    return jax.tree.map(
        lambda a: jax.device_put(jnp.broadcast_to(a, (data,) + a.shape),
                                 self._x_sharding), tree)

  def _make_cache(self, model, data: int):
    """The model's cache (a hybrid model's: one per pool), `data` shards'
    pools in all, created in place sharded `sharding.cache_spec()`: no device
    ever holds more than its own part."""
    config = self.config
    if self._pooled():
      make = lambda: window_pool.make_caches(  # noqa: E731
          model.config, [s.num_blocks for s in self.state.states],
          block_size=config.block_size, dtype=config.cache_dtype)
    elif self._shared():
      make = lambda: shared_pool.make_cache(  # noqa: E731
          model.config, self.state.num_blocks, block_size=config.block_size,
          dtype=config.cache_dtype)
    else:
      make = lambda: model.make_cache(  # noqa: E731
          data * config.num_blocks, config.block_size, config.cache_dtype)
    out = jax.tree.map(lambda a: NamedSharding(self.mesh, sharding.spec_of(a)),
                       jax.eval_shape(make))
    return jax.jit(make, out_shardings=out)()

  @property
  def pool_state(self):
    """The block state of the first (on one device, the only) data shard."""
    return jax.tree.map(lambda a: a[0], self.state)

  def _jit_for(self, bucket: Bucket):
    """The jitted step to lower for `bucket`, named after it
    (`decode_step_4x4`, `mixed_step_16x4`: JAX's compile logs, XLA's dumps
    and profiles name the program by it)."""
    step_fn = out_pack.packs(self._step_fn, per_pool=True)

    def step(model_def, params, *args, decode_only, num_logprobs):
      return step_fn(model_def, params, *args, decode_only=decode_only,
                     num_logprobs=num_logprobs)
    kind = "decode" if bucket.decode_only else "mixed"
    step.__name__ = f"{kind}_step_{bucket.num_tokens}x{bucket.num_seqs}"
    return jax.jit(step, static_argnums=(0,), donate_argnums=self._donate,
                   static_argnames=_STATIC)

  def replace_pool(self, config, state: bm.BlockState, cache: kv_cache_lib.KVCache):
    """A resized pool (`resize.resize_pool`, one device): its config, state
    (one pool's) and cache; every compiled step is dropped (the pool's size
    is in their shapes)."""
    self.config, self.state = config, self._per_shard(state)
    self.cache = sharding.shard_cache(cache, self.mesh)
    # Only the pool's arrays are new: the others keep the shardings they
    # were made with (a step returns `last_tokens` spelled otherwise), so a
    # pool resized back to an earlier size has that size's key again and
    # reuses its programs.
    self._remember_shardings(("cache", "state"))
    self._steps.clear()
    self._multi.clear()
    self._bookkeepers.clear()
    for name in ("_spec_steps", "_spec_loops"):  # `spec_step`'s, `spec_loop`'s
      self.__dict__.pop(name, None)
    self._key = self._key[:-1] + (self._signature(),)

  def _pooled(self) -> bool:
    """A hybrid model's pool per window (`pooled_step.PooledState`)."""
    return isinstance(self.state, pooled_step.PooledState)

  def _shared(self) -> bool:
    """A hybrid model's one pool for every layer group
    (`shared_pool.SharedState`)."""
    return isinstance(self.state, shared_pool.SharedState)

  def _donated_names(self) -> tuple[str, ...]:
    """The arrays donated to every step, in the step's argument order (then
    the slot state, read only)."""
    if self.tier is None:
      return "cache", "state", "last_tokens"
    return "cache", "state", "tier", "last_tokens"

  def _donated(self) -> tuple:
    return tuple(getattr(self, n) for n in self._donated_names())

  def _remember_shardings(self, names: tuple[str, ...]):
    """Keeps the shardings the runner's arrays `names` (of `_HELD`) were
    made with (see `arg_spec`)."""
    made_with = getattr(self, "_made_with", {})
    self._made_with = {**made_with, **{
        n: [getattr(a, "sharding", None) for a in jax.tree.leaves(getattr(self, n))]
        for n in names}}

  def _signature(self) -> tuple:
    """The part of `_key` that the held arrays fix: their shapes, dtypes
    and the shardings they were made with (`arg_spec`), not those a step
    returned them with."""
    return compiler.signature(self._params, self.arg_spec("cache"),
                              self.arg_spec("state"), self.arg_spec("last_tokens"),
                              self.arg_spec("tier"))

  def arg_spec(self, name: str):
    """The runner's array `name` (one of `_HELD`) as the abstract value a
    program lowers with: its shapes and dtypes, and the shardings it was
    made with. The arrays a step returns have equivalent shardings that may
    be spelled otherwise (on a 1x1 mesh, an empty spec): lowered as they
    are, a program compiled on first use after other steps would be
    another XLA module (another persistent-cache key) than `Engine.warmup`'s
    of the same shapes."""
    leaves, treedef = jax.tree.flatten(getattr(self, name))
    return treedef.unflatten([compiler.spec(a, s) for a, s in
                              zip(leaves, self._made_with[name], strict=True)])

  def write_slots(self, updates: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Writes the changed rows of each pool's slot state (`HostSlots.
    take_updates`, one per pool, all of one row count) to the device: one
    small scatter, the slot state donated, dispatched before the step that
    reads them (it does not wait). Its program is compiled once per row
    count (a power of two; `compile_slot_writes`, timed apart)."""
    self.slot_writes += 1
    cols = self._put(tuple(_stack(*[u[i] for u in updates]) for i in range(3)))
    rows = cols[0].shape[1]
    if rows not in self._slot_writers:
      self.compile_slot_writes((rows,))
    self.slots = self._slot_writers[rows](self.slots, *cols)

  def compile_jobs(self, jobs: dict, **kw) -> tuple[dict, float]:
    """`compiler.compile_all(jobs, **kw)` for this runner's programs (keys
    `(self._key, *program)`), with `config.check_traces` first checking
    that none would be traced a second time (`compiler.check_traced_once`;
    raises AssertionError)."""
    if self._traced is not None:
      compiler.check_traced_once(self._traced, jobs)
    return compiler.compile_all(jobs, **kw)

  def compile_slot_writes(self, sizes: tuple[int, ...] | None = None) -> float:
    """Compiles the slot-state scatter for each row count in `sizes`
    (default: every power of two up to `max_seqs`) not compiled yet, through
    `compiler.compile_all` (shared by engines of equal sizes); runs nothing.
    Returns the seconds spent (added to `compile_seconds`)."""
    max_seqs = self.slots.temperature.shape[-1]
    if sizes is None:
      sizes = tuple(1 << i for i in range((max_seqs - 1).bit_length() + 1))
    widths = slot_state_lib.packed_widths(self.config.max_logit_bias)
    data = self.mesh.shape[sharding.DATA]

    def lowerer(u):
      specs = [jax.ShapeDtypeStruct((data, u) + shape, dtype, sharding=self._x_sharding)
               for shape, dtype in (((), np.int32), ((widths[0],), np.int32),
                                    ((widths[1],), np.float32))]
      return lambda: self._write_slots_jit.lower(self.slots, *specs)
    jobs = {(self._key, "slots", u): lowerer(u) for u in sizes
            if u not in self._slot_writers}
    done, seconds = self.compile_jobs(jobs)
    for (_, _, u), exe in done.items():
      self._slot_writers[u] = exe
    self.compile_seconds += seconds
    return seconds

  def _no_swaps(self):
    n = self.config.max_batch
    none = np.full(n, -1, np.int32)
    return swap_step.SwapInputs(swap_out=none, swap_in=none, drop=none)

  def _specs(self, xs: list[StepInputs]) -> StepInputs:
    """The abstract step inputs of the pools' inputs `xs` (see `place`)."""
    return jax.tree.map(
        lambda *a: compiler.spec(_stack(*a), self._x_sharding), *xs)

  def _lowerer(self, bucket: Bucket, xs: list[StepInputs]):
    specs = (self._specs(xs),)
    if self.tier is not None:
      specs += (jax.tree.map(compiler.spec, self._no_swaps()),)
    held = [self.arg_spec(n) for n in self._donated_names() + ("slots",)]
    return lambda: self._jit_for(bucket).lower(
        self._model_def, self._params, *held, *specs,
        decode_only=bucket.decode_only, num_logprobs=self.num_logprobs)

  def compile(self, inputs: dict[Bucket, list[StepInputs]]) -> float:
    """Compiles the step of every bucket in `inputs` (`{bucket: the pools'
    inputs of that shape}`, e.g. all padding) that this process has not
    compiled yet, in parallel; runs nothing. Returns the seconds spent."""
    jobs = {(self._key, b): self._lowerer(b, xs) for b, xs in inputs.items()
            if b not in self._steps}
    # Only decode steps take the CPU dots option (`compiler.compiler_options`);
    # a mixed step of as few rows ran faster with XLA's defaults.
    done, seconds = self.compile_jobs(
        jobs, rows=self._decode_rows({k: k[1] for k in jobs if k[1].decode_only}))
    for (_, b), exe in done.items():
      self._steps[b] = exe
    self.compile_seconds += seconds
    return seconds

  @property
  def compiled_buckets(self) -> tuple[Bucket, ...]:
    """The buckets whose step this runner holds, smallest first."""
    return tuple(sorted(self._steps))

  def place(self, xs: list[StepInputs]) -> StepInputs:
    """The pools' inputs as the step's argument: stacked on a leading
    `[data]` axis (see `_put`)."""
    return self._put(jax.tree.map(_stack, *xs))

  def _put(self, tree):
    """`tree`'s NumPy arrays `[data, ...]` as step arguments: as they are in
    one process (the executable puts each data shard on its devices); on
    several hosts every process builds the same arrays and places only the
    shards its own devices hold."""
    if self._one_process:
      return tree
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, self._x_sharding,
                                               lambda i: a[i]), tree)

  def lower(self, bucket: Bucket, xs: list[StepInputs]) -> jax.stages.Lowered:
    """The step of `bucket`, lowered for inspection; runs nothing."""
    return self._lowerer(bucket, xs)()

  def dispatch(self, bucket: Bucket, xs: list[StepInputs], swaps=None
               ) -> StepOutputs:
    """Launches the step on the pools' inputs (compiling it first if needed);
    returns its outputs, still on the device (this does not wait: steps queue
    on the device in dispatch order). `swaps`: with preemption by swap, the
    scheduler's `take_swaps()` (the copies are dispatched first)."""
    exe = self._steps.get(bucket)
    if exe is None:
      self.compile({bucket: xs})
      exe = self._steps[bucket]
    if self.tier is None:
      self.cache, self.state, self.last_tokens, out = exe(
          self._params, self.cache, self.state, self.last_tokens, self.slots,
          self.place(xs))
      return out
    s = self._no_swaps()
    if swaps is not None:
      s, moved_out, moved_in = swaps
      self.cache, self.host_cache, moved = swap_step.dispatch_copies(
          self.cache, self.host_cache, moved_out, moved_in)
      self.moved = [a + b for a, b in zip(self.moved, moved)]
    self.cache, self.state, self.tier, self.last_tokens, out, _ = exe(
        self._params, self.cache, self.state, self.tier, self.last_tokens,
        self.slots, self.place(xs), s)
    return out

  def copy_prefix_blocks(self, copies) -> None:
    """Dispatches a step's prefix-cache host-level copies
    (`prefix_offload.Copies`; None: nothing): the stores (device to host)
    first, then the loads; call it before dispatching the step. Pairs are
    padded to a power of two (`swap_step.copy_pairs`: few compiled sizes)."""
    if copies is None:
      return
    pool = self.host_cache
    pool.flush()  # the earlier steps' stores (their gathers have run)
    src, dst, n_out = swap_step.copy_pairs(copies.out.src, copies.out.dst)
    if n_out:
      pool.store(self.cache, src, dst[:n_out])
    src, dst, n_in = swap_step.copy_pairs(copies.back.src, copies.back.dst)
    if n_in:
      self.cache = pool.load(self.cache, src, dst)
    self.moved = [self.moved[0] + n_out, self.moved[1] + n_in]

  def compile_prefix_copies(self, max_loads: int, max_stores: int) -> None:
    """Runs each copy once at every padded size up to its most blocks
    (`prefix_offload.max_loads` / `max_stores`; all pairs -1: nothing
    moves), so that no step compiles one."""
    if not self.prefix_host_blocks:
      return
    t = time.perf_counter()
    m = 1
    while m <= max(max_loads, max_stores):
      none = np.full(m, -1, np.int32)
      if m <= max_stores:
        self.host_cache.store(self.cache, none, none[:0])
      if m <= max_loads:
        self.cache = self.host_cache.load(self.cache, none, none)
      m *= 2
    self.host_cache.flush()
    jax.block_until_ready(self.cache)
    self.compile_seconds += time.perf_counter() - t

  def take_moved_bytes(self) -> tuple[int, int]:
    """Bytes copied device -> host and host -> device by the copies
    dispatched since the last call (real blocks x `KVCache.bytes_per_block`)."""
    (out, back), self.moved = self.moved, [0, 0]
    if not (out or back):
      return 0, 0
    per_block = self.cache.bytes_per_block
    return out * per_block, back * per_block

  def compile_bookkeeping(self, xs: list[StepInputs]) -> float:
    """Compiles the bookkeeping-only step (`dispatch_bookkeeping`) for the
    pools' inputs `xs` (e.g. all padding, of the bucket an empty plan
    picks), unless compiled already; runs nothing. Returns the seconds spent
    (added to `compile_seconds`). Not with preemption by swap."""
    shape = _shapes(xs)
    if self.tier is not None or shape in self._bookkeepers:
      return 0.0
    key = (self._key, "bookkeeping", shape)
    done, seconds = self.compile_jobs({key: self._bookkeeping_lowerer(xs)})
    self._bookkeepers[shape] = done[key]
    self.compile_seconds += seconds
    return seconds

  def _bookkeeping_lowerer(self, xs: list[StepInputs]):
    specs, state = self._specs(xs), self.arg_spec("state")
    if self._pooled() or self._shared():
      jitted = _pooled_bookkeeping_jit if self._pooled() else _shared_bookkeeping_jit
      return lambda: jitted.lower(state, specs, num_logprobs=self.num_logprobs)
    return lambda: _bookkeeping_jit.lower(
        state, specs, mesh=self.mesh, num_logprobs=self.num_logprobs)

  def dispatch_bookkeeping(self, xs: list[StepInputs]) -> StepOutputs:
    """Launches the bookkeeping of a step with no entries
    (`step.bookkeeping_step`: its releases, registrations and forks, no
    model; compiled first if `Engine.warmup` did not, counted in
    `compile_seconds`); returns its outputs, still on the device. Not with
    preemption by swap (`Engine` runs such a step as an ordinary one)."""
    if self.tier is not None:
      raise ValueError("a bookkeeping-only step does not carry swaps")
    shape = _shapes(xs)  # (no stacked copy just to look up the program)
    if shape not in self._bookkeepers:
      self.compile_bookkeeping(xs)
    self.state, out = self._bookkeepers[shape](self.state, self.place(xs))
    return out

  def fetch(self, out: StepOutputs, num_pools: int, *, top: bool = True
            ) -> list[StepOutputs]:
    """Waits for a dispatched step's outputs; returns each pool's, on the
    host. `top`: also the top log-probs and their ids (beam search and
    requests with `SamplingParams.logprobs` need them; otherwise they stay
    on the device, `None` here)."""
    if not self._one_process:  # several hosts: every process gets it all
      out = multihost_utils.process_allgather(out, tiled=True)
    return out_pack.fetch(out, top=top, pools=num_pools)


def _device_of(params) -> jax.Device:
  """The device of the parameters (all on one), or the default device."""
  for a in params:
    devices = getattr(a, "devices", lambda: ())()
    if len(devices) == 1:
      return next(iter(devices))
  return jax.devices()[0]
