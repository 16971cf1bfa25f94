"""The offline and streaming API, in the spirit of vLLM's `LLM.generate`.

    llm = LLM(model, num_blocks=256, max_batch=32)
    outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16))
    for delta in llm.stream([[1, 2, 3]], SamplingParams(max_new_tokens=16)):
      print(delta.request_id, delta.index, delta.token_ids)

Prompts are token ids (there is no tokenizer here). `generate` returns one
`RequestOutput` per prompt, in prompt order; `stream` yields `RequestDelta`s as
tokens reach the host: concatenating a request's deltas of sample `i` gives
`generate`'s `completions[i].token_ids`, and every request ends with a delta
whose `output` is its `RequestOutput` (rejected requests too).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from jax.sharding import Mesh

from paged_jax.serving.driver import Driver
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.protocol import ServingModel
from paged_jax.serving.requests import Request, RequestDelta, RequestOutput
from paged_jax.serving.sampling import SamplingParams

Prompts = Sequence[Sequence[int]] | Sequence[Request]
Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
  """An engine with a batch API: give prompts, get completions.

  Args:
    model: a `ServingModel` (e.g. `paged_jax.models.llama.model.Llama`).
    config: an `EngineConfig`, or None to build one from `**config_kw`.
    mesh: optional `(data, model)` mesh (see `Engine`).
    warmup: compile every step shape now rather than on first use.
    **config_kw: `EngineConfig` fields (with `config=None`).

  Raises:
    ValueError: if both `config` and `config_kw` are given, or the sizes are
      invalid (`EngineConfig`).
  """

  def __init__(self, model: ServingModel, config: EngineConfig | None = None, *,
               mesh: Mesh | None = None, warmup: bool = False, **config_kw):
    if config is not None and config_kw:
      raise ValueError(f"give an EngineConfig or its fields, not both "
                       f"(got config and {sorted(config_kw)})")
    self.engine = Engine(model, config or EngineConfig(**config_kw), mesh=mesh)
    if warmup:
      self.engine.warmup()

  def _requests(self, prompts: Prompts, sampling_params: Params) -> list[Request]:
    if self.engine.has_unfinished():
      raise RuntimeError("the engine still has unfinished requests")
    n = len(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
      params = [sampling_params or SamplingParams()] * n
    else:
      params = list(sampling_params)
      if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for "
                         f"{n} prompts; give one, or one per prompt")
    out = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
      if isinstance(p, Request):
        out.append(p)
      else:
        out.append(Request(i, list(p), sp))
    ids = [r.request_id for r in out]
    if len(set(ids)) != len(ids):
      raise ValueError(f"request ids must be unique, got {ids}")
    return out

  def generate(self, prompts: Prompts, sampling_params: Params = None
               ) -> list[RequestOutput]:
    """Serves every prompt; returns their outputs in prompt order.

    Args:
      prompts: token-id lists (request ids 0, 1, ...), or `Request`s.
      sampling_params: one `SamplingParams` for all, one per prompt, or None
        for the defaults (ignored for `Request`s, which carry their own).

    Returns:
      One `RequestOutput` per prompt (`rejected` set for those refused).

    Raises:
      ValueError: on a `sampling_params` list of the wrong length, or repeated
        request ids.
    """
    requests = self._requests(prompts, sampling_params)
    driver = Driver(self.engine)
    for r in requests:
      driver.add_request(r)
    by_id = {o.request_id: o for o in driver.run()}
    return [by_id[r.request_id] for r in requests]

  def stream(self, prompts: Prompts, sampling_params: Params = None
             ) -> Iterator[RequestDelta]:
    """Serves every prompt, yielding `RequestDelta`s as tokens arrive (see
    the module docstring); arguments as in `generate`."""
    requests = self._requests(prompts, sampling_params)
    driver = Driver(self.engine, stream=True)
    try:
      for r in requests:
        driver.add_request(r)
      yield from driver.run()
    finally:
      driver.close()
