"""`EngineConfig`: the engine's static sizes and switches, validated here.

Every rule about a combination of engine settings lives in
`EngineConfig.__post_init__` (or the checks it calls: `swap.check_config`,
`spec_host.check_config`), so the Python API, `paged-jax generate` and the
server refuse the same things with the same message (the CLIs rewrite the
field names into their flags, `entrypoints/engine_args.py`).
"""

from __future__ import annotations

import dataclasses

from paged_jax.speculative import SpeculativeConfig
from paged_jax.serving import buckets as buckets_lib
from paged_jax.serving import reclamation
from paged_jax.serving import spec_host
from paged_jax.serving import prefix_offload
from paged_jax.serving import swap as swap_lib
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.multistep import MAX_STEPS


# The largest value of each size (past it a value is a mistake, not a
# setting: each sizes arrays of every step or of the pool). Block ids are
# int32, the batch and step sizes set rows of every compiled step.
MAX_MODEL_LEN = 2**24
SIZE_LIMITS = {"num_blocks": 2**31 - 1, "block_size": 2**20, "max_batch": 2**16,
               "max_tokens_per_step": 2**20, "max_beam_width": 2**16,
               "min_bucket": 2**20}


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
      `max_position_embeddings` capped at the pool size. For a model run
      without its sliding window (`Llama.without_sliding_window`, vLLM's
      `--disable-sliding-window`) the default is also capped at the window
      and a longer value is refused (`reclamation.max_model_len`).
    max_beam_width: largest beam width served (fixes the log-prob rows).
    max_logprobs: most top log-probs a request may ask for
      (`SamplingParams.logprobs`, vLLM's name). Static: the device step
      computes `max(max_logprobs, 2 * max_beam_width)` (at most the vocab)
      top log-probs per sample row, and the host fetches them only for the
      steps where some row asked. Default 8, what the step computed before;
      `lax.top_k` of 20 rather than 8 costs little next to the sampler's
      pass over the vocab, so the server raises it to its `--max-logprobs`.
    max_logit_bias: most `SamplingParams.logit_bias` entries a request may
      give. Static: every step carries `i32` ids and `f32` biases of this
      width per sample row (8 bytes per entry and row, sent every step,
      added to the logits by one scatter-add). Default 0, the feature off:
      zero-sized arrays, nothing sent or run, so an engine that does not
      serve it pays nothing; a request with a bias is then rejected. The
      OpenAI server sets it from `--max-logit-bias` (default 300, OpenAI's
      bound).
    static_batching: admit only when nothing runs (the contiguous baseline).
    cache_dtype: KV dtype name as `kv_cache.cache_dtype` ("auto",
      "float32", "bfloat16", "float16", "int8", "fp8"); None: the model's.
      int8 / fp8 store per-token scales beside the pages.
    min_bucket: smallest step shape (`buckets.py`): steps are padded to the
      powers of two (and midpoints) from `min_bucket` up to `max_batch`
      (decode), from `max(min_bucket, max_batch)` up to
      `max_tokens_per_step` (mixed). Set it to
      `max_tokens_per_step` for the two fixed shapes of old (every step
      padded to the largest).
    bucket_midpoints: also the 1.5x midpoints between powers of two (less
      padding, about twice the shapes to compile).
    check_traces: assert that the engine traces each of its programs at
      most once (tests): asking for a program it already has under another
      key raises AssertionError (`compiler.check_traced_once`). Engines of
      equal sizes share the compiled programs either way (`compiler.py`):
      each compiles once per process.
    async_scheduling: dispatch step N+1 before reading step N's results, so
      the host's work overlaps the device's (vLLM v1's async scheduling; see
      `Engine.step`). Off: every step waits for its results (the same
      tokens, a step later for nothing).
    enable_prefix_caching: keep the full blocks of finished (and preempted)
      sequences cached and start new sequences on the longest cached prefix
      of their tokens (vLLM's automatic prefix caching; see the module
      docstring). Off by default: without it the step is the plain
      allocator's, and with it a workload that shares nothing paid 8-20% of
      its output tokens/s on a 2-core CPU (benchmarks/RESULTS.md section 11).
    admission_headroom_steps: block-aware admission. A waiting request is
      admitted only if the blocks of its prompt chunk leave the running
      sequences room to grow for this many more decode steps (about
      `running * steps / block_size` blocks; in a pool with a sliding
      window, where a sequence's blocks stop growing at its window, the
      blocks its sequences will hold and one step's growth before
      reclamation: `window_pool.local_admission_room`; a hybrid model's
      shared pool: `shared_pool.SharedHost.admission_room`); 0 checks no blocks at
      admission (rows and token budget only, the policy before #21: a
      refused reservation then takes the admission back or preempts). Fewer
      preemptions and recomputed tokens for slightly fewer sequences at once. Default 16, chosen by measurement (issue #21 note:
      on a 4,096-token pool at batch 32, preemptions 34 -> 5 and 191 -> 42,
      computed tokens -15% and -42%, steps +3% and +1%, on a long-prompt and
      a ShareGPT-like workload against no block check).
    num_scheduler_steps: K, decode steps per dispatch in a steady decode
      state (vLLM's former `--num-scheduler-steps`; `multistep.py`): when
      nothing waits for admission and every entry decodes, one program runs
      up to K decode steps, blocks reserved on the device, each row stopping
      at its stop ids, budget or a full pool; the next step is planned after
      its results. In [1, `multistep.MAX_STEPS`]; 1 = off. Single steps
      where it does not apply (`multistep_host.py`: beam search, forks,
      stop strings, prompt chunks) and always on a mesh. Default 1, by
      measurement (RESULTS.md section 13: on the loaded 2-core CPU, CPU time
      per token 0.81-0.87x at K = 8, throughput within the noise at batch 32;
      K > 1 makes the next step's planning wait and streams in bursts).
    speculative_config: a `speculative.SpeculativeConfig` (vLLM's
      `--speculative-config`; method "ngram" or "draft_model", greedy or sampled):
      decode steps verify drafts (`spec_host.py`, `spec_step.py`, `spec_draft.py`);
      with `num_scheduler_steps > 1` ("ngram" only) up to K verification
      iterations per dispatch, the drafts proposed on the device
      (`spec_loop.py`). None: off.
    preemption_mode: what a preempted sequence loses (vLLM v0's
      `--preemption-mode`): "recompute" drops its KV and computes it again
      when readmitted; "swap" copies its blocks to a host-memory tier and
      back (`swap.py`, `paged_jax.host_tier`), one device, without prefix
      caching, multi-step decode or speculation. Default "recompute", by
      measurement (RESULTS.md section 14c: on the 2-core CPU swap computed
      21% fewer token rows but was not faster, XLA CPU's scatter being slow).
    swap_space_blocks: KV blocks in the host tier for "swap" (>= 1 there).
    kv_offloading_size: GiB of host memory for the prefix cache's host
      level (vLLM's `--kv-offloading-size`; `prefix_offload.py`): blocks the
      device cache evicts are kept there and loaded back on a hit. 0 (the
      default): none. Needs prefix caching, one device, recompute.
    sliding_window_reclamation: give back the blocks that a sliding-window
      model's future queries cannot see (`reclamation.py`,
      `paged_jax.window_reclaim`): None (default) on where the model and
      the other settings allow it, else off with a log line; True: on, or a
      ValueError naming what prevents it; False: off.
  """

  num_blocks: int
  block_size: int = 16
  max_batch: int = 16
  max_tokens_per_step: int = 128
  max_model_len: int | None = None
  max_beam_width: int = 1
  max_logprobs: int = 8
  max_logit_bias: int = 0
  static_batching: bool = False
  cache_dtype: str | None = None
  min_bucket: int = 1
  bucket_midpoints: bool = True
  check_traces: bool = False
  async_scheduling: bool = True
  enable_prefix_caching: bool = False
  admission_headroom_steps: int = 16
  num_scheduler_steps: int = 1
  speculative_config: SpeculativeConfig | None = None
  preemption_mode: str = "recompute"
  swap_space_blocks: int = 0
  kv_offloading_size: float = 0.0
  sliding_window_reclamation: bool | None = None

  def __post_init__(self):
    swap_lib.check_config(self)
    prefix_offload.check_config(self)
    for name, hi in SIZE_LIMITS.items():
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
      if value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    # Upper bounds: past them a value is a mistake, not a setting (the
    # headroom is in decode steps, at most the longest sequence the CLIs
    # allow; the other two size per-row arrays of every step).
    for name, hi in (("admission_headroom_steps", MAX_MODEL_LEN), ("max_logprobs", 2**16),
                     ("max_logit_bias", 2**16)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
      if value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    k = self.num_scheduler_steps
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_STEPS:
      raise ValueError(f"num_scheduler_steps must be an int in [1, {MAX_STEPS}], "
                       f"got {k!r}")
    for name in ("static_batching", "check_traces", "async_scheduling",
                 "enable_prefix_caching", "bucket_midpoints"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.max_tokens_per_step < self.max_batch:
      raise ValueError(f"max_tokens_per_step={self.max_tokens_per_step} must be >= "
                       f"max_batch={self.max_batch} so every decode fits a step")
    if self.max_model_len is not None and self.max_model_len < 2:
      raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
    if self.max_model_len is not None and self.max_model_len > MAX_MODEL_LEN:
      raise ValueError(f"max_model_len must be <= {MAX_MODEL_LEN}, got {self.max_model_len}")
    if self.max_beam_width > self.max_batch:
      raise ValueError(f"max_beam_width={self.max_beam_width} must be <= "
                       f"max_batch={self.max_batch}")
    spec_host.check_config(self)
    reclamation.check_config(self)

  @property
  def buckets(self) -> tuple[Bucket, ...]:
    """Every step shape this engine may compile (`buckets.bucket_set`)."""
    return buckets_lib.bucket_set(self.max_batch, self.max_tokens_per_step,
                                  self.min_bucket, self.bucket_midpoints)
