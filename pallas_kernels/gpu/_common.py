"""Helpers shared by the GPU (Pallas/Triton) attention kernels (not public API)."""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels import quantization

# `TritonCompilerParams` became `CompilerParams` in jax.experimental.pallas.triton.
CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(
    plgpu, "TritonCompilerParams")

# Triton's `dot` needs every dimension to be at least this big.
MIN_DOT_DIM = 16
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                    jnp.dtype(jnp.float16))
# K/V pages may also be 8-bit with scales (dequantised in the kernel).
KV_DTYPES = SUPPORTED_DTYPES + quantization.QUANTIZED_DTYPES
# Triton converts float8_e4m3fn ("fp8e4nv") only on sm_89 (Ada) and later.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
MAX_HEAD_DIM = 256
MAX_BLOCK_K = 512


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def default_block_k(q, k_pages, max_blocks_per_seq: int, *,
                    tile_bytes: int = 16 * 1024) -> int:
  """KV tokens per compute block: one K tile of about `tile_bytes` (16 KiB:
  64 tokens for bf16 at head_dim 128), in [16, 128], at most the table's
  capacity (rounded up to a power of two) and at least one page."""
  head_dim = q.shape[-1]
  block_size = k_pages.shape[2]
  itemsize = max(jnp.dtype(q.dtype).itemsize, jnp.dtype(k_pages.dtype).itemsize)
  block_k = next_pow2(max(tile_bytes // (head_dim * itemsize), 1))
  block_k = min(max(block_k, MIN_DOT_DIM), 128)
  block_k = min(block_k, max(next_pow2(max_blocks_per_seq * block_size),
                             MIN_DOT_DIM))
  return max(block_k, block_size)


def _attached_compute_capability() -> tuple[int, int] | None:
  """The first attached GPU's compute capability, None without a GPU (the
  kernels then lower for an H200, sm_90)."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not cc:
    return None
  return tuple(int(x) for x in str(cc).split(".")[:2])


def compute_dtype(q_dtype, kv_dtype):
  """Dot input dtype: q's for quantised pages (int8 and e4m3 values are
  exact in every float dtype), else the shared dtype."""
  if quantization.is_quantized(kv_dtype):
    return jnp.dtype(q_dtype)
  return jnp.promote_types(q_dtype, kv_dtype)


def limitation(q, k_pages, block_tables) -> str | None:
  """Why Triton cannot serve these (well-formed) shapes/dtypes, or None."""
  del block_tables
  for name, dtype, allowed in (("q", q.dtype, SUPPORTED_DTYPES),
                               ("k_pages", k_pages.dtype, KV_DTYPES)):
    if jnp.dtype(dtype) not in allowed:
      return (f"{name} dtype {jnp.dtype(dtype)} is not one of"
              f" {[str(d) for d in allowed]}")
  if jnp.dtype(k_pages.dtype) == jnp.float8_e4m3fn:
    cc = _attached_compute_capability()
    if cc is not None and cc < FP8_MIN_COMPUTE_CAPABILITY:
      return (f"float8_e4m3fn pages need compute capability >= "
              f"{FP8_MIN_COMPUTE_CAPABILITY[0]}.{FP8_MIN_COMPUTE_CAPABILITY[1]}"
              f" in Triton, the attached GPU has {cc[0]}.{cc[1]}")
  head_dim = q.shape[2]
  block_size = k_pages.shape[2]
  if not (is_pow2(head_dim) and MIN_DOT_DIM <= head_dim <= MAX_HEAD_DIM):
    return (f"{head_dim=} must be a power of two in [{MIN_DOT_DIM},"
            f" {MAX_HEAD_DIM}] (Triton tile rules)")
  if not is_pow2(block_size):
    return f"{block_size=} must be a power of two (Triton tile rules)"
  return None


def tile_limitation(block_size: int, config) -> str | None:
  """Problems with a config's KV tile and launch knobs, or None."""
  if config.pages_per_compute_block < 1:
    return (f"config.pages_per_compute_block={config.pages_per_compute_block}"
            " must be at least 1")
  block_k = config.pages_per_compute_block * block_size
  if not (is_pow2(block_k) and MIN_DOT_DIM <= block_k <= MAX_BLOCK_K):
    return (f"pages_per_compute_block * block_size = {block_k} must be a power"
            f" of two in [{MIN_DOT_DIM}, {MAX_BLOCK_K}] (Triton tile rules)")
  if not (is_pow2(config.num_warps) and config.num_warps <= 32):
    return f"config.num_warps={config.num_warps} must be a power of two <= 32"
  if config.num_stages < 1:
    return f"config.num_stages={config.num_stages} must be at least 1"
  return None


def online_softmax_step(o, m, l, s, v, *, compute_dtype, precision,
                        v_scales=None):
  """One online-softmax update of `(o, m, l)` with a block's scores.

  s: f32[rows, block_k] with invisible entries -inf; v: [block_k, head_dim]
  with invisible rows loaded as 0; o: f32[rows, head_dim]; m, l: f32[rows]
  (m starts finite, so `exp(m - m_next)` stays a number when a row sees
  nothing); v_scales: quantised V, f32[block_k] (invisible ones loaded as 0).
  """
  m_next = jnp.maximum(m, s.max(axis=-1))
  alpha = jnp.exp(m - m_next)
  p = jnp.exp(s - m_next[:, None])  # masked scores give exp(-inf) = 0
  l_next = alpha * l + p.sum(axis=-1)
  if v_scales is not None:
    p = quantization.scale_probs(p, v_scales[None, :])
  pv = plgpu.dot(p.astype(compute_dtype), v.astype(compute_dtype),
                 precision=precision)
  return alpha[:, None] * o + pv, m_next, l_next


def normalise(o, l):
  """`o / l`, with zeros for rows that saw no key (l == 0)."""
  return jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def zero(dtype):
  """The `other=` of a masked load of `dtype`: a typed zero (Triton's
  lowering cannot cast a Python int to float8)."""
  return jnp.zeros((), dtype)
