"""Paged decode attention on Mosaic GPU (Hopper and newer), one TMA per page.

Never run on a GPU yet: checked on CPU in Mosaic GPU interpret mode (JAX >=
0.11) and lowered for CUDA from CPU; its speed is unmeasured.

One program per (sequence, KV head, k-split), one warpgroup each:

* the GQA group of the KV head (`num_q_heads // num_kv_heads` query heads) is
  the row block of both matmuls, padded with zero rows to `ROWS = 64`, the
  smallest M of a Hopper `wgmma`: its rows arrive by TMA in a zeroed untiled
  buffer and move to the swizzled wgmma tile through registers (the output
  leaves the same way, so no pad or slice runs in XLA); padded rows cost MMA
  work only (`64 / group` times the useful FLOPs, free in a bandwidth-bound
  decode) and shared memory (`[64, head_dim]` Q and staging tiles, a
  `[64, block_kv]` P tile);
* a compute step covers `block_kv = max(64, block_size)` tokens: one TMA copy
  per page (the block-table entry read as a scalar, used as the page index)
  into a `num_stages`-deep ring of K and V buffers, each slot with its own
  barrier (one arrival per page), so the copies of the next `num_stages - 1`
  steps overlap this step's matmuls;
* `S = Q K^T` and `O += P V` are `wgmma`s (K is read transposed in shared
  memory, P goes through shared memory), with the online softmax in float32;
* with `k_splits > 1` each program covers a slice of the steps and writes its
  unnormalised float32 partial output, running max and sum; the wrapper merges
  them.

The contract (`pallas_kernels.contract`) holds as on every backend: a page
that is past `kv_len`, before the sliding window, or not a block in
`[0, num_blocks)` is never copied (its barrier is arrived at by hand) and its
tokens are masked; V rows past `kv_len` in the last step are zeroed in shared
memory before `P V` (a page's tail may hold anything, NaN included, and
`0 * NaN` is NaN); the V ring starts zeroed, so an uncopied page's slot holds
finite data from an earlier page.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import contract
from pallas_kernels import quantization

ROWS = 64  # a wgmma's M: the padded GQA group
MIN_BLOCK_KV = 64  # tokens per step: one 128-byte swizzle row of bf16
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_NUM_SMS = 132  # H100 / H200
SMEM_BYTES = 227 * 1024  # an H100 / H200 block's dynamic shared memory
# Mosaic GPU's interpreter reads transposed shared-memory operands from 0.11 on.
MIN_INTERPRET_VERSION = (0, 11)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
  """Tuning knobs (static, hashable).

  Attributes:
    k_splits: programs per (sequence, KV head), each covering a slice of the
      context; >1 for small batches (partials merged outside the kernel).
    num_stages: depth of the K/V shared-memory ring (2: double buffering).
  """
  k_splits: int = 1
  num_stages: int = 2


def block_kv(block_size: int) -> int:
  """Tokens per compute step: whole pages, at least `MIN_BLOCK_KV`."""
  return max(MIN_BLOCK_KV, block_size)


def interpret_unsupported_reason() -> str | None:
  """Why this JAX cannot run the kernel in Mosaic GPU interpret mode, or
  None."""
  version = jax.__version_info__[:2]
  if tuple(version) < MIN_INTERPRET_VERSION:
    return ("Mosaic GPU interpret mode needs JAX >= "
            f"{'.'.join(map(str, MIN_INTERPRET_VERSION))} (its interpreter "
            "cannot read the transposed K operand of a wgmma), got JAX "
            f"{jax.__version__}")
  return None


def smem_bytes(q, k_pages, config: MosaicDecodeConfig) -> int:
  """Shared memory one program allocates: the K/V ring, the Q tile, the row
  staging buffer (Q in, the output out), P, and with splits the f32 partial
  output, max and sum (barriers not counted)."""
  head_dim = q.shape[-1]
  itemsize = jnp.dtype(q.dtype).itemsize
  bk = block_kv(k_pages.shape[2])
  total = 2 * config.num_stages * bk * head_dim * itemsize  # K, V rings
  total += 2 * ROWS * head_dim * itemsize + ROWS * bk * itemsize  # Q x2, P
  if config.k_splits > 1:
    total += ROWS * head_dim * 4 + 2 * ROWS * 4  # o, m, l partials
  return total


def default_config(q, k_pages, block_tables, *,
                   num_sms: int = DEFAULT_NUM_SMS) -> MosaicDecodeConfig:
  """A config from the shapes (arrays or `jax.ShapeDtypeStruct`s).

  k-splits until there are about two programs per multiprocessor (a power of
  two, at most 32, never more than the table has steps); the deepest ring of
  3, 2 or 1 stages that fits `SMEM_BYTES`, without splits if none fits with
  them. Never measured on a GPU.
  """
  batch, _, _ = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  bk = block_kv(block_size)
  steps = pl.cdiv(block_tables.shape[1] * block_size, bk)
  programs = max(batch * num_kv_heads, 1)
  k_splits = 1
  while (k_splits * 2 <= min(32, steps)
         and programs * k_splits < 2 * num_sms):
    k_splits *= 2
  # Without splits the output reuses Q's buffer: the fallback that fits most.
  for splits in dict.fromkeys((k_splits, 1)):
    for num_stages in (3, 2, 1):
      config = MosaicDecodeConfig(k_splits=splits, num_stages=num_stages)
      if smem_bytes(q, k_pages, config) <= SMEM_BYTES:
        return config
  return config


def unsupported_reason(q, k_pages, block_tables, *, soft_cap=None,
                       sliding_window=None, config=None) -> str | None:
  """Why this kernel cannot serve these inputs, or None if it can.

  Accepts arrays or `jax.ShapeDtypeStruct`s; looks only at shapes, dtypes
  and (off a GPU, where it would run in interpret mode) the JAX version.
  """
  error = contract.attention_input_error(
      q, k_pages, block_tables, soft_cap=soft_cap,
      sliding_window=sliding_window)
  if error is not None:
    return f"invalid inputs: {error}"
  reason = _limitation(q, k_pages, block_tables, config)
  if reason is None and jax.default_backend() not in ("gpu", "cuda"):
    # Off a GPU it can only be interpreted.
    reason = interpret_unsupported_reason()
  return reason


def _limitation(q, k_pages, block_tables, config) -> str | None:
  """Why this (well-formed) input cannot be served by the kernel, or None."""
  q_dtype, kv_dtype = jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype)
  if quantization.is_quantized(kv_dtype):
    return (f"{kv_dtype.name} pages (with per-token scales) are not "
            "implemented in the Mosaic GPU kernel; implementation='pallas_gpu'"
            " or 'xla' serves them")
  names = [d.name for d in SUPPORTED_DTYPES]
  if q_dtype not in SUPPORTED_DTYPES:
    return (f"q dtype {q_dtype.name} is not one of {names} (wgmma operands; "
            "float32 would run as tf32)")
  if kv_dtype != q_dtype:
    return (f"k_pages dtype must equal q dtype {q_dtype.name} (one wgmma "
            f"operand type), got {kv_dtype.name}")
  _, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  if group > ROWS:
    return (f"num_q_heads // num_kv_heads = {group} must be at most {ROWS} "
            "(one wgmma row block)")
  if head_dim not in HEAD_DIMS:
    return f"head_dim={head_dim} must be one of {HEAD_DIMS}"
  if block_size not in BLOCK_SIZES:
    return f"block_size={block_size} must be one of {BLOCK_SIZES}"
  if config is None:
    config = default_config(q, k_pages, block_tables)
  if config.k_splits < 1:
    return f"config.k_splits={config.k_splits} must be at least 1"
  if config.num_stages < 1:
    return f"config.num_stages={config.num_stages} must be at least 1"
  need = smem_bytes(q, k_pages, config)
  if need > SMEM_BYTES:
    return (f"{config} needs {need} bytes of shared memory, more than the "
            f"{SMEM_BYTES} of a block")
  return None


def _load(ref, layout):
  """All of `ref` in registers with `layout`, bank conflicts allowed (a
  one-off copy). `plgpu.load`'s index argument is required in JAX 0.10,
  deprecated in 0.11 and gone in 0.12."""
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout, optimized=False)
  return plgpu.load(ref, layout=layout, optimized=False)


def _transposed(ref):
  """`ref` viewed transposed (`ref.T` where JAX has it)."""
  if hasattr(ref, "T"):
    return ref.T
  return plgpu.transpose_ref(ref, (1, 0))


def _paged_decode_kernel(
    q_ref,  # [batch, num_kv_heads, group, head_dim]  (GMEM)
    k_ref,  # [num_kv_heads, num_blocks, block_size, head_dim]  (GMEM)
    v_ref,  # [num_kv_heads, num_blocks, block_size, head_dim]  (GMEM)
    table_ref,  # i32[batch, max_blocks_per_seq]  (GMEM)
    kv_len_ref,  # i32[batch]  (GMEM), clamped to the table's capacity
    *refs,  # outputs: o [batch, num_kv_heads, group, head_dim] (one split) or
    # f32 [k_splits, batch, num_kv_heads, group, head_dim] (the real rows
    # only) and m, l f32[k_splits, batch, num_kv_heads, ROWS]; then scratch
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    k_splits: int,
    num_stages: int,
):
  if k_splits == 1:
    (o_ref,), scratch = refs[:1], refs[1:]
    m_ref = l_ref = None
  else:
    (o_ref, m_ref, l_ref), scratch = refs[:3], refs[3:]
  (q_smem, rows_smem, k_smem, v_smem, p_smem, *partials, q_bar, k_bars,
   v_bars) = scratch
  if k_splits == 1:  # the output goes out through the row staging buffer
    o_smem, m_smem, l_smem = rows_smem, None, None
  else:
    o_smem, m_smem, l_smem = partials
  group = q_ref.shape[2]
  _, num_blocks, block_size, head_dim = k_ref.shape
  max_blocks_per_seq = table_ref.shape[1]
  bk = k_smem.shape[1]
  pages_per_step = bk // block_size
  dtype = q_smem.dtype
  b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")

  # Visible tokens are [lo, hi); this split owns steps [start, end).
  hi = kv_len_ref[b]
  lo = jnp.int32(0)
  if sliding_window is not None:
    lo = jnp.maximum(hi - sliding_window, 0)
  first = lax.div(lo, jnp.int32(bk))
  num_steps = jnp.maximum(pl.cdiv(hi, jnp.int32(bk)) - first, 0)
  per_split = pl.cdiv(num_steps, jnp.int32(k_splits))
  start = first + split * per_split
  end = jnp.minimum(start + per_split, first + num_steps)
  n = jnp.maximum(end - start, 0)

  def page_of(step, p):
    """(page id, whether it is copied) of page `p` of compute step `step`."""
    j = step * pages_per_step + p
    page = table_ref[b, jnp.minimum(j, max_blocks_per_seq - 1)]
    used = (j * block_size < hi) & ((j + 1) * block_size > lo)
    return page, used & contract.valid_block(page, num_blocks)

  def issue(step, slot):
    """Starts the copies of `step`'s pages into ring slot `slot`."""
    for p in range(pages_per_step):
      page, copied = page_of(step, p)
      rows = pl.ds(p * block_size, block_size)
      for src, dst, bars in ((k_ref, k_smem, k_bars), (v_ref, v_smem, v_bars)):
        @pl.when(copied)
        def _copy(src=src, dst=dst, bars=bars, page=page, rows=rows):
          plgpu.copy_gmem_to_smem(src.at[h, page], dst.at[slot, rows],
                                  bars.at[slot])

        @pl.when(~copied)
        def _skip(bars=bars):  # never read: arrive without a copy
          plgpu.barrier_arrive(bars.at[slot])

  # The V ring starts zeroed: an uncopied page's slot then holds finite data.
  zeros = plgpu.layout_cast(jnp.zeros((bk, head_dim), dtype),
                            plgpu.Layout.WGMMA)
  for slot in range(num_stages):
    v_smem[slot] = zeros
  # Q's group rows land in a zeroed, untiled [ROWS, head_dim] buffer (a
  # tiled one cannot take fewer than 8 rows), then move to the wgmma tile.
  layout = plgpu.Layout.WGMMA
  rows_smem[...] = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), dtype), layout)
  plgpu.commit_smem()

  plgpu.copy_gmem_to_smem(q_ref.at[b, h], rows_smem.at[pl.ds(0, group)],
                          q_bar.at[0])
  for i in range(num_stages):
    pl.when(i < n)(functools.partial(issue, start + i, i))
  plgpu.barrier_wait(q_bar.at[0])
  q_smem[...] = _load(rows_smem, layout)
  plgpu.commit_smem()

  row_layout = layout.reduce(1)

  def body(i, carry):
    acc, m, l = carry
    step = start + i
    slot = lax.rem(i, jnp.int32(num_stages))
    plgpu.barrier_wait(k_bars.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, _transposed(k_smem.at[slot]))
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, bk), jnp.float32)) * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=layout)
    tokens = step * bk + col
    visible = (tokens >= lo) & (tokens < hi)
    for p in range(pages_per_step):
      _, copied = page_of(step, p)
      visible &= (col // block_size != p) | copied
    s = jnp.where(visible, s, -jnp.inf)

    # A finite running max keeps exp(m - m_next) a number when nothing is seen.
    m_next = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_next)
    prob = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
    l = l * alpha + prob.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p_smem[...] = prob.astype(dtype)

    plgpu.barrier_wait(v_bars.at[slot])

    @pl.when(step * bk + bk > hi)  # the last step: zero V rows past kv_len
    def _zero_tail():
      row = plgpu.broadcasted_iota(jnp.int32, (bk, head_dim), 0, layout=layout)
      v = v_smem[slot]
      v_smem[slot] = jnp.where(step * bk + row < hi, v, jnp.zeros_like(v))

    plgpu.commit_smem()

    # A fresh accumulator, added to the rescaled one (the interpreter has no
    # `run_state`, which would accumulate in place).
    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
      return acc_ref[...]
    acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))

    # Both reads of this slot are done: refill it with step i + num_stages.
    pl.when(i + num_stages < n)(
        lambda: issue(step + num_stages, slot))
    return acc, m_next, l

  acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), layout)
  m = plgpu.layout_cast(
      jnp.full((ROWS,), jnp.finfo(jnp.float32).min, jnp.float32), row_layout)
  l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
  acc, m, l = lax.fori_loop(0, n, body, (acc, m, l))

  if k_splits == 1:
    safe = jnp.where(l > 0, l, 1.0)
    out = jnp.where(lax.broadcast_in_dim(l > 0, acc.shape, [0]),
                    acc / lax.broadcast_in_dim(safe, acc.shape, [0]), 0.0)
    o_smem[...] = out.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[b, h])
  else:
    o_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[split, b, h])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[split, b, h])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[split, b, h])
  plgpu.wait_smem_to_gmem(0)


def _swizzled(shape, dtype):
  """A shared-memory buffer tiled and swizzled for wgmma (128-byte rows)."""
  elems = 128 // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128)))


def _paged_decode_call(q, k_pages, v_pages, block_tables, kv_lens, *,
                       sm_scale, soft_cap, sliding_window,
                       config: MosaicDecodeConfig, interpret):
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  bk = block_kv(block_size)
  k_splits, num_stages = config.k_splits, config.num_stages
  dtype = q.dtype

  # [batch, num_kv_heads, group, head_dim]: a free reshape (no pad in XLA).
  qg = q.reshape(batch, num_kv_heads, group, head_dim)

  rows = (batch, num_kv_heads, ROWS)
  if k_splits == 1:
    out_type = jax.ShapeDtypeStruct(qg.shape, dtype)
    partials = []
  else:
    ml = jax.ShapeDtypeStruct((k_splits,) + rows, jnp.float32)
    out_type = (jax.ShapeDtypeStruct(
        (k_splits, batch, num_kv_heads, group, head_dim), jnp.float32), ml, ml)
    partials = [plgpu.SMEM((ROWS, head_dim), jnp.float32),  # o
                plgpu.SMEM((ROWS,), jnp.float32),  # m
                plgpu.SMEM((ROWS,), jnp.float32)]  # l
  scratch = [
      _swizzled((ROWS, head_dim), dtype),  # q (the wgmma tile)
      plgpu.SMEM((ROWS, head_dim), dtype),  # q's rows in, the output's out
      _swizzled((num_stages, bk, head_dim), dtype),  # k ring
      _swizzled((num_stages, bk, head_dim), dtype),  # v ring
      _swizzled((ROWS, bk), dtype),  # p
      *partials,
      plgpu.Barrier(num_barriers=1),  # q
      plgpu.Barrier(num_arrivals=bk // block_size, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=bk // block_size, num_barriers=num_stages),
  ]
  kernel = functools.partial(
      _paged_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, k_splits=k_splits, num_stages=num_stages)
  kwargs = {}
  if interpret:
    kwargs["interpret"] = _interpret_params()
  out = plgpu.kernel(
      kernel, out_type=out_type, scratch_types=scratch,
      grid=(batch, num_kv_heads, k_splits), grid_names=("b", "h", "s"),
      compiler_params=plgpu.CompilerParams(approx_math=False),
      **kwargs)(qg, k_pages, v_pages, block_tables, kv_lens)

  if k_splits == 1:
    o = out
  else:
    # o: [k_splits, batch, num_kv_heads, group, head_dim]; m, l: [..., ROWS]
    o, m, l = out
    m, l = m[..., :group], l[..., :group]
    m_max = lax.optimization_barrier(m.max(axis=0))
    w = jnp.exp(m - m_max[None])
    l_sum = (w * l).sum(axis=0)
    o = (w[..., None] * o).sum(axis=0)
    o = jnp.where(l_sum[..., None] > 0,
                  o / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)
  o = o.reshape(batch, num_q_heads, head_dim)
  return o.astype(dtype)


def _interpret_params():
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret  # pylint: disable=g-import-not-at-top
    params = interpret.InterpretGPUParams
  return params(detect_races=True)


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "soft_cap", "sliding_window", "config",
                     "interpret"])
def paged_decode(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: jax.Array,  # i32[batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # i32[batch]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    config: MosaicDecodeConfig | None = None,
    interpret: bool = False,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
  """Decode attention over a paged KV cache (Mosaic GPU, Hopper and newer).

  Sequence `b`'s single query sits at position `kv_lens[b] - 1` and attends to
  its first `kv_lens[b]` tokens, found through `block_tables[b]`.

  Args:
    q: `[batch, num_q_heads, head_dim]` queries, bfloat16 or float16.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` keys, the
      dtype of `q`; `head_dim` in `HEAD_DIMS`, `block_size` in `BLOCK_SIZES`.
    v_pages: values, same shape and dtype as `k_pages`.
    block_tables: `i32[batch, max_blocks_per_seq]` (as in
      `pallas_kernels.contract`: entries past `kv_len` are never read, an
      entry inside it that is not a block contributes no tokens).
    kv_lens: `i32[batch]`, clamped to `[0, max_blocks_per_seq * block_size]`.
    sm_scale: score scale, default `head_dim ** -0.5`.
    soft_cap: if set, scores become `soft_cap * tanh(s / soft_cap)`.
    sliding_window: if set, the query sees only its last `sliding_window`
      tokens (its own included).
    config: `MosaicDecodeConfig`; `default_config(...)` when None.
    interpret: run in Mosaic GPU interpret mode on CPU (JAX >= 0.11).
    k_scales, v_scales: must be None (8-bit pages are refused).

  Returns:
    `[batch, num_q_heads, head_dim]` in `q.dtype`.

  Raises:
    ValueError: if shapes or dtypes disagree (`pallas_kernels.contract`) or
      the kernel cannot serve them (see `unsupported_reason`).

  Example:
    >>> q = jnp.ones((2, 8, 128), jnp.bfloat16)
    >>> k = jnp.ones((2, 16, 16, 128), jnp.bfloat16)
    >>> tables = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    >>> out = paged_decode(q, k, k, tables, jnp.array([5, 100], jnp.int32),
    ...                    interpret=True)  # doctest: +SKIP
  """
  contract.check_attention_inputs(
      q, k_pages, block_tables, v_pages=v_pages, kv_lens=kv_lens,
      soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
      v_scales=v_scales)
  reason = _limitation(q, k_pages, block_tables, config)
  if reason is None and interpret:
    reason = interpret_unsupported_reason()
  if reason is not None:
    raise ValueError(
        f"paged_decode (Mosaic GPU) cannot serve these inputs: {reason}")
  if contract.is_empty(q, block_tables):
    return jnp.zeros(q.shape, q.dtype)
  if config is None:
    config = default_config(q, k_pages, block_tables)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  kv_lens = contract.clamp_kv_lens(kv_lens, block_tables.shape[1],
                                   k_pages.shape[2])
  return _paged_decode_call(
      q, k_pages, v_pages, block_tables, kv_lens,
      sm_scale=float(sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      config=config, interpret=interpret)
