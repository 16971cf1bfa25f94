"""What the engine needs from a model: a small protocol.

The engine is model-independent. A model it serves implements `ServingModel`
(structural typing: no base class to inherit). `paged_jax/models/llama/model.py`'s
`Llama` is one implementation.

The step calls, inside one jitted function:

    meta = paged_jax.step_metadata.step_metadata(state, seq_ids, q_lens, ...)
    hidden, cache = model.paged_forward(tokens, meta, cache)
    logits = model.logits(hidden[sample_rows])

so `paged_forward` and `logits` must be traceable, and the model must be an
`nnx.Module` (the engine splits it into a static graph and a flat list of
parameter arrays, `step.ModelDef`). The engine creates the cache with
`make_cache` and reads the sizes it needs from `config`.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import jax

from paged_jax import kv_cache as kv_cache_lib
from paged_jax.step_metadata import StepMetadata


@runtime_checkable
class ModelConfig(Protocol):
  """The static sizes the engine reads from `model.config`.

  Attributes:
    vocab_size: logits width; prompt ids must lie in `[0, vocab_size)`.
    max_position_embeddings: longest sequence the model accepts.
    eos_token_ids: default stop tokens (a request may give its own).
    num_layers, num_kv_heads, head_dim: the KV cache's shape (mesh engines
      build the cache from them).
    jnp_dtype: the cache's default dtype.
  """

  vocab_size: int
  max_position_embeddings: int
  eos_token_ids: Sequence[int]
  num_layers: int
  num_kv_heads: int
  head_dim: int

  @property
  def jnp_dtype(self): ...


@runtime_checkable
class ServingModel(Protocol):
  """A decoder the engine can serve (see the module docstring)."""

  config: ModelConfig

  def make_cache(self, num_blocks: int, block_size: int,
                 dtype=None) -> kv_cache_lib.KVCache:
    """A zeroed `KVCache` with `num_blocks` blocks of `block_size` tokens."""

  def paged_forward(self, tokens: jax.Array, meta: StepMetadata,
                    cache: kv_cache_lib.KVCache
                    ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """One step over the ragged token batch.

    Args:
      tokens: `i32[num_tokens]` in the step's layout (`StepMetadata`).
      meta: the step's metadata, shared by every layer.
      cache: the `KVCache`; this step's K/V are written into it.

    Returns:
      `(hidden [num_tokens, hidden_size], cache)`.
    """

  def logits(self, hidden: jax.Array) -> jax.Array:
    """`[..., hidden_size] -> f32[..., vocab_size]` (final norm and head)."""

  def shard(self, mesh) -> "ServingModel":
    """The model laid out over a `(data, model)` mesh (only for `Engine(...,
    mesh=...)`; the result's `config.num_kv_heads` is the cache's)."""
