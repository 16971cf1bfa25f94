"""A continuous-batching engine over the paged KV cache.

Each `Engine.step()`:

1. schedules on the host (`scheduler.py`, one `Scheduler` per pool);
2. picks the step's shape: the smallest bucket (`buckets.py`) holding the
   real work, a decode bucket when every entry runs one token;
3. runs ONE jitted device step (`step.py`, through `runner.py`) with the
   cache and block state donated: release -> fork -> reserve -> copy-on-write
   -> `step_metadata` -> `model.paged_forward` -> logits of the rows to
   sample -> sampling and top log-probs;
4. applies the results: appends tokens, finishes sequences (EOS or budget),
   and queues their blocks for release at the start of the next step.

Each bucket compiles once (`warmup()` compiles them all up front); shapes
never depend on the requests in flight beyond the bucket chosen.

One source of truth for blocks: the block manager's pure functions. The
step's bookkeeping (`step.bookkeeping`: release -> fork -> release ->
reserve) is one function; the device runs it inside the step, and each
`Scheduler` runs it first on its host mirror of the pool's `BlockState` (on
the host CPU) with the very same inputs. The block manager is deterministic,
so the mirror and the device state stay identical, and the scheduler plans
admissions and preemptions from the mirror's exact answers (`Scheduler._fit`:
a refused entry makes it take back admissions or preempt, then it runs the
bookkeeping again). No block count, sharing or copy-on-write rule is
re-derived on the host; the device's `ok` is only checked to be all true.
Releases of finished sequences travel to the device with the next step
(after its forks when a finished parent's children fork in it).

On a `(data, model)` device mesh (`Engine(..., mesh=...)`) the model is
tensor-parallel and each data shard is a replica with its own pool and its
own `Scheduler`; one jitted step (`step.mesh_device_step`) serves them all.

With `static_batching=True` and `block_size == max_model_len` the same engine
is a contiguous max-length cache with static batching (the baseline paging is
compared against): every sequence reserves one max-length slot, and new
requests start only when the whole batch has finished.

The engine serves any model implementing `protocol.ServingModel`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from jax.sharding import Mesh

from paged_jax import block_manager as bm
from paged_jax import sharding
from paged_jax.serving import buckets as buckets_lib
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.protocol import ServingModel
from paged_jax.serving.requests import Request, RequestDelta, RequestOutput
from paged_jax.serving.runner import Runner
from paged_jax.serving.scheduler import Scheduler
from paged_jax.serving.stats import EngineStats


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine sizes (they fix the compiled shapes).

  Attributes:
    num_blocks: physical KV blocks in the pool.
    block_size: tokens per block.
    max_batch: sequences per step (rows of the largest decode step).
    max_tokens_per_step: token rows of the largest mixed (prefill) step;
      >= max_batch.
    max_model_len: longest prompt + output; default the model's
      `max_position_embeddings` capped at the pool size.
    max_beam_width: largest beam width served (fixes the log-prob rows).
    static_batching: admit only when nothing runs (the contiguous baseline).
    cache_dtype: KV dtype name, default the model's.
    min_bucket: smallest step shape (`buckets.py`): steps are padded to the
      powers of two (and midpoints) from `min_bucket` up to `max_batch`
      (decode), from `max(min_bucket, max_batch)` up to
      `max_tokens_per_step` (mixed). Set it to
      `max_tokens_per_step` for the two fixed shapes of old (every step
      padded to the largest).
    bucket_midpoints: also the 1.5x midpoints between powers of two (less
      padding, about twice the shapes to compile).
    check_traces: compile this engine's own step functions wrapped in
      `chex.assert_max_traces(n=1)` (tests; call `chex.clear_trace_counter()`
      before building a second such engine). Otherwise engines share one
      jitted step, so engines of equal sizes compile once per process.
  """

  num_blocks: int
  block_size: int = 16
  max_batch: int = 16
  max_tokens_per_step: int = 128
  max_model_len: int | None = None
  max_beam_width: int = 1
  static_batching: bool = False
  cache_dtype: str | None = None
  min_bucket: int = 1
  bucket_midpoints: bool = True
  check_traces: bool = False

  def __post_init__(self):
    for name in ("num_blocks", "block_size", "max_batch", "max_tokens_per_step",
                 "max_beam_width", "min_bucket"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.max_tokens_per_step < self.max_batch:
      raise ValueError(f"max_tokens_per_step={self.max_tokens_per_step} must be >= "
                       f"max_batch={self.max_batch} so every decode fits a step")
    if self.max_model_len is not None and self.max_model_len < 2:
      raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
    if self.max_beam_width > self.max_batch:
      raise ValueError(f"max_beam_width={self.max_beam_width} must be <= "
                       f"max_batch={self.max_batch}")

  @property
  def buckets(self) -> tuple[Bucket, ...]:
    """Every step shape this engine may compile (`buckets.bucket_set`)."""
    return buckets_lib.bucket_set(self.max_batch, self.max_tokens_per_step,
                                  self.min_bucket, self.bucket_midpoints)


class Engine:
  """Continuous batching over a paged KV cache (see the module docstring).

  On a `(data, model)` mesh (`mesh=paged_jax.sharding.make_mesh(...)`) the
  model is laid out tensor-parallel over `model` (`model.shard(mesh)`) and
  every data shard is a replica with its own pool of `config.num_blocks`
  blocks, its own block state and `config.max_batch` sequences: `EngineConfig`
  sizes are per data shard. Requests go to the data shard with the fewest
  unfinished requests; one jitted step runs every shard at once.

  Several hosts (after `jax.distributed.initialize`): every process runs the
  same program with the same requests in the same order, so every process
  keeps the same (deterministic) host schedule; each places only its own
  devices' shards of the step inputs and reads back the step's small
  outputs. The weights, cache and block states stay where the mesh puts them.

  Example:
    >>> model = init_model(LlamaConfig.tiny())
    >>> engine = Engine(model, EngineConfig(num_blocks=64))
    >>> engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    >>> outputs = engine.run_until_done()
  """

  def __init__(self, model: ServingModel, config: EngineConfig,
               mesh: Mesh | None = None):
    self.config = config
    self.mesh = mesh
    if mesh is not None:
      model = model.shard(mesh)
    self.model_config = model.config
    bs = config.block_size
    max_len = config.max_model_len or min(model.config.max_position_embeddings,
                                          config.num_blocks * bs)
    self.max_model_len = max_len
    self.max_seqs = 2 * config.max_batch
    # Top log-probs returned per sample row: 2 * beam width candidates, at
    # least 8 so that beam widths up to 4 share one compiled step.
    self.num_logprobs = min(max(8, 2 * config.max_beam_width),
                            model.config.vocab_size)
    self.stats = EngineStats()
    self.buckets = config.buckets
    data = 1 if mesh is None else mesh.shape[sharding.DATA]
    blocks_per_seq = -(-max_len // bs)
    initial = bm.init(num_blocks=config.num_blocks, block_size=bs,
                      max_seqs=self.max_seqs,
                      max_blocks_per_seq=blocks_per_seq)
    self._pools = [Scheduler(config, model.config, max_len, self.stats, initial)
                   for _ in range(data)]
    self._runner = Runner(model, config, blocks_per_seq=blocks_per_seq,
                          max_seqs=self.max_seqs, num_logprobs=self.num_logprobs,
                          mesh=mesh)

  # ----------------------------------------------------------------- requests

  def add_request(self, request: Request) -> RequestOutput | None:
    """Queues `request` (on the data shard with the fewest unfinished
    requests), or rejects it if it can never be served.

    Returns:
      None when accepted; a `RequestOutput` with `rejected` set otherwise
      (also returned by the next `step` or `run_until_done`).
    """
    pool = min(self._pools, key=lambda p: p.num_running + p.num_waiting)
    return pool.add_request(request)

  def has_unfinished(self) -> bool:
    return any(p.has_unfinished() for p in self._pools)

  def abort_request(self, request_id) -> bool:
    """Drops a waiting or running request (a client went away): its sequences
    leave the queues and their blocks are released by the next step (`flush`
    when idle). Its `RequestOutput` (finish reason "abort") comes from the
    next `step` / `take_deltas`. False if unknown or already finished."""
    return any(p.abort_request(request_id) for p in self._pools)

  def stop_sequence(self, request_id, index: int = 0) -> bool:
    """Finishes sample `index` of a running request now (finish reason
    "stop": a stop string the host matched); blocks go back next step.
    False if there is no such live sequence (or it is a beam search)."""
    return any(p.stop_sequence(request_id, index) for p in self._pools)

  @property
  def num_running(self) -> int:
    return sum(p.num_running for p in self._pools)

  @property
  def num_waiting(self) -> int:
    return sum(p.num_waiting for p in self._pools)

  @property
  def data_shards(self) -> int:
    """Data shards (block pools): the mesh's data axis, 1 without a mesh."""
    return len(self._pools)

  @property
  def block_state(self):
    """The `BlockState` (on a mesh: the data shards' states, stacked)."""
    return self._runner.state

  @property
  def cache(self):
    """The `KVCache` (donated to every step: do not hold on to it)."""
    return self._runner.cache

  @property
  def compiled_buckets(self) -> tuple[Bucket, ...]:
    """The buckets this engine has run (each compiled once)."""
    return self._runner.compiled_buckets

  def usage(self) -> dict:
    """Blocks used / total, running and waiting sequences (from the last
    step), summed over the data shards."""
    total = {}
    for p in self._pools:
      for k, v in p.usage().items():
        total[k] = total.get(k, 0) + v
    return total

  # ------------------------------------------------------------------- a step

  def _largest(self, decode_only: bool) -> Bucket:
    return [b for b in self.buckets if b.decode_only == decode_only][-1]

  def lower_step(self, decode_only: bool, bucket: Bucket | None = None
                 ) -> "jax.stages.Lowered":
    """The jitted step of one shape (default: the largest of its kind),
    lowered for inspection (`.as_text()`, `.compile().as_text()`,
    `.cost_analysis()`); runs nothing."""
    bucket = bucket or self._largest(decode_only)
    xs = [p._build([], bucket)[0] for p in self._pools]  # pylint: disable=protected-access
    return self._runner.lower(bucket, xs)

  def _bucket(self, plans) -> Bucket:
    decode_only = all(n == 1 for plan in plans for _, n in plan)
    work = [Scheduler.work(plan) for plan in plans]
    return buckets_lib.choose(
        self.buckets, num_tokens=max(t for t, _ in work),
        num_seqs=max(s for _, s in work), decode_only=decode_only)

  def step(self) -> list[RequestOutput]:
    """Runs one engine step; returns the requests that finished (or were
    rejected) since the last call."""
    t0 = time.perf_counter()
    plans = [p.begin_step() for p in self._pools]
    if all(plan is None for plan in plans):
      return self._take_outputs()
    plans = [plan or [] for plan in plans]
    bucket = self._bucket(plans)
    built = [p.build_step(plan, bucket) for p, plan in zip(self._pools, plans)]
    t1 = time.perf_counter()
    pending = self._runner.dispatch(bucket, [x for x, _ in built])
    outs = self._runner.fetch(pending, len(self._pools))
    t2 = time.perf_counter()
    for (_, apply), out in zip(built, outs):
      apply(out, t2)
    self._count(bucket)
    for p in self._pools:
      p.end_step()
    st = self.stats
    st.device_seconds += t2 - t1
    st.decode_device_seconds += (t2 - t1) * bucket.decode_only
    st.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
    return self._take_outputs()

  def _count(self, bucket: Bucket):
    st = self.stats
    st.steps += 1
    st.decode_steps += bucket.decode_only
    st.mixed_steps += not bucket.decode_only
    st.padded_rows += bucket.num_tokens * len(self._pools)
    key = (bucket.num_tokens, bucket.num_seqs, bucket.decode_only)
    st.buckets[key] = st.buckets.get(key, 0) + 1
    usage = self.usage()
    st.blocks_used.add(usage["blocks_used"])
    st.running.add(usage["running"])
    st.waiting.add(usage["waiting"])

  def warmup(self, buckets: tuple[Bucket, ...] | None = None):
    """Compiles the step of every bucket (default: all of `self.buckets`)
    with all-padding inputs (changes nothing).

    Raises:
      RuntimeError: if the engine is not idle.
    """
    if self.has_unfinished() or any(p.has_releases() for p in self._pools):
      raise RuntimeError("warmup() needs an idle engine")
    for p in self._pools:
      p.warmup()
    for bucket in buckets or self.buckets:
      xs = [p.build_step([], bucket)[0] for p in self._pools]
      self._runner.fetch(self._runner.dispatch(bucket, xs), len(self._pools))

  def _take_outputs(self):
    outs = []
    for p in self._pools:
      outs += p.take_outputs()
    return outs

  def stream_deltas(self, enabled: bool = True):
    """Starts (or stops) keeping per-token `RequestDelta`s for `take_deltas`."""
    for p in self._pools:
      p.collect_deltas = enabled

  def take_deltas(self) -> list[RequestDelta]:
    """The `RequestDelta`s since the last call (see `stream_deltas`)."""
    out = []
    for p in self._pools:
      out += p.take_deltas()
    return out

  def run_until_done(self, max_steps: int = 1_000_000,
                     on_step: Callable[["Engine", list], None] | None = None
                     ) -> list[RequestOutput]:
    """Steps until every request has finished; returns all outputs."""
    outputs = self._take_outputs()
    for _ in range(max_steps):
      if not self.has_unfinished():
        break
      done = self.step()
      outputs += done
      if on_step is not None:
        on_step(self, done)
    else:
      raise RuntimeError(f"requests still unfinished after {max_steps} steps")
    self.flush()
    return outputs

  def flush(self):
    """Runs the releases still queued (so the pool is empty when idle)."""
    if any(p.has_releases() for p in self._pools):
      self.step()
