"""GPU ragged paged attention (Pallas/Triton): interpret mode and CUDA lowering."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.reference import ragged_paged_attention_reference
from pallas_kernels.gpu import paged_decode as pd
from pallas_kernels.gpu import ragged_attention as ra
from pallas_kernels.gpu.ragged_attention import RaggedAttentionConfig
from tests.cases import assert_rows_close, make_decode_case, make_ragged_case
from tests.pallas_kernels.gpu_lowering import lower_for_cuda, shape_structs


@dataclasses.dataclass(frozen=True)
class Mix:
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  dtype: type = jnp.float32
  group: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  block_size: int = 16
  max_blocks_per_seq: int = 4
  max_num_seqs: int | None = None  # padding sequences beyond len(q_lens)
  num_tokens: int | None = None  # padding rows beyond sum(q_lens)
  block_q: int | None = None  # None: default config
  pages_per_compute_block: int = 2
  sm_scale: float | None = None
  soft_cap: float | None = None
  sliding_window: int | None = None

  def __str__(self):
    return (f"{jnp.dtype(self.dtype).name}-q{list(self.q_lens)}"
            f"-kv{list(self.kv_lens)}-g{self.group}x{self.num_kv_heads}"
            f"-d{self.head_dim}-bs{self.block_size}-bq{self.block_q}"
            f"-ppcb{self.pages_per_compute_block}-cap{self.soft_cap}"
            f"-win{self.sliding_window}")

  def config(self):
    if self.block_q is None:
      return None
    return RaggedAttentionConfig(
        block_q=self.block_q,
        pages_per_compute_block=self.pages_per_compute_block)

  def kwargs(self):
    return dict(sm_scale=self.sm_scale, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window)

  def case(self, seed=0, **kw):
    return make_ragged_case(
        np.random.default_rng(seed), q_lens=self.q_lens, kv_lens=self.kv_lens,
        num_q_heads=self.group * self.num_kv_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
        max_num_seqs=self.max_num_seqs, num_tokens=self.num_tokens,
        dtype=self.dtype, **kw)


def _args(c):
  return (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
          c.num_seqs)


# Prefill, chunked prefill (q_len < kv_len), decode (q_len 1), empty sequences,
# padding rows and padding sequences; every knob value appears at least once.
CASES = [
    Mix((5, 1, 0, 17, 1), (5, 9, 16, 40, 1), block_q=4, max_blocks_per_seq=3,
        max_num_seqs=7, num_tokens=30),
    Mix((33, 1, 8), (33, 64, 20), jnp.bfloat16, group=8, num_kv_heads=1,
        head_dim=128, block_size=8, max_blocks_per_seq=8, block_q=2,
        soft_cap=5.0, sliding_window=10),
    Mix((1, 16, 3), (30, 16, 100), jnp.bfloat16, group=1, block_size=32,
        block_q=16, pages_per_compute_block=1, sliding_window=40,
        sm_scale=0.1, num_tokens=24),
    Mix((7, 12), (50, 12), group=4, head_dim=256, block_size=8,
        max_blocks_per_seq=8, soft_cap=3.0, max_num_seqs=3),  # default config
]


@pytest.mark.parametrize("m", CASES, ids=str)
def test_matches_reference(m):
  c = m.case()
  out = ra.ragged_paged_attention(*_args(c), config=m.config(), interpret=True,
                                  **m.kwargs())
  assert out.dtype == c.q.dtype
  ref = ragged_paged_attention_reference(*_args(c), **m.kwargs())
  assert_rows_close(out, ref, m.dtype)
  total = int(c.cu_q_lens[c.num_seqs[0]])
  assert not np.asarray(out, np.float32)[total:].any(), "padding rows not 0"


@pytest.mark.parametrize("m", CASES, ids=str)
def test_lowers_for_cuda(m):
  f = functools.partial(ra.ragged_paged_attention, config=m.config(),
                        **m.kwargs())
  lower_for_cuda(f, *shape_structs(*_args(m.case())))



def test_q_len_one_equals_paged_decode():
  rng = np.random.default_rng(3)
  c = make_decode_case(rng, batch=6, num_q_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, max_blocks_per_seq=4)
  batch = c.q.shape[0]
  # One query per sequence with kv_len >= 1; a kv_len == 0 one gets none.
  q_lens = (np.asarray(c.kv_lens) > 0).astype(np.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  rows = np.flatnonzero(q_lens)
  q = c.q[rows]
  kw = dict(soft_cap=4.0, sliding_window=20)
  ragged = ra.ragged_paged_attention(
      q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, cu,
      jnp.array([batch], jnp.int32), interpret=True, **kw)
  decode = pd.paged_decode(c.q, c.k_pages, c.v_pages, c.block_tables,
                           c.kv_lens, interpret=True, **kw)
  np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode)[rows],
                             rtol=1e-5, atol=1e-5)


def _pad_pool(c, num_blocks):
  """Pads the K/V pool with NaN blocks so every mix has the same shapes."""
  extra = num_blocks - c.k_pages.shape[1]
  pad = ((0, 0), (0, extra), (0, 0), (0, 0))
  return dataclasses.replace(
      c, k_pages=jnp.pad(c.k_pages, pad, constant_values=jnp.nan),
      v_pages=jnp.pad(c.v_pages, pad, constant_values=jnp.nan))


def test_one_compile_for_many_batch_mixes():
  config = RaggedAttentionConfig(block_q=4, pages_per_compute_block=2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(*args):
    return ra.ragged_paged_attention(*args, config=config, interpret=True)

  chex.clear_trace_counter()
  mixes = [((12, 1, 1), (12, 30, 2)),
           ((1, 1, 1, 1, 1), (1, 64, 17, 5, 33)),
           ((), ())]
  for i, (q_lens, kv_lens) in enumerate(mixes):
    m = Mix(q_lens, kv_lens, max_num_seqs=5, num_tokens=16)
    c = _pad_pool(m.case(seed=i), num_blocks=30)
    out = step(*_args(c))
    assert_rows_close(out, ragged_paged_attention_reference(*_args(c)), m.dtype)


def test_default_config_is_servable():
  s = jax.ShapeDtypeStruct
  for group, bs, hd in ((1, 8, 64), (4, 16, 128), (8, 128, 256), (32, 16, 128),
                        (128, 16, 64)):
    args = (s((100, 2 * group, hd), jnp.bfloat16),
            s((2, 64, bs, hd), jnp.bfloat16), s((4, 16), jnp.int32))
    config = ra.default_config(*args)
    assert ra.unsupported_reason(*args, config=config) is None, config


def _small_inputs(**overrides):
  shapes = dict(q=((10, 8, 64), jnp.float32),
                k=((2, 10, 16, 64), jnp.float32),
                v=((2, 10, 16, 64), jnp.float32),
                tables=((3, 4), jnp.int32),
                lens=((3,), jnp.int32),
                cu=((4,), jnp.int32),
                num_seqs=((1,), jnp.int32))
  shapes.update(overrides)
  return [jnp.zeros(shape, dtype) for shape, dtype in shapes.values()]


# Kernel limitations and config errors; malformed inputs (the validator's
# messages) are tested for every backend by tests/contract.py.
_BAD_INPUTS = [
    (dict(k=((2, 10, 12, 64), jnp.float32),
          v=((2, 10, 12, 64), jnp.float32)), {},
     r"block_size=12 must be a power of two"),
    ({}, dict(config=RaggedAttentionConfig(block_q=3)),
     r"config.block_q=3 must be a power of two"),
    ({}, dict(config=RaggedAttentionConfig(block_q=2)),
     r"config.block_q \* padded group = 8 rows must be in \[16, 256\]"),
    ({}, dict(config=RaggedAttentionConfig(block_q=128)),
     r"= 512 rows must be in"),
    ({}, dict(config=RaggedAttentionConfig(pages_per_compute_block=3)),
     r"pages_per_compute_block \* block_size = 48"),
]


@pytest.mark.parametrize("overrides,kwargs,match", _BAD_INPUTS,
                         ids=[m[:40] for _, _, m in _BAD_INPUTS])
def test_value_errors(overrides, kwargs, match):
  with pytest.raises(ValueError, match="ragged_paged_attention \\(GPU\\) cannot"
                     " serve these inputs: .*" + match):
    ra.ragged_paged_attention(*_small_inputs(**overrides), interpret=True,
                              **kwargs)


def test_unsupported_reason_of_invalid_inputs():
  q, k, _, tables, *_ = _small_inputs(q=((10, 8), jnp.float32))
  assert ra.unsupported_reason(q, k, tables) == (
      "invalid inputs: q must be [num_tokens, num_q_heads, head_dim], got "
      "shape (10, 8)")


_SWEEP = [
    Mix((40, 1, 1, 9), (64, 64, 3, 9), dtype, group=g, block_size=bs,
        max_blocks_per_seq=64 // bs, block_q=bq, pages_per_compute_block=pp,
        soft_cap=cap, sliding_window=win, num_tokens=64, max_num_seqs=6)
    for dtype, g, bs, bq, pp, cap, win in [
        (jnp.float32, 1, 8, 16, 2, None, None),
        (jnp.bfloat16, 2, 16, 8, 1, 10.0, 3),
        (jnp.float32, 8, 32, 4, 1, None, 33),
        (jnp.bfloat16, 4, 64, 16, 1, 1.5, None),
        (jnp.float32, 4, 8, 32, 8, None, 16),
        (jnp.bfloat16, 16, 16, 1, 4, None, None),
    ]
]


@pytest.mark.slow
@pytest.mark.parametrize("m", _SWEEP, ids=str)
def test_matches_reference_sweep(m):
  c = m.case(seed=1)
  out = ra.ragged_paged_attention(*_args(c), config=m.config(), interpret=True,
                                  **m.kwargs())
  assert_rows_close(out, ragged_paged_attention_reference(*_args(c), **m.kwargs()), m.dtype)
  lower_for_cuda(functools.partial(ra.ragged_paged_attention,
                                   config=m.config(), **m.kwargs()),
                 *shape_structs(*_args(c)))


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn],
                         ids=["int8", "fp8"])
def test_quantized_pages_lower_for_cuda(kv_dtype):
  s = jax.ShapeDtypeStruct
  pages = s((8, 512, 16, 128), kv_dtype)
  scales = s((8, 512, 16), jnp.float32)
  args = (s((64, 32, 128), jnp.bfloat16), pages, pages, s((4, 64), jnp.int32),
          s((4,), jnp.int32), s((5,), jnp.int32), s((1,), jnp.int32))
  text = lower_for_cuda(
      lambda *a: ra.ragged_paged_attention(*a[:7], k_scales=a[7],
                                           v_scales=a[8]), *args, scales,
      scales)
  assert jnp.dtype(kv_dtype).name in text
