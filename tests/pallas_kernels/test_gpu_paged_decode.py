"""GPU paged decode (Pallas/Triton): interpret mode on CPU, lowering for CUDA."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.reference import paged_attention_reference
from pallas_kernels.gpu import paged_decode as pd
from pallas_kernels.gpu.paged_decode import PagedDecodeConfig
from tests.cases import TOLERANCES, assert_rows_close, make_decode_case
from tests.pallas_kernels.gpu_lowering import lower_for_cuda, shape_structs, triton_ir


@dataclasses.dataclass(frozen=True)
class Params:
  dtype: type = jnp.float32
  group: int = 1  # q heads per kv head
  num_kv_heads: int = 2
  head_dim: int = 64
  block_size: int = 16
  max_blocks_per_seq: int = 4
  pages_per_compute_block: int | None = None  # None: default config
  k_splits: int = 1
  sm_scale: float | None = None
  soft_cap: float | None = None
  sliding_window: int | None = None
  batch: int = 6

  def __str__(self):
    return (f"{jnp.dtype(self.dtype).name}-g{self.group}x{self.num_kv_heads}"
            f"-d{self.head_dim}-bs{self.block_size}x{self.max_blocks_per_seq}"
            f"-ppcb{self.pages_per_compute_block}-ks{self.k_splits}"
            f"-scale{self.sm_scale}-cap{self.soft_cap}-win{self.sliding_window}")

  def config(self):
    if self.pages_per_compute_block is None:
      return None
    return PagedDecodeConfig(k_splits=self.k_splits,
                             pages_per_compute_block=self.pages_per_compute_block)

  def kwargs(self):
    return dict(sm_scale=self.sm_scale, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window)


# A sample of the grid in which every value of every knob appears at least once:
# GQA 1/4/8/32, float32/bfloat16, block sizes 8..128, head dims 64/128/256,
# k-splits 1..4 (more splits than compute blocks too), soft cap, windows.
CASES = [
    Params(jnp.float32, 1, 2, 64, 8, 6, 2, 1),
    Params(jnp.float32, 4, 2, 128, 16, 9, 4, 3, soft_cap=10.0,
           sliding_window=1),
    Params(jnp.bfloat16, 8, 1, 128, 16, 8, 2, 2, sliding_window=20),
    Params(jnp.bfloat16, 4, 2, 256, 32, 4, 1, 4, sm_scale=0.05),
    Params(jnp.float32, 8, 2, 64, 128, 2, 1, 3, soft_cap=2.0,
           sliding_window=100),
    Params(jnp.bfloat16, 32, 1, 64, 8, 12, soft_cap=5.0),  # default config
]


def _case(p: Params, seed=0, **kw):
  rng = np.random.default_rng(seed)
  return make_decode_case(
      rng, batch=p.batch, num_q_heads=p.group * p.num_kv_heads,
      num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
      block_size=p.block_size, max_blocks_per_seq=p.max_blocks_per_seq,
      dtype=p.dtype, **kw)


def _args(c):
  return c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens


def _check_against_reference(p: Params, seed=0):
  c = _case(p, seed)
  out = pd.paged_decode(*_args(c), config=p.config(), interpret=True,
                        **p.kwargs())
  assert out.dtype == c.q.dtype
  ref = paged_attention_reference(*_args(c), **p.kwargs())
  assert_rows_close(out, ref, p.dtype)
  zero = np.asarray(c.kv_lens) == 0
  assert not np.asarray(out, np.float32)[zero].any(), "kv_len == 0 must be 0"


@pytest.mark.parametrize("p", CASES, ids=str)
def test_matches_reference(p):
  _check_against_reference(p)


@pytest.mark.parametrize("p", CASES, ids=str)
def test_lowers_for_cuda(p):
  c = _case(p)
  f = functools.partial(pd.paged_decode, config=p.config(), **p.kwargs())
  lower_for_cuda(f, *shape_structs(*_args(c)))


def test_lowers_for_cuda_with_default_config_of_benchmark_shape():
  s = jax.ShapeDtypeStruct
  args = (s((8, 32, 128), jnp.bfloat16), s((8, 4096, 16, 128), jnp.bfloat16),
          s((8, 4096, 16, 128), jnp.bfloat16), s((8, 512), jnp.int32),
          s((8,), jnp.int32))
  config = pd.default_config(*args[:2], args[3])
  assert config.k_splits > 1
  lower_for_cuda(pd.paged_decode, *args)


def test_large_pool_lowers_with_64_bit_offsets():
  # 2**31 elements per K array: offsets must not overflow int32.
  s = jax.ShapeDtypeStruct
  args = (s((2, 8, 128), jnp.bfloat16), s((1, 1 << 20, 16, 128), jnp.bfloat16),
          s((1, 1 << 20, 16, 128), jnp.bfloat16), s((2, 64), jnp.int32),
          s((2,), jnp.int32))
  lower_for_cuda(pd.paged_decode, *args)



def test_all_lengths_zero_gives_zeros():
  p = Params(jnp.float32, 4, 2, 64, 16, 3, 1, 2, batch=3)
  c = _case(p, kv_lens=np.zeros(3, np.int32))
  out = pd.paged_decode(*_args(c), config=p.config(), interpret=True)
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def _jax_builtin_paged_attention():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import paged_attention  # pylint: disable=g-import-not-at-top
  return paged_attention.paged_attention


@pytest.mark.parametrize("dtype", [
    jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_agrees_with_jax_builtin(dtype):
  # JAX's kernel reads whole compute blocks of the table and does not scale the
  # scores, so: valid table entries everywhere, no NaN, sm_scale = 1.
  p = Params(dtype, 4, 2, 64, 16, 8, 2, 2, sm_scale=1.0)
  c = _case(p, unused_entry=0, poison=False)
  q = (c.q.astype(jnp.float32) * 64**-0.5).astype(dtype)
  args = (q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
  ours = pd.paged_decode(*args, config=p.config(), sm_scale=1.0,
                         interpret=True)
  theirs = _jax_builtin_paged_attention()(
      *args, k_splits=2, pages_per_compute_block=2, interpret=True)
  ref = paged_attention_reference(*args, sm_scale=1.0)
  assert_rows_close(ours, ref, dtype)
  assert_rows_close(theirs, ref, dtype)
  tol = {k: 2 * v for k, v in TOLERANCES[jnp.dtype(dtype)].items()}
  np.testing.assert_allclose(np.asarray(ours, np.float32),
                             np.asarray(theirs, np.float32), **tol)


def test_vmap_over_layers():
  p = Params(jnp.bfloat16, 4, 2, 64, 16, 3, 1, 2)
  layers = [_case(p, seed=0), _case(p, seed=1)]
  # Same tables and lengths in every layer, as in a model.
  c0 = layers[0]
  qs = jnp.stack([c.q for c in layers])
  k_pages = jnp.stack([c0.k_pages, c0.k_pages[:, ::-1]])
  v_pages = jnp.stack([c0.v_pages, c0.v_pages * 2])
  def per_layer(interpret):
    return jax.vmap(functools.partial(pd.paged_decode, config=p.config(),
                                      interpret=interpret),
                    in_axes=(0, 0, 0, None, None))

  out = per_layer(True)(qs, k_pages, v_pages, c0.block_tables, c0.kv_lens)
  for i in range(2):
    ref = paged_attention_reference(qs[i], k_pages[i], v_pages[i],
                                 c0.block_tables, c0.kv_lens)
    assert_rows_close(out[i], ref, p.dtype)
  lower_for_cuda(per_layer(False), *shape_structs(
      qs, k_pages, v_pages, c0.block_tables, c0.kv_lens))


def test_decode_step_with_donated_cache_traces_once():
  p = Params(jnp.float32, 4, 2, 64, 16, 4, 2, 2)
  config = p.config()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  @chex.assert_max_traces(n=1)
  def step(k_pages, v_pages, q, new_k, new_v, block_tables, kv_lens):
    # Append one token per sequence at position kv_len - 1, then attend.
    bs = k_pages.shape[2]
    pos = kv_lens - 1
    pages = block_tables[jnp.arange(q.shape[0]), pos // bs]
    k_pages = k_pages.at[:, pages, pos % bs].set(jnp.swapaxes(new_k, 0, 1))
    v_pages = v_pages.at[:, pages, pos % bs].set(jnp.swapaxes(new_v, 0, 1))
    out = pd.paged_decode(q, k_pages, v_pages, block_tables, kv_lens,
                          config=config, interpret=True)
    return k_pages, v_pages, out

  chex.clear_trace_counter()
  lens = np.asarray([1, 15, 16, 17, 40, 64])
  for seed in range(2):
    # New lengths, tables and values each step; the same pool size.
    lens = np.random.default_rng(seed).permutation(lens)
    c = _case(p, seed, kv_lens=lens)
    rng = np.random.default_rng(seed + 10)
    new_k, new_v = (jnp.asarray(rng.standard_normal(
        (p.batch, p.num_kv_heads, p.head_dim)), jnp.float32) for _ in range(2))
    k_pages, v_pages, out = step(c.k_pages, c.v_pages, c.q, new_k,
                                 new_v, c.block_tables, c.kv_lens)
    ref = paged_attention_reference(c.q, k_pages, v_pages, c.block_tables,
                                 c.kv_lens)
    assert_rows_close(out, ref, p.dtype)


def test_default_config_heuristic():
  s = jax.ShapeDtypeStruct

  def config(batch, context, num_sms=132, block_size=16, head_dim=128,
             dtype=jnp.bfloat16):
    return pd.default_config(
        s((batch, 32, head_dim), dtype),
        s((8, 1024, block_size, head_dim), dtype),
        s((batch, context // block_size), jnp.int32), num_sms=num_sms)

  # Few (sequence, kv head) pairs and a long context: split the sequence.
  assert config(1, 32768).k_splits == 64
  assert config(8, 8192).k_splits == 8
  assert config(8, 8192, num_sms=16).k_splits == 1
  # Enough programs already: no split.
  assert config(64, 8192).k_splits == 1
  # Never more splits than the table has compute blocks.
  assert config(1, 64).k_splits == 1
  c = config(8, 8192)
  assert c.pages_per_compute_block * 16 == 32
  assert (c.num_warps, c.num_stages) == (4, 3)
  assert config(8, 8192, head_dim=256).pages_per_compute_block * 16 == 16
  assert config(8, 8192, head_dim=64).pages_per_compute_block * 16 == 64
  assert config(8, 8192, dtype=jnp.float32).pages_per_compute_block * 16 == 16
  assert config(8, 8192, block_size=128).pages_per_compute_block == 1
  # Every default is servable.
  for batch, context, bs in itertools.product((1, 8, 256), (16, 4096), (8, 128)):
    args = (s((batch, 32, 128), jnp.bfloat16),
            s((8, 64, bs, 128), jnp.bfloat16),
            s((batch, max(context // bs, 1)), jnp.int32))
    assert pd.unsupported_reason(*args, config=pd.default_config(*args)) is None


def test_unsupported_reason_accepts_shape_structs():
  s = jax.ShapeDtypeStruct
  q = s((2, 8, 128), jnp.bfloat16)
  k = s((2, 64, 16, 128), jnp.bfloat16)
  tables = s((2, 8), jnp.int32)
  assert pd.unsupported_reason(q, k, tables) is None
  assert pd.unsupported_reason(q, k, tables, soft_cap=30.0,
                               sliding_window=128) is None
  assert "power of two" in pd.unsupported_reason(
      q, s((2, 64, 24, 128), jnp.bfloat16), tables)


def _small_inputs(**overrides):
  shapes = dict(q=((2, 8, 64), jnp.float32),
                k=((2, 10, 16, 64), jnp.float32),
                v=((2, 10, 16, 64), jnp.float32),
                tables=((2, 4), jnp.int32),
                lens=((2,), jnp.int32))
  shapes.update(overrides)
  return [jnp.zeros(shape, dtype) for shape, dtype in shapes.values()]


# Kernel limitations and config errors; malformed inputs (the validator's
# messages) are tested for every backend by tests/contract.py.
_BAD_INPUTS = [
    (dict(q=((2, 8, 64), jnp.float8_e4m3fn)), {},
     r"q dtype float8_e4m3fn is not one of"),
    (dict(q=((2, 8, 48), jnp.float32), k=((2, 10, 16, 48), jnp.float32),
          v=((2, 10, 16, 48), jnp.float32)), {},
     r"head_dim=48 must be a power of two in \[16, 256\]"),
    (dict(q=((2, 8, 512), jnp.float32), k=((2, 10, 16, 512), jnp.float32),
          v=((2, 10, 16, 512), jnp.float32)), {},
     r"head_dim=512 must be a power of two"),
    (dict(k=((2, 10, 12, 64), jnp.float32),
          v=((2, 10, 12, 64), jnp.float32)), {},
     r"block_size=12 must be a power of two"),
    ({}, dict(config=PagedDecodeConfig(k_splits=0)),
     r"config.k_splits=0 must be at least 1"),
    ({}, dict(config=PagedDecodeConfig(pages_per_compute_block=0)),
     r"config.pages_per_compute_block=0 must be at least 1"),
    (dict(k=((2, 10, 8, 64), jnp.float32), v=((2, 10, 8, 64), jnp.float32)),
     dict(config=PagedDecodeConfig(pages_per_compute_block=1)),
     r"pages_per_compute_block \* block_size = 8 must be a power of two in "
     r"\[16, 512\]"),
    ({}, dict(config=PagedDecodeConfig(pages_per_compute_block=3)),
     r"pages_per_compute_block \* block_size = 48"),
    ({}, dict(config=PagedDecodeConfig(num_warps=3)),
     r"config.num_warps=3 must be a power of two <= 32"),
    ({}, dict(config=PagedDecodeConfig(num_stages=0)),
     r"config.num_stages=0 must be at least 1"),
]


@pytest.mark.parametrize("overrides,kwargs,match", _BAD_INPUTS,
                         ids=[m[:40] for _, _, m in _BAD_INPUTS])
def test_value_errors(overrides, kwargs, match):
  with pytest.raises(ValueError, match="paged_decode \\(GPU\\) cannot serve these"
                     " inputs: .*" + match):
    pd.paged_decode(*_small_inputs(**overrides), interpret=True, **kwargs)


def test_unsupported_reason_of_invalid_inputs():
  q, k, _, tables, _ = _small_inputs(q=((2, 7, 64), jnp.float32))
  assert pd.unsupported_reason(q, k, tables) == (
      "invalid inputs: num_q_heads=7 must be a multiple of num_kv_heads=2")


def _sampled_grid(n, seed=0):
  grid = list(itertools.product(
      (jnp.float32, jnp.bfloat16),  # dtype
      (1, 4, 8),  # group
      (64, 128, 256),  # head_dim
      (8, 16, 32, 64, 128),  # block_size
      (1, 2, 4, 8),  # pages_per_compute_block
      (1, 2, 5),  # k_splits
      (None, 3.0),  # soft_cap
      (None, 1, 17, 200),  # sliding_window
  ))
  rng = np.random.default_rng(seed)
  picks = []
  for i in rng.permutation(len(grid)):
    dtype, group, hd, bs, ppcb, ks, cap, window = grid[i]
    if not 16 <= bs * ppcb <= 256:
      continue
    picks.append(Params(dtype, group, 2, hd, bs, max(1, 512 // bs // 2), ppcb,
                        ks, soft_cap=cap, sliding_window=window, batch=8))
    if len(picks) == n:
      break
  return picks


@pytest.mark.slow
@pytest.mark.parametrize("p", _sampled_grid(40), ids=str)
def test_matches_reference_sweep(p):
  _check_against_reference(p, seed=1)
  c = _case(p)
  lower_for_cuda(functools.partial(pd.paged_decode, config=p.config(),
                                   **p.kwargs()), *shape_structs(*_args(c)))


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn],
                         ids=["int8", "fp8"])
@pytest.mark.parametrize("k_splits", [1, 4])
def test_quantized_pages_lower_for_cuda(kv_dtype, k_splits):
  """bf16 queries over 8-bit pages with their f32 scales, one split and
  several (the benchmark's shape class; the kernel names its page dtype)."""
  s = jax.ShapeDtypeStruct
  pages = s((8, 512, 16, 128), kv_dtype)
  scales = s((8, 512, 16), jnp.float32)
  args = (s((4, 32, 128), jnp.bfloat16), pages, pages, s((4, 64), jnp.int32),
          s((4,), jnp.int32))
  config = pd.PagedDecodeConfig(k_splits=k_splits, pages_per_compute_block=4)
  text = lower_for_cuda(
      lambda *a: pd.paged_decode(*a[:5], k_scales=a[5], v_scales=a[6],
                                 config=config), *args, scales, scales)
  assert jnp.dtype(kv_dtype).name in text


@pytest.mark.parametrize("ppcb", [1, 4])
def test_page_ids_arrive_a_block_ahead_in_one_read(ppcb):
  """In the Triton IR, the loop's only integer load is the next compute
  block's `ppcb` table entries (one vector, carried to the next step), never
  one table entry per token."""
  s = jax.ShapeDtypeStruct
  args = (s((4, 32, 128), jnp.bfloat16), s((8, 256, 16, 128), jnp.bfloat16),
          s((8, 256, 16, 128), jnp.bfloat16), s((4, 64), jnp.int32),
          s((4,), jnp.int32))
  config = PagedDecodeConfig(pages_per_compute_block=ppcb)
  (ir,) = triton_ir(functools.partial(pd.paged_decode, config=config), *args)
  loop = ir[ir.index("scf.for"):ir.index("scf.yield")]
  int_loads = re.findall(r"tt\.load [^\n]*: (tensor<[^>]*i32>>|!tt\.ptr<i32>)",
                         loop)
  assert int_loads == [f"tensor<{ppcb}x!tt.ptr<i32>>"]
  carried = re.search(r"scf\.for [^\n]*-> \(([^\n]*)\)", ir).group(1)
  assert carried.endswith(f"tensor<{ppcb}xi32>")
