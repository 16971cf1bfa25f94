"""A continuous-batching engine over the paged KV cache.

Each `Engine.step()`:

1. schedules on the host (`scheduler.py`, one `Scheduler` per pool);
2. picks the step's shape: the smallest bucket (`buckets.py`) holding the
   real work, a decode bucket when every entry runs one token;
3. runs ONE jitted device step (`step.py`, through `runner.py`) with the
   cache and block state donated: release -> fork -> reserve -> copy-on-write
   -> `step_metadata` -> `model.paged_forward` -> logits of the rows to
   sample -> sampling and top log-probs, with each sequence slot's sampling
   parameters kept on the device (`slot_state.py`: written when a sequence
   takes a slot, so a steady decode step sends none of them); a step with
   nothing to compute (only releases, e.g. after the last sequences
   finished) runs its bookkeeping alone, no model;
4. applies the results: appends tokens, finishes sequences (EOS or budget),
   and queues their blocks for release at the start of the next step.

Each bucket compiles once per process (`warmup()` compiles them all up
front, concurrently; otherwise each on first use, timed apart); shapes never
depend on the requests in flight beyond the bucket chosen.

Steps are asynchronous (`EngineConfig.async_scheduling`, on by default): the
host commits a step as soon as it is built -- the tokens it will sample are
`PENDING`, the device keeps them per sequence slot and the next step reads
them there -- so step N+1 is scheduled, built and dispatched while step N
runs, and step N's results are applied after that dispatch.

One source of truth for blocks: the block manager's pure functions. The
step's bookkeeping (`step.bookkeeping`: register -> release -> fork ->
release -> share -> reserve) is one function the device runs inside the
step; each `Scheduler` first applies the same transitions, with the very
same inputs, to an exact NumPy model of its pool (`host_pool.HostPool`,
proven equal to `block_manager` by a model-based test), so planning never
runs or waits for anything on the device. The scheduler plans admissions and
preemptions from the model's exact answers (`Scheduler._fit`: a refused
entry makes it roll the trial back, take back admissions or preempt, and try
again). The device's `ok` masks and a fingerprint of its block state are
checked against the model's when a step's results arrive.
Releases of finished sequences travel to the device with the next step
(after its forks when a finished parent's children fork in it).

Prefix caching (`EngineConfig.enable_prefix_caching`). Each `Scheduler`
keeps a host index (`paged_jax.prefix_cache.PrefixIndex`) from chained,
keyed block hashes (salted by `Request.cache_salt`) to physical blocks. A
sequence's full blocks are registered (`block_manager.register`) by the first
step after their K/V were written, or by the step that releases them; a
released registered block stays cached (its K/V kept) until an allocation
evicts it, least recently released first. At admission a sequence looks up
the longest cached prefix of its tokens (its last token always computed) and
starts on those blocks (`block_manager.share`, before this step's reserve so
they cannot be evicted under it), skipping their prefill. Register and share
run inside the step's bookkeeping (register -> release -> fork -> release ->
share -> reserve), so the host model decides them exactly as the device
does; the index inserts what this step registers and drops what the model's reserve
reports evicted, so no entry ever points at a reused block. Blocks whose
tokens are still in flight (the last block of an asynchronous step) are not
hashed until the tokens arrive; a sequence released before then leaves that
block uncached.

On a `(data, model)` device mesh (`Engine(..., mesh=...)`) the model is
tensor-parallel and each data shard is a replica with its own pool and its
own `Scheduler`; one jitted step (`step.device_step`) serves them all. With
no mesh the same step runs on a 1x1 mesh of the model's device.

With `static_batching=True` and `block_size == max_model_len` the same engine
is a contiguous max-length cache with static batching (the baseline paging is
compared against): every sequence reserves one max-length slot, and new
requests start only when the whole batch has finished.

The engine serves any model implementing `protocol.ServingModel`.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
from jax.sharding import Mesh

from paged_jax import block_manager as bm
from paged_jax import sharding
from paged_jax.serving import buckets as buckets_lib
from paged_jax.serving import out_pack, prefix_offload, slot_state
from paged_jax.serving import resize as resize_lib
from paged_jax.serving import reclamation
from paged_jax.serving import window_pool
from paged_jax.serving import spec_draft, spec_host, spec_loop_host
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.config import EngineConfig  # re-exported: its home before
from paged_jax.serving.protocol import ServingModel
from paged_jax.serving.requests import Request, RequestDelta, RequestOutput
from paged_jax.serving.runner import Runner
from paged_jax.serving.scheduler import Pending, Scheduler
from paged_jax.serving.stats import EngineStats
from paged_jax.serving.step import StepOutputs


class InFlight(NamedTuple):
  """A dispatched step whose results have not been applied yet."""

  out: StepOutputs  # on the device
  pending: list[Pending]  # each pool's
  has_beam: bool  # beam rows: their groups wait for the results
  wants_top: bool  # beam rows, or rows that asked for top log-probs
  bucket: Bucket | None  # None: a bookkeeping-only step (no entries)
  multi: list | None = None  # a K-step dispatch: each pool's MultiStepPending


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
    spec_host.check_mesh(config, mesh)
    if mesh is not None:
      model = model.shard(mesh)
    # A draft model is served with the target: one pool, both caches.
    model = spec_draft.attach(model, config.speculative_config)
    self.model_config = model.config
    bs = config.block_size
    max_len = reclamation.max_model_len(
        config.max_model_len, min(model.config.max_position_embeddings,
                                  config.num_blocks * bs), model.config)
    self.max_model_len = max_len
    self.max_seqs = 2 * config.max_batch
    # Top log-probs computed per sample row: 2 * beam width candidates, and
    # at least the `max_logprobs` requests may ask for (8 by default, so
    # that beam widths up to 4 share one compiled step).
    self.num_logprobs = max(1, min(max(config.max_logprobs, 2 * config.max_beam_width),
                                   model.config.vocab_size))
    # The most a request may ask for (`SamplingParams.logprobs`).
    self.max_logprobs = min(config.max_logprobs, model.config.vocab_size)
    self.stats = EngineStats()
    self.buckets = config.buckets
    data = 1 if mesh is None else mesh.shape[sharding.DATA]
    blocks_per_seq = -(-max_len // bs)
    # Sliding-window block reclamation, where it applies (`reclamation.py`).
    self.reclamation = reclamation.decide(config, model.config, mesh)
    initial = bm.init(num_blocks=config.num_blocks, block_size=bs,
                      max_seqs=self.max_seqs,
                      max_blocks_per_seq=blocks_per_seq,
                      prefix_caching=config.enable_prefix_caching,
                      window=self.reclamation.window)
    if self.reclamation.pools is not None:  # hybrid: shared, or a pool per window
      self.reclamation, pooled = window_pool.plan(
          config, model.config, self.reclamation, max_model_len=max_len,
          max_seqs=self.max_seqs, max_blocks_per_seq=blocks_per_seq)
      initial = pooled or initial
    self._pools = [Scheduler(config, model.config, max_len, self.stats, initial)
                   for _ in range(data)]
    self._runner = Runner(model, config, blocks_per_seq=blocks_per_seq,
                          max_seqs=self.max_seqs, num_logprobs=self.num_logprobs,
                          mesh=mesh, initial_state=initial)
    for p in self._pools if config.kv_offloading_size else ():  # `prefix_offload.py`
      p.init_prefix_offload(self._runner.prefix_host_blocks,
                            self._runner.cache.bytes_per_block)
    # The dispatched step whose results have not been applied yet.
    self._pending: InFlight | None = None
    self._drained: list[RequestOutput] = []  # outputs of a `drain()`'s step

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
    """Requests waiting or running, or a step's results still to apply."""
    if self._pending is not None and any(
        rec.live() for rec in self._pending.pending):
      return True
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
    """The `BlockState` (on a mesh: the data shards' states, stacked; a
    hybrid model's pools: a `pooled_step.PooledState`, or its shared pool:
    a `shared_pool.SharedState`)."""
    if self.mesh is None:  # the one pool of the 1x1 mesh, without its axis
      return self._runner.pool_state
    return self._runner.state

  @property
  def cache(self):
    """The `KVCache` (donated to every step: do not hold on to it; a tuple
    of one per pool for a `pooled_step.PooledState`)."""
    return self._runner.cache

  @property
  def compiled_buckets(self) -> tuple[Bucket, ...]:
    """The buckets this engine has run (each compiled once)."""
    return self._runner.compiled_buckets

  def usage(self) -> dict:
    """Blocks used / cached / total, running and waiting sequences, and the
    host tier's blocks used / total and swapped-out sequences (0 without
    one), from the last step, summed over the data shards
    (`Scheduler.usage`)."""
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
    work = [Scheduler.work(plan) for plan in plans]
    # Every entry runs >= 1 token: one each exactly when tokens == entries.
    decode_only = all(t == len(plan) for plan, (t, _) in zip(plans, work))
    return buckets_lib.choose(
        self.buckets, num_tokens=max(t for t, _ in work),
        num_seqs=max(s for _, s in work), decode_only=decode_only)

  def step(self) -> list[RequestOutput]:
    """Runs one engine step; returns the requests that finished (or were
    rejected) since the last call.

    With `config.async_scheduling` (the default) the step is dispatched
    before the previous step's results are read, so the host's work on step
    N+1 (scheduling, building inputs, dispatch) overlaps the device running
    step N; step N+1 takes step N's sampled tokens from the device. A
    sequence that samples EOS in step N may then compute one more (void)
    token in step N+1. Beam search waits for its results before its next
    step (its next tokens are chosen on the host).
    """
    t0 = time.perf_counter()
    compile0 = self._compile_seconds()
    waited, bucket = 0.0, None
    if self._pending is not None and (self._pending.has_beam
                                      or self._pending.multi is not None
                                      or not self.config.async_scheduling
                                      or spec_host.wants_results(self)):
      # Beam search: its next step needs them; K steps: their token counts.
      waited += self._resolve_pending()
    plans = [p.begin_step() for p in self._pools]
    if all(plan is None for plan in plans):
      if self._pending is not None:
        waited += self._resolve_pending()
      self._account(t0, waited, compile0, True, None)
      return self._take_outputs()
    plans = [plan or [] for plan in plans]
    bucket = self._bucket(plans)
    # Decode steps in this dispatch (`multistep_host.py`; one device only).
    k = 1 if self.mesh is not None else self._pools[0].num_steps(plans[0], bucket)
    # With K > 1 the device proposes, inside the loop (`spec_loop_host.py`):
    # `drafts` is then each row's "may propose".
    loop = spec_loop_host.applies(self, plans, bucket, k)
    drafts = spec_host.propose(self, plans, bucket, on_device=loop)  # (None: none)
    built = [p.build_step(plan, bucket) for p, plan in zip(self._pools, plans)]
    # Did the device finish everything dispatched while the host worked?
    exposed = self._pending is None or out_pack.is_ready(self._pending.out)
    multi = None
    self._write_slots()  # the slot rows bound since the last step, if any
    if len(self._pools) == 1:  # the prefix cache's host level: its copies first
      self._runner.copy_prefix_blocks(self._pools[0].take_prefix_copies())
    if all(not plan for plan in plans) and self._runner.tier is None:
      # Nothing to compute (releases, registrations, forks only: e.g. the
      # sequences that finished in the last step): no model, no bucket.
      out = self._runner.dispatch_bookkeeping([x for x, _ in built])
      self.stats.bookkeeping_steps += 1
      bucket = None
    elif loop and drafts is not None:
      out, multi = spec_loop_host.dispatch(self, built, bucket, k, drafts)
    elif k > 1:
      ((x, pending),) = built
      m, ms = self._pools[0].multistep_inputs(pending, x)
      out, multi = self._runner.dispatch_multistep(bucket, k, x, m), [ms]
      self.stats.multisteps += 1
    elif drafts is not None:
      out, multi = spec_host.dispatch(self, built, bucket, drafts)
    else:
      out = self._runner.dispatch(bucket, [x for x, _ in built],
                                  self._pools[0].take_swaps())
    if bucket is not None:
      self._count(bucket)
    for p in self._pools:
      p.end_step()
    previous, self._pending = self._pending, InFlight(
        out, [pending for _, pending in built],
        any(pending.beam for _, pending in built),
        any(pending.beam or pending.top for _, pending in built), bucket, multi)
    if previous is not None:
      waited += self._resolve(previous)
    if not self.config.async_scheduling or self._pending.has_beam:
      waited += self._resolve_pending()
    self._account(t0, waited, compile0, exposed, bucket)
    return self._take_outputs()

  def _write_slots(self):
    """Sends the pools' slot-state rows written since the last step (one
    scatter; none in a steady decode step)."""
    n = max(p.slot_updates_pending() for p in self._pools)
    if not n:
      return
    rows = slot_state.update_rows(n)  # one shape for every data shard
    self._runner.write_slots([p.take_slot_updates(rows) for p in self._pools])

  def _compile_seconds(self) -> float:
    """Seconds spent compiling step shapes so far."""
    return self._runner.compile_seconds

  def _account(self, t0: float, waited: float, compile0: float, exposed: bool,
               bucket: Bucket | None):
    """Adds a step's host work, waiting and device share to the stats
    (compiling on first use excluded, counted apart)."""
    compiled = self._compile_seconds() - compile0
    self.stats.add_transfers(*self._runner.take_moved_bytes())
    self.stats.add_step_time(time.perf_counter() - t0 - compiled, waited, compiled,
                             exposed, bucket is not None and bucket.decode_only)

  def _resolve_pending(self) -> float:
    pending, self._pending = self._pending, None
    return self._resolve(pending)

  def _resolve(self, flight: InFlight) -> float:
    """Waits for a dispatched step's results and applies them; returns the
    seconds spent waiting."""
    if spec_host.is_spec(flight):
      return spec_host.resolve(self, flight)
    if spec_loop_host.is_loop(flight):
      return spec_loop_host.resolve(self, flight)
    t = time.perf_counter()
    outs = self._runner.fetch(flight.out, len(self._pools), top=flight.wants_top)
    now = time.perf_counter()
    if flight.multi is not None:
      (p,), (rec,), (o,), (ms,) = self._pools, flight.pending, outs, flight.multi
      p.resolve_multistep(rec, ms, o, now)
      return now - t
    for p, rec, o in zip(self._pools, flight.pending, outs):
      p.resolve(rec, o, now)
    return now - t

  def _count(self, bucket: Bucket):
    if len(self._pools) == 1:
      gauges = self._pools[0].gauges()
    else:
      gauges = [sum(g) for g in zip(*(p.gauges() for p in self._pools))]
    self.stats.add_step(bucket, len(self._pools), *gauges)

  def warmup(self, buckets: tuple[Bucket, ...] | None = None) -> float:
    """Compiles the step of every bucket (default: all of `self.buckets`),
    concurrently (`compiler.py`); runs nothing. Returns the seconds spent
    compiling (0 when this process had compiled them all already, e.g. for
    an engine of equal sizes)."""
    before = self._runner.compile_seconds
    buckets = buckets or self.buckets
    self._runner.compile(
        {b: [p._build([], b)[0] for p in self._pools]  # pylint: disable=protected-access
         for b in buckets})
    self._runner.compile_slot_writes()  # the slot-state scatters too
    if self._runner.tier is None:  # the step of an empty plan (releases only)
      empty = [[] for _ in self._pools]
      self._runner.compile_bookkeeping(
          [p._build([], self._bucket(empty))[0] for p in self._pools])  # pylint: disable=protected-access
    self._runner.compile_prefix_copies(prefix_offload.max_loads(self.config),
                                       prefix_offload.max_stores(self.config))
    k = self.config.num_scheduler_steps
    if k > 1 and self.mesh is None:  # the K-step decode programs too
      self._runner.compile_multistep(self._pools[0].multistep_padding(buckets), k)
    spec_host.warmup(self, buckets)  # the verification steps too
    spec_loop_host.warmup(self, buckets)  # and their loops
    # Warm-up is not "compiling on first use": keep it out of the stats.
    seconds = self._runner.compile_seconds - before
    self._runner.compile_seconds = before
    return seconds

  def _take_outputs(self):
    outs, self._drained = self._drained, []
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
    """Steps until every request has finished; returns all outputs
    (`driver.Driver`, the one loop over `step`)."""
    from paged_jax.serving.driver import Driver  # pylint: disable=import-outside-toplevel  # it imports this module
    return Driver(self).run_until_done(max_steps, on_step)

  def flush(self) -> list[RequestOutput]:
    """Applies the step still in flight and runs the releases still queued
    (so the pool is empty when idle); returns the requests that finished (or
    were rejected) since the last call, as `step` does."""
    self.drain()
    return self._take_outputs()

  def drain(self):
    """`flush` without taking the outputs (the next `step` or `flush` returns
    them): nothing in flight, no release queued afterwards."""
    if self._pending is not None:
      self._resolve_pending()
    if any(p.has_releases() for p in self._pools):
      self._drained += self.step()
    if self._pending is not None:
      self._resolve_pending()

  def resize_kv_cache(self, num_blocks: int) -> bool:
    """Resizes the KV pool to `num_blocks` blocks while serving: grown, or
    compacted and shrunk (`resize.resize_pool`). Running and waiting requests
    carry on with the same tokens; every step shape compiles again on first
    use (`warmup()` compiles them ahead).

    Returns:
      True when resized; False (nothing changed) when running sequences
      hold more than `num_blocks` blocks, or an unfinished request needs
      more at its longest.

    Raises:
      ValueError: on a mesh, with preemption by swap, or for a size that is
        not a positive int.
    """
    return resize_lib.resize_pool(self, num_blocks)
