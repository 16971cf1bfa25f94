"""Paged attention: one API, one layout, every backend.

`paged_attention` (decode: one query per sequence) dispatches to

* `"pallas_tpu"`: the Mosaic TPU kernel (`pallas_kernels.tpu`);
* `"pallas_gpu"`: the Pallas GPU kernel on the Triton lowering (`pallas_kernels.gpu`);
* `"xla"`: the XLA path (`paged_jax.xla_attention`), on any platform.

`implementation=None` picks the kernel for the default backend's platform and
falls back to XLA where that kernel cannot serve the call; an explicit
`implementation` that cannot serve the call raises a `ValueError` that says
why. With `interpret=True` either kernel runs in Pallas interpret mode on CPU
(the TPU kernel with race detection and NaN-filled uninitialised memory).
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax
import jax.numpy as jnp

from paged_jax import kv_cache
from paged_jax import xla_attention

IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")
_KERNEL_MODULES = {
    "pallas_tpu": "pallas_kernels.tpu.paged_decode",
    "pallas_gpu": "pallas_kernels.gpu.paged_decode",
}
_KERNEL_PLATFORMS = {"pallas_tpu": ("tpu",), "pallas_gpu": ("gpu", "cuda", "rocm")}


def _load_kernel(module_name: str):
  """The kernel module, or the reason it cannot be imported."""
  try:
    return importlib.import_module(module_name), None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"{module_name} cannot be imported ({type(e).__name__}: {e})"


def check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens, *,
                       q_rows="batch", sliding_window=None,
                       soft_cap=None) -> None:
  """Static (shape and dtype) checks shared by the attention entry points.

  Raises:
    ValueError: saying which argument is wrong, what was expected and what was
      given.
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [{q_rows}, num_q_heads, head_dim], got shape "
                     f"{q.shape}")
  if k_pages.ndim != 4:
    raise ValueError("k_pages must be [num_kv_heads, num_blocks, block_size, "
                     f"head_dim], got shape {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages.shape={v_pages.shape} must equal "
                     f"k_pages.shape={k_pages.shape}")
  num_q_heads, head_dim = q.shape[-2:]
  num_kv_heads = k_pages.shape[0]
  if k_pages.shape[3] != head_dim:
    raise ValueError(f"head_dim of q ({head_dim}) must equal head_dim of "
                     f"k_pages ({k_pages.shape[3]})")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
  if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype,
                                                   jnp.integer):
    raise ValueError("block_tables must be an integer [num_seqs, "
                     "max_blocks_per_seq] array, got "
                     f"{block_tables.dtype}{list(block_tables.shape)}")
  if kv_lens.shape != block_tables.shape[:1] or not jnp.issubdtype(
      kv_lens.dtype, jnp.integer):
    raise ValueError(f"kv_lens must be i32[{block_tables.shape[0]}] (one length"
                     f" per block-table row), got {kv_lens.dtype}"
                     f"{list(kv_lens.shape)}")
  if not jnp.issubdtype(q.dtype, jnp.floating) or not jnp.issubdtype(
      k_pages.dtype, jnp.floating):
    raise ValueError(f"q and k_pages must be floating, got {q.dtype} and "
                     f"{k_pages.dtype}")
  if sliding_window is not None and (not isinstance(sliding_window, int)
                                     or sliding_window <= 0):
    raise ValueError(f"sliding_window must be a positive int or None, got "
                     f"{sliding_window=}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be positive or None, got {soft_cap=}")


def _platform() -> str:
  return jax.default_backend()


def select_implementation(
    implementation: str | None, *, kernel_modules: dict[str, str],
    reason_args: tuple, reason_kwargs: dict, interpret) -> tuple[str, object]:
  """Resolves `implementation` to a backend that can serve the call.

  Returns:
    `(name, kernel_module or None for "xla")`.

  Raises:
    ValueError: for an unknown name, or an explicit choice that cannot serve
      the call (with the reason).
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None,"
                     f" got {implementation!r}")

  def reason(name):
    if name == "xla":
      return None
    platform = _platform()
    if not interpret and platform not in _KERNEL_PLATFORMS[name]:
      return (f"it runs on {_KERNEL_PLATFORMS[name][0]}, the default backend "
              f"is {platform} (pass interpret=True to run it in Pallas "
              "interpret mode)")
    module, why = _load_kernel(kernel_modules[name])
    if module is None:
      return why
    return module.unsupported_reason(*reason_args, **reason_kwargs)

  if implementation is not None:
    why = reason(implementation)
    if why is not None:
      raise ValueError(f"implementation={implementation!r} cannot serve this "
                       f"call: {why}")
    choice = implementation
  else:
    platform = _platform()
    choice = "xla"
    for name, platforms in _KERNEL_PLATFORMS.items():
      if platform in platforms and reason(name) is None:
        choice = name
        break
  module = None if choice == "xla" else _load_kernel(kernel_modules[choice])[0]
  return choice, module


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    implementation: str | None = None,
    interpret=False,
) -> jax.Array:
  """Decode attention over a paged KV cache.

  Each sequence has one query, at position `kv_lens[b] - 1` (its own token,
  already written to the cache). GQA/MQA: query head `h` reads KV head
  `h // (num_q_heads // num_kv_heads)`.

  Args:
    q: `[batch, num_q_heads, head_dim]`, float32/bfloat16/float16.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    v_pages: same shape as `k_pages`.
    block_tables: `i32[batch, max_blocks_per_seq]`; entries past a sequence's
      last block are never read (`NULL_BLOCK` there is fine).
    kv_lens: `i32[batch]` tokens in the cache per sequence; 0 gives zeros.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: if set, scores become `soft_cap * tanh(s / soft_cap)` (after
      `sm_scale`).
    sliding_window: if set, the query at position `p` sees keys
      `p - sliding_window + 1 .. p`.
    implementation: `None`, `"xla"`, `"pallas_tpu"` or `"pallas_gpu"`.
    interpret: run a Pallas kernel in interpret mode (CPU testing). For the
      TPU kernel, a `pltpu.InterpretParams` is also accepted.

  Returns:
    `[batch, num_q_heads, head_dim]` in `q.dtype`.

  Raises:
    ValueError: on inconsistent shapes/dtypes, or an `implementation` that
      cannot serve the call (the message says why).

  Example:
    >>> from paged_jax import block_manager as bm
    >>> k = jnp.ones((2, 4, 8, 64)); q = jnp.ones((3, 8, 64))
    >>> tables = jnp.array([[0, 1], [2, -1], [-1, -1]]); lens = jnp.array([12, 3, 0])
    >>> paged_attention(q, k, k, tables, lens, implementation="xla").shape
    (3, 8, 64)
  """
  check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens,
                     sliding_window=sliding_window, soft_cap=soft_cap)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kwargs = dict(soft_cap=soft_cap, sliding_window=sliding_window)
  name, module = select_implementation(
      implementation, kernel_modules=_KERNEL_MODULES,
      reason_args=(q, k_pages, block_tables), reason_kwargs=kwargs,
      interpret=interpret)
  if name == "xla":
    return xla_attention.paged_decode_xla(
        q, k_pages, v_pages, block_tables, kv_lens, sm_scale=float(sm_scale),
        **kwargs)
  fn: Callable = module.paged_decode
  return fn(q, k_pages, v_pages, block_tables, kv_lens, sm_scale=sm_scale,
            interpret=interpret, **kwargs)


_RAGGED_KERNEL_MODULES = {
    "pallas_tpu": "pallas_kernels.tpu.ragged_attention",
    "pallas_gpu": "pallas_kernels.gpu.ragged_attention",
}


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    implementation: str | None = None,
    interpret=False,
) -> jax.Array:
  """Attention for chunked prefill and mixed prefill + decode batches.

  The new query tokens of all sequences are concatenated: sequence `s` owns
  rows `cu_q_lens[s]:cu_q_lens[s+1]` of `q`. `kv_lens[s]` counts the tokens in
  the cache including the new ones (already written), so query `i` of
  sequence `s` sits at position `kv_lens[s] - q_len[s] + i` and attends
  causally to positions up to its own (within `sliding_window` if given).
  Decode is the case `q_len == 1` and gives the same result as
  `paged_attention`. `num_seqs` is an array, so the batch composition changes
  without retracing.

  Args:
    q: `[num_tokens, num_q_heads, head_dim]`.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    v_pages: same shape as `k_pages`.
    block_tables: `i32[max_num_seqs, max_blocks_per_seq]`.
    kv_lens: `i32[max_num_seqs]`.
    cu_q_lens: `i32[max_num_seqs + 1]`, non-decreasing, `cu_q_lens[0] == 0`.
    num_seqs: `i32[1]`, the live sequences (the first `num_seqs` rows).
    sm_scale, soft_cap, sliding_window, implementation, interpret: as in
      `paged_attention`.

  Returns:
    `[num_tokens, num_q_heads, head_dim]` in `q.dtype`; padding rows (beyond
    `cu_q_lens[num_seqs]`) are zeros.

  Raises:
    ValueError: on inconsistent shapes/dtypes, or an `implementation` that
      cannot serve the call.
  """
  check_paged_inputs(q, k_pages, v_pages, block_tables, kv_lens,
                     q_rows="num_tokens", sliding_window=sliding_window,
                     soft_cap=soft_cap)
  max_num_seqs = block_tables.shape[0]
  if cu_q_lens.shape != (max_num_seqs + 1,):
    raise ValueError(f"cu_q_lens must be i32[max_num_seqs + 1] = "
                     f"i32[{max_num_seqs + 1}], got {list(cu_q_lens.shape)}")
  if jnp.size(num_seqs) != 1:
    raise ValueError(f"num_seqs must be i32[1], got shape {jnp.shape(num_seqs)}")
  num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(1)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kwargs = dict(soft_cap=soft_cap, sliding_window=sliding_window)
  name, module = select_implementation(
      implementation, kernel_modules=_RAGGED_KERNEL_MODULES,
      reason_args=(q, k_pages, block_tables), reason_kwargs=kwargs,
      interpret=interpret)
  if name == "xla":
    return xla_attention.ragged_paged_attention_xla(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        sm_scale=float(sm_scale), **kwargs)
  return module.ragged_paged_attention(
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
      sm_scale=sm_scale, interpret=interpret, **kwargs)


def write_and_ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slots: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    **kwargs,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes the new tokens' K/V into their slots, then runs ragged attention.

  One call per layer for a prefill or mixed step. Jit the caller with the
  pages donated and the write happens in place (the cache aliases input to
  output). Slots come from `block_manager.slot_mapping`, which maps any
  position in a shared block (refcount > 1) to -1, and -1 slots are dropped:
  a write to a block another sequence still reads is impossible by
  construction. After `reserve` has done its copy-on-write, every new token's
  slot is in an exclusively owned block.

  Args:
    q: `[num_tokens, num_q_heads, head_dim]`.
    k, v: `[num_tokens, num_kv_heads, head_dim]` the new tokens' K/V.
    slots: `i32[num_tokens]`; -1 for padding rows.
    k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, **kwargs: as
      in `ragged_paged_attention`.

  Returns:
    `(out [num_tokens, num_q_heads, head_dim], k_pages, v_pages)`.
  """
  k_pages, v_pages = kv_cache.write_kv(k_pages, v_pages, k, v, slots)
  out = ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                               cu_q_lens, num_seqs, **kwargs)
  return out, k_pages, v_pages
