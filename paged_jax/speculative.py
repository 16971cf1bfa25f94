"""Speculative decoding: verifying draft tokens, and the n-gram proposer.

A verification step, per sequence with `L` cached tokens and last sampled
token `t`: a proposer drafts `d <= k` tokens; the step reserves `1 + d` slots
(`block_manager.reserve`), runs the target model on the `1 + d` query rows
`[t, x_0 .. x_{d-1}]` (ragged attention takes `q_len > 1` per sequence, in
the same step as other sequences' decode rows) and gets the target's
distribution after each row: `1 + d` rows of logits. A verifier here accepts
`a <= d` drafts and emits `a + 1` tokens: the accepted drafts, then one token
of the target's own (the correction at the first rejection, or the bonus
token when every draft is accepted). The step then rolls the cache back to
the tokens it keeps, `block_manager.truncate(state, seq, L + 1 + a)`, before
anything registers blocks for the prefix cache, so no draft token is ever
cached. The emitted token `a + 1` is not cached yet: it is next step's `t`.

* `greedy_accept`: temperature 0. The emitted tokens are exactly the target's
  greedy tokens (the longest prefix where draft == target argmax, plus the
  target's next token).
* `rejection_sample`: temperature > 0 (Leviathan et al. 2023, Chen et al.
  2023): draft `x` with draft probability `q(x)` is accepted with probability
  `min(1, p(x) / q(x))`; at the first rejection the token is drawn from
  `norm(max(0, p - q))`; when all are accepted the bonus token is drawn from
  `p`. The emitted tokens are distributed exactly as the target's own
  samples. A deterministic draft (the n-gram proposer) is `q` one-hot:
  `draft_probs=None`.
* `ngram_propose`: prompt lookup (vLLM's `"method": "ngram"`, with its
  `prompt_lookup_min` / `prompt_lookup_max`); `SpeculativeConfig` reads
  vLLM's `--speculative-config` JSON for it.

All three are pure, jittable and batched; ragged batches pass `num_draft`
per row, padding rows `num_draft = 0`.

Example:
  >>> draft = jnp.array([[5, 7, 9]])
  >>> target = jnp.array([[5, 7, 2, 4]])  # argmax after each query row
  >>> tokens, accepted = greedy_accept(draft, target, jnp.array([3]))
  >>> tokens.tolist(), accepted.tolist()
  ([[5, 7, 2, -1]], [2])
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _int32

# Entries of `tokens` past the emitted ones, and of drafts past `num_draft`.
NO_TOKEN = -1


def _shape_error(name, want, x):
  return ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def _check_drafts(draft_tokens, num_draft):
  draft_tokens = _int32.as_int32("draft_tokens", draft_tokens, ndim=2)
  num_draft = _int32.as_int32("num_draft", num_draft)
  batch = draft_tokens.shape[0]
  if num_draft.shape != (batch,):
    raise _shape_error("num_draft", f"[batch={batch}]", num_draft)
  return draft_tokens, num_draft


def _emitted(draft_tokens, last, num_accepted, num_draft):
  """`(tokens i32[B, K + 1], num_accepted i32[B])`: drafts before
  `num_accepted`, `last` at it, `NO_TOKEN` after; rows whose `num_draft` lies
  outside `[0, K]` get no token and `num_accepted = -1`."""
  batch, k = draft_tokens.shape
  bad = (num_draft < 0) | (num_draft > k)
  cols = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  padded = jnp.concatenate(
      [draft_tokens, jnp.full((batch, 1), NO_TOKEN, jnp.int32)], axis=1)
  a = num_accepted[:, None]
  tokens = jnp.where(cols < a, padded, jnp.where(cols == a, last[:, None],
                                                 NO_TOKEN))
  return (jnp.where(bad[:, None], NO_TOKEN, tokens),
          jnp.where(bad, -1, num_accepted))


def _leading_true(x):
  """`i32[B]`: length of the leading run of True along the last axis."""
  return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1,
                 dtype=jnp.int32)


def greedy_accept(draft_tokens, target_tokens, num_draft
                  ) -> tuple[jax.Array, jax.Array]:
  """Greedy verification: the longest prefix where draft == target, plus one.

  Args:
    draft_tokens: `int[B, K]` proposed tokens; entries past `num_draft` are
      ignored.
    target_tokens: `int[B, K + 1]` the target's greedy token after each query
      row: column `j` follows the sequence and `draft_tokens[:, :j]`.
    num_draft: `int[B]` drafts per row, in `[0, K]`.

  Returns:
    `(tokens i32[B, K + 1], num_accepted i32[B])`: the row emits
    `num_accepted + 1` tokens, `tokens[:num_accepted + 1]` (exactly the
    target's greedy continuation); `NO_TOKEN` after. A row whose `num_draft`
    lies outside `[0, K]` emits nothing and gets `num_accepted = -1` (its
    `truncate` to `L + 1 + num_accepted = L` then rolls the whole lookahead
    back).

  Raises:
    ValueError: if the arguments are not integer arrays of shapes `[B, K]`,
      `[B, K + 1]` and `[B]`.
  """
  draft_tokens, num_draft = _check_drafts(draft_tokens, num_draft)
  batch, k = draft_tokens.shape
  target_tokens = _int32.as_int32("target_tokens", target_tokens, ndim=2)
  if target_tokens.shape != (batch, k + 1):
    raise _shape_error("target_tokens", f"[batch={batch}, K + 1={k + 1}]",
                       target_tokens)
  cols = jnp.arange(k, dtype=jnp.int32)[None, :]
  match = (draft_tokens == target_tokens[:, :k]) & (cols < num_draft[:, None])
  accepted = _leading_true(match)
  last = jnp.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
  return _emitted(draft_tokens, last, accepted, num_draft)


def rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, keys
                     ) -> tuple[jax.Array, jax.Array]:
  """Sampling verification that preserves the target distribution.

  Row by row: draft `j` (token `x`, draft probability `q_j(x)`, target
  probability `p_j(x)`) is accepted with probability `min(1, p_j(x) /
  q_j(x))`, in order, until the first rejection. At a rejection in column
  `j` the emitted token is drawn from `norm(max(0, p_j - q_j))`; when all
  `num_draft` drafts are accepted, the bonus token is drawn from
  `p_{num_draft}`. A draft token outside `[0, V)` is rejected and the token
  drawn from `p_j` (as if `q_j` put its mass outside the vocabulary).

  `p` and `q` are the distributions the tokens are meant to follow, after
  temperature, top-k and top-p: both models' filtered probabilities,
  normalised (the acceptance test compares their values; the draws
  normalise for themselves). A one-hot `p` (a temperature-0 row) makes this
  exactly `greedy_accept`, so a batch mixing greedy and sampled requests can
  run this function alone.

  Args:
    draft_tokens: `int[B, K]` proposed tokens, drawn from `draft_probs`.
    draft_probs: `float[B, K, V]` the draft's distribution for each draft,
      or `None` for a deterministic draft (`q` one-hot at the draft token:
      the n-gram proposer). Entries past `num_draft` are ignored.
    target_probs: `float[B, K + 1, V]` the target's distribution after each
      query row (column `j` follows the sequence and `draft_tokens[:, :j]`).
    num_draft: `int[B]` drafts per row, in `[0, K]`.
    keys: `B` PRNG keys, one per row (`key<impl>[B]`, or raw `uint32[B, 2]`),
      e.g. the engine's `fold_in(fold_in(key(0), seed), position)`.

  Returns:
    `(tokens i32[B, K + 1], num_accepted i32[B])`, as `greedy_accept`.

  Raises:
    ValueError: if a shape or dtype is not the one above (the vocabulary of
      `draft_probs` and `target_probs` must agree; probabilities must be
      floating point).
  """
  draft_tokens, num_draft = _check_drafts(draft_tokens, num_draft)
  batch, k = draft_tokens.shape
  target_probs = jnp.asarray(target_probs)
  if target_probs.ndim != 3 or target_probs.shape[:2] != (batch, k + 1):
    raise _shape_error("target_probs",
                       f"[batch={batch}, K + 1={k + 1}, vocab]", target_probs)
  vocab = target_probs.shape[2]
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs)
    if draft_probs.shape != (batch, k, vocab):
      raise _shape_error("draft_probs",
                         f"[batch={batch}, K={k}, vocab={vocab}]", draft_probs)
  for name, x in (("target_probs", target_probs), ("draft_probs", draft_probs)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
  keys = jnp.asarray(keys)
  if keys.shape[:1] != (batch,):
    raise ValueError(f"keys must hold one PRNG key per row ([batch={batch}] "
                     f"typed keys or [batch, 2] raw ones), got shape "
                     f"{tuple(keys.shape)}")
  p = target_probs.astype(jnp.float32)
  q = None if draft_probs is None else draft_probs.astype(jnp.float32)
  rows = jnp.arange(batch)
  cols = jnp.arange(k, dtype=jnp.int32)[None, :]
  in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)
  safe = jnp.clip(draft_tokens, 0, vocab - 1)
  split = jax.vmap(jax.random.split)(keys)
  if k:
    px = jnp.take_along_axis(p[:, :k], safe[..., None], axis=2)[..., 0]
    qx = (jnp.ones_like(px) if q is None else
          jnp.take_along_axis(q, safe[..., None], axis=2)[..., 0])
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(split[:, 0])
    # u in [0, 1): accept with probability min(1, p/q); p >= q always accepts
    # (when p > 0), without a division.
    accept = jnp.where(px >= qx, px > 0, u * qx < px)
    accept &= in_vocab & (cols < num_draft[:, None])
    accepted = _leading_true(accept)
  else:
    accepted = jnp.zeros((batch,), jnp.int32)
  p_at = p[rows, accepted]  # [B, V]: the target's row at the stop column
  rejected = accepted < num_draft
  if k:
    j = jnp.minimum(accepted, k - 1)
    vocab_ids = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    if q is None:
      residual = jnp.where(vocab_ids == safe[rows, j][:, None], 0.0, p_at)
    else:
      residual = jnp.maximum(p_at - q[rows, j], 0.0)
    rejected_in_vocab = rejected & in_vocab[rows, j]
    dist = jnp.where(rejected_in_vocab[:, None], residual, p_at)
    # Rounding can leave a rejection with no residual mass: fall back to p.
    dist = jnp.where(jnp.sum(dist, axis=1, keepdims=True) > 0, dist, p_at)
  else:
    dist = p_at
  last = jax.vmap(jax.random.categorical)(split[:, 1], jnp.log(dist))
  return _emitted(draft_tokens, last.astype(jnp.int32), accepted, num_draft)


def ngram_propose(tokens, lens, *, num_speculative_tokens: int,
                  prompt_lookup_min: int, prompt_lookup_max: int,
                  max_len=None) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup: drafts the tokens that followed an earlier copy of the
  sequence's last n tokens.

  For each row, finds the longest `n` in `[prompt_lookup_min,
  prompt_lookup_max]` such that the last `n` tokens occur earlier in the
  sequence (overlapping the suffix is allowed, the suffix itself is not a
  match), takes the earliest such occurrence, and proposes the up to
  `num_speculative_tokens` tokens that follow it (fewer when the sequence
  ends first). vLLM's n-gram proposer makes the same choice. Cost:
  `O(B * T * prompt_lookup_max)` comparisons, no sort.

  Args:
    tokens: `int[B, T]` token ids; row `b`'s sequence is `tokens[b,
      :lens[b]]` (prompt and generated tokens, the last sampled one
      included); entries past it are ignored.
    lens: `int[B]` sequence lengths; values are clipped to `[0, T]`.
    num_speculative_tokens: `k >= 1`, the most drafts per row (static).
    prompt_lookup_min: shortest n-gram to match, `>= 1` (static).
    prompt_lookup_max: longest n-gram to match, `>= prompt_lookup_min`
      (static).
    max_len: `int` or `int[B]`, optional: the longest a sequence may get;
      drafts are capped at `max_len - lens` (vLLM's `max_model_len`).

  Returns:
    `(draft i32[B, k], num_draft i32[B])`: `draft[b, :num_draft[b]]` are the
    proposals, `NO_TOKEN` after; `num_draft` is 0 where nothing matches.

  Raises:
    ValueError: if `tokens` is not `[B, T]` and `lens` `[B]` of an integer
      dtype, or a static size is out of range.

  Example:
    >>> draft, n = ngram_propose(jnp.array([[1, 2, 3, 4, 2, 3]]),
    ...                          jnp.array([6]), num_speculative_tokens=4,
    ...                          prompt_lookup_min=2, prompt_lookup_max=3)
    >>> draft.tolist(), n.tolist()
    ([[4, 2, 3, -1]], [3])
  """
  k = _int32.positive_int("num_speculative_tokens", num_speculative_tokens)
  n_min = _int32.positive_int("prompt_lookup_min", prompt_lookup_min)
  n_max = _int32.positive_int("prompt_lookup_max", prompt_lookup_max)
  if n_max < n_min:
    raise ValueError(f"prompt_lookup_max={n_max} must be >= "
                     f"prompt_lookup_min={n_min}")
  tokens = _int32.as_int32("tokens", tokens, ndim=2)
  lens = _int32.as_int32("lens", lens)
  batch, t = tokens.shape
  if lens.shape != (batch,):
    raise _shape_error("lens", f"[batch={batch}]", lens)
  if max_len is not None:
    shape = (batch,)
    max_len = _int32.as_int32("max_len", jnp.broadcast_to(max_len, shape)
                              if isinstance(max_len, jax.Array) else
                              np.broadcast_to(np.asarray(max_len), shape))
  cols = jnp.arange(k, dtype=jnp.int32)[None, :]
  if t < 2:  # static: no earlier match fits
    return (jnp.full((batch, k), NO_TOKEN, jnp.int32),
            jnp.zeros((batch,), jnp.int32))
  lens = jnp.clip(lens, 0, t)
  ends = jnp.arange(t, dtype=jnp.int32)[None, :]  # end of an earlier match
  rows = jnp.arange(batch)
  # length[b, e]: how many of the last n_max tokens end an equal run at e,
  # grown one token at a time. A match must leave a token to propose after
  # it, so the suffix itself never matches.
  run = ends <= lens[:, None] - 2
  length = jnp.zeros((batch, t), jnp.int32)
  for i in range(min(n_max, t)):
    last_i = tokens[rows, jnp.clip(lens - 1 - i, 0, t - 1)]  # [B]
    earlier = tokens[rows[:, None], jnp.clip(ends - i, 0, t - 1)]  # [B, T]
    run &= (ends >= i) & (lens[:, None] > i) & (earlier == last_i[:, None])
    length += run.astype(jnp.int32)
  best = jnp.max(length, axis=1)
  # The earliest of the longest matches.
  start = jnp.argmax(length == best[:, None], axis=1).astype(jnp.int32) + 1
  count = jnp.minimum(k, lens - start)
  if max_len is not None:  # max(., 0) - lens cannot wrap
    count = jnp.minimum(count, jnp.maximum(max_len, 0) - lens)
  count = jnp.where(best >= n_min, jnp.maximum(count, 0), 0)
  draft = tokens[rows[:, None], jnp.clip(start[:, None] + cols, 0, t - 1)]
  return jnp.where(cols < count[:, None], draft, NO_TOKEN), count


METHODS = ("ngram", "draft_model")  # vLLM's names; "eagle": not yet
_NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
_DRAFT_ONLY = ("model", "draft_num_layers")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """vLLM's `--speculative-config`, for the methods implemented here.

  `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ...,
  "prompt_lookup_min": ...}`. As in vLLM, the n-gram bounds default to 5 and
  5 when both are left out, and one given alone sets the other.

  `{"method": "draft_model", "model": ..., "num_speculative_tokens": k}`: a
  draft model with the target's vocabulary proposes on the device
  (`serving.spec_draft`). `model` (vLLM's key) names its checkpoint as
  `--model` does (`paged_jax.models.loader.load`: "tiny", "smollm2", a
  Hugging Face directory, a .gguf file); left out, the draft is the target
  itself. `draft_num_layers` (paged-jax's key) keeps only the draft's
  first layers: `{"method": "draft_model", "draft_num_layers": 2, ...}`
  is the target cut to 2 layers.

  Attributes:
    method: one of `METHODS`.
    num_speculative_tokens: drafts per sequence and step, `k >= 1`.
    prompt_lookup_min: shortest n-gram to match (`>= 1`).
    prompt_lookup_max: longest n-gram to match (`>= prompt_lookup_min`).
    model: draft_model: the draft's checkpoint (None: the target).
    draft_num_layers: draft_model: layers of the draft kept (None: all).
    adaptive: (paged-jax's, not vLLM's) the engine's speculation policy
      (`serving.spec_policy`): rows whose proposals keep missing sit out,
      and a step verifies only the drafts whose expected acceptance pays
      for the rows they add (each step program timed at warm-up). False:
      every eligible step with a proposal verifies it.

  Raises:
    ValueError: naming the field: an unknown method (the supported ones
      listed), a count that is not a positive int, `prompt_lookup_max <
      prompt_lookup_min`, an `adaptive` that is not a bool, a key of the
      other method (`prompt_lookup_*` with draft_model, `model` or
      `draft_num_layers` with ngram), a `model` that is not a string.

  Example:
    >>> config = SpeculativeConfig.from_json(
    ...     '{"method": "ngram", "num_speculative_tokens": 3, '
    ...     '"prompt_lookup_max": 4}')
    >>> config.prompt_lookup_min, config.prompt_lookup_max
    (4, 4)
  """

  num_speculative_tokens: int
  method: str = "ngram"
  prompt_lookup_min: int | None = None
  prompt_lookup_max: int | None = None
  model: str | None = None
  draft_num_layers: int | None = None
  adaptive: bool = True

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method={self.method!r} is not supported; supported: "
                       f"{', '.join(METHODS)}")
    set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731
    set_("num_speculative_tokens", _int32.positive_int(
        "num_speculative_tokens", self.num_speculative_tokens))
    if not isinstance(self.adaptive, bool):
      raise ValueError(f"adaptive must be a bool, got {self.adaptive!r}")
    other = _NGRAM_ONLY if self.method == "draft_model" else _DRAFT_ONLY
    for name in other:
      if getattr(self, name) is not None:
        raise ValueError(f"{name} does not apply to method={self.method!r}")
    if self.method == "draft_model":
      if self.model is not None and not isinstance(self.model, str):
        raise ValueError(f"model must be a checkpoint name or path (a string), "
                         f"got {self.model!r}")
      if self.draft_num_layers is not None:
        set_("draft_num_layers", _int32.positive_int("draft_num_layers",
                                                     self.draft_num_layers))
      return
    lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
    if lo is None and hi is None:
      lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    set_("prompt_lookup_min", _int32.positive_int("prompt_lookup_min", lo))
    set_("prompt_lookup_max", _int32.positive_int("prompt_lookup_max", hi))
    if self.prompt_lookup_max < self.prompt_lookup_min:
      raise ValueError(f"prompt_lookup_max={self.prompt_lookup_max} must be >= "
                       f"prompt_lookup_min={self.prompt_lookup_min}")

  @classmethod
  def from_json(cls, config) -> SpeculativeConfig:
    """From the JSON text of `--speculative-config` (or its parsed dict).

    Raises:
      ValueError: if the text is not a JSON object, names a key this config
        does not have, or a field is invalid (see the class).
    """
    if isinstance(config, str):
      try:
        config = json.loads(config)
      except json.JSONDecodeError as e:
        raise ValueError(f"speculative config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
      raise ValueError(f"speculative config must be a JSON object, got "
                       f"{type(config).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - names)
    if unknown:
      raise ValueError(f"unknown speculative config keys {unknown}; known: "
                       f"{sorted(names)}")
    if "num_speculative_tokens" not in config:
      raise ValueError("speculative config needs num_speculative_tokens")
    return cls(**config)

  def propose(self, tokens, lens, max_len=None) -> tuple[jax.Array, jax.Array]:
    """This config's proposer (`ngram_propose`) on `tokens` `int[B, T]`,
    `lens` `int[B]`: `(draft i32[B, k], num_draft i32[B])`.

    Raises:
      ValueError: for method "draft_model" (its proposer is a model on the
        device: `serving.spec_draft.propose`).
    """
    if self.method != "ngram":
      raise ValueError(f"propose is the ngram proposer; method={self.method!r} "
                       "proposes in the engine (serving.spec_draft)")
    return ngram_propose(tokens, lens,
                         num_speculative_tokens=self.num_speculative_tokens,
                         prompt_lookup_min=self.prompt_lookup_min,
                         prompt_lookup_max=self.prompt_lookup_max,
                         max_len=max_len)
