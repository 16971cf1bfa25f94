"""Sampling: per-request parameters and the jitted sampler (beam search: `beam.py`).

Randomness is keyed by `(seed, position)`: the token generated at position `p`
of a sequence whose seed is `s` uses `fold_in(fold_in(key(0), s), p)`. So the
output does not depend on batching, on which step a token is produced in, or
on preemption and recompute; sample `i` of an `n > 1` request uses seed
`seed + i` and matches an `n = 1` request with that seed.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax._int32 import INT32_MAX, INT32_MIN


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to generate for one request.

  Attributes:
    max_new_tokens: output budget per sequence (>= 1).
    temperature: 0 is greedy (deterministic); > 0 samples.
    top_k: keep the `top_k` most likely tokens; 0 keeps all.
    top_p: keep the smallest set of tokens whose probability reaches `top_p`
      (applied after top-k); 1.0 keeps all.
    seed: random seed; sample `i` uses `seed + i`.
    n: independent samples of the prompt (they share its blocks).
    beam_width: > 1 runs beam search (deterministic; the temperature, top-k
      and top-p are ignored) and returns `beam_width` hypotheses.
    eos_token_ids: stop tokens; the model's when empty.
    length_penalty: beam hypotheses are ranked by
      `sum_logprob / num_generated ** length_penalty`.
    stop_token_ids: more tokens that end a sequence (besides the EOS ones);
      finish reason "stop", the token kept in `token_ids`.
    min_tokens: the EOS and stop tokens are masked out of the first
      `min_tokens` generated tokens (at most `MAX_BANNED` such ids).
    stop: stop strings, matched on the decoded text by the text layer
      (`paged_jax.serving.text`); the engine itself ignores them. One str is
      one stop string.
    ignore_eos: no EOS token ends a sequence (`stop_token_ids` still do).
    logprobs: None, or the number of most likely alternatives returned with
      each generated token besides the sampled one (vLLM's meaning; 0: the
      sampled token's log-probability only, which every token has anyway).
      At most the engine's `EngineConfig.max_logprobs` (a rejection past
      it); not with beam search. The log-probabilities are those of the
      distribution the sampler starts from: the model's logits after
      `logit_bias` and the `min_tokens` mask, before temperature, top-k and
      top-p (see `token_logprobs`).
    logit_bias: added to the model's logits before sampling (greedy too), a
      mapping (or pairs) from token id to a bias in [-100, 100] (OpenAI's
      range: -100 in effect bans a token, +100 all but forces it). Stored as
      `(id, bias)` pairs sorted by id. At most the engine's
      `EngineConfig.max_logit_bias` entries, ids inside its vocabulary (the
      engine rejects the request otherwise).

  Every field is checked here against what the engine can hold (ids, counts
  and seeds are int32 on the device), so a request built from any input
  either raises `ValueError` now or is served: integers (not bools) in
  range, finite reals, token ids as a sequence of ints in int32, stop
  strings non-empty. Sequences are stored as tuples.

  Raises:
    ValueError: a field out of its range or of the wrong type, naming it.
  """

  max_new_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  n: int = 1
  beam_width: int = 1
  eos_token_ids: tuple[int, ...] = ()
  length_penalty: float = 1.0
  stop_token_ids: tuple[int, ...] = ()
  min_tokens: int = 0
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  logprobs: int | None = None
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    # Every value is checked against what the engine holds: int32 ids,
    # counts and seeds on the device, so nothing can fail or wrap in a step.
    for name, lo in (("max_new_tokens", 1), ("top_k", 0), ("n", 1), ("beam_width", 1),
                     ("min_tokens", 0)):
      self._set(name, _int(name, getattr(self, name), lo, INT32_MAX))
    for name in ("temperature", "top_p", "length_penalty"):
      self._set(name, _real(name, getattr(self, name)))
    # Both are float32 on the device: finite there, and top_p not rounded to 0.
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
    if self.temperature > FLOAT32_MAX:
      raise ValueError(f"temperature must be <= {FLOAT32_MAX:.4g} (float32), got "
                       f"{self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if np.float32(self.top_p) == 0:
      raise ValueError(f"top_p must be in (0, 1] in float32, got {self.top_p!r}")
    if not math.isfinite(self.length_penalty):
      raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")
    if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
        or not 0 <= self.seed <= INT32_MAX:
      raise ValueError(f"seed must be an int in [0, 2**31), got {_show(self.seed)}")
    self._set("seed", int(self.seed))
    if self.seed + self.num_seqs - 1 > INT32_MAX:  # sample i uses seed + i
      raise ValueError(f"seed + {self.num_seqs - 1} (sample i uses seed + i) must be "
                       f"< 2**31, got seed={self.seed}")
    if self.min_tokens > self.max_new_tokens:
      raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}]"
                       f", got {self.min_tokens!r}")
    for name in ("eos_token_ids", "stop_token_ids"):
      self._set(name, _ids(name, getattr(self, name)))
    if isinstance(self.stop, str):
      self._set("stop", (self.stop,))
    if not isinstance(self.stop, (tuple, list)) or any(
        not isinstance(t, str) or not t for t in self.stop):
      raise ValueError(f"stop strings must be non-empty str, got {_show(self.stop)}")
    self._set("stop", tuple(self.stop))
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"ignore_eos must be a bool, got {_show(self.ignore_eos)}")
    if self.ignore_eos and self.eos_token_ids:
      raise ValueError(f"give eos_token_ids or ignore_eos, not both (got "
                       f"eos_token_ids={self.eos_token_ids})")
    if self.logprobs is not None:
      self._set("logprobs", _int("logprobs", self.logprobs, 0, INT32_MAX))
      if self.beam_width > 1:
        raise ValueError(f"logprobs is not served with beam search (got "
                         f"beam_width={self.beam_width})")
    self._set("logit_bias", _bias(self.logit_bias))
    if self.n > 1 and self.beam_width > 1:
      raise ValueError(f"use n or beam_width, not both (got n={self.n}, "
                       f"beam_width={self.beam_width})")

  def _set(self, name, value):
    object.__setattr__(self, name, value)

  def stop_ids(self, model_eos_token_ids) -> frozenset[int]:
    """The token ids that end a sequence: the EOS ones (this request's, else
    the model's; none with `ignore_eos`) and `stop_token_ids`."""
    eos = () if self.ignore_eos else (self.eos_token_ids or tuple(model_eos_token_ids))
    return frozenset(eos) | frozenset(self.stop_token_ids)

  @property
  def num_seqs(self) -> int:
    """Sequences the request runs at once."""
    return max(self.n, self.beam_width)


FLOAT32_MAX = float(np.finfo(np.float32).max)
_REPR = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40


def _show(value) -> str:
  """A short repr, safe for any value (deeply nested ones too)."""
  return _REPR.repr(value)


def _int(name: str, value, lo: int, hi: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be an int >= {lo}, got {_show(value)}")
  if not lo <= value <= hi:
    raise ValueError(f"{name} must be >= {lo}" + (" and < 2**31" if value > hi else "")
                     + f", got {value!r}")
  return int(value)


def _real(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise ValueError(f"{name} must be a real number, got {_show(value)}")
  return float(value)


def _ids(name: str, value) -> tuple[int, ...]:
  """Token ids as a tuple of int32 ints (a negative id is never sampled)."""
  if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
    raise ValueError(f"{name} must be a tuple of int token ids, got {_show(value)}")
  bad = [t for t in value if isinstance(t, bool) or not isinstance(t, (int, np.integer))
         or not INT32_MIN <= t <= INT32_MAX]
  if bad:
    raise ValueError(f"{name} must hold int32 token ids, got {_show(bad[0])}")
  return tuple(int(t) for t in value)


MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range)


def _bias(value) -> tuple[tuple[int, float], ...]:
  """`logit_bias` as `(id, bias)` pairs sorted by id: int32 ids >= 0, each
  once, biases finite reals in [-MAX_BIAS, MAX_BIAS]."""
  if isinstance(value, dict):
    pairs = list(value.items())
  elif isinstance(value, (tuple, list)) and all(
      isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
    pairs = [tuple(p) for p in value]
  else:
    raise ValueError(f"logit_bias must map token ids to biases, got {_show(value)}")
  for t, b in pairs:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) \
        or not 0 <= t <= INT32_MAX:
      raise ValueError(f"logit_bias keys must be int32 token ids >= 0, got {_show(t)}")
    if isinstance(b, bool) or not isinstance(b, (int, float, np.integer, np.floating)) \
        or not -MAX_BIAS <= b <= MAX_BIAS:  # (NaN fails both comparisons)
      raise ValueError(f"logit_bias values must be finite numbers in "
                       f"[-{MAX_BIAS:g}, {MAX_BIAS:g}], got {_show(b)} for token {t}")
  ids = [int(t) for t, _ in pairs]
  if len(set(ids)) != len(ids):
    raise ValueError("logit_bias names a token id twice")
  return tuple(sorted((int(t), float(b)) for t, b in pairs))


def add_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
  """`logits` (f32[rows, vocab]) plus each row's `values` (f32[rows, B]) at
  its `ids` (i32[rows, B], -1 = none): one scatter-add. `B == 0` (the
  feature off): `logits` unchanged, nothing runs."""
  if ids.shape[-1] == 0:
    return logits
  rows, vocab = logits.shape
  ids = jnp.where(ids >= 0, ids, vocab)  # out of range: dropped
  return logits.at[jnp.arange(rows)[:, None], ids].add(values, mode="drop")


# Token ids one sample row may mask (min_tokens: the EOS and stop tokens).
MAX_BANNED = 8


def ban_tokens(logits: jax.Array, banned: jax.Array) -> jax.Array:
  """`logits` (f32[rows, vocab]) with the ids `banned` (i32[rows, MAX_BANNED],
  -1 = none) of each row set to -inf."""
  rows, vocab = logits.shape
  ids = jnp.where(banned >= 0, banned, vocab)  # out of range: dropped
  return logits.at[jnp.arange(rows)[:, None], ids].set(-jnp.inf, mode="drop")


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """f32[rows]: log-probability of `tokens` (i32[rows]) under `logits`
  (f32[rows, vocab]: the engine passes the logits after the bans and biases,
  before temperature, top-k and top-p; `top_logprobs` reads the same)."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse


def _filtered_logits(logits, temperature, top_k, top_p):
  """One row: temperature, then top-k, then top-p; masked entries -inf.

  Exactly the identity (after scaling) for `top_k == 0` and `top_p >= 1`, so a
  row's result never depends on the other rows of the batch.
  """
  vocab = logits.shape[-1]
  scaled = logits / jnp.maximum(temperature, 1e-6)
  sorted_desc = -jnp.sort(-scaled)
  ranks = jnp.arange(vocab)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_k = ranks < k
  probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf))
  before = jnp.cumsum(probs) - probs  # mass strictly above each rank
  keep = in_k & ((before < top_p) | (top_p >= 1.0))
  threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf))
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def argmax(logits: jax.Array) -> jax.Array:
  """`i32[rows]`: `jnp.argmax(logits, axis=-1)` of `logits` (f32[rows, vocab]),
  exactly (the first maximum; the first NaN of a row that has one), as two
  plain reductions: the row's maximum, then the least index that holds it.

  XLA:CPU lowers `jnp.argmax` to one variadic (value, index) reduction that
  it does not vectorise: over SmolLM2's 49,152 logits it took 11.1 ms at 32
  rows against 1.3 ms for this form (RESULTS 7p), 3% of a decode step.
  """
  nan = jnp.isnan(logits)
  # XLA:CPU's max does not always propagate a NaN, so NaN rows are told apart.
  nan_row = jnp.any(nan, axis=-1, keepdims=True)
  top = jnp.max(logits, axis=-1, keepdims=True)
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  hit = jnp.where(nan_row, nan, logits == top)
  return jnp.min(jnp.where(hit, ids, logits.shape[-1]), axis=-1)


def sample_tokens(
    logits: jax.Array,  # f32[rows, vocab]
    temperature: jax.Array,  # f32[rows]
    top_k: jax.Array,  # i32[rows]
    top_p: jax.Array,  # f32[rows]
    seeds: jax.Array,  # i32[rows]
    positions: jax.Array,  # i32[rows]
) -> jax.Array:
  """Samples one token per row (jittable; rows are independent).

  Rows with `temperature == 0` take the argmax. Others sample from the
  temperature-scaled, top-k and top-p filtered distribution with the key
  `fold_in(fold_in(key(0), seed), position)`. The sort that top-k/top-p need
  and the random draws run only when some row asks for them (`lax.cond`), so
  an all-greedy batch costs one argmax.

  Returns:
    `i32[rows]` token ids.
  """
  greedy = argmax(logits)

  def stochastic(_):
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    needs_filter = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1.0)))
    filtered = jax.lax.cond(
        needs_filter,
        lambda _: jax.vmap(_filtered_logits)(logits, temperature, top_k, top_p),
        lambda _: scaled, None)

    def draw(row, seed, pos):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), pos)
      return jax.random.categorical(key, row).astype(jnp.int32)

    return jnp.where(temperature > 0, jax.vmap(draw)(filtered, seeds, positions),
                     greedy)

  return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`(f32[rows, k] log-probabilities, i32[rows, k] ids)`, best first.

  The top `k` of the logits themselves (a row's log-softmax is the logits
  shifted by one constant, so the order is the same) minus the row's
  logsumexp: no `[rows, vocab]` log-softmax is materialised, and the
  logsumexp is the one `token_logprobs` computes (XLA computes it once)."""
  top, ids = jax.lax.top_k(logits, k)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return top - lse[:, None], ids.astype(jnp.int32)
