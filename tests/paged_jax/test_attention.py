"""The shared attention test base, rerun for every implementation.

Each case is random: ragged lengths (0, 1, block boundaries, full), random
non-contiguous block tables with NULL_BLOCK past each sequence, NaN in every
block and slot the batch does not own, compared row by row with the float32
reference. The parameter grid is sampled (a fixed list of mixed configurations
by default, a seeded random sample of the full product behind `-m slow`).
"""

from __future__ import annotations

import functools
import itertools
import random
import re

import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention
from paged_jax import reference
from paged_jax import xla_attention
from tests import cases
from tests import contract

# (implementation, interpret): every registered backend runs the same tests.
IMPLS = [pytest.param((name, name != "xla"), id=name)
         for name in attention.IMPLEMENTATIONS]
RAGGED_IMPLS = [pytest.param((b.name, b.name != "xla"), id=b.name)
                for b in attention.RAGGED_BACKENDS]

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
  cases.assert_rows_close(_call_or_skip(f, *args), ref, jnp.float32)
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
# The shared contract (tests/contract.py) through the public API


class TestXlaContract(contract.MalformedInputContract,
                      contract.StaticErrorContract, contract.QuantizedContract):
  decode = staticmethod(functools.partial(attention.paged_attention,
                                          implementation="xla"))
  ragged = staticmethod(functools.partial(attention.ragged_paged_attention,
                                          implementation="xla"))


class TestPallasGpuApiStaticErrors(contract.StaticErrorContract):
  decode = staticmethod(functools.partial(
      attention.paged_attention, implementation="pallas_gpu", interpret=True))
  ragged = staticmethod(functools.partial(
      attention.ragged_paged_attention, implementation="pallas_gpu",
      interpret=True))


class TestPallasTpuApiStaticErrors(contract.StaticErrorContract,
                                   contract.QuantizedContract):
  # The contract's 8-token pages are below the 32-row VMEM tile of 8-bit
  # pages: refused through the registry before anything runs (see
  # tests/pallas_kernels/test_tpu_contract.py for the kernels serving them
  # at 32-token pages).
  refuses = contract.QUANTIZED_DTYPES
  refusal = (r"implementation='pallas_tpu' cannot serve this call: "
             r"block_size=8 must be a multiple of 32 for {dtype} pages \(VMEM "
             r"sublane tiling\)")
  decode = staticmethod(functools.partial(
      attention.paged_attention, implementation="pallas_tpu", interpret=True))
  ragged = staticmethod(functools.partial(
      attention.ragged_paged_attention, implementation="pallas_tpu",
      interpret=True))


def test_wide_integer_indices_saturate_instead_of_wrapping():
  """An int64 table entry 2**32 + 1 must not wrap to block 1 (nor a length
  2**32 + 3 to 3): it is out of range, and the contract applies."""
  c = contract.decode_case(seed=9)
  tables = np.asarray(c.block_tables).astype(np.int64)
  kv_lens = np.asarray(c.kv_lens).astype(np.int64)
  tables[0, 1] = 2**32 + int(tables[0, 0])  # would wrap onto a real block
  kv_lens[1] = 2**32 + 3  # would wrap to 3
  out = attention.paged_attention(c.q, c.k_pages, c.v_pages, tables, kv_lens,
                                  implementation="xla")
  ref = reference.paged_attention_reference(
      c.q, c.k_pages, c.v_pages, np.where(tables > 2**31, -1, tables),
      np.minimum(kv_lens, 2**31 - 1))
  cases.assert_rows_close(out, ref, jnp.float32)


# ----------------------------------------------------------------------------
# Checked mode: checkify turns traced contract violations into errors


def _checked(fn):
  return jax.jit(checkify.checkify(functools.partial(fn, debug_checks=True),
                                   errors=checkify.user_checks))


# Jitted once: the tests below share shapes, so they share one compilation.
CHECKED_DECODE = _checked(attention.paged_attention)
CHECKED_RAGGED = _checked(attention.ragged_paged_attention)


def _valid_decode():
  rng = np.random.default_rng(12)
  return cases.make_decode_case(rng, batch=3, num_q_heads=4, num_kv_heads=2,
                                head_dim=64, block_size=8,
                                max_blocks_per_seq=3, kv_lens=[5, 24, 0])


@pytest.mark.parametrize("change, match", [
    (dict(kv_lens=[5, 25, 0]), r"kv_lens must be in \[0, max_blocks_per_seq "
     r"\* block_size = 24\]: sequence 1 has kv_len 25"),
    (dict(kv_lens=[5, 24, -1]), "sequence 2 has kv_len -1"),
    (dict(table=(0, 0, -1)), r"block_tables\[0, 0\] = -1 is inside kv_len but "
     r"not a block in \[0, num_blocks = \d+\)"),
    (dict(table=(1, 2, 2**30)), r"block_tables\[1, 2\] = 1073741824 is inside"),
])
def test_checkify_decode_violations(change, match):
  c = _valid_decode()
  tables, kv_lens = np.array(c.block_tables), np.array(c.kv_lens)
  if "kv_lens" in change:
    kv_lens = np.array(change["kv_lens"], np.int32)
  if "table" in change:
    s, j, value = change["table"]
    tables[s, j] = value
  err, out = CHECKED_DECODE(
      c.q, c.k_pages, c.v_pages, tables, kv_lens)
  assert err.get() is not None and re.search(match, err.get()), err.get()
  assert np.isfinite(np.asarray(out)).all()  # the contract still holds
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()


def test_checkify_passes_valid_inputs_on_every_op():
  c = _valid_decode()
  err, _ = CHECKED_DECODE(
      c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
  assert err.get() is None
  row, = [r for r in contract.RAGGED_ROWS if r.what == "num_seqs -1"]
  r, _ = contract.ragged_case(row, seed=0)  # NaN-free tables
  tables = jnp.where(r.block_tables >= 0, r.block_tables, 0)
  err, _ = CHECKED_RAGGED(
      jnp.nan_to_num(r.q), r.k_pages, r.v_pages, tables, r.kv_lens,
      r.cu_q_lens, jnp.array([4], jnp.int32))
  assert err.get() is None, err.get()


@pytest.mark.parametrize("what, match", [
    ("num_seqs -1", r"num_seqs must be in \[0, max_num_seqs = 4\], got -1"),
    ("num_seqs past max_num_seqs",
     r"num_seqs must be in \[0, max_num_seqs = 4\], got 7"),
    ("cu_q_lens[0] != 0", r"cu_q_lens\[0\] must be 0, got 2"),
    ("cu_q_lens decreasing", r"cu_q_lens must be non-decreasing: "
     r"cu_q_lens\[1\] = 5 > cu_q_lens\[2\] = 3"),
    ("cu_q_lens past num_tokens",
     r"cu_q_lens\[num_seqs\] = 27 must be at most num_tokens = 24"),
    ("lengths and table entries", r"sequence 1 has kv_len 1000"),
    ("q_len > kv_len", r"sequence 0 has q_len 5 > kv_len 3"),
])
def test_checkify_ragged_violations(what, match):
  row, = [r for r in contract.RAGGED_ROWS if r.what == what]
  r, _ = contract.ragged_case(row, seed=0)
  err, _ = CHECKED_RAGGED(
      r.q, r.k_pages, r.v_pages, r.block_tables, r.kv_lens, r.cu_q_lens,
      r.num_seqs)
  assert err.get() is not None and re.search(match, err.get()), err.get()


def test_checkify_composes_with_a_kernel():
  """The checks live in the public API, before dispatch: a Pallas kernel
  (interpret mode here) is checked the same way, and still follows the
  contract."""
  c = contract.decode_case(seed=0)
  args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
  err, out = _checked(functools.partial(
      attention.paged_attention, implementation="pallas_gpu",
      interpret=True))(*args)
  assert re.search("sequence 1 has kv_len 1000", err.get()), err.get()
  cases.assert_rows_close(out, reference.paged_attention_reference(*args),
                          jnp.float32)


def test_checks_are_free_by_default():
  """By default the debug checks leave nothing in the compiled step: no op,
  and no effect (an effect keeps a jitted step off the C++ dispatch path)."""
  c = _valid_decode()
  args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
  for fn in (attention.paged_attention, attention.ragged_paged_attention):
    jaxpr = jax.make_jaxpr(fn)(*args) if fn is attention.paged_attention else \
        jax.make_jaxpr(fn)(c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
                           jnp.arange(4, dtype=jnp.int32), jnp.array([3], jnp.int32))
    assert not jaxpr.effects, jaxpr.effects
  checked = jax.make_jaxpr(functools.partial(attention.paged_attention,
                                             debug_checks=True))(*args)
  assert checked.effects  # the test can fail: the checks are effects
  hlo = jax.jit(attention.paged_attention).lower(*args).compile().as_text()
  direct = jax.jit(functools.partial(
      xla_attention.paged_decode_xla, sm_scale=64**-0.5)).lower(
          *args).compile().as_text()
  count = lambda text: len(re.findall(r"^\s+\S+ = ", text, re.M))
  assert count(hlo) == count(direct)


# ----------------------------------------------------------------------------
# Dispatch: the registry


def test_default_implementation_on_cpu_is_xla():
  q, k, _, tables, _ = _small()
  for backends in (attention.DECODE_BACKENDS, attention.RAGGED_BACKENDS):
    assert attention.select_implementation(
        backends, None, q, k, tables).name == "xla"
  assert attention.IMPLEMENTATIONS == ("pallas_tpu", "pallas_gpu", "xla",
                                       "pallas_mosaic_gpu")
  # After "xla", which always serves: None never picks the Mosaic GPU kernel
  # (no GPU run has shown it faster; BUILD.md).
  assert attention.DECODE_BACKENDS[-1].name == "pallas_mosaic_gpu"


def test_explicit_kernel_in_interpret_mode_is_selected():
  q, k, _, tables, _ = _small()
  backend = attention.select_implementation(
      attention.DECODE_BACKENDS, "pallas_gpu", q, k, tables, interpret=True)
  assert backend.fn is attention.gpu_decode.paged_decode


def test_no_backend_can_serve_lists_every_reason():
  q, k, _, tables, _ = _small()
  registry = (
      attention.Backend("a", None, lambda *a, **k: "too big"),
      attention.Backend("b", None, platforms=("tpu",)),
  )
  with pytest.raises(ValueError, match=r"no implementation can serve this "
                     r"call: a: too big; b: it runs on tpu, the default "
                     r"backend is cpu"):
    attention.select_implementation(registry, None, q, k, tables)


def test_kernel_refusal_is_a_value_error_with_its_reason():
  q, k, v, tables, lens = _small()
  k = v = jnp.zeros((2, 4, 12, 64))  # block_size 12: not a power of two
  with pytest.raises(ValueError, match=r"implementation='pallas_gpu' cannot "
                     r"serve this call: block_size=12 must be a power of two"):
    attention.paged_attention(q, k, v, tables, lens,
                              implementation="pallas_gpu", interpret=True)
  # implementation=None on CPU never tries a kernel.
  out = attention.paged_attention(q, k, v, tables, lens)
  assert out.shape == q.shape


def _small():
  q = jnp.zeros((2, 8, 64))
  pages = jnp.zeros((2, 4, 16, 64))
  return q, pages, pages, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(implementation="cuda"), r"implementation must be one of "
     r"\('pallas_tpu', 'pallas_gpu', 'xla'(, 'pallas_mosaic_gpu')?\) or None, "
     r"got 'cuda'"),
    (dict(implementation="pallas_tpu"), "implementation='pallas_tpu' cannot "
     "serve this call: it runs on tpu, the default backend is cpu"),
    (dict(implementation="pallas_gpu"), "implementation='pallas_gpu' cannot "
     "serve this call: it runs on gpu, the default backend is cpu"),
])
def test_option_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    attention.paged_attention(*_small(), **kwargs)
  q, k, v, tables, lens = _small()
  with pytest.raises(ValueError, match=match):
    attention.ragged_paged_attention(
        q, k, v, tables, lens, jnp.zeros((3,), jnp.int32), 1, **kwargs)


def test_mosaic_gpu_decode_is_refused_on_cpu_without_interpret():
  with pytest.raises(ValueError, match="implementation='pallas_mosaic_gpu' "
                     "cannot serve this call: it runs on gpu, the default "
                     "backend is cpu"):
    attention.paged_attention(*_small(), implementation="pallas_mosaic_gpu")
  with pytest.raises(ValueError, match=r"implementation must be one of "
                     r"\('pallas_tpu', 'pallas_gpu', 'xla'\) or None, got "
                     "'pallas_mosaic_gpu'"):  # decode only
    q, k, v, tables, lens = _small()
    attention.ragged_paged_attention(
        q, k, v, tables, lens, jnp.zeros((3,), jnp.int32), 1,
        implementation="pallas_mosaic_gpu")


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
