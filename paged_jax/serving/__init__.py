"""Serving: a continuous-batching engine over the paged KV cache.

Files, by concern:

* `protocol.py`: `ServingModel`, what a model implements to be served;
* `requests.py`: `Request`, `RequestOutput`, `Completion`, `RequestDelta`;
* `sampling.py`: `SamplingParams` and the jitted sampler; `beam.py`: beam
  search rules;
* `buckets.py`: the static set of step shapes;
* `scheduler.py`: the host side of one pool (queues, admission, preemption);
* `step.py`: the jitted device step; `runner.py`: the device arrays and the
  compiled steps;
* `engine.py`: `Engine` and `EngineConfig`; `stats.py`: `EngineStats`;
* `llm.py`: `LLM`, the offline (`generate`) and streaming (`stream`) API;
* `tokenizer.py`: tokenizers (byte-level, Hugging Face `tokenizer.json`);
  `text.py`: `TextEngine`, text deltas and stop strings.

Example:
  >>> from paged_jax.serving import LLM, SamplingParams
  >>> llm = LLM(model, num_blocks=64)
  >>> outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8))
"""

from paged_jax.serving.beam import Beam
from paged_jax.serving.beam import beam_search_step
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.engine import Engine
from paged_jax.serving.engine import EngineConfig
from paged_jax.serving.llm import LLM
from paged_jax.serving.protocol import ModelConfig
from paged_jax.serving.protocol import ServingModel
from paged_jax.serving.requests import Completion
from paged_jax.serving.requests import Request
from paged_jax.serving.requests import RequestDelta
from paged_jax.serving.requests import RequestOutput
from paged_jax.serving.sampling import SamplingParams
from paged_jax.serving.stats import EngineStats

__all__ = [
    "Beam",
    "Bucket",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "LLM",
    "ModelConfig",
    "Request",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "ServingModel",
    "beam_search_step",
]
