"""Mosaic GPU paged decode: interpret mode on CPU (JAX >= 0.11), lowering for
CUDA from CPU (every supported JAX), and its refusals.

The interpreter runs with race detection and NaN-filled uninitialised shared
memory: a missing barrier wait, an uncopied page read without its mask, or a
V tail past `kv_len` left unzeroed shows up as a race or a NaN.
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

from paged_jax.reference import paged_attention_reference
from pallas_kernels.mosaic_gpu import paged_decode as md
from pallas_kernels.mosaic_gpu.paged_decode import MosaicDecodeConfig
from tests import contract
from tests import window_contract
from tests.cases import assert_rows_close, make_decode_case

INTERPRET_ERROR = md.interpret_unsupported_reason()
needs_interpreter = pytest.mark.skipif(
    INTERPRET_ERROR is not None, reason=str(INTERPRET_ERROR))


@dataclasses.dataclass(frozen=True)
class Params:
  dtype: type = jnp.bfloat16
  group: int = 4  # q heads per kv head
  num_kv_heads: int = 2
  head_dim: int = 64
  block_size: int = 16
  max_blocks_per_seq: int = 8
  k_splits: int = 1
  num_stages: int = 2
  soft_cap: float | None = None
  sliding_window: int | None = None
  batch: int = 3

  def __str__(self):
    return (f"{jnp.dtype(self.dtype).name}-g{self.group}x{self.num_kv_heads}"
            f"-d{self.head_dim}-bs{self.block_size}x{self.max_blocks_per_seq}"
            f"-ks{self.k_splits}-st{self.num_stages}-cap{self.soft_cap}"
            f"-win{self.sliding_window}")

  def config(self):
    return MosaicDecodeConfig(k_splits=self.k_splits,
                              num_stages=self.num_stages)

  def kwargs(self):
    return dict(soft_cap=self.soft_cap, sliding_window=self.sliding_window)


# Few cases (the interpreter is slow), each a different pipeline shape:
# several pages per step with more steps than stages (the ring wraps), one
# page per step, splits with a window and a soft cap, f16, GQA 1 and 8.
CASES = [
    Params(jnp.bfloat16, 4, 2, 64, 16, 10),  # 4 pages/step, 3 steps, 2 stages
    Params(jnp.float16, 8, 1, 128, 8, 12, k_splits=2, num_stages=3,
           soft_cap=5.0, sliding_window=40),  # 8 pages/step, window
]
SLOW_CASES = [
    Params(jnp.bfloat16, 1, 2, 64, 64, 4, k_splits=3, num_stages=1),
    Params(jnp.bfloat16, 16, 1, 256, 128, 2, num_stages=1, sliding_window=130),
    Params(jnp.float16, 2, 4, 128, 32, 9, k_splits=4, num_stages=3,
           soft_cap=2.0, batch=5),
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
  out = md.paged_decode(*_args(c), config=p.config(), interpret=True,
                        **p.kwargs())
  assert out.dtype == c.q.dtype
  ref = paged_attention_reference(*_args(c), **p.kwargs())
  assert_rows_close(out, ref, p.dtype)
  zero = np.asarray(c.kv_lens) == 0
  assert not np.asarray(out, np.float32)[zero].any(), "kv_len == 0 must be 0"


@needs_interpreter
@pytest.mark.parametrize("p", CASES, ids=str)
def test_matches_reference(p):
  _check_against_reference(p)


@needs_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("p", SLOW_CASES, ids=str)
def test_matches_reference_slow(p):
  _check_against_reference(p, seed=1)


def _shape_structs(*arrays):
  return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


def lower_for_cuda(f, *args) -> str:
  """`jax.jit(f)` lowered for CUDA from CPU; the Mosaic GPU kernel must be in
  the module (not an XLA fallback)."""
  text = jax.jit(f).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered module"
  return text


@pytest.mark.parametrize("p", CASES + SLOW_CASES[1:2], ids=str)
def test_lowers_for_cuda(p):
  c = _case(p)
  lower_for_cuda(functools.partial(md.paged_decode, config=p.config(),
                                   **p.kwargs()), *_shape_structs(*_args(c)))


def test_benchmark_shape_lowers_with_default_config():
  """The issue's shape (bf16, 32/8 heads, head_dim 128, block 16, 4k
  context), at batch 64 (no split) and batch 4 (splits)."""
  s = jax.ShapeDtypeStruct
  pages = s((8, 4096, 16, 128), jnp.bfloat16)
  for batch, splits in ((64, 1), (4, 16)):
    args = (s((batch, 32, 128), jnp.bfloat16), pages, pages,
            s((batch, 256), jnp.int32), s((batch,), jnp.int32))
    assert md.default_config(*args[:2], args[3]).k_splits == splits
    lower_for_cuda(md.paged_decode, *args)


def _layers(p: Params):
  """Two layers' q and pages over one table and set of lengths."""
  c0, c1 = _case(p, seed=0), _case(p, seed=1)
  return (jnp.stack([c0.q, c1.q]), jnp.stack([c0.k_pages, c0.k_pages[:, ::-1]]),
          jnp.stack([c0.v_pages, c0.v_pages * 2]), c0.block_tables, c0.kv_lens)


def _per_layer(**kwargs):
  return jax.vmap(functools.partial(md.paged_decode, **kwargs),
                  in_axes=(0, 0, 0, None, None))


def test_vmap_over_layers_lowers_to_one_kernel():
  text = lower_for_cuda(_per_layer(), *_shape_structs(*_layers(Params())))
  assert text.count("custom_call @mosaic_gpu") == 1  # not one per layer


@needs_interpreter
@pytest.mark.slow
def test_vmap_over_layers_matches_reference():
  args = _layers(Params(batch=2))
  out = _per_layer(interpret=True)(*args)
  for i in range(2):
    ref = paged_attention_reference(args[0][i], args[1][i], args[2][i],
                                    *args[3:])
    assert_rows_close(out[i], ref, jnp.bfloat16)


def test_default_config():
  s = jax.ShapeDtypeStruct

  def config(batch, context, block_size=16, head_dim=128):
    return md.default_config(
        s((batch, 32, head_dim), jnp.bfloat16),
        s((8, 1024, block_size, head_dim), jnp.bfloat16),
        s((batch, context // block_size), jnp.int32))

  # (sequence, KV head) programs times splits reach 2 * 132 multiprocessors.
  assert config(1, 32768).k_splits == 32  # 8 programs: split to the cap
  assert config(8, 8192).k_splits == 8  # 64 programs -> 512
  assert config(64, 8192).k_splits == 1  # 512 programs already
  assert config(1, 64).k_splits == 1  # one step: nothing to split
  # The deepest ring that fits: 3 stages at head_dim 128 (with splits' f32
  # partials too); at head_dim 256, 2 without splits, 1 with them (the
  # partial output takes 64 KiB) or with 128-token pages.
  assert config(8, 8192).num_stages == 3
  assert config(64, 8192, head_dim=256).num_stages == 2
  assert config(8, 8192, head_dim=256).num_stages == 1
  assert config(64, 8192, head_dim=256, block_size=128).num_stages == 1
  # Splits' f32 partials do not fit beside 128-token pages at head_dim 256.
  assert config(1, 8192, head_dim=256, block_size=128) == MosaicDecodeConfig(
      k_splits=1, num_stages=1)
  # Every default is servable.
  for batch, head_dim, block_size in itertools.product(
      (1, 8, 256), md.HEAD_DIMS, md.BLOCK_SIZES):
    args = (s((batch, 32, head_dim), jnp.bfloat16),
            s((8, 64, block_size, head_dim), jnp.bfloat16),
            s((batch, 4096 // block_size), jnp.int32))
    reason = md.unsupported_reason(*args, config=md.default_config(*args))
    assert reason in (None, INTERPRET_ERROR), (args, reason)


def _small(q_dtype=jnp.bfloat16, kv_dtype=None, head_dim=64, block_size=16,
           num_q_heads=8, num_kv_heads=2):
  s = jax.ShapeDtypeStruct
  kv = s((num_kv_heads, 10, block_size, head_dim), kv_dtype or q_dtype)
  return (s((2, num_q_heads, head_dim), q_dtype), kv, kv, s((2, 4), jnp.int32),
          s((2,), jnp.int32))


_REFUSALS = [
    (dict(q_dtype=jnp.float32), {},
     r"q dtype float32 is not one of \['bfloat16', 'float16'\]"),
    (dict(kv_dtype=jnp.float16), {},
     "k_pages dtype must equal q dtype bfloat16 .*, got float16"),
    (dict(head_dim=96), {}, r"head_dim=96 must be one of \(64, 128, 256\)"),
    (dict(block_size=4), {},
     r"block_size=4 must be one of \(8, 16, 32, 64, 128\)"),
    (dict(num_q_heads=130, num_kv_heads=1), {},
     "num_q_heads // num_kv_heads = 130 must be at most 64"),
    ({}, dict(config=MosaicDecodeConfig(k_splits=0)),
     "config.k_splits=0 must be at least 1"),
    ({}, dict(config=MosaicDecodeConfig(num_stages=0)),
     "config.num_stages=0 must be at least 1"),
    (dict(head_dim=256, block_size=128),
     dict(config=MosaicDecodeConfig(k_splits=2, num_stages=1)),
     r"MosaicDecodeConfig\(k_splits=2, num_stages=1\) needs 279040 bytes "
     "of shared memory, more than the 232448 of a block"),
]


@pytest.mark.parametrize("shapes,kwargs,match", _REFUSALS,
                         ids=[m[:30] for _, _, m in _REFUSALS])
def test_refusals(shapes, kwargs, match):
  args = _small(**shapes)
  reason = md.unsupported_reason(*args[:2], args[3], **kwargs)
  assert reason is not None and re.search(match, reason), reason
  with pytest.raises(ValueError, match="paged_decode \\(Mosaic GPU\\) cannot "
                     "serve these inputs: " + match):
    jax.eval_shape(functools.partial(md.paged_decode, **kwargs), *args)


def test_unsupported_reason_of_invalid_inputs():
  q, k, _, tables, _ = _small(num_q_heads=7)
  assert md.unsupported_reason(q, k, tables) == (
      "invalid inputs: num_q_heads=7 must be a multiple of num_kv_heads=2")


@pytest.mark.skipif(INTERPRET_ERROR is None, reason="this JAX interprets it")
def test_old_jax_refuses_interpret_mode_by_name():
  args = _small()
  assert md.unsupported_reason(*args[:2], args[3]) == INTERPRET_ERROR
  with pytest.raises(ValueError, match="Mosaic GPU interpret mode needs JAX "
                     r">= 0.11 .*, got JAX 0\.10"):
    jax.eval_shape(functools.partial(md.paged_decode, interpret=True), *args)


# ----------------------------------------------------------------------------
# The shared contract (tests/contract.py), in bfloat16 (no float32 kernel).


def _no_ragged(*args, **kwargs):
  del args, kwargs
  pytest.skip("the Mosaic GPU backend has no ragged kernel")


@needs_interpreter
class TestMosaicGpuContract(contract.MalformedDecodeContract):
  dtype = jnp.bfloat16
  decode = staticmethod(functools.partial(md.paged_decode, interpret=True))


@needs_interpreter
@pytest.mark.slow
class TestMosaicGpuSplitContract(contract.MalformedDecodeContract):
  dtype = jnp.float16
  decode = staticmethod(functools.partial(
      md.paged_decode, interpret=True,
      config=MosaicDecodeConfig(k_splits=2, num_stages=1)))


class TestMosaicGpuStaticErrors(contract.StaticErrorContract,
                                contract.QuantizedContract):
  refuses = contract.QUANTIZED_DTYPES
  refusal = (r"paged_decode \(Mosaic GPU\) cannot serve these inputs: "
             r"{dtype} pages \(with per-token scales\) are not implemented in "
             r"the Mosaic GPU kernel")
  decode = staticmethod(md.paged_decode)
  ragged = staticmethod(_no_ragged)


@needs_interpreter
class TestMosaicWindowContract(window_contract.WindowDecodeContract):
  """Blocks outside the window are neither copied nor read: the shared
  NaN / NULL_BLOCK case, and the global-to-shared copies counted."""
  dtype = jnp.bfloat16
  decode = staticmethod(functools.partial(md.paged_decode, interpret=True))

  def test_only_visible_pages_are_copied(self):
    full, _, hidden = window_contract.decode_case(dtype=self.dtype)
    args = (full.q, full.k_pages, full.v_pages, full.block_tables, full.kv_lens)
    with window_contract.page_copies(full.k_pages.shape) as copied:
      if copied is None:
        pytest.skip("this JAX's Mosaic GPU interpreter exposes no copy hook")
      jax.block_until_ready(self.decode(
          *args, sliding_window=window_contract.WINDOW))
    window_contract.check_page_copies(copied, full, hidden, decode=True)
    with window_contract.page_copies(full.k_pages.shape) as all_copied:
      jax.block_until_ready(self.decode(*args))
    assert len(all_copied) >= len(copied) + 2 * hidden.sum(), (
        len(all_copied), len(copied))
