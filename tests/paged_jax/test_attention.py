"""The shared attention test base, rerun for every implementation.

Each case is random: ragged lengths (0, 1, block boundaries, full), random
non-contiguous block tables with NULL_BLOCK past each sequence, NaN in every
block and slot the batch does not own, compared row by row with the float32
reference. The parameter grid is sampled (a fixed list of mixed configurations
by default, a seeded random sample of the full product behind `-m slow`).
"""

from __future__ import annotations

import importlib
import itertools
import random

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention
from paged_jax import reference
from tests import cases


def _available(module):
  try:
    importlib.import_module(module)
    return True
  except ImportError:
    return False


# (implementation, interpret): every backend that exists runs the same tests.
IMPLS = [pytest.param(("xla", False), id="xla")]
for _name, _mod in (("pallas_gpu", "pallas_kernels.gpu.paged_decode"),
                    ("pallas_tpu", "pallas_kernels.tpu.paged_decode")):
  IMPLS.append(pytest.param(
      (_name, True), id=_name,
      marks=pytest.mark.skipif(not _available(_mod), reason=f"no {_mod}")))
RAGGED_IMPLS = [pytest.param(("xla", False), id="xla")]
for _name, _mod in (("pallas_gpu", "pallas_kernels.gpu.ragged_attention"),
                    ("pallas_tpu", "pallas_kernels.tpu.ragged_attention")):
  RAGGED_IMPLS.append(pytest.param(
      (_name, True), id=_name,
      marks=pytest.mark.skipif(not _available(_mod), reason=f"no {_mod}")))

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window)
DECODE_CONFIGS = [
    (4, 4, 64, 16, jnp.float32, None, None),
    (8, 2, 128, 16, jnp.bfloat16, None, None),
    (16, 2, 64, 32, jnp.float32, 30.0, None),
    (8, 1, 128, 8, jnp.bfloat16, None, 20),
    (32, 4, 128, 16, jnp.float32, 5.0, 37),
]
FULL_GRID = list(itertools.product(
    [(4, 4), (8, 2), (16, 2), (8, 1)], [64, 128, 256], [8, 16, 32, 64, 128],
    [jnp.float32, jnp.bfloat16], [None, 10.0], [None, 17]))
SAMPLED = random.Random(0).sample(FULL_GRID, 12)


def _call_or_skip(fn, *args, **kwargs):
  """Runs `fn`; a backend that refuses the configuration by design is skipped
  (its refusal is tested with the kernel), never silently replaced."""
  try:
    return fn(*args, **kwargs)
  except ValueError as e:
    if "cannot serve this call" in str(e):
      pytest.skip(str(e))
    raise


def _decode_check(impl, interpret, config, seed, batch=7, width=6):
  hq, hkv, d, bs, dtype, cap, window = config
  rng = np.random.default_rng(seed)
  c = cases.make_decode_case(rng, batch=batch, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=d, block_size=bs, max_blocks_per_seq=width,
                             dtype=dtype)
  kw = dict(soft_cap=cap, sliding_window=window)
  out = _call_or_skip(attention.paged_attention, c.q, c.k_pages, c.v_pages,
                      c.block_tables, c.kv_lens, implementation=impl,
                      interpret=interpret, **kw)
  assert out.shape == c.q.shape and out.dtype == c.q.dtype
  ref = reference.paged_attention_reference(
      c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, **kw)
  cases.assert_rows_close(out, ref, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=str)
def test_decode_matches_reference(impl, config):
  _decode_check(*impl, config, seed=hash(config) % 2**32)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", SAMPLED, ids=str)
def test_decode_matches_reference_sweep(impl, config):
  (hq, hkv), d, bs, dtype, cap, window = config
  _decode_check(*impl, (hq, hkv, d, bs, dtype, cap, window), seed=1,
                batch=9, width=max(2, 256 // bs))


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_under_jit_and_vmap(impl):
  name, interpret = impl
  rng = np.random.default_rng(3)
  c = cases.make_decode_case(rng, batch=4, num_q_heads=8, num_kv_heads=2,
                             head_dim=64, block_size=16, max_blocks_per_seq=4)
  f = jax.jit(lambda *a: attention.paged_attention(
      *a, implementation=name, interpret=interpret))
  args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
  ref = reference.paged_attention_reference(*args)
  cases.assert_rows_close(f(*args), ref, jnp.float32)
  # vmap over a leading "layers" axis of q and pages.
  stacked = [jnp.stack([a, a]) for a in args[:3]]
  out = jax.vmap(f, in_axes=(0, 0, 0, None, None))(*stacked, *args[3:])
  cases.assert_rows_close(out[1], ref, jnp.float32)


def _ragged_check(impl, interpret, q_lens, kv_lens, config, seed):
  hq, hkv, d, bs, dtype, cap, window = config
  rng = np.random.default_rng(seed)
  width = -(-max(kv_lens) // bs)
  c = cases.make_ragged_case(
      rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=hq, num_kv_heads=hkv,
      head_dim=d, block_size=bs, max_blocks_per_seq=width,
      max_num_seqs=len(q_lens) + 2, num_tokens=sum(q_lens) + 5, dtype=dtype)
  kw = dict(soft_cap=cap, sliding_window=window)
  args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
          c.num_seqs)
  out = _call_or_skip(attention.ragged_paged_attention, *args,
                      implementation=impl, interpret=interpret, **kw)
  ref = reference.ragged_paged_attention_reference(*args, **kw)
  cases.assert_rows_close(out, ref, dtype)
  # Padding rows (NaN queries, owned by no sequence) come back as zeros.
  assert not np.asarray(out[sum(q_lens):], np.float32).any()


RAGGED_MIXES = [
    # prefill chunks with and without cached prefixes, decode tokens, empties
    ([40, 1, 1, 17], [40, 33, 1, 50]),
    ([1, 1, 1], [16, 17, 15]),
    ([64, 0, 3], [64, 9, 200]),
]


@pytest.mark.parametrize("impl", RAGGED_IMPLS)
@pytest.mark.parametrize("mix, config", list(zip(RAGGED_MIXES, DECODE_CONFIGS[::2])),
                         ids=str)
def test_ragged_matches_reference(impl, mix, config):
  _ragged_check(*impl, *mix, config, seed=len(mix[0]))


@pytest.mark.slow
@pytest.mark.parametrize("impl", RAGGED_IMPLS)
@pytest.mark.parametrize("mix", RAGGED_MIXES, ids=str)
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=str)
def test_ragged_matches_reference_sweep(impl, mix, config):
  _ragged_check(*impl, *mix, config, seed=len(mix[0]) + 1)


@pytest.mark.parametrize("impl", RAGGED_IMPLS)
def test_ragged_decode_equals_paged_attention(impl):
  name, interpret = impl
  rng = np.random.default_rng(5)
  c = cases.make_decode_case(rng, batch=6, num_q_heads=8, num_kv_heads=2,
                             head_dim=64, block_size=16, max_blocks_per_seq=4)
  decode = attention.paged_attention(c.q, c.k_pages, c.v_pages, c.block_tables,
                                     c.kv_lens, implementation="xla")
  cu = jnp.arange(7, dtype=jnp.int32)
  ragged = attention.ragged_paged_attention(
      c.q, c.k_pages, c.v_pages, c.block_tables, jnp.maximum(c.kv_lens, 1), cu,
      jnp.array([6]), implementation=name, interpret=interpret)
  live = np.asarray(c.kv_lens) > 0  # ragged needs kv_len >= q_len
  np.testing.assert_allclose(np.asarray(ragged)[live], np.asarray(decode)[live],
                             atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", RAGGED_IMPLS)
def test_ragged_compiles_once_for_many_batch_mixes(impl):
  name, interpret = impl
  rng = np.random.default_rng(7)
  max_seqs, num_tokens, bs, width = 4, 48, 8, 8
  chex.clear_trace_counter()  # the counter is per code object, across params

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(*args):
    return attention.ragged_paged_attention(*args, implementation=name,
                                            interpret=interpret)

  for _ in range(5):
    n = int(rng.integers(1, max_seqs + 1))
    q_lens = rng.integers(1, num_tokens // max_seqs + 1, n)
    kv_lens = q_lens + rng.integers(0, 20, n)
    c = cases.make_ragged_case(
        rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=4, num_kv_heads=2,
        head_dim=64, block_size=bs, max_blocks_per_seq=width,
        max_num_seqs=max_seqs, num_tokens=num_tokens, extra_blocks=40 - sum(
            -(-int(k) // bs) for k in kv_lens))
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
            c.num_seqs)
    cases.assert_rows_close(
        step(*args)[:int(q_lens.sum())],
        reference.ragged_paged_attention_reference(*args)[:int(q_lens.sum())],
        jnp.float32)


# ----------------------------------------------------------------------------
# Dispatch and errors


def test_default_implementation_on_cpu_is_xla():
  name, module = attention.select_implementation(
      None, kernel_modules={}, reason_args=(), reason_kwargs={},
      interpret=False)
  assert (name, module) == ("xla", None)


def _small():
  q = jnp.zeros((2, 8, 64))
  pages = jnp.zeros((2, 4, 16, 64))
  return q, pages, pages, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((8, 64))), r"q must be \[batch, num_q_heads, head_dim\]"),
    (dict(k_pages=jnp.zeros((4, 16, 64))), r"k_pages must be \[num_kv_heads"),
    (dict(v_pages=jnp.zeros((2, 4, 16, 32))), r"v_pages.shape=\(2, 4, 16, 32\) "
     r"must equal k_pages.shape=\(2, 4, 16, 64\)"),
    (dict(q=jnp.zeros((2, 8, 32))), r"head_dim of q \(32\) must equal head_dim"),
    (dict(q=jnp.zeros((2, 7, 64))), "num_q_heads=7 must be a multiple of "
     "num_kv_heads=2"),
    (dict(block_tables=jnp.zeros((2, 3))), "block_tables must be an integer"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), r"kv_lens must be i32\[2\]"),
    (dict(q=jnp.zeros((2, 8, 64), jnp.int32)), "q and k_pages must be floating"),
])
def test_input_errors(change, match):
  names = ["q", "k_pages", "v_pages", "block_tables", "kv_lens"]
  args = dict(zip(names, _small()))
  args.update(change)
  with pytest.raises(ValueError, match=match):
    attention.paged_attention(**args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sliding_window=0), "sliding_window must be a positive int or None"),
    (dict(soft_cap=-1.0), "soft_cap must be positive or None"),
    (dict(implementation="cuda"), "implementation must be one of"),
    (dict(implementation="pallas_tpu"), "implementation='pallas_tpu' cannot "
     "serve this call: it runs on tpu, the default backend is cpu"),
])
def test_option_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    attention.paged_attention(*_small(), **kwargs)


def test_ragged_argument_errors():
  q, k, v, tables, lens = _small()
  with pytest.raises(ValueError, match=r"cu_q_lens must be i32\[max_num_seqs "
                     r"\+ 1\] = i32\[3\], got \[2\]"):
    attention.ragged_paged_attention(q, k, v, tables, lens,
                                     jnp.zeros((2,), jnp.int32), jnp.array([1]))
  with pytest.raises(ValueError, match="num_seqs must be i32"):
    attention.ragged_paged_attention(q, k, v, tables, lens,
                                     jnp.zeros((3,), jnp.int32),
                                     jnp.array([1, 2]))


def test_write_and_ragged_attention_writes_in_place_then_attends():
  """The fused step: new K/V land in their slots (donated pages, aliased in
  place), then attention sees them; writes to a shared block are dropped."""
  from paged_jax import block_manager as bm  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(11)
  hq, hkv, d, bs = 4, 2, 64, 8
  state = bm.init(num_blocks=16, block_size=bs, max_seqs=3, max_blocks_per_seq=6)
  k_pages = jnp.asarray(rng.standard_normal((hkv, 16, bs, d)), jnp.float32)
  v_pages = jnp.asarray(rng.standard_normal((hkv, 16, bs, d)), jnp.float32)
  # Sequence 0 has 10 cached tokens and gets 3 more; sequence 1 is new (20).
  state, _ = bm.reserve(state, jnp.array([0]), jnp.array([10]))
  state, _ = bm.reserve(state, jnp.array([0, 1]), jnp.array([3, 20]))
  seq = jnp.array([0] * 3 + [1] * 20 + [-1] * 3, jnp.int32)  # 3 padding rows
  pos = jnp.concatenate([jnp.arange(10, 13), jnp.arange(20), jnp.zeros(3, int)])
  slots = bm.slot_mapping(state, seq, pos.astype(jnp.int32))
  tables, lens = bm.gather_tables(state, jnp.array([0, 1, 2]))
  cu = jnp.array([0, 3, 23, 23], jnp.int32)
  q = jnp.asarray(rng.standard_normal((26, hq, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((26, hkv, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((26, hkv, d)), jnp.float32)
  step = jax.jit(attention.write_and_ragged_attention, donate_argnums=(4, 5))
  out, k_new, v_new = step(q, k, v, slots, k_pages, v_pages, tables, lens, cu,
                           jnp.array([2]))
  assert k_pages.is_deleted()  # donated: the cache was updated in place
  got = np.asarray(k_new).reshape(hkv, -1, d)[:, np.asarray(slots[:23])]
  np.testing.assert_array_equal(got, np.swapaxes(np.asarray(k[:23]), 0, 1))
  ref = reference.ragged_paged_attention_reference(
      q, k_new, v_new, tables, lens, cu, jnp.array([2]))
  cases.assert_rows_close(out, ref, jnp.float32)
  assert not np.asarray(out[23:]).any()
  # After a fork the prompt's blocks are shared: their slots are -1 (dropped).
  state, _ = bm.fork(state, jnp.array([1]), jnp.array([2]))
  shared = bm.slot_mapping(state, jnp.array([1, 2]), jnp.array([5, 19]))
  assert shared.tolist() == [-1, -1]


def test_ragged_q_shape_error_names_num_tokens():
  _, k, v, tables, lens = _small()
  with pytest.raises(ValueError, match=r"q must be \[num_tokens, num_q_heads, "
                     r"head_dim\], got shape \(8, 64\)"):
    attention.ragged_paged_attention(jnp.zeros((8, 64)), k, v, tables, lens,
                                     jnp.zeros((3,), jnp.int32), jnp.array([1]))
