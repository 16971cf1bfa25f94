"""TPU ragged paged attention vs the float32 reference, in TPU interpret mode.

Interpret mode runs with race detection on and uninitialised memory filled
with NaN. Batches are random mixes of decode tokens and prefill chunks (with
and without a cached prefix, up to ~100 tokens), padded with NaN query rows
and empty sequences. Every block-table entry the kernel must not read (unused
entries, pages wholly before a sequence's sliding window) holds `FAR_BLOCK`
(see tpu_testing): a passing test proves they were never touched.

8-bit pages (`QUANTIZED_SPECS`) are checked as in test_tpu_paged_decode.py:
against the reference on the dequantised pages at the query dtype's
tolerance, and (float32 queries) on the float pages they came from at
`cases.QUANTIZED_TOLERANCES`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    kernel as jax_rpa)

from paged_jax.reference import ragged_paged_attention_reference
from pallas_kernels import quantization
from pallas_kernels.tpu import paged_decode as pd
from pallas_kernels.tpu import ragged_attention as ra
from tests.cases import assert_rows_close, make_ragged_case, quantize_case
from tests.pallas_kernels.tpu_testing import FAR_BLOCK, races_found


@dataclasses.dataclass(frozen=True)
class Spec:
  dtype: str = "float32"
  num_q_heads: int = 2
  num_kv_heads: int = 1
  head_dim: int = 128
  block_size: int = 8
  max_blocks_per_seq: int = 8
  max_num_seqs: int = 6
  num_tokens: int = 64
  soft_cap: float | None = None
  sliding_window: int | None = None
  sm_scale: float | None = None
  queries_per_block: int | None = None  # None: default_config
  pages_per_compute_block: int | None = None
  q_dtype: str | None = None  # None: same as the pages

  @property
  def quantized(self):
    return quantization.is_quantized(self.dtype)

  def scale_shapes(self):
    """`{k_scales, v_scales}` shapes for 8-bit pages, else empty."""
    if not self.quantized:
      return {}
    scales = jax.ShapeDtypeStruct(
        (self.num_kv_heads, self.num_blocks, self.block_size), jnp.float32)
    return dict(k_scales=scales, v_scales=scales)

  @property
  def num_blocks(self):  # fixed, so every case of a spec has the same shapes
    return self.max_num_seqs * self.max_blocks_per_seq + 2

  @property
  def config(self):
    if self.queries_per_block is None:
      return None
    return ra.RaggedAttentionConfig(self.queries_per_block,
                                    self.pages_per_compute_block)

  @property
  def attn_kwargs(self):
    return dict(sm_scale=self.sm_scale, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window)

  def shapes(self):
    dtype = jnp.dtype(self.dtype)
    s = jax.ShapeDtypeStruct
    k = s((self.num_kv_heads, self.num_blocks, self.block_size,
           self.head_dim), dtype)
    q_dtype = jnp.dtype(self.q_dtype or dtype)
    return (s((self.num_tokens, self.num_q_heads, self.head_dim), q_dtype), k,
            k,
            s((self.max_num_seqs, self.max_blocks_per_seq), jnp.int32),
            s((self.max_num_seqs,), jnp.int32),
            s((self.max_num_seqs + 1,), jnp.int32), s((1,), jnp.int32))


DEFAULT_SPECS = [
    # MHA, float32, soft cap + sliding window, two pages per compute block.
    Spec(num_q_heads=2, num_kv_heads=2, soft_cap=8.0, sliding_window=24,
         queries_per_block=16, pages_per_compute_block=2),
    # GQA 4, bfloat16, head_dim 64, window, one page per compute block.
    Spec(dtype="bfloat16", num_q_heads=4, head_dim=64, block_size=16,
         max_blocks_per_seq=4, num_tokens=48, sliding_window=19,
         queries_per_block=16, pages_per_compute_block=1),
    # GQA 8, plain causal, default config.
    Spec(num_q_heads=8, block_size=16, max_blocks_per_seq=6),
    # head_dim 256, bfloat16, GQA 2 over two KV heads, everything on.
    Spec(dtype="bfloat16", num_q_heads=4, num_kv_heads=2, head_dim=256,
         block_size=32, max_blocks_per_seq=3, num_tokens=40, sm_scale=0.1,
         soft_cap=30.0, sliding_window=40, queries_per_block=32,
         pages_per_compute_block=2),
]
BASE = DEFAULT_SPECS[0]
# 8-bit pages (block sizes fill 32-row tiles): lowered by default, numerics
# behind -m slow (the shared contract runs int8 and fp8 by default).
QUANTIZED_SPECS = [
    # int8, bfloat16 queries, GQA 4, window + cap, two pages per block.
    Spec(dtype="int8", q_dtype="bfloat16", num_q_heads=8, num_kv_heads=2,
         head_dim=128, block_size=32, max_blocks_per_seq=4, num_tokens=48,
         soft_cap=10.0, sliding_window=37, queries_per_block=16,
         pages_per_compute_block=2),
    # fp8, float32 queries, MHA, head_dim 64, default config.
    Spec(dtype="float8_e4m3fn", q_dtype="float32", num_q_heads=2,
         num_kv_heads=2, head_dim=64, block_size=64, max_blocks_per_seq=2,
         num_tokens=40),
]


def _sample_slow_specs(n=16, seed=0):
  rng = np.random.default_rng(seed)
  grid = list(itertools.product(
      ["float32", "bfloat16"], [1, 4, 8], [64, 128, 256], [8, 16, 32],
      [None, 10.0], [None, 1, 37], [16, 32], [1, 3]))
  specs = []
  for i in rng.permutation(len(grid))[:n]:
    dtype, group, head_dim, block_size, cap, window, tq, ppcb = grid[i]
    specs.append(Spec(
        dtype=dtype, num_q_heads=group * 2, num_kv_heads=2,
        head_dim=head_dim, block_size=block_size,
        max_blocks_per_seq=max(2, 128 // block_size), num_tokens=112,
        soft_cap=cap, sliding_window=window, queries_per_block=tq,
        pages_per_compute_block=ppcb))
  return specs


SLOW_SPECS = _sample_slow_specs()


def _id(spec: Spec) -> str:
  s = (f"{spec.dtype}-g{spec.num_q_heads // spec.num_kv_heads}"
       f"-kvh{spec.num_kv_heads}-d{spec.head_dim}-bs{spec.block_size}")
  for name in ("soft_cap", "sliding_window", "sm_scale", "queries_per_block",
               "pages_per_compute_block"):
    if getattr(spec, name) is not None:
      s += f"-{name}={getattr(spec, name)}"
  return s


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  # A kernel that raised leaves the interpreter's shared state behind.
  pltpu.reset_tpu_interpret_mode_state()
  yield


def random_mix(rng, spec: Spec, *, decode_only=False):
  """Random (q_lens, kv_lens) of a mixed batch that fits the spec's shapes."""
  bs, capacity = spec.block_size, spec.block_size * spec.max_blocks_per_seq
  edges = [e for e in (1, bs - 1, bs, bs + 1, capacity) if e >= 1]
  n = spec.max_num_seqs if decode_only else int(
      rng.integers(1, spec.max_num_seqs + 1))
  budget = spec.num_tokens
  q_lens, kv_lens = [], []
  for _ in range(n):
    kv = int(rng.choice(edges) if rng.random() < 0.4 else
             rng.integers(1, capacity + 1))
    kind = "decode" if decode_only else rng.choice(
        ["decode", "prefill", "chunk", "idle"], p=[0.4, 0.2, 0.3, 0.1])
    if kind == "decode":
      q = 1
    elif kind == "prefill":  # no cached prefix
      kv = min(kv, 100)
      q = kv
    elif kind == "chunk":  # chunk after a cached prefix
      q = int(rng.integers(1, min(kv, 100) + 1))
    else:  # a live sequence with no new token this step
      q = 0
    q = min(q, budget)
    budget -= q
    q_lens.append(q)
    kv_lens.append(kv)
  return q_lens, kv_lens


def _hidden_tables(tables, kv_lens, cu_q_lens, num_seqs, block_size,
                   sliding_window):
  """Entries of pages wholly before every query's window -> FAR_BLOCK."""
  tables = np.array(tables)
  if sliding_window is None:
    return jnp.asarray(tables)
  cu = np.asarray(cu_q_lens)
  for s in range(int(np.asarray(num_seqs)[0])):
    first_pos = int(kv_lens[s]) - (cu[s + 1] - cu[s])
    first_key = max(first_pos - sliding_window + 1, 0)
    tables[s, :first_key // block_size] = FAR_BLOCK
  return jnp.asarray(tables)


def _make_case(spec: Spec, rng, q_lens=None, kv_lens=None, **kw):
  """A random mix; 8-bit pages are quantised from float32 ones."""
  if q_lens is None:
    q_lens, kv_lens = random_mix(rng, spec, **kw)
  need = sum(-(-k // spec.block_size) for k in kv_lens)
  case = make_ragged_case(
      rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=spec.num_q_heads,
      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
      block_size=spec.block_size, max_blocks_per_seq=spec.max_blocks_per_seq,
      max_num_seqs=spec.max_num_seqs, num_tokens=spec.num_tokens,
      dtype=jnp.float32 if spec.quantized else jnp.dtype(spec.dtype),
      extra_blocks=spec.num_blocks - need, unused_entry=FAR_BLOCK)
  if spec.quantized:
    case = quantize_case(case, spec.dtype)
  if spec.q_dtype is not None:
    case.q = case.q.astype(spec.q_dtype)
  return case


def _run(spec: Spec, case, *, hide=True):
  tables = case.block_tables
  if hide:
    tables = _hidden_tables(tables, np.asarray(case.kv_lens), case.cu_q_lens,
                            case.num_seqs, spec.block_size,
                            spec.sliding_window)
  out = ra.ragged_paged_attention(
      case.q, case.k_pages, case.v_pages, tables, case.kv_lens,
      case.cu_q_lens, case.num_seqs, config=spec.config, interpret=True,
      **spec.attn_kwargs, **case.scales())
  out = jax.block_until_ready(out)
  assert races_found() in (False, None), "race detected in interpret mode"
  assert out.shape == case.q.shape and out.dtype == case.q.dtype
  total = int(np.asarray(case.cu_q_lens)[int(case.num_seqs[0])])
  assert not np.asarray(out, np.float32)[total:].any(), "padding rows not 0"
  return out


def _check_against_reference(spec: Spec, case):
  out = _run(spec, case)
  ref = ragged_paged_attention_reference(
      case.q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens,
      case.cu_q_lens, case.num_seqs, **spec.attn_kwargs, **case.scales())
  assert_rows_close(out, ref, case.q.dtype)
  return out


def _lower_for_tpu(spec: Spec):
  f = functools.partial(ra.ragged_paged_attention, config=spec.config,
                        **spec.attn_kwargs)
  return jax.jit(f).trace(*spec.shapes(), **spec.scale_shapes()).lower(
      lowering_platforms=("tpu",))


# ---------------------------------------------------------------------------
# Numerics in interpret mode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", DEFAULT_SPECS, ids=_id)
def test_matches_reference(spec):
  _check_against_reference(spec, _make_case(spec, np.random.default_rng(0)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", QUANTIZED_SPECS, ids=_id)
def test_quantized_matches_reference(spec):
  float_spec = dataclasses.replace(spec, dtype="float32")
  float_case = _make_case(float_spec, np.random.default_rng(7))
  case = _make_case(spec, np.random.default_rng(7))  # same draws, quantised
  out = _check_against_reference(spec, case)
  if jnp.dtype(case.q.dtype) == jnp.float32:
    ref = ragged_paged_attention_reference(
        float_case.q, float_case.k_pages, float_case.v_pages,
        float_case.block_tables, float_case.kv_lens, float_case.cu_q_lens,
        float_case.num_seqs, **spec.attn_kwargs)
    assert_rows_close(out, ref, spec.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW_SPECS, ids=_id)
def test_matches_reference_sweep(spec):
  q, k, _, tables, *_ = spec.shapes()
  reason = ra.unsupported_reason(q, k, tables, config=spec.config)
  if reason is not None:
    assert spec.dtype == "bfloat16" and spec.block_size % 16, reason
    pytest.skip(reason)
  rng = np.random.default_rng(1)
  for _ in range(2):
    _check_against_reference(spec, _make_case(spec, rng))


def test_matches_shared_and_jax_references():
  """The shared oracle and JAX's own `ref_ragged_paged_attention` agree.

  JAX's reference takes K and V interleaved in one page array,
  `[num_blocks, block_size, 2 * num_kv_heads, head_dim]` (K at even heads),
  returns only the live rows and reads every table entry (so it gets the
  canonical tables, not the FAR_BLOCK ones).
  """
  spec = BASE
  rng = np.random.default_rng(7)
  case = _make_case(spec, rng, q_lens=[4, 1, 30], kv_lens=[12, 64, 45])
  out = _run(spec, case)
  ref = ragged_paged_attention_reference(
      case.q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens,
      case.cu_q_lens, case.num_seqs, **spec.attn_kwargs)
  assert_rows_close(out, ref, jnp.float32)

  k = jnp.transpose(case.k_pages, (1, 2, 0, 3))
  v = jnp.transpose(case.v_pages, (1, 2, 0, 3))
  kv_pages = jnp.stack([k, v], axis=3).reshape(
      k.shape[0], k.shape[1], 2 * spec.num_kv_heads, spec.head_dim)
  tables = jnp.where(case.block_tables == FAR_BLOCK, -1, case.block_tables)
  jax_ref = jax_rpa.ref_ragged_paged_attention(
      case.q, kv_pages, case.kv_lens, tables, case.cu_q_lens, case.num_seqs,
      sm_scale=spec.head_dim**-0.5, soft_cap=spec.soft_cap,
      sliding_window=spec.sliding_window)
  total = int(case.cu_q_lens[int(case.num_seqs[0])])
  assert jax_ref.shape[0] == total
  assert_rows_close(out[:total], jax_ref, jnp.float32)


def test_decode_tokens_match_paged_decode():
  """A batch of single-token sequences gives what `paged_decode` gives."""
  spec = Spec(num_q_heads=8, num_kv_heads=2, block_size=8,
              max_blocks_per_seq=4, max_num_seqs=5, num_tokens=5,
              sliding_window=13)
  case = _make_case(spec, np.random.default_rng(3), decode_only=True)
  out = _run(spec, case)
  decode = pd.paged_decode(case.q, case.k_pages, case.v_pages,
                           case.block_tables, case.kv_lens,
                           sliding_window=spec.sliding_window, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(decode), rtol=1e-5,
                             atol=1e-5)


def test_one_trace_for_many_batch_mixes():
  """num_seqs, cu_q_lens and kv_lens are data: new mixes never retrace."""
  spec = BASE

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(*args):
    return ra.ragged_paged_attention(*args, config=spec.config,
                                     interpret=True, **spec.attn_kwargs)

  chex.clear_trace_counter()
  rng = np.random.default_rng(11)
  mixes = [([1] * 6, [9, 1, 64, 8, 17, 33]),  # decode only
           ([64], [64]),  # one prefill filling the whole token budget
           ([3, 1, 20], [40, 2, 20])]  # prefix chunk, decode, fresh prefill
  for q_lens, kv_lens in mixes:
    case = _make_case(spec, rng, q_lens, kv_lens)
    tables = _hidden_tables(case.block_tables, np.asarray(case.kv_lens),
                            case.cu_q_lens, case.num_seqs, spec.block_size,
                            spec.sliding_window)
    out = step(case.q, case.k_pages, case.v_pages, tables, case.kv_lens,
               case.cu_q_lens, case.num_seqs)
    ref = ragged_paged_attention_reference(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.kv_lens,
        case.cu_q_lens, case.num_seqs, **spec.attn_kwargs)
    assert_rows_close(out, ref, jnp.float32)


# ---------------------------------------------------------------------------
# Lowering for TPU (Mosaic) from the CPU host
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", DEFAULT_SPECS + QUANTIZED_SPECS, ids=_id)
def test_lowers_for_tpu(spec):
  assert "tpu_custom_call" in _lower_for_tpu(spec).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("spec", SLOW_SPECS, ids=_id)
def test_lowers_for_tpu_sweep(spec):
  q, k, _, tables, *_ = spec.shapes()
  if ra.unsupported_reason(q, k, tables, config=spec.config) is not None:
    pytest.skip("refused")
  _lower_for_tpu(spec)


@pytest.mark.slow
def test_lowering_grid():
  """dtype x group x head_dim x block_size x queries_per_block: lowers or is
  refused for a bfloat16 tiling reason."""
  refused = set()
  for dtype, group, head_dim, block_size, tq in itertools.product(
      ["float32", "bfloat16", "int8", "float8_e4m3fn"], [1, 2, 4, 8],
      [64, 128, 256], [8, 16, 32, 64, 128], [8, 16, 64]):
    spec = Spec(dtype=dtype, num_q_heads=2 * group, num_kv_heads=2,
                head_dim=head_dim, block_size=block_size, soft_cap=20.0,
                sliding_window=100, max_blocks_per_seq=16, num_tokens=100,
                queries_per_block=tq, pages_per_compute_block=2,
                q_dtype="float32" if quantization.is_quantized(dtype)
                else None)
    q, k, _, tables, *_ = spec.shapes()
    reason = ra.unsupported_reason(q, k, tables, config=spec.config)
    if reason is not None:
      knob = reason.split("=")[0]
      refused.add((dtype, knob, block_size if knob == "block_size" else tq))
      continue
    _lower_for_tpu(spec)
  assert refused == {("bfloat16", "block_size", 8),
                     ("bfloat16", "queries_per_block", 8),
                     *((d, "block_size", bs) for d in ("int8", "float8_e4m3fn")
                       for bs in (8, 16))}


# ---------------------------------------------------------------------------
# Configuration and input checks
# ---------------------------------------------------------------------------


def test_default_config():
  q, k, _, tables, *_ = Spec(num_q_heads=8, block_size=16,
                             max_blocks_per_seq=64, num_tokens=512).shapes()
  config = ra.default_config(q, k, tables)
  assert config == ra.RaggedAttentionConfig(queries_per_block=16,
                                            pages_per_compute_block=16)
  assert hash(config) == hash(ra.RaggedAttentionConfig(16, 16))
  q, k, _, tables, *_ = Spec(num_q_heads=1, num_tokens=40).shapes()
  assert ra.default_config(q, k, tables).queries_per_block == 64


@pytest.mark.parametrize("kwargs, match", [
    (dict(queries_per_block=24), "queries_per_block=24 must be a power of two"),
    (dict(queries_per_block=4), "queries_per_block=4 must be a power of two"),
    (dict(pages_per_compute_block=0), "pages_per_compute_block=0 must be"),
    (dict(vmem_limit_bytes=-1), "vmem_limit_bytes=-1 must be positive"),
])
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ra.RaggedAttentionConfig(**kwargs)


NAMES = ("q", "k", "v", "tables", "kv_lens", "cu_q_lens", "num_seqs")
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _shapes(**changes):
  """BASE shapes (num_tokens 64, 6 seqs x 8 blocks, 50 blocks) with changes."""
  shapes = dict(zip(NAMES, BASE.shapes()))
  for name, (shape, dtype) in changes.items():
    shapes[name] = jax.ShapeDtypeStruct(shape, dtype)
  return [shapes[n] for n in NAMES]


@pytest.mark.parametrize("changes, config, match", [
    (dict(q=((64, 2, 128), bf16), k=((2, 50, 16, 128), bf16),
          v=((2, 50, 16, 128), bf16)), ra.RaggedAttentionConfig(8, 1),
     "queries_per_block=8 must be a multiple of 16 for bfloat16 queries"),
    (dict(q=((64, 2, 128), bf16), k=((2, 50, 8, 128), bf16),
          v=((2, 50, 8, 128), bf16)), None,
     "block_size=8 must be a multiple of 16 for bfloat16 pages"),
    (dict(q=((64, 2, 96), f32), k=((2, 50, 8, 96), f32),
          v=((2, 50, 8, 96), f32)), None, r"head_dim=96 is not one of"),
    (dict(k=((2, 50, 16, 128), jnp.int8), v=((2, 50, 16, 128), jnp.int8)),
     None, r"block_size=16 must be a multiple of 32 for int8 pages \(VMEM "
     r"sublane tiling\)"),
    (dict(tables=((6, 40000), i32)), None, "bytes of SMEM"),
    ({}, ra.RaggedAttentionConfig(256, 512), "bytes of VMEM"),
])
def test_unsupported_inputs(changes, config, match):
  q, k, v, tables, *rest = _shapes(**changes)
  reason = ra.unsupported_reason(q, k, tables, config=config)
  assert reason is not None and re.search(match, reason), reason
  scales = {}
  if quantization.is_quantized(k.dtype):
    s = jax.ShapeDtypeStruct(k.shape[:3], jnp.float32)
    scales = dict(k_scales=s, v_scales=s)
  with pytest.raises(ValueError, match="cannot serve these inputs: .*" + match):
    jax.eval_shape(functools.partial(ra.ragged_paged_attention, config=config),
                   q, k, v, tables, *rest, **scales)


def test_unsupported_reason_of_invalid_and_valid_inputs():
  q, k, _, tables, *_ = _shapes(q=((64, 3, 128), f32))
  assert ra.unsupported_reason(q, k, tables).startswith("invalid inputs")
  case = _make_case(BASE, np.random.default_rng(2))
  assert ra.unsupported_reason(case.q, case.k_pages, case.block_tables,
                               soft_cap=2.0, sliding_window=3) is None
