"""TPU paged-decode kernel vs the float32 reference, in TPU interpret mode.

Interpret mode runs with race detection on and uninitialised memory filled
with NaN. Unused block-table entries (and, with a sliding window, the entries
of pages wholly before the window) are set to `FAR_BLOCK` (see tpu_testing):
a passing test proves they were never touched.

8-bit pages (`QUANTIZED_SPECS`) carry scales poisoned like their values
(`tests.cases.quantize_case`: NaN scales on every slot no sequence owns). The
kernel is compared with the float32 reference on the dequantised pages at
the query dtype's tolerance (float32 queries: every matmul is float32 at
HIGHEST and the scale row is exact, so only the summation order differs;
measured ~5e-7 against 2e-5; bfloat16 queries round q and p as the bfloat16
path does), and, for float32 queries, with the reference on the float pages
they were quantised from at `cases.QUANTIZED_TOLERANCES`. The shared contract
(test_tpu_contract.py) runs the same two comparisons on malformed rows.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from paged_jax.reference import paged_attention_reference
from pallas_kernels import contract
from pallas_kernels import quantization
from pallas_kernels.tpu import paged_decode as pd
from tests.cases import assert_rows_close, make_decode_case, quantize_case
from tests.pallas_kernels.tpu_testing import FAR_BLOCK, races_found


@dataclasses.dataclass(frozen=True)
class Spec:
  dtype: str = "float32"
  num_q_heads: int = 2
  num_kv_heads: int = 1
  head_dim: int = 128
  block_size: int = 8
  max_blocks_per_seq: int = 4
  batch: int = 6  # 6 covers every edge length of `ragged_lengths`
  soft_cap: float | None = None
  sliding_window: int | None = None
  sm_scale: float | None = None
  pages_per_compute_block: int | None = None  # None: default_config
  q_dtype: str | None = None  # None: same as the pages

  @property
  def config(self):
    if self.pages_per_compute_block is None:
      return None
    return pd.PagedDecodeConfig(self.pages_per_compute_block)

  @property
  def attn_kwargs(self):
    return dict(sm_scale=self.sm_scale, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window)

  @property
  def quantized(self):
    return quantization.is_quantized(self.dtype)

  def scale_shapes(self):
    """`{k_scales, v_scales}` shapes for 8-bit pages, else empty."""
    if not self.quantized:
      return {}
    _, k, _, _, _ = self.shapes()
    scales = jax.ShapeDtypeStruct(k.shape[:3], jnp.float32)
    return dict(k_scales=scales, v_scales=scales)

  def shapes(self):
    q_dtype = jnp.dtype(self.q_dtype or self.dtype)
    q = jax.ShapeDtypeStruct(
        (self.batch, self.num_q_heads, self.head_dim), q_dtype)
    k = jax.ShapeDtypeStruct(
        (self.num_kv_heads, self.batch * self.max_blocks_per_seq + 3,
         self.block_size, self.head_dim), jnp.dtype(self.dtype))
    tables = jax.ShapeDtypeStruct((self.batch, self.max_blocks_per_seq),
                                  jnp.int32)
    lens = jax.ShapeDtypeStruct((self.batch,), jnp.int32)
    return q, k, k, tables, lens


DEFAULT_SPECS = [
    # MHA (group 1), several pages per compute block, float32.
    Spec(num_q_heads=2, num_kv_heads=2, block_size=8, max_blocks_per_seq=5,
         pages_per_compute_block=2),
    # GQA 4, head_dim 64, soft cap, compute block not dividing the table.
    Spec(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
         max_blocks_per_seq=4, soft_cap=5.0, pages_per_compute_block=3),
    # GQA 8, bfloat16, sliding window, one page per compute block.
    Spec(dtype="bfloat16", num_q_heads=8, num_kv_heads=1, block_size=16,
         sliding_window=19, pages_per_compute_block=1),
    # head_dim 256, bfloat16, soft cap + window + explicit sm_scale.
    Spec(dtype="bfloat16", num_q_heads=4, num_kv_heads=1, head_dim=256,
         block_size=32, max_blocks_per_seq=3, soft_cap=30.0, sliding_window=40,
         sm_scale=0.1, pages_per_compute_block=2, batch=5),
    # GQA 8 with two KV heads, window of one token, default config, float32
    # queries over bfloat16 pages (computed in float32).
    Spec(dtype="bfloat16", q_dtype="float32", num_q_heads=16, num_kv_heads=2,
         block_size=16, sliding_window=1),
]
# Shapes and config shared by the tests below, so they reuse one compilation
# (TPU interpret mode compiles slowly on CPU).
BASE = DEFAULT_SPECS[0]
# 8-bit pages: block sizes fill 32-row tiles. Lowered by default; their
# numerics behind -m slow (the shared contract runs int8 and fp8 by default).
QUANTIZED_SPECS = [
    # int8, bfloat16 queries, GQA 8 over two KV heads, window + cap, three
    # pages per compute block (scales laid along lanes by the MXU).
    Spec(dtype="int8", q_dtype="bfloat16", num_q_heads=16, num_kv_heads=2,
         block_size=32, max_blocks_per_seq=4, soft_cap=20.0,
         sliding_window=40, pages_per_compute_block=3),
    # fp8, float32 queries, head_dim 256, 64-token pages.
    Spec(dtype="float8_e4m3fn", q_dtype="float32", num_q_heads=4,
         num_kv_heads=1, head_dim=256, block_size=64, max_blocks_per_seq=3,
         pages_per_compute_block=2, batch=5),
    # int8, float32 queries, MHA, 128-token pages, one page per block.
    Spec(dtype="int8", q_dtype="float32", num_q_heads=2, num_kv_heads=2,
         head_dim=64, block_size=128, max_blocks_per_seq=2,
         pages_per_compute_block=1),
]


def _sample_slow_specs(n=24, seed=0):
  rng = np.random.default_rng(seed)
  grid = list(itertools.product(
      ["float32", "bfloat16"], [1, 4, 8], [64, 128, 256],
      [8, 16, 32, 64, 128], [None, 10.0], [None, 1, 37], [1, 2, 3]))
  specs = []
  for i in rng.permutation(len(grid))[:n]:
    dtype, group, head_dim, block_size, cap, window, ppcb = grid[i]
    num_kv_heads = 1 if group == 8 else 2
    specs.append(Spec(
        dtype=dtype, num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_blocks_per_seq=3, soft_cap=cap, sliding_window=window,
        pages_per_compute_block=ppcb))
  return specs


SLOW_SPECS = _sample_slow_specs()


def _id(spec: Spec) -> str:
  s = (f"{spec.dtype}-g{spec.num_q_heads // spec.num_kv_heads}"
       f"-kvh{spec.num_kv_heads}-d{spec.head_dim}-bs{spec.block_size}")
  for name in ("soft_cap", "sliding_window", "sm_scale",
               "pages_per_compute_block", "q_dtype"):
    if getattr(spec, name) is not None:
      s += f"-{name}={getattr(spec, name)}"
  return s


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  # A kernel that raised leaves the interpreter's shared state behind.
  pltpu.reset_tpu_interpret_mode_state()
  yield


def _hide_skipped_pages(tables, kv_lens, block_size, sliding_window):
  """Tables whose entries the kernel must not read all point at FAR_BLOCK."""
  tables = np.array(tables)
  for b, kv_len in enumerate(np.asarray(kv_lens)):
    tables[b, -(-int(kv_len) // block_size):] = FAR_BLOCK
    if sliding_window is not None:
      first_page = max(int(kv_len) - sliding_window, 0) // block_size
      tables[b, :first_page] = FAR_BLOCK
  return jnp.asarray(tables)


def _make_case(spec: Spec, seed: int, **kw):
  """A random case; 8-bit pages are quantised from float32 ones."""
  rng = np.random.default_rng(seed)
  case = make_decode_case(
      rng, batch=spec.batch, num_q_heads=spec.num_q_heads,
      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
      block_size=spec.block_size, max_blocks_per_seq=spec.max_blocks_per_seq,
      dtype=jnp.float32 if spec.quantized else jnp.dtype(spec.dtype), **kw)
  if spec.quantized:
    case = quantize_case(case, spec.dtype)
  if spec.q_dtype is not None:
    case.q = case.q.astype(spec.q_dtype)
  return case


def _check_against_reference(spec: Spec, case, *, hide_skipped=True,
                             reference=paged_attention_reference):
  tables = case.block_tables
  if hide_skipped:
    tables = _hide_skipped_pages(tables, case.kv_lens, spec.block_size,
                                 spec.sliding_window)
  out = pd.paged_decode(case.q, case.k_pages, case.v_pages, tables,
                        case.kv_lens, config=spec.config, interpret=True,
                        **spec.attn_kwargs, **case.scales())
  out = jax.block_until_ready(out)
  assert races_found() in (False, None), "race detected in interpret mode"
  assert out.shape == case.q.shape and out.dtype == case.q.dtype
  empty = np.asarray(case.kv_lens) == 0
  assert not np.asarray(out, np.float32)[empty].any(), "kv_len 0 must give 0"
  if empty.all():
    return
  ref = reference(case.q, case.k_pages, case.v_pages, case.block_tables,
                  case.kv_lens, **spec.attn_kwargs, **case.scales())
  assert_rows_close(out, ref, case.q.dtype)
  return out


def _lower_for_tpu(spec: Spec):
  f = functools.partial(pd.paged_decode, config=spec.config,
                        **spec.attn_kwargs)
  return jax.jit(f).trace(*spec.shapes(), **spec.scale_shapes()).lower(
      lowering_platforms=("tpu",))


# ---------------------------------------------------------------------------
# Numerics in interpret mode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", DEFAULT_SPECS, ids=_id)
def test_matches_reference(spec):
  _check_against_reference(spec, _make_case(spec, seed=0))


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW_SPECS, ids=_id)
def test_matches_reference_sweep(spec):
  q, k, _, tables, _ = spec.shapes()
  reason = pd.unsupported_reason(q, k, tables, config=spec.config)
  if reason is not None:
    assert spec.dtype == "bfloat16" and spec.block_size % 16, reason
    pytest.skip(reason)
  _check_against_reference(spec, _make_case(spec, seed=1))


@pytest.mark.slow
@pytest.mark.parametrize("spec", QUANTIZED_SPECS, ids=_id)
def test_quantized_matches_reference(spec):
  float_case = _make_case(dataclasses.replace(spec, dtype="float32"), seed=7)
  case = _make_case(spec, seed=7)  # the same draws, quantised
  out = _check_against_reference(spec, case)
  if jnp.dtype(case.q.dtype) == jnp.float32:
    ref = paged_attention_reference(
        float_case.q, float_case.k_pages, float_case.v_pages,
        float_case.block_tables, float_case.kv_lens, **spec.attn_kwargs)
    assert_rows_close(out, ref, spec.dtype)


def test_null_block_entries_with_canonical_sentinel():
  """The canonical -1 sentinel works end to end (and the batched oracle is
  the shared one)."""
  case = _make_case(BASE, seed=3)
  assert (np.asarray(case.block_tables) == -1).any()
  _check_against_reference(BASE, case, hide_skipped=False,
                           reference=paged_attention_reference)


def test_all_empty_sequences_give_zeros():
  case = _make_case(BASE, seed=4)
  case.kv_lens = jnp.zeros_like(case.kv_lens)  # every table entry now unused
  _check_against_reference(BASE, case)


def test_under_jit_with_donated_query():
  case = _make_case(BASE, seed=5, unused_entry=FAR_BLOCK)
  ref = paged_attention_reference(case.q, case.k_pages, case.v_pages,
                                 case.block_tables, case.kv_lens)
  params = pltpu.InterpretParams(detect_races=True)
  step = jax.jit(
      functools.partial(pd.paged_decode, config=BASE.config,
                        interpret=params),
      donate_argnums=(0,))
  q = jnp.array(case.q, copy=True)
  out = step(q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens)
  assert_rows_close(out, ref, jnp.float32)
  assert races_found() in (False, None)


# ---------------------------------------------------------------------------
# Lowering for TPU (Mosaic) from the CPU host
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", DEFAULT_SPECS + QUANTIZED_SPECS, ids=_id)
def test_lowers_for_tpu(spec):
  assert "tpu_custom_call" in _lower_for_tpu(spec).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW_SPECS, ids=_id)
def test_lowers_for_tpu_sweep(spec):
  q, k, _, tables, _ = spec.shapes()
  if pd.unsupported_reason(q, k, tables, config=spec.config) is not None:
    pytest.skip("refused")
  _lower_for_tpu(spec)


@pytest.mark.slow
def test_lowering_grid():
  """Every dtype x group x head_dim x block_size either lowers or is refused."""
  refused = set()
  for dtype, group, head_dim, block_size in itertools.product(
      ["float32", "bfloat16", "int8", "float8_e4m3fn"], [1, 2, 4, 8, 16],
      [64, 128, 256], [8, 16, 32, 64, 128]):
    spec = Spec(dtype=dtype, num_q_heads=2 * group, num_kv_heads=2,
                head_dim=head_dim, block_size=block_size, soft_cap=20.0,
                sliding_window=100, max_blocks_per_seq=16,
                q_dtype="bfloat16" if quantization.is_quantized(dtype)
                else None)
    q, k, _, tables, _ = spec.shapes()
    if pd.unsupported_reason(q, k, tables) is not None:
      refused.add((dtype, block_size))
      continue
    _lower_for_tpu(spec)
  assert refused == {("bfloat16", 8), ("int8", 8), ("int8", 16),
                     ("float8_e4m3fn", 8), ("float8_e4m3fn", 16)}


def test_bfloat16_block_size_8_is_refused():
  spec = Spec(dtype="bfloat16", block_size=8)
  q, k, v, tables, lens = spec.shapes()
  reason = pd.unsupported_reason(q, k, tables)
  assert reason is not None and "multiple of 16" in reason
  with pytest.raises(ValueError, match="cannot serve.*multiple of 16"):
    jax.eval_shape(pd.paged_decode, q, k, v, tables, lens)


# ---------------------------------------------------------------------------
# Configuration and input checks
# ---------------------------------------------------------------------------


def test_default_config():
  q, k, _, tables, _ = Spec(block_size=16, max_blocks_per_seq=64).shapes()
  config = pd.default_config(q, k, tables)
  assert config == pd.PagedDecodeConfig(pages_per_compute_block=32)
  assert hash(config) == hash(pd.PagedDecodeConfig(32))
  q, k, _, tables, _ = Spec(block_size=16, max_blocks_per_seq=3).shapes()
  assert pd.default_config(q, k, tables).pages_per_compute_block == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(pages_per_compute_block=0), "pages_per_compute_block=0 must be"),
    (dict(vmem_limit_bytes=0), "vmem_limit_bytes=0 must be positive"),
])
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    pd.PagedDecodeConfig(**kwargs)


def _shapes(**changes):
  """Default shapes (q, k, v, tables, lens) with some replaced."""
  names = ("q", "k", "v", "tables", "lens")
  shapes = dict(zip(names, Spec(num_q_heads=4).shapes()))
  for name, (shape, dtype) in changes.items():
    shapes[name] = jax.ShapeDtypeStruct(shape, dtype)
  return [shapes[n] for n in names]


f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


@pytest.mark.parametrize("changes, kwargs", [
    (dict(q=((6, 4, 1, 128), f32)), {}),
    (dict(tables=((5, 4), i32)), {}),
    ({}, dict(sliding_window=0)),
])
def test_unsupported_reason_of_invalid_inputs(changes, kwargs):
  """Invalid inputs are refused with the shared validator's message (whose
  every message tests/contract.py checks on this kernel)."""
  q, k, _, tables, _ = _shapes(**changes)
  reason = pd.unsupported_reason(q, k, tables, **kwargs)
  error = contract.attention_input_error(q, k, tables, **kwargs)
  assert error is not None and reason == f"invalid inputs: {error}"


@pytest.mark.parametrize("changes, config, match", [
    (dict(q=((6, 4, 128), jnp.float16), k=((1, 27, 16, 128), jnp.float16),
          v=((1, 27, 16, 128), jnp.float16)), None,
     "q dtype float16 is not float32 or bfloat16"),
    (dict(k=((1, 27, 8, 128), jnp.float16), v=((1, 27, 8, 128), jnp.float16)),
     None, "k_pages dtype float16 is not float32, bfloat16, int8 or "
     "float8_e4m3fn"),
    (dict(q=((6, 4, 96), f32), k=((1, 27, 8, 96), f32),
          v=((1, 27, 8, 96), f32)), None, r"head_dim=96 is not one of"),
    (dict(k=((1, 27, 12, 128), f32), v=((1, 27, 12, 128), f32)), None,
     "block_size=12 must be a multiple of 8 for float32"),
    # 8-bit pages fill (32, 128) tiles: 16- and 8-token pages are refused.
    (dict(k=((1, 27, 16, 128), jnp.int8), v=((1, 27, 16, 128), jnp.int8)),
     None, r"block_size=16 must be a multiple of 32 for int8 pages \(VMEM "
     r"sublane tiling\)"),
    (dict(k=((1, 27, 8, 128), jnp.float8_e4m3fn),
          v=((1, 27, 8, 128), jnp.float8_e4m3fn)), None,
     r"block_size=8 must be a multiple of 32 for float8_e4m3fn pages"),
    (dict(q=((4096, 4, 128), f32), tables=((4096, 64), i32),
          lens=((4096,), i32)), None, "bytes of SMEM"),
    ({}, pd.PagedDecodeConfig(pages_per_compute_block=4096), "bytes of VMEM"),
])
def test_unsupported_inputs(changes, config, match):
  q, k, v, tables, lens = _shapes(**changes)
  reason = pd.unsupported_reason(q, k, tables, config=config)
  assert reason is not None and re.search(match, reason), reason
  scales = {}
  if quantization.is_quantized(k.dtype):
    s = jax.ShapeDtypeStruct(k.shape[:3], jnp.float32)
    scales = dict(k_scales=s, v_scales=s)
  with pytest.raises(ValueError, match="cannot serve these inputs: .*" + match):
    jax.eval_shape(functools.partial(pd.paged_decode, config=config,
                                     **scales), q, k, v, tables, lens)


def test_unsupported_reason_accepts_arrays():
  case = _make_case(Spec(num_q_heads=4), seed=6)
  assert pd.unsupported_reason(case.q, case.k_pages, case.block_tables,
                               soft_cap=3.0, sliding_window=5) is None
