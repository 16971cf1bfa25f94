"""Workloads and the paged-vs-contiguous comparison.

`synthetic_requests` draws a seeded workload with ShareGPT-like length variety
(log-normal prompt and output lengths, a long tail). `run_workload` serves a
list of requests with either engine kind on the same KV memory and returns a
stats dict; `benchmarks/` and `examples/generate.py` both call it.

* "paged": blocks of `block_size` tokens, continuous batching, preemption.
* "contiguous": every sequence reserves a `max_model_len` slot up front
  (one block of `max_model_len` tokens) and requests run in static batches:
  the next batch starts when the previous one has finished. Same KV bytes,
  so it fits `kv_tokens // max_model_len` sequences at once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from paged_jax.models.llama.model import Llama
from paged_jax.serving.driver import Driver
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request, RequestOutput
from paged_jax.serving.sampling import SamplingParams
from paged_jax import sharding
from paged_jax import traces

KINDS = ("paged", "contiguous")


def sharegpt_mini(max_model_len: int, scale: float = 1 / 6) -> traces.TraceSpec:
  """`paged_jax.traces`' ShareGPT-like spec with every length scaled by `scale`.

  Same skew (log-normal spreads) as the ShareGPT-like trace, means 161 / 338
  tokens times `scale` (about 27 / 56 by default), so a CPU run stays short.
  """
  s = traces.SHAREGPT_LIKE
  return dataclasses.replace(
      s, name="sharegpt-mini", prompt_mean=s.prompt_mean * scale,
      output_mean=s.output_mean * scale, max_total_len=max_model_len)


def requests_from_trace(trace: traces.Trace, *, vocab_size: int, seed: int = 0,
                        params: SamplingParams | None = None,
                        exclude_ids: Sequence[int] = ()) -> list[Request]:
  """Requests with the trace's prompt and output lengths and random prompt ids.

  Args:
    trace: a `paged_jax.traces.Trace`.
    vocab_size: prompt ids are drawn uniformly from the vocabulary minus
      `exclude_ids` (e.g. EOS, so that prompts carry no stop token).
    seed: seed of the prompt ids.
    params: sampling parameters; `max_new_tokens` becomes the trace's output
      length.

  Returns:
    `Request`s with ids 0..len(trace)-1 (arrival times are the trace's).
  """
  rng = np.random.default_rng(seed)
  params = params or SamplingParams()
  allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude_ids, int))
  return [Request(i, rng.choice(allowed, size=int(p)).tolist(),
                  _with_budget(params, int(o)))
          for i, (p, o) in enumerate(zip(trace.prompt_lens, trace.output_lens))]


def synthetic_requests(
    num_requests: int = 48,
    *,
    vocab_size: int,
    max_model_len: int = 256,
    seed: int = 0,
    scale: float = 1 / 6,
    params: SamplingParams | None = None,
    exclude_ids: Sequence[int] = (),
) -> list[Request]:
  """A seeded workload with ShareGPT-like length variety, scaled down.

  Lengths come from `paged_jax.traces.make_trace(sharegpt_mini(...))`: the
  ShareGPT-like log-normal model with means times `scale`, prompt + output
  clipped to `max_model_len`.

  Raises:
    ValueError: `num_requests < 1` or `max_model_len < 2`.
  """
  if max_model_len < 2:
    raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
  trace = traces.make_trace(sharegpt_mini(max_model_len, scale), num_requests,
                            seed=seed)
  return requests_from_trace(trace, vocab_size=vocab_size, seed=seed,
                             params=params, exclude_ids=exclude_ids)


def _with_budget(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
  d = {f: getattr(params, f) for f in params.__dataclass_fields__}
  d["max_new_tokens"] = max_new_tokens
  return SamplingParams(**d)


def engine_config(kind: str, *, kv_tokens: int, block_size: int, max_batch: int,
                  max_tokens_per_step: int, max_model_len: int,
                  max_beam_width: int = 1, enable_prefix_caching: bool = False,
                  **kw) -> EngineConfig:
  """The `EngineConfig` of `kind` holding `kv_tokens` tokens of KV.

  `enable_prefix_caching` applies to "paged" only: the contiguous baseline
  is the plain static cache (one max-length block per sequence, never full).

  Raises:
    ValueError: unknown kind, or a budget too small for the kind.
  """
  if kind == "paged":
    num_blocks = kv_tokens // block_size
    if num_blocks < 1:
      raise ValueError(f"KV budget of {kv_tokens} tokens is less than one "
                       f"block of {block_size}")
    return EngineConfig(num_blocks=num_blocks, block_size=block_size,
                        max_batch=max_batch, max_tokens_per_step=max_tokens_per_step,
                        max_model_len=max_model_len, max_beam_width=max_beam_width,
                        enable_prefix_caching=enable_prefix_caching, **kw)
  if kind == "contiguous":
    slots = kv_tokens // max_model_len
    if slots < 1:
      raise ValueError(f"KV budget of {kv_tokens} tokens is less than one "
                       f"max-length sequence ({max_model_len}) for the contiguous cache")
    batch = min(max_batch, slots)
    return EngineConfig(num_blocks=slots, block_size=max_model_len,
                        max_batch=batch,
                        max_tokens_per_step=max(max_tokens_per_step, batch),
                        max_model_len=max_model_len,
                        max_beam_width=min(max_beam_width, batch),
                        static_batching=True, **kw)
  raise ValueError(f"engine kind must be one of {KINDS}, got {kind!r}")


def warmup(engine: Engine) -> float:
  """Compiles every step shape on an idle engine; returns the seconds taken."""
  t = time.perf_counter()
  engine.warmup()
  return time.perf_counter() - t


def run_workload(
    kind: str,
    model: Llama,
    requests: Sequence[Request],
    *,
    kv_tokens: int,
    block_size: int = 16,
    max_batch: int = 16,
    max_tokens_per_step: int = 128,
    max_model_len: int = 256,
    max_beam_width: int = 1,
    arrival_times: Sequence[float] | None = None,
    progress: bool = True,
    mesh=None,
    **engine_kw,
) -> tuple[dict, list[RequestOutput]]:
  """Serves `requests` and measures it (compilation excluded).

  Args:
    kind: "paged" or "contiguous" (see the module docstring).
    model: the model.
    requests: the workload.
    kv_tokens: KV memory budget in tokens (the same bytes for both kinds;
      per data shard on a mesh).
    block_size, max_batch, max_tokens_per_step, max_model_len,
      max_beam_width: engine sizes (see `EngineConfig`; per data shard).
    arrival_times: seconds after the start at which each request arrives
      (e.g. `paged_jax.traces.Trace.arrival_times`); default all at once.
    progress: show a tqdm progress bar on stderr.
    mesh: optional `(data, model)` mesh to serve on (see `Engine`).
    **engine_kw: other `EngineConfig` fields.

  Returns:
    `(stats, outputs)`: `stats` is a JSON-able dict (requests served and
    rejected, tokens generated, wall seconds and tokens/s after compilation,
    peak and mean KV blocks used, peak concurrent sequences, preemptions,
    host and device milliseconds per step, compile seconds); `outputs` are the
    `RequestOutput`s in request order.
  """
  config = engine_config(kind, kv_tokens=kv_tokens, block_size=block_size,
                         max_batch=max_batch,
                         max_tokens_per_step=max_tokens_per_step,
                         max_model_len=max_model_len,
                         max_beam_width=max_beam_width, **engine_kw)
  engine = Engine(model, config, mesh=mesh)
  compile_s = warmup(engine)
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=len(requests), desc=f"{kind:>10}", unit="req", leave=True,
               dynamic_ncols=True)

  def on_step(eng: Engine, done):
    if bar is not None:
      u = eng.usage()
      bar.set_postfix_str(f"KV {u['blocks_used']}/{u['blocks_total']} blocks, "
                          f"running {u['running']}, waiting {u['waiting']}",
                          refresh=False)
      bar.update(len(done))

  t0 = time.perf_counter()
  driver = Driver(engine)  # arrival times count from here
  for i, r in enumerate(requests):  # rejections come back from the driver too
    driver.add_request(r, None if arrival_times is None else arrival_times[i])
  outputs = driver.run_until_done(on_step=on_step)
  # (the cache, not `engine.block_state`: on one device that indexes the
  # stacked state, an eager op whose first use compiles inside the timing)
  jax.block_until_ready(engine.cache)
  # Shapes compiled on first use (none after a full warm-up) are not serving.
  wall = time.perf_counter() - t0 - engine.stats.compile_seconds
  if bar is not None:
    bar.close()
  order = {r.request_id: i for i, r in enumerate(requests)}
  outputs.sort(key=lambda o: order[o.request_id])
  return workload_stats(kind, engine, len(requests), wall, compile_s), outputs


def workload_stats(kind: str, engine: Engine, num_requests: int, wall: float,
                   compile_s: float) -> dict:
  """`run_workload`'s JSON-able stats of a served engine."""
  config = engine.config
  st = engine.stats
  steps = max(st.steps, 1)
  shards = engine.data_shards
  total_blocks = shards * config.num_blocks
  kv_bytes = engine.cache.nbytes
  devices = sharding.per_device_cache_bytes(engine.cache)
  stats = {
      "kind": kind,
      "requests": num_requests,
      "served": st.finished,
      "rejected": st.rejected,
      "generated_tokens": st.generated_tokens,
      "computed_tokens": st.computed_tokens,
      "padded_rows": st.padded_rows,
      "padding_ratio": st.padding_ratio,
      "wall_seconds": wall,
      "tokens_per_second": st.generated_tokens / wall if wall > 0 else 0.0,
      "steps": st.steps,
      "decode_steps": st.decode_steps,
      "mixed_steps": st.mixed_steps,
      "data_shards": shards,
      "num_blocks": total_blocks,
      "block_size": config.block_size,
      "kv_bytes": kv_bytes,
      "devices": len(engine.cache.k_pages.sharding.device_set),
      "kv_bytes_per_device": max(devices.values()),
      "peak_blocks_used": st.blocks_used.peak,
      "mean_blocks_used": st.blocks_used.mean,
      "peak_kv_fraction": st.blocks_used.peak / total_blocks,
      "mean_kv_fraction": st.blocks_used.mean / total_blocks,
      "peak_running": st.running.peak,
      "mean_running": st.running.mean,
      "max_batch": shards * config.max_batch,
      "preemptions": st.preemptions,
      "recomputed_tokens": st.recomputed_tokens,
      "deferred_admissions": st.deferred_admissions,
      "refused_reservations": st.refused_reservations,
      "async_scheduling": config.async_scheduling,
      "prefix_caching": config.enable_prefix_caching,
      "prefix_cache_hit_rate": st.prefix_cache_hit_rate,
      "prefix_hit_tokens": st.prefix_hit_tokens,
      "prefix_queried_tokens": st.prefix_queried_tokens,
      "prefill_tokens_saved": st.prefix_tokens_saved,
      "prefix_blocks_registered": st.prefix_blocks_registered,
      "prefix_blocks_evicted": st.prefix_blocks_evicted,
      "blocks_cached": engine.usage()["blocks_cached"],
      "speculative": config.speculative_config is not None,
      "spec_steps": st.spec_steps,
      "spec_proposed_tokens": st.spec_proposed,
      "spec_accepted_tokens": st.spec_accepted,
      "acceptance_rate": st.acceptance_rate,
      "mean_accepted_length": st.mean_accepted_length,
      "spec_draft_seconds": st.spec_draft_seconds,
      "peak_blocks_cached": st.blocks_cached.peak,
      "host_ms_per_step": 1e3 * st.host_seconds / steps,
      "exposed_host_ms_per_step": 1e3 * st.exposed_host_seconds / steps,
      "wait_ms_per_step": 1e3 * st.wait_seconds / steps,
      "host_share": st.host_share,
      "device_ms_per_step": 1e3 * st.device_seconds / steps,
      "device_ms_per_decode_step": (1e3 * st.decode_device_seconds
                                    / max(st.decode_steps, 1)),
      "compile_seconds": compile_s + st.compile_seconds,
      "buckets_compiled": len(engine.compiled_buckets),
      "latency_seconds": st.latency_summary(),
      "kv_cache": allocated_cache(engine.cache),
  }
  return stats


def allocated_cache(cache) -> dict:
  """What the engine's `KVCache` really holds, read from its arrays (so a
  requested dtype that was not allocated shows): page dtype, whether it has
  scales, total bytes and bytes per token slot (scales included)."""
  return {"dtype": str(cache.dtype), "scales": cache.quantized,
          "bytes": cache.nbytes, "bytes_per_token": cache.bytes_per_token}
