"""Rotary position embeddings (RoPE), including Llama 3 frequency scaling.

The rotation is the "rotate half" form used by Llama and Hugging Face
transformers: the head dimension is split into two halves `(x1, x2)` and
rotated as `(x1 cos - x2 sin, x2 cos + x1 sin)`, with frequency `i` shared by
lanes `i` and `i + head_dim // 2`.

Frequencies are computed once on the host (they depend only on static config)
and positions are applied inside jit, so a query or key at absolute position
`p` gets the same rotation whether it is computed in a prefill chunk, a decode
step or the dense oracle.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1 frequency scaling (Hugging Face `rope_type: "llama3"`).

  Low frequencies (wavelength above `original_max_position_embeddings /
  low_freq_factor`) are divided by `factor`, high frequencies are kept, and the
  band between is interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LinearScaling:
  """Position interpolation: every frequency divided by `factor`."""

  factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Static RoPE settings; hashable so it can sit in a static argument.

  Attributes:
    head_dim: rotated dimension, even.
    theta: base wavelength (`rope_theta`).
    scaling: `None` (plain RoPE), `Llama3Scaling` or `LinearScaling`.
  """

  head_dim: int
  theta: float = 10000.0
  scaling: Llama3Scaling | LinearScaling | None = None

  def __post_init__(self):
    if self.head_dim <= 0 or self.head_dim % 2:
      raise ValueError(f"RoPE needs a positive even head_dim, got {self.head_dim=}")
    if self.theta <= 0:
      raise ValueError(f"RoPE theta must be positive, got {self.theta=}")


def inverse_frequencies(config: RopeConfig) -> np.ndarray:
  """Returns `f32[head_dim // 2]`, the (scaled) inverse frequencies.

  Computed in float32 exactly as Hugging Face transformers does, so that
  logits of the same checkpoint agree to float32 rounding.
  """
  dim = config.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv_freq = (np.float32(1.0) / (np.float32(config.theta) ** exponents)).astype(np.float32)
  scaling = config.scaling
  if scaling is None:
    return inv_freq
  if isinstance(scaling, LinearScaling):
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  if isinstance(scaling, Llama3Scaling):
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  raise ValueError(f"unknown RoPE scaling {scaling!r}")


def apply_rope(
    x: jax.Array,  # [num_tokens, num_heads, head_dim]
    positions: jax.Array,  # i32[num_tokens]
    config: RopeConfig,
) -> jax.Array:
  """Rotates `x` by its tokens' positions.

  Args:
    x: `[num_tokens, num_heads, head_dim]` queries or keys, any float dtype.
    positions: `i32[num_tokens]` absolute position of each token (padding
      tokens may hold any value; their rows are rotated and ignored).
    config: static RoPE settings; `config.head_dim` must equal `x.shape[-1]`.

  Returns:
    `x` rotated, same shape and dtype. The angles are computed in float32 and
    the product in `x.dtype`, as in Hugging Face's Llama.

  Raises:
    ValueError: if the head dimension of `x` is not `config.head_dim`.

  Example:
    >>> cfg = RopeConfig(head_dim=8)
    >>> apply_rope(jnp.ones((3, 2, 8)), jnp.arange(3), cfg).shape
    (3, 2, 8)
  """
  if x.shape[-1] != config.head_dim:
    raise ValueError(f"x head_dim {x.shape[-1]} does not match RoPE {config.head_dim=}")
  inv_freq = jnp.asarray(inverse_frequencies(config))
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, hd]
  cos = jnp.cos(emb).astype(x.dtype)
  sin = jnp.sin(emb).astype(x.dtype)
  half = config.head_dim // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin
