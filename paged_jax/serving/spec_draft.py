"""The draft-model proposer (`{"method": "draft_model", ...}`): a second,
smaller model with the target's vocabulary proposes on the device.

The draft's KV cache is a second `KVCache` with the target's number of
blocks and block size, indexed by the SAME block tables: the engine serves
`DraftPair(target, draft)`, whose cache is the pair `(target_cache,
draft_cache)`. One allocator and one `BlockState` therefore hold both
models' blocks: a sequence's draft blocks are its target blocks, so they
are reserved, forked, copied on write (`kv_cache.copy_blocks` copies in
both), rolled back (`block_manager.truncate`) and freed with the sequence,
with no second allocator to keep in step. The price is memory: the pool's
bytes per token are the target's plus the draft's (a 2-layer draft of a
30-layer target: +7%).

The invariant: after every step, the draft's KV holds the same positions
as the target's, computed on the same tokens.

* Ordinary steps (prompt prefill chunks, plain decode): `DraftPair.
  paged_forward` runs the draft on the step's tokens and metadata after the
  target (its hidden states are dropped), so the draft's prefill runs
  alongside the target's, in the same program.
* A verification step (`spec_step.spec_device_step`) of a row with `L`
  cached tokens, last token `t` and `d <= k` drafts (`1 + d` slots
  reserved, positions `L .. L + d`): `propose` runs `k + 1` draft decode
  steps in one `lax.fori_loop`; step `j` feeds `t` (j = 0) or the draft's
  own previous proposal `x_{j-1}`, writes its KV at position `L + j` and
  proposes `x_j = argmax` of the draft's logits (rows with `j > d` are
  inactive: no write). The target then verifies `[t, x_0 .. x_{d-1}]`
  (target only: the draft's KV at those positions is already written), and
  `truncate` keeps `L + 1 + a` positions: `t, x_0 .. x_{a-1}`, whose draft
  KV was computed on exactly those tokens (an accepted draft equals the
  token kept). The last draft step (`j = d`) only writes `x_{d-1}`'s KV,
  needed when all `d` drafts are accepted; this costs one more draft
  forward per round and keeps every round the same program (no catch-up
  of a ragged backlog).

The proposal is the draft's argmax, a point mass given the context, so the
verification's rule (a draft is accepted iff the target's seeded draw for
that position equals it; `spec_step.verify`) is exact at every
temperature: the emitted tokens are those of plain decoding for the same
seed. Acceptance with sampling is then `p(x)`, below full rejection
sampling's `min(1, p/q)` summed over a sampled draft.

Example:
  >>> spec = SpeculativeConfig.from_json(
  ...     '{"method": "draft_model", "num_speculative_tokens": 3, '
  ...     '"draft_num_layers": 1}')   # the target's first layer proposes
  >>> engine = Engine(model, EngineConfig(num_blocks=64,
  ...                                     speculative_config=spec))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import step_metadata as step_metadata_lib
from paged_jax.serving import sampling


class DraftPair(nnx.Module):
  """A target and its draft, served as one model (`ServingModel`).

  Its `config`, `logits` and `shard` are the target's; its cache is the
  pair `(target KVCache, draft KVCache)` over one pool of blocks, and
  `paged_forward` runs both models on the step's tokens (see the module
  docstring).

  Args:
    target: the served model.
    draft: a model with the target's `vocab_size` (any depth and width).

  Raises:
    ValueError: if the vocabularies differ.
  """

  def __init__(self, target, draft):
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
      raise ValueError(f"the draft model's vocab_size={dv} must equal the "
                       f"target's vocab_size={tv} (the same tokenizer)")
    self.target = target
    self.draft = draft
    self.config = target.config

  def make_cache(self, num_blocks: int, block_size: int, dtype=None) -> tuple:
    """`(target KVCache, draft KVCache)`, both of `num_blocks` blocks of
    `block_size` tokens (the draft's in its own layers, heads and dtype)."""
    return (self.target.make_cache(num_blocks, block_size, dtype),
            self.draft.make_cache(num_blocks, block_size, dtype))

  def paged_forward(self, tokens: jax.Array, meta, cache: tuple
                    ) -> tuple[jax.Array, tuple]:
    """The target's step and the draft's on the same tokens (`i32[num_tokens]`)
    and metadata: `(target hidden [num_tokens, hidden], (target, draft) cache)`."""
    hidden, target_cache = self.target.paged_forward(tokens, meta, cache[0])
    _, draft_cache = self.draft.paged_forward(tokens, meta, cache[1])
    return hidden, (target_cache, draft_cache)

  def logits(self, hidden: jax.Array) -> jax.Array:
    return self.target.logits(hidden)

  def shard(self, mesh):
    raise ValueError("speculative_config with method 'draft_model' runs on one "
                     "device, not on a mesh")


def truncate_layers(model, num_layers: int):
  """`model` (a `Llama`) keeping only its first `num_layers` layers, the same
  embedding, final norm and head: a draft made from the target itself.

  Raises:
    ValueError: if `num_layers` is not in `[1, model.config.num_layers]`, or
      the model's layers follow a pattern (`layer_types`) that the cut would
      break.
  """
  from paged_jax.models.llama.model import Llama  # pylint: disable=import-outside-toplevel
  c = model.config
  if (isinstance(num_layers, bool) or not isinstance(num_layers, int)
      or not 1 <= num_layers <= c.num_layers):
    raise ValueError(f"draft_num_layers must be an int in [1, {c.num_layers}] "
                     f"(the draft model's layers), got {num_layers!r}")
  if num_layers == c.num_layers:
    return model
  if c.layer_types is not None:
    raise ValueError("draft_num_layers cannot cut a model whose layers follow "
                     "a pattern (layer_types)")
  scan = c.scan_layers
  stacked = model.with_scan_layers(True)
  config = dataclasses.replace(c, num_layers=num_layers, scan_layers=True)
  new = Llama.abstract(config, implementation=model.implementation)
  state = nnx.state(stacked, nnx.Param)
  state["layers"] = jax.tree.map(lambda x: x[:num_layers], state["layers"])
  nnx.update(new, state)
  return new.with_scan_layers(scan)


def draft_kv_bytes_per_token(config, spec, cache_dtype=None) -> int | None:
  """Bytes per token the draft's cache adds to the pool: 0 without a draft
  model; for a draft made from the target (no `spec.model`: the target
  itself, or its first `spec.draft_num_layers` layers) the draft's own
  `kv_bytes_per_token`; None for a draft loaded from `spec.model` (its sizes
  are known only once it is loaded).

  Args:
    config: the target's `LlamaConfig`.
    spec: a `SpeculativeConfig`, or None.
    cache_dtype: as `LlamaConfig.kv_bytes_per_token`.
  """
  if spec is None or spec.method != "draft_model":
    return 0
  if spec.model is not None:
    return None
  layers = spec.draft_num_layers or config.num_layers
  return dataclasses.replace(config, num_layers=layers).kv_bytes_per_token(cache_dtype)


def attach(model, spec):
  """The model the engine serves for `spec` (`SpeculativeConfig`): `model`
  itself, or with method "draft_model" `DraftPair(model, draft)`: the draft
  loaded from `spec.model` (`paged_jax.models.loader.load`, in the target's
  dtype and layer form) or, without one, the target itself, then cut to
  `spec.draft_num_layers` layers when given.

  Raises:
    ValueError, FileNotFoundError: as `loader.load`, `truncate_layers` and
      `DraftPair`.
  """
  if spec is None or spec.method != "draft_model":
    return model
  draft = model
  if spec.model is not None:
    from paged_jax.models import loader  # pylint: disable=import-outside-toplevel
    draft = loader.load(spec.model, dtype=jnp.dtype(model.config.jnp_dtype).name,
                        implementation=getattr(model, "implementation", None),
                        scan_layers=model.config.scan_layers).model
  if spec.draft_num_layers is not None:
    draft = truncate_layers(draft, spec.draft_num_layers)
  return DraftPair(model, draft)


def propose(draft, cache: kv_cache_lib.KVCache, state: bm.BlockState,
            seq_ids: jax.Array, last: jax.Array, num_draft: jax.Array,
            active: jax.Array, k: int) -> tuple[jax.Array, kv_cache_lib.KVCache]:
  """The draft's `k` greedy proposals per row, its KV written at the rows'
  reserved positions (module docstring: `k + 1` decode steps in one
  `lax.fori_loop`).

  Args:
    draft: the draft model.
    cache: the draft's `KVCache`.
    state: the block state after the draft reserve: row `i`'s sequence holds
      `L_i + 1 + num_draft[i]` slots (its `seq_lens`).
    seq_ids: i32[S], each row's slot (-1: padding).
    last: i32[S], each row's last token `t` (position `L_i`).
    num_draft: i32[S], drafts `d_i <= k` to propose (the rest are -1).
    active: bool[S], rows whose reservations succeeded.
    k: static, `num_speculative_tokens`.

  Returns:
    `(drafts i32[S, k], cache)`: `drafts[i, :d_i]`, -1 after.
  """
  S = seq_ids.shape[0]
  real = (seq_ids >= 0) & active
  sid = jnp.clip(seq_ids, 0, state.max_seqs - 1)
  base = state.seq_lens[sid] - 1 - num_draft  # L_i
  cols = jnp.arange(k, dtype=jnp.int32)[None, :]

  def body(j, carry):
    tok, drafts, c = carry
    on = real & (j <= num_draft)
    # The sequence as the draft sees it at step j: L + j + 1 slots.
    lens = state.seq_lens.at[jnp.where(on, sid, state.max_seqs)].set(
        base + j + 1, mode="drop")
    # Every row keeps its one row of the decode layout; `active` turns the
    # finished ones off (a q_len of 0 would shift the rows after it).
    meta = step_metadata_lib.step_metadata(
        state.replace(seq_lens=lens), seq_ids, jnp.ones((S,), jnp.int32),
        num_tokens=S, active=on, decode_only=True)
    hidden, c = draft.paged_forward(tok, meta, c)
    nxt = sampling.argmax(draft.logits(hidden))
    drafts = jnp.where((cols == j) & (j < num_draft)[:, None] & on[:, None],
                       nxt[:, None], drafts)
    return jnp.where(on, nxt, tok), drafts, c

  init = (last.astype(jnp.int32), jnp.full((S, k), -1, jnp.int32), cache)
  _, drafts, cache = jax.lax.fori_loop(0, k + 1, body, init)
  return drafts, cache


def fill_layout(tokens: jax.Array, query_rows: jax.Array, drafts: jax.Array,
                num_draft: jax.Array) -> jax.Array:
  """The verification layout `tokens` (i32[T]) with row `i`'s drafts at its
  query rows `query_rows[i, 1:1 + num_draft[i]]` (`spec_step.SpecInputs`)."""
  T = tokens.shape[0]
  k = drafts.shape[1]
  cols = jnp.arange(k, dtype=jnp.int32)[None, :]
  idx = jnp.where(cols < num_draft[:, None], query_rows[:, 1:], T)
  return tokens.at[idx].set(drafts, mode="drop")
