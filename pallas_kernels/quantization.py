"""8-bit K/V pages: the one quantise rule and the one dequantise rule.

A quantised page stores `int8` or `float8_e4m3fn` values beside float32
scales, one per token and KV head, in the pages' own block layout:

  values: [num_kv_heads, num_blocks, block_size, head_dim]  int8 / float8_e4m3fn
  scales: f32[num_kv_heads, num_blocks, block_size]

and `x ~= values.astype(f32) * scales[..., None]` (`dequantize`). Scales are
per token (absmax over `head_dim` / the dtype's largest value, `quantize`), so
they are computed where the token is written, with no calibration, and an
outlier token costs only its own row's precision.

Attention never materialises the dequantised pages: since the scale is
constant along `head_dim`, `q . (k * s) = (q . k) * s` and
`sum_t p_t (v_t * s_t) = sum_t (p_t s_t) v_t`. Every backend applies the K
scale to the scores and the V scale to the probabilities (`scale_scores`,
`scale_probs`); the softmax denominator uses the unscaled probabilities.

Only jax and numpy are imported: `paged_jax` (the cache writes, the float32
reference) and the kernels share these functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SCALE_DTYPE = jnp.dtype(jnp.float32)


def is_quantized(dtype) -> bool:
  """Whether pages of `dtype` carry scales (int8 or float8_e4m3fn)."""
  return jnp.dtype(dtype) in QUANTIZED_DTYPES


def max_value(dtype) -> float:
  """The largest magnitude a quantised value holds: 127 (int8, symmetric:
  -128 is never written) or 448 (float8_e4m3fn)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:
    return 127.0
  if dtype == jnp.float8_e4m3fn:
    return float(jnp.finfo(dtype).max)
  raise ValueError(f"dtype must be one of {[str(d) for d in QUANTIZED_DTYPES]},"
                   f" got {dtype}")


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Quantises `x [..., head_dim]` with one scale per row.

  Args:
    x: `[..., head_dim]` floating values.
    dtype: `int8` or `float8_e4m3fn`.

  Returns:
    `(values [..., head_dim] in dtype, scales f32[...])` with
    `scales = max|x| / max_value(dtype)` (0 for an all-zero row, whose values
    are 0). int8 rounds to nearest; float8 rounds to nearest even after
    clipping (e4m3fn has no infinity: an overflow would be NaN). A NaN row
    gives a NaN scale.

  Raises:
    ValueError: if `dtype` is not a quantised dtype.

  Example:
    >>> vals, s = quantize(jnp.array([[1.0, -2.0]]), jnp.int8)
    >>> vals.tolist(), float(s[0]) * 127
    ([[64, -127]], 2.0)
  """
  qmax = max_value(dtype)
  x = x.astype(jnp.float32)
  scales = jnp.max(jnp.abs(x), axis=-1) / qmax
  inv = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
  y = jnp.clip(x * inv[..., None], -qmax, qmax)
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.round(y)
  return y.astype(dtype), scales


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
  """`values [..., head_dim]` (int8/fp8) times `scales f32[...]`, in float32."""
  return values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]


def scale_scores(s: jax.Array, k_scales: jax.Array | None) -> jax.Array:
  """Scores `q . k_values` (`f32[..., tokens]`) times the tokens' K scales
  (`f32[tokens]`-broadcastable); unchanged when `k_scales` is None."""
  return s if k_scales is None else s * k_scales


def scale_probs(p: jax.Array, v_scales: jax.Array | None) -> jax.Array:
  """Probabilities `f32[..., tokens]` times the tokens' V scales, for the
  weighted sum of V values; unchanged when `v_scales` is None."""
  return p if v_scales is None else p * v_scales


def scales_error(pages, scales, name: str) -> str | None:
  """What is wrong with the scales that `pages` (shape/dtype only) need.

  Quantised pages need `f32[num_kv_heads, num_blocks, block_size]` scales;
  float pages take none (None).
  """
  if is_quantized(pages.dtype):
    want = tuple(pages.shape[:3])
    if scales is None:
      return (f"{jnp.dtype(pages.dtype)} pages need {name} "
              f"f32{list(want)}, got None")
    if tuple(scales.shape) != want or jnp.dtype(scales.dtype) != SCALE_DTYPE:
      return (f"{name} must be f32{list(want)} (the pages' [num_kv_heads, "
              f"num_blocks, block_size]), got "
              f"{jnp.dtype(scales.dtype)}{list(scales.shape)}")
    return None
  if scales is not None:
    return (f"{name} must be None for {jnp.dtype(pages.dtype)} pages (only "
            f"{[str(d) for d in QUANTIZED_DTYPES]} pages carry scales)")
  return None
