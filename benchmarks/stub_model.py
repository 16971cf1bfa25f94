"""A `ServingModel` whose forward costs next to nothing (host-cost benchmarks
and the engine's scheduling tests).

The hidden state of a token row is its token's embedding plus a term in its
position, and the logits are one small matmul, so greedy outputs depend only
on the token and the position and are the same alone and batched. Nothing is
written to the cache.

A slow device step, to show what the host does meanwhile:
`StubConfig.spin` adds that many chained [384, 384] matmuls to every step
(device work, dispatched asynchronously). `StubConfig.sleep_s` adds a host
callback that sleeps instead; note that on the CPU backend a program with a
host callback runs synchronously inside its dispatch (measured with JAX
0.10.2: a jitted call whose callback sleeps 0.2 s returned after 0.22 s, a
0.3 s matmul chain after 8 ms), so use `spin` to show overlap on CPU.

Imports only `paged_jax` (the installed API) and JAX, so the same file runs
against any version of the engine.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import kv_cache as kv_cache_lib


@dataclasses.dataclass(frozen=True)
class StubConfig:
  vocab_size: int = 64
  max_position_embeddings: int = 1 << 16
  eos_token_ids: tuple[int, ...] = ()
  num_layers: int = 1
  num_kv_heads: int = 1
  head_dim: int = 8
  hidden_size: int = 8
  sleep_s: float = 0.0  # host callback sleep per step (0: none)
  spin: int = 0  # chained [384, 384] matmuls per step (0: none)

  @property
  def jnp_dtype(self):
    return jnp.float32


# Every call of the sleeping callback records (start, end) perf_counter times.
CALLBACK_TIMES: list[tuple[float, float]] = []


def _sleep(seconds: float):
  def callback(x):
    t0 = time.perf_counter()
    time.sleep(seconds)
    CALLBACK_TIMES.append((t0, time.perf_counter()))
    return x
  return callback


class StubModel(nnx.Module):
  """See the module docstring."""

  def __init__(self, config: StubConfig = StubConfig(), seed: int = 0):
    self.config = config
    k1, k2 = jax.random.split(jax.random.key(seed))
    v, h = config.vocab_size, config.hidden_size
    self.embed = nnx.Param(jax.random.normal(k1, (v, h), jnp.float32))
    self.head = nnx.Param(jax.random.normal(k2, (h, v), jnp.float32))

  def make_cache(self, num_blocks: int, block_size: int, dtype=None):
    c = self.config
    return kv_cache_lib.KVCache.create(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
        num_blocks=num_blocks, block_size=block_size, head_dim=c.head_dim,
        dtype=jnp.float32)

  def paged_forward(self, tokens, meta, cache):
    h = self.embed[...][tokens] + 0.01 * meta.positions[:, None].astype(jnp.float32)
    if self.config.spin > 0:
      m0 = jnp.full((384, 384), 1.0 / 384, jnp.float32) + h[:1, :1]
      acc = jax.lax.fori_loop(0, self.config.spin,
                              lambda i, m: jnp.tanh(m @ m.T + 0.1), m0)
      h = h + 1e-30 * acc[0, 0]  # below float32 resolution: h unchanged
    if self.config.sleep_s > 0:
      h = jax.pure_callback(_sleep(self.config.sleep_s),
                            jax.ShapeDtypeStruct(h.shape, h.dtype), h)
    return h, cache

  def logits(self, hidden):
    return hidden @ self.head[...]

  def shard(self, mesh):
    return self
