"""Engine statistics in bounded memory.

Counters and running aggregates only: a long-running server keeps O(1) state
per statistic. Latency percentiles come from a bounded window of the most
recent samples (`Latency.window`, default 8192), means and counts from every
sample.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

WINDOW = 8192


class Latency:
  """Running count / mean / max of a latency in seconds, and percentiles over
  the last `window` samples.

  Example:
    >>> lat = Latency(window=4)
    >>> for x in (1.0, 2.0, 3.0, 4.0, 5.0):
    ...   lat.add(x)
    >>> lat.count, lat.mean, len(lat.recent)
    (5, 3.0, 4)
  """

  def __init__(self, window: int = WINDOW):
    if window < 1:
      raise ValueError(f"window must be >= 1, got {window}")
    self.count = 0
    self.total = 0.0
    self.max = 0.0
    self.recent: collections.deque[float] = collections.deque(maxlen=window)

  def add(self, seconds: float):
    self.count += 1
    self.total += seconds
    self.max = max(self.max, seconds)
    self.recent.append(seconds)

  def add_many(self, seconds: list[float]):
    """`add` of each of `seconds`, in order (one call per step's batch)."""
    if seconds:
      self.count += len(seconds)
      self.total += sum(seconds)
      self.max = max(self.max, max(seconds))
      self.recent.extend(seconds)

  @property
  def mean(self) -> float:
    return self.total / self.count if self.count else 0.0

  def percentile(self, q: float) -> float:
    return float(np.percentile(self.recent, q)) if self.recent else 0.0

  def summary(self) -> dict:
    """`{"count", "mean", "p50", "p90", "p99", "max"}` in seconds."""
    return {"count": self.count, "mean": self.mean,
            "p50": self.percentile(50), "p90": self.percentile(90),
            "p99": self.percentile(99), "max": self.max}


class Gauge:
  """Running peak and mean of a value sampled once per step."""

  def __init__(self):
    self.count = 0
    self.total = 0.0
    self.peak = 0

  def add(self, value: int):
    self.count += 1
    self.total += value
    self.peak = max(self.peak, value)

  @property
  def mean(self) -> float:
    return self.total / self.count if self.count else 0.0


@dataclasses.dataclass
class EngineStats:
  """What the engine counts while it runs (bounded memory).

  Attributes:
    steps, decode_steps, mixed_steps: device steps run, by kind.
    bookkeeping_steps: steps with nothing to compute (only releases,
      registrations or forks: e.g. after the last sequences finished), run
      as their block bookkeeping alone, no model (not in `steps`).
    generated_tokens: output tokens of finished requests.
    computed_tokens: real token rows run (prompt, recompute and decode).
    padded_rows: token rows computed, padding included (the buckets' sizes).
    preemptions, refused_reservations, finished, rejected, aborted: counts.
    recomputed_tokens: tokens whose K/V a preemption dropped (the victims'
      computed tokens at that moment), to be computed again at re-admission
      (less any prefix-cache hits then).
    swapped_out, swapped_in: sequences preempted by swap, and swapped back
      (`EngineConfig.preemption_mode`); swap_blocks_out, swap_blocks_in:
      blocks copied to and from host memory (x `kv_cache` bytes per block).
    offload_bytes_to_host, offload_bytes_to_device: bytes of the copies
      between device and host memory dispatched so far (swaps and the
      prefix cache's host level), real blocks x `KVCache.bytes_per_block`
      (vLLM's `kv_offload_total_bytes`, GPU_to_CPU / CPU_to_GPU).
    external_prefix_queried_tokens, external_prefix_hit_tokens: prompt
      tokens looked up in the prefix cache's host level after the device
      cache missed them, and those found there (vLLM's
      `external_prefix_cache_queries` / `_hits`); 0 without the level.
    multisteps: dispatches that ran several decode steps on the device
      (`EngineConfig.num_scheduler_steps`; each counts once in `steps`),
      speculative loops (`spec_loop.py`) included.
    multistep_tokens: tokens those dispatches emitted after each row's
      first (decode tokens with no host work of their own).
    multistep_refused: rows those dispatches stopped on a refused
      reservation (the pool full inside the loop).
    spec_steps, spec_rows: verification steps (`spec_step.py`) and
      iterations of speculative loops (`spec_loop.py`), and rows of them
      that verified at least one draft.
    spec_proposed, spec_accepted: draft tokens verified, and accepted
      (`acceptance_rate`, `mean_accepted_length`).
    spec_draft_seconds: the host's time proposing drafts (with the loop:
      writing the device's token history).
    deferred_admissions: steps in which block-aware admission left a
      waiting request queued because its prompt's blocks would not leave
      the running sequences room to grow (`Scheduler._schedule`).
    host_seconds: the host's own work per step (scheduling, input building,
      dispatching, applying results), compilation excluded.
    wait_seconds: the host waiting for a step's results.
    exposed_host_seconds: the host work of steps after which the device had
      already finished every step dispatched (it sat idle for part of that
      work): an upper bound on the device time lost to the host. Without
      asynchronous scheduling every step's host work is exposed.
    device_seconds: the engine's wall time (host work plus waiting,
      compilation excluded) minus the exposed host work: a lower bound on
      the time the device was busy.
    decode_device_seconds: the part of it in decode steps.
    compile_seconds: compiling step shapes on first use (warm-up excluded).
    prefix_queried_tokens, prefix_hit_tokens: prompt tokens of admitted
      requests, and those served from the prefix cache, at each request's
      first admission (`prefix_cache_hit_rate`).
    prefix_tokens_saved: tokens not computed thanks to cache hits, at every
      admission (re-admissions after preemption included).
    prefix_blocks_registered, prefix_blocks_evicted: blocks entered into the
      prefix cache, and cached blocks evicted for reuse.
    blocks_used, blocks_cached, running, waiting: per-step gauges (peak,
      mean); cached blocks are free to reuse but keep their K/V for hits.
    ttft, tpot, itl, e2e: latencies in seconds (time to first token, time
      per output token after the first, inter-token latency, end to end).
    buckets: steps run per bucket `(num_tokens, num_seqs, decode_only)`
      (bounded by the static bucket set).
  """

  steps: int = 0
  decode_steps: int = 0
  bookkeeping_steps: int = 0
  mixed_steps: int = 0
  generated_tokens: int = 0
  computed_tokens: int = 0
  padded_rows: int = 0
  preemptions: int = 0
  recomputed_tokens: int = 0
  swapped_out: int = 0
  swapped_in: int = 0
  swap_blocks_out: int = 0
  swap_blocks_in: int = 0
  offload_bytes_to_host: int = 0
  offload_bytes_to_device: int = 0
  external_prefix_queried_tokens: int = 0
  external_prefix_hit_tokens: int = 0
  deferred_admissions: int = 0
  multisteps: int = 0
  multistep_tokens: int = 0
  multistep_refused: int = 0
  spec_steps: int = 0
  spec_rows: int = 0
  spec_proposed: int = 0
  spec_accepted: int = 0
  spec_draft_seconds: float = 0.0
  refused_reservations: int = 0
  finished: int = 0
  rejected: int = 0
  aborted: int = 0
  host_seconds: float = 0.0
  wait_seconds: float = 0.0
  exposed_host_seconds: float = 0.0
  device_seconds: float = 0.0
  decode_device_seconds: float = 0.0
  compile_seconds: float = 0.0
  prefix_queried_tokens: int = 0
  prefix_hit_tokens: int = 0
  prefix_tokens_saved: int = 0
  prefix_blocks_registered: int = 0
  prefix_blocks_evicted: int = 0
  blocks_used: Gauge = dataclasses.field(default_factory=Gauge)
  blocks_cached: Gauge = dataclasses.field(default_factory=Gauge)
  running: Gauge = dataclasses.field(default_factory=Gauge)
  waiting: Gauge = dataclasses.field(default_factory=Gauge)
  ttft: Latency = dataclasses.field(default_factory=Latency)
  tpot: Latency = dataclasses.field(default_factory=Latency)
  itl: Latency = dataclasses.field(default_factory=Latency)
  e2e: Latency = dataclasses.field(default_factory=Latency)
  buckets: dict = dataclasses.field(default_factory=dict)

  def add_step(self, bucket, num_pools: int, blocks_used: int, blocks_cached: int,
               running: int, waiting: int):
    """Counts one dispatched step of `bucket` (`buckets.Bucket`) over
    `num_pools` pools, and samples the gauges (summed over the pools, as
    `Engine.usage()` reports them)."""
    self.steps += 1
    self.decode_steps += bucket.decode_only
    self.mixed_steps += not bucket.decode_only
    self.padded_rows += bucket.num_tokens * num_pools
    key = (bucket.num_tokens, bucket.num_seqs, bucket.decode_only)
    self.buckets[key] = self.buckets.get(key, 0) + 1
    self.blocks_used.add(blocks_used)
    self.blocks_cached.add(blocks_cached)
    self.running.add(running)
    self.waiting.add(waiting)

  def add_step_time(self, wall: float, waited: float, compiled: float,
                    exposed: bool, decode: bool):
    """Adds one `Engine.step`'s seconds: `wall` (compiling excluded) of
    which `waited` waiting for results, `compiled` compiling on first use;
    `exposed`: the device had finished everything before the host's work
    ended; `decode`: a decode step."""
    self.compile_seconds += compiled
    host = max(wall - waited, 0.0)
    self.host_seconds += host
    self.wait_seconds += waited
    self.exposed_host_seconds += host * exposed
    device = wall - host * exposed
    self.device_seconds += device
    if decode:
      self.decode_device_seconds += device

  def add_transfers(self, to_host: int, to_device: int):
    """Counts the bytes of dispatched copies between memories
    (`Runner.take_moved_bytes`)."""
    self.offload_bytes_to_host += to_host
    self.offload_bytes_to_device += to_device

  @property
  def host_share(self) -> float:
    """Exposed host time / (exposed host time + waiting): the share of the
    engine's time the device may have idled for the host (an upper bound)."""
    total = self.exposed_host_seconds + self.wait_seconds
    return self.exposed_host_seconds / total if total else 0.0

  @property
  def prefix_cache_hit_rate(self) -> float:
    """Prompt tokens served from the prefix cache / prompt tokens (admitted
    requests, first admissions; vLLM's definition)."""
    q = self.prefix_queried_tokens
    return self.prefix_hit_tokens / q if q else 0.0

  @property
  def acceptance_rate(self) -> float:
    """Accepted / proposed draft tokens (speculative decoding; 0.0 if none)."""
    return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

  @property
  def mean_accepted_length(self) -> float:
    """Drafts accepted per row that verified some (each such row also emits
    one token of the target's own: `1 + this` tokens per row and step)."""
    return self.spec_accepted / self.spec_rows if self.spec_rows else 0.0

  @property
  def padding_ratio(self) -> float:
    """Token rows computed / real tokens (1.0 = no padding)."""
    return self.padded_rows / self.computed_tokens if self.computed_tokens else 0.0

  def latency_summary(self) -> dict:
    """`{"ttft": {...}, "tpot": {...}, "itl": {...}, "e2e": {...}}` in
    seconds (see `Latency.summary`)."""
    return {name: getattr(self, name).summary()
            for name in ("ttft", "tpot", "itl", "e2e")}
