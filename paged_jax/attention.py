"""Paged attention: one API, one layout, every backend.

`paged_attention` (decode: one query per sequence) and
`ragged_paged_attention` (chunked prefill and mixed batches) dispatch through
an explicit registry of backends (`DECODE_BACKENDS`, `RAGGED_BACKENDS`), each
a `Backend` with a name, the function it runs and `unsupported_reason(...)`:

* `"pallas_tpu"`: the Mosaic TPU kernels (`pallas_kernels.tpu`);
* `"pallas_gpu"`: the Pallas GPU kernels on the Triton lowering (`pallas_kernels.gpu`);
* `"xla"`: the XLA path (`paged_jax.xla_attention`), on any platform;
* `"pallas_mosaic_gpu"` (decode only): the Mosaic GPU kernel
  (`pallas_kernels.mosaic_gpu`, Hopper and newer). It is registered after
  `"xla"`, so `implementation=None` never picks it: no GPU run has yet shown
  it faster than the Triton kernel.

`implementation=None` picks the first backend, in registry order, that runs on
the default backend's platform and can serve the call (XLA always can); an
explicit `implementation` that cannot serve the call raises a `ValueError`
that says why. With `interpret=True` each kernel runs in its own Pallas
interpret mode on CPU (the TPU and Mosaic GPU kernels with race detection and
NaN-filled uninitialised memory).

Every backend validates the same way (`pallas_kernels.contract`): static
mistakes are `ValueError`s with one set of messages, and malformed traced
values (lengths past a table's capacity, table entries that are not blocks,
a bad `num_seqs` or `cu_q_lens`) follow one documented contract. To turn those
traced violations into errors, ask for the checks (`debug_checks=True`) and
run under `jax.experimental.checkify`:

    from jax.experimental import checkify
    checked = jax.jit(checkify.checkify(
        functools.partial(paged_attention, debug_checks=True),
        errors=checkify.user_checks))
    err, out = checked(q, k_pages, v_pages, block_tables, kv_lens)
    err.throw()  # e.g. "block_tables[3, 1] = -1 is inside kv_len but not ..."

Quantised pages (int8 / float8_e4m3fn) come with their per-token, per-KV-head
float32 scales as `k_scales=` / `v_scales=` (`f32[num_kv_heads, num_blocks,
block_size]`, `KVCache.k_scales[layer]`); every backend dequantises inside
(`pallas_kernels.quantization`), or refuses the dtype in `unsupported_reason`,
never casting silently.

The checks are off by default because even outside `checkify` a debug check
is an effect that keeps a jitted step off JAX's fast C++ dispatch path (about
10x the host cost per call). `out` follows the contract either way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from paged_jax import kv_cache
from paged_jax import xla_attention
from pallas_kernels import contract
from pallas_kernels.gpu import paged_decode as gpu_decode
from pallas_kernels.gpu import ragged_attention as gpu_ragged
from pallas_kernels.tpu import paged_decode as tpu_decode
from pallas_kernels.tpu import ragged_attention as tpu_ragged


def _always_serves(*args, **kwargs) -> None:
  del args, kwargs
  return None


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of one attention operation.

  Attributes:
    name: what `implementation=` calls it.
    fn: the implementation, called as `fn(*arrays, sm_scale=..., soft_cap=...,
      sliding_window=..., k_scales=..., v_scales=..., interpret=...)`.
    reason: `reason(q, k_pages, block_tables, *, soft_cap, sliding_window)`,
      None if `fn` can serve those shapes, else why not (readable).
    platforms: the JAX platforms it compiles for; empty: any.
  """
  name: str
  fn: Callable
  reason: Callable = _always_serves
  platforms: tuple[str, ...] = ()

  def unsupported_reason(self, q, k_pages, block_tables, *, soft_cap=None,
                         sliding_window=None, interpret=False) -> str | None:
    """None if this backend can serve the call, else why not.

    A kernel compiled for another platform than the default backend's cannot
    serve, unless `interpret` asks for Pallas interpret mode.
    """
    platform = jax.default_backend()
    if self.platforms and platform not in self.platforms and not interpret:
      return (f"it runs on {self.platforms[0]}, the default backend is "
              f"{platform} (pass interpret=True to run it in Pallas interpret "
              "mode)")
    return self.reason(q, k_pages, block_tables, soft_cap=soft_cap,
                       sliding_window=sliding_window)


def _xla_decode(*args, interpret=False, **kwargs):
  del interpret
  return xla_attention.paged_decode_xla(*args, **kwargs)


def _xla_ragged(*args, interpret=False, **kwargs):
  del interpret
  return xla_attention.ragged_paged_attention_xla(*args, **kwargs)


def _mosaic_gpu_decode(*args, **kwargs):
  # Imported on first use: Mosaic GPU's modules take about 1.5 s to import.
  from pallas_kernels.mosaic_gpu import paged_decode  # pylint: disable=g-import-not-at-top
  return paged_decode.paged_decode(*args, **kwargs)


def _mosaic_gpu_reason(*args, **kwargs):
  from pallas_kernels.mosaic_gpu import paged_decode  # pylint: disable=g-import-not-at-top
  return paged_decode.unsupported_reason(*args, **kwargs)


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
DECODE_BACKENDS = (
    Backend("pallas_tpu", tpu_decode.paged_decode,
            tpu_decode.unsupported_reason, ("tpu",)),
    Backend("pallas_gpu", gpu_decode.paged_decode,
            gpu_decode.unsupported_reason, _GPU_PLATFORMS),
    Backend("xla", _xla_decode),
    # After "xla": implementation=None never picks it (never run on a GPU).
    Backend("pallas_mosaic_gpu", _mosaic_gpu_decode, _mosaic_gpu_reason,
            ("gpu", "cuda")),
)
RAGGED_BACKENDS = (
    Backend("pallas_tpu", tpu_ragged.ragged_paged_attention,
            tpu_ragged.unsupported_reason, ("tpu",)),
    Backend("pallas_gpu", gpu_ragged.ragged_paged_attention,
            gpu_ragged.unsupported_reason, _GPU_PLATFORMS),
    Backend("xla", _xla_ragged),
)
IMPLEMENTATIONS = tuple(b.name for b in DECODE_BACKENDS)


def select_implementation(backends, implementation: str | None, q, k_pages,
                          block_tables, *, soft_cap=None, sliding_window=None,
                          interpret=False) -> Backend:
  """The backend of `backends` that serves this call.

  Args:
    backends: a registry (`DECODE_BACKENDS`, `RAGGED_BACKENDS`, or any tuple
      of `Backend`s), in order of preference.
    implementation: a backend's name, or None for the first that can serve
      on the default backend's platform.
    q, k_pages, block_tables, soft_cap, sliding_window: the call (only shapes
      and dtypes are read).
    interpret: whether a kernel may run in Pallas interpret mode (for an
      explicit `implementation` only).

  Raises:
    ValueError: for an unknown name, for an explicit choice that cannot serve
      (with its reason), or when no backend can serve (with every reason).
  """
  names = tuple(b.name for b in backends)
  if implementation is not None and implementation not in names:
    raise ValueError(f"implementation must be one of {names} or None, got "
                     f"{implementation!r}")
  call = dict(soft_cap=soft_cap, sliding_window=sliding_window)
  if implementation is not None:
    backend = backends[names.index(implementation)]
    why = backend.unsupported_reason(q, k_pages, block_tables,
                                     interpret=interpret, **call)
    if why is not None:
      raise ValueError(f"implementation={implementation!r} cannot serve this "
                       f"call: {why}")
    return backend
  refusals = []
  for backend in backends:
    why = backend.unsupported_reason(q, k_pages, block_tables, **call)
    if why is None:
      return backend
    refusals.append(f"{backend.name}: {why}")
  raise ValueError("no implementation can serve this call: "
                   + "; ".join(refusals))


def _index_array(x):
  """Host/Python integers as an array; other integer dtypes as int32
  (saturating, see `contract.saturate_to_int32`); anything else unchanged for
  the validator to judge."""
  if not hasattr(x, "dtype"):
    x = np.asarray(x)
  return contract.saturate_to_int32(x)


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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    debug_checks: bool = False,
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
      last block are never read (`NULL_BLOCK` there is fine). An entry inside
      `kv_len` that is not a block in `[0, num_blocks)` contributes no tokens.
      Other integer dtypes are converted to int32, saturating.
    kv_lens: `i32[batch]` tokens in the cache per sequence; 0 gives zeros;
      clamped to `[0, max_blocks_per_seq * block_size]`.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: if set, scores become `soft_cap * tanh(s / soft_cap)` (after
      `sm_scale`).
    sliding_window: if set, the query at position `p` sees keys
      `p - sliding_window + 1 .. p`.
    implementation: `None`, `"xla"`, `"pallas_tpu"`, `"pallas_gpu"` or
      `"pallas_mosaic_gpu"` (never picked by `None`).
    interpret: run a Pallas kernel in interpret mode (CPU testing), each in
      its own (Mosaic GPU's needs JAX >= 0.11). For the TPU kernel, a
      `pltpu.InterpretParams` is also accepted.
    debug_checks: trace the contract's `checkify.debug_check`s of the traced
      lengths and table entries (see the module docstring). Off by default:
      a debug check is an unordered effect, and a jitted function with one
      cannot use JAX's C++ dispatch path (measured 2026-12-01: ~10x the
      per-call host cost of a small jitted function on CPU).
    k_scales: with int8 / float8_e4m3fn pages, `f32[num_kv_heads,
      num_blocks, block_size]`: key `t` is `k_pages[h, b, t] * k_scales[h, b,
      t]`; None (the default) with float pages.
    v_scales: as `k_scales`, for `v_pages`.

  Returns:
    `[batch, num_q_heads, head_dim]` in `q.dtype`.

  Raises:
    ValueError: on inconsistent shapes/dtypes, or an `implementation` that
      cannot serve the call (the message says why). With `debug_checks=True`
      under `checkify.checkify(..., errors=checkify.user_checks)`, malformed
      traced lengths and table entries become checkify errors.

  Example:
    >>> from paged_jax import block_manager as bm
    >>> k = jnp.ones((2, 4, 8, 64)); q = jnp.ones((3, 8, 64))
    >>> tables = jnp.array([[0, 1], [2, -1], [-1, -1]]); lens = jnp.array([12, 3, 0])
    >>> paged_attention(q, k, k, tables, lens, implementation="xla").shape
    (3, 8, 64)
  """
  block_tables, kv_lens = _index_array(block_tables), _index_array(kv_lens)
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
      v_scales=v_scales)
  if debug_checks:
    contract.debug_check_decode(q, k_pages, block_tables, kv_lens)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kwargs = dict(soft_cap=soft_cap, sliding_window=sliding_window)
  backend = select_implementation(DECODE_BACKENDS, implementation, q, k_pages,
                                  block_tables, interpret=interpret, **kwargs)
  return backend.fn(q, k_pages, v_pages, block_tables, kv_lens,
                    sm_scale=float(sm_scale), interpret=interpret,
                    k_scales=k_scales, v_scales=v_scales, **kwargs)


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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    debug_checks: bool = False,
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
    block_tables: `i32[max_num_seqs, max_blocks_per_seq]` (as in
      `paged_attention`).
    kv_lens: `i32[max_num_seqs]` (clamped as in `paged_attention`).
    cu_q_lens: `i32[max_num_seqs + 1]`, non-decreasing, `cu_q_lens[0] == 0`,
      `cu_q_lens[num_seqs] <= num_tokens`. Sequences from the first one that
      breaks this on are dropped (their rows are zeros); all of them when
      `cu_q_lens[0] != 0`.
    num_seqs: `i32[1]` (or a scalar), the live sequences (the first
      `num_seqs` rows), clamped to `[0, max_num_seqs]`.
    sm_scale, soft_cap, sliding_window, implementation, interpret, k_scales,
      v_scales, debug_checks: as in `paged_attention`.

  Returns:
    `[num_tokens, num_q_heads, head_dim]` in `q.dtype`; padding rows (beyond
    `cu_q_lens[num_seqs]`) are zeros.

  Raises:
    ValueError: on inconsistent shapes/dtypes, or an `implementation` that
      cannot serve the call. With `debug_checks=True` under
      `checkify.checkify(..., errors=checkify.user_checks)`, malformed traced
      `num_seqs`, `cu_q_lens`, lengths and table entries become checkify
      errors.
  """
  block_tables, kv_lens = _index_array(block_tables), _index_array(kv_lens)
  cu_q_lens, num_seqs = _index_array(cu_q_lens), _index_array(num_seqs)
  if num_seqs.shape == ():
    num_seqs = num_seqs.reshape(1)
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      cu_q_lens=cu_q_lens, num_seqs=num_seqs, ragged=True, soft_cap=soft_cap,
      sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)
  if debug_checks:
    contract.debug_check_ragged(q, k_pages, block_tables, kv_lens, cu_q_lens,
                                num_seqs)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kwargs = dict(soft_cap=soft_cap, sliding_window=sliding_window)
  backend = select_implementation(RAGGED_BACKENDS, implementation, q, k_pages,
                                  block_tables, interpret=interpret, **kwargs)
  return backend.fn(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                    num_seqs, sm_scale=float(sm_scale), interpret=interpret,
                    k_scales=k_scales, v_scales=v_scales, **kwargs)


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
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    **kwargs,
) -> tuple[jax.Array, ...]:
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
    k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales,
      v_scales, **kwargs: as in `ragged_paged_attention` (quantised pages:
      the new tokens are quantised as `kv_cache.write_kv` does).

  Returns:
    `(out [num_tokens, num_q_heads, head_dim], k_pages, v_pages)`, and then
    `k_scales, v_scales` for quantised pages (as `kv_cache.write_kv`).
  """
  scales = {} if k_scales is None else dict(k_scales=k_scales,
                                            v_scales=v_scales)
  arrays = kv_cache.write_kv(k_pages, v_pages, k, v, slots, **scales)
  names = ("k_pages", "v_pages", "k_scales", "v_scales")
  out = ragged_paged_attention(q, *arrays[:2], block_tables, kv_lens,
                               cu_q_lens, num_seqs,
                               **dict(zip(names[2:], arrays[2:])), **kwargs)
  return (out,) + tuple(arrays)
