"""Which requests the engine accepts: the rules a request must meet before
it is queued (`Scheduler.add_request`), each returning why it is rejected or
None.

`request_rejection` runs them all for the engine. The vocabulary, limits and
size rules are also asked on their own, before a model is loaded or a
request queued: `paged-jax generate` checks a prompt file
(`entrypoints/prompts.check_vocab`) and its flags
(`entrypoints/generate.check_fits_engine`), the OpenAI server a request's
fields (`protocol.check_limits`), so each rule lives here alone.
"""

from __future__ import annotations

import numpy as np

from paged_jax.serving import sampling as sampling_lib
from paged_jax.serving import spec_host
from paged_jax.serving import window_pool
from paged_jax.serving.requests import Request

__all__ = ["limits_rejection", "request_rejection", "size_rejection",
           "vocab_rejection"]


def vocab_rejection(prompt, vocab_size: int) -> str | None:
  """Why the engine rejects `prompt` (token ids) for its vocabulary, or None:
  every id an int in `[0, vocab_size)`. `request_rejection` runs it for
  every request; `paged-jax generate` asks it of a prompt file's entries
  before loading a model (`entrypoints/prompts.check_vocab`)."""
  bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
  if bad:
    return f"prompt token {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
  return None


def limits_rejection(params, *, max_logprobs: int, max_logit_bias: int,
                     vocab_size: int) -> str | None:
  """Why the engine rejects these `SamplingParams` for its per-row limits,
  or None: top log-probs up to `max_logprobs` (the engine's, at most the
  vocabulary), `logit_bias` up to `max_logit_bias` entries with ids in the
  vocabulary. `request_rejection` runs it for every request; the OpenAI
  server asks it before queueing one (`protocol.check_limits`), in its field
  names."""
  p = params
  if p.logprobs is not None and p.logprobs > max_logprobs:
    return (f"logprobs must be <= {max_logprobs} (the engine's max_logprobs), "
            f"got {p.logprobs}")
  if len(p.logit_bias) > max_logit_bias:
    return (f"logit_bias must hold at most {max_logit_bias} entries (the "
            f"engine's max_logit_bias), got {len(p.logit_bias)}")
  if p.logit_bias and p.logit_bias[-1][0] >= vocab_size:  # (sorted by id)
    return (f"logit_bias token id {p.logit_bias[-1][0]} is outside the "
            f"vocabulary [0, {vocab_size})")
  return None


def size_rejection(params, prompt_len: int, *, max_batch: int,
                   max_model_len: int | None) -> str | None:
  """Why the engine rejects a request of `prompt_len` tokens and these
  `SamplingParams` on its sizes alone, or None: its prompt and budget must
  fit `max_model_len` (None: not checked), and its sequences (`n` or the
  beam width) one batch. `request_rejection` runs it for every request;
  the CLIs ask it on their flags before loading a model
  (`entrypoints/generate.check_fits_engine`), so the rule lives here alone."""
  total = prompt_len + params.max_new_tokens
  if max_model_len is not None and total > max_model_len:
    return (f"prompt ({prompt_len}) + max_new_tokens ({params.max_new_tokens}) = "
            f"{total} exceeds max_model_len={max_model_len}")
  if params.num_seqs > max_batch:
    return f"needs {params.num_seqs} sequences at once, max_batch is {max_batch}"
  return None


def request_rejection(request: Request, *, config, model_config,
                      max_model_len: int, pool) -> str | None:
  """Why the engine rejects `request`, or None: it must fit the speculative
  config (`spec_host.rejection`), have a prompt of ids in the vocabulary, a
  valid `cache_salt`, fit the engine's sizes, beam width and per-row limits,
  ban at most `sampling_lib.MAX_BANNED` ids for `min_tokens`, and fit the
  pool alone (`window_pool.block_rejection` on `pool`, the scheduler's host
  model), so that every accepted request completes. `config`: the
  `EngineConfig`; `model_config`: the model's (vocabulary, EOS ids)."""
  p, c = request.params, config
  if c.speculative_config is not None and spec_host.rejection(request):
    return spec_host.rejection(request)
  prompt = request.prompt
  if not prompt:
    return "empty prompt"
  if request.cache_salt is not None and not isinstance(request.cache_salt, (str, bytes)):
    return f"cache_salt must be a str or bytes, got {request.cache_salt!r}"
  vocab = model_config.vocab_size
  why = vocab_rejection(prompt, vocab)
  if why:
    return why
  why = size_rejection(p, len(prompt), max_batch=c.max_batch,
                       max_model_len=max_model_len)
  if why:
    return why
  if p.beam_width > c.max_beam_width:
    return f"beam_width={p.beam_width} exceeds the engine's max_beam_width={c.max_beam_width}"
  why = limits_rejection(p, max_logprobs=min(c.max_logprobs, vocab),
                         max_logit_bias=c.max_logit_bias, vocab_size=vocab)
  if why:
    return why
  stops = p.stop_ids(model_config.eos_token_ids)
  if p.min_tokens and len(stops) > sampling_lib.MAX_BANNED:
    return (f"min_tokens needs at most {sampling_lib.MAX_BANNED} EOS and stop "
            f"token ids, got {len(stops)}")
  return window_pool.block_rejection(pool, len(prompt) + p.max_new_tokens,
                                     p.beam_width, c)
