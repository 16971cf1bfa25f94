"""The attention contract test base, rerun by every backend's tests.

Two bases (Tokamax's `test_base` idea); a backend's test module subclasses
them and says how to call its decode and ragged functions:

* `StaticErrorContract`: every static mistake is a `ValueError` with the one
  message of `pallas_kernels.contract`, whichever backend is called;
* `QuantizedContract`: int8 / float8_e4m3fn pages with their scales, on the
  same NaN-poisoned malformed rows, against the float32 reference twice: on
  the dequantised pages (float32 tolerance: only the order of the scale
  multiplications differs) and on the float pages they were quantised from
  (the 8-bit tolerance of `cases.QUANTIZED_TOLERANCES`); a backend that
  cannot serve a dtype refuses it with a `ValueError` naming it;
* `MalformedInputContract`: every row of the malformed-traced-input contract
  (lengths past the table's capacity or negative, table entries that are
  `NULL_BLOCK`, `num_blocks`, `2**30` or negative inside `kv_len`, ragged
  `num_seqs` out of range, `cu_q_lens` not starting at 0, decreasing, or past
  `num_tokens`, more new tokens than `kv_len`) against the float32 reference, with NaN in every block slot
  and query row the contract says is not used.

Shapes are small and shared by every backend (interpret mode is slow).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK
from tests import cases

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, WIDTH = 4, 2, 64, 8, 3
CAPACITY = WIDTH * BLOCK_SIZE
FAR = 2**30


def _owned_slots(tables, kv_lens, served, num_blocks, block_size=BLOCK_SIZE):
  """bool[num_blocks, block_size]: the slots the contract lets attention read."""
  owned = np.zeros((num_blocks, block_size), bool)
  for s in range(served):
    kv = min(max(int(kv_lens[s]), 0), WIDTH * block_size)
    for j in range(-(-kv // block_size)):
      block = int(tables[s, j])
      if 0 <= block < num_blocks:
        owned[block, :min(block_size, kv - j * block_size)] = True
  return owned


def _scaled_len(n, block_size):
  """A row's length for pages of `block_size` (the rows are written for
  BLOCK_SIZE): lengths inside the table's capacity scale with the pages, so
  each row keeps its meaning; the others stay (past the capacity, negative)."""
  return n * (block_size // BLOCK_SIZE) if 0 <= n <= CAPACITY else n


def _pages(rng, owned):
  num_blocks, block_size = owned.shape
  shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
  k = rng.standard_normal(shape, np.float32)
  v = rng.standard_normal(shape, np.float32)
  k[:, ~owned] = np.nan
  v[:, ~owned] = np.nan
  return jnp.asarray(k), jnp.asarray(v)


# Decode: one row of the contract per sequence; `B` is a real block id (each
# `B` a distinct block), the other entries are what a buggy caller passes.
B = "block"
DECODE_ROWS = [  # (what, kv_len, table)
    ("well formed", 10, [B, B, NULL_BLOCK]),
    ("kv_len past the table's capacity", 1000, [B, B, B]),
    ("kv_len int32 max", 2**31 - 1, [B, NULL_BLOCK, B]),
    ("negative kv_len", -5, [B, B, B]),
    ("NULL_BLOCK inside kv_len", 20, [B, NULL_BLOCK, B]),
    ("block id == num_blocks", 12, ["num_blocks", B, B]),
    ("block id 2**30", 16, [B, FAR, NULL_BLOCK]),
    ("negative block id, nothing left", 5, [-7, B, B]),
]


def decode_case(seed, dtype=jnp.float32, block_size=BLOCK_SIZE):
  """The DECODE_ROWS batch in `dtype`; `block_size` (a multiple of
  BLOCK_SIZE) scales the rows' lengths with it (`_scaled_len`)."""
  rng = np.random.default_rng(seed)
  batch = len(DECODE_ROWS)
  num_blocks = sum(t.count(B) for _, _, t in DECODE_ROWS) + 2
  ids = iter(rng.permutation(num_blocks))
  tables = np.array(
      [[int(next(ids)) if e == B else num_blocks if e == "num_blocks" else e
        for e in t] for _, _, t in DECODE_ROWS], np.int32)
  kv_lens = np.array([_scaled_len(n, block_size) for _, n, _ in DECODE_ROWS],
                     np.int32)
  k, v = _pages(rng, _owned_slots(tables, kv_lens, batch, num_blocks,
                                  block_size))
  q = jnp.asarray(rng.standard_normal((batch, NUM_Q_HEADS, HEAD_DIM),
                                      np.float32), dtype)
  return cases.PagedCase(q, k.astype(dtype), v.astype(dtype),
                         jnp.asarray(tables), jnp.asarray(kv_lens))


@dataclasses.dataclass(frozen=True)
class RaggedRow:
  what: str
  cu_q_lens: tuple[int, ...]
  num_seqs: int
  served: int  # leading sequences the contract serves
  kv_lens: tuple[int, ...] = (9, 17, 4, 24)
  tables: tuple[tuple, ...] = ((B, B, NULL_BLOCK), (B, B, B), (B, B, B),
                               (B, B, B))

  def __str__(self):
    return self.what


NUM_TOKENS = 24
RAGGED_ROWS = [
    RaggedRow("lengths and table entries", (0, 5, 6, 7, 11), 4, 4,
              kv_lens=(9, 1000, -3, 20),
              tables=((B, NULL_BLOCK, B), (B, "num_blocks", B), (B, B, B),
                      (B, FAR, -2))),
    RaggedRow("q_len > kv_len", (0, 5, 6, 7, 11), 4, 4,
              kv_lens=(3, 17, 0, 2)),
    RaggedRow("num_seqs -1", (0, 5, 6, 7, 11), -1, 0),
    RaggedRow("num_seqs past max_num_seqs", (0, 5, 6, 7, 11), 7, 4),
    RaggedRow("cu_q_lens[0] != 0", (2, 5, 6, 7, 11), 4, 0),
    RaggedRow("cu_q_lens decreasing", (0, 5, 3, 7, 11), 4, 1),
    RaggedRow("cu_q_lens past num_tokens", (0, 5, 6, NUM_TOKENS + 3,
                                            NUM_TOKENS + 3), 4, 2),
]


def ragged_case(row: RaggedRow, seed, block_size=BLOCK_SIZE):
  """`row` as a batch; `block_size` scales its lengths as in `decode_case`
  (meaningful for rows whose new tokens stay within the scaled lengths)."""
  rng = np.random.default_rng(seed)
  max_num_seqs = len(row.kv_lens)
  # One pool size for every row: the same shapes reuse one compilation.
  num_blocks = max(sum(t.count(B) for t in r.tables) for r in RAGGED_ROWS) + 2
  ids = iter(rng.permutation(num_blocks))
  tables = np.array(
      [[int(next(ids)) if e == B else num_blocks if e == "num_blocks" else e
        for e in t] for t in row.tables], np.int32)
  kv_lens = np.array([_scaled_len(n, block_size) for n in row.kv_lens],
                     np.int32)
  k, v = _pages(rng, _owned_slots(tables, kv_lens, row.served, num_blocks,
                                  block_size))
  q = rng.standard_normal((NUM_TOKENS, NUM_Q_HEADS, HEAD_DIM), np.float32)
  used = np.zeros(NUM_TOKENS, bool)
  for s in range(row.served):
    used[row.cu_q_lens[s]:row.cu_q_lens[s + 1]] = True
  q[~used] = np.nan  # rows no served sequence owns must not be read
  assert len(row.cu_q_lens) == max_num_seqs + 1
  return cases.PagedCase(jnp.asarray(q), k, v, jnp.asarray(tables),
                         jnp.asarray(kv_lens),
                         jnp.asarray(row.cu_q_lens, jnp.int32),
                         jnp.asarray([row.num_seqs], jnp.int32)), used


class MalformedDecodeContract:
  """Malformed traced decode inputs give the reference's answer.

  Subclasses define `decode(q, k, v, tables, kv_lens, **kw)` and may override
  `check_after_call()` (e.g. the TPU race detector) and `dtype` (of q and the
  pages, for a kernel without float32).
  """
  dtype = jnp.float32

  def decode(self, *args, **kwargs):
    raise NotImplementedError

  def check_after_call(self):
    pass

  # The windowed call masks a mix of valid and invalid pages in most rows;
  # the plain causal one is behind -m slow (each call compiles anew).
  @pytest.mark.parametrize("kwargs", [
      dict(sliding_window=7, soft_cap=5.0),
      pytest.param({}, marks=pytest.mark.slow)], ids=["window+cap", "causal"])
  def test_malformed_decode_rows(self, kwargs):
    c = decode_case(seed=len(kwargs), dtype=self.dtype)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
    out = jax.block_until_ready(self.decode(*args, **kwargs))
    self.check_after_call()
    ref = reference.paged_attention_reference(*args, **kwargs)
    for r, (what, _, _) in enumerate(DECODE_ROWS):
      try:
        cases.assert_rows_close(out[r:r + 1], ref[r:r + 1], self.dtype)
      except AssertionError as e:
        raise AssertionError(f"row {r} ({what}): {e}") from None
    # The rows the contract empties are zeros.
    assert not np.asarray(out[3]).any() and not np.asarray(out[7]).any()


  @pytest.mark.parametrize("batch, width", [(0, WIDTH), (2, 0)])
  def test_empty_decode_gives_zeros(self, batch, width):
    k = jnp.zeros((NUM_KV_HEADS, 4, BLOCK_SIZE, HEAD_DIM), self.dtype)
    q = jnp.ones((batch, NUM_Q_HEADS, HEAD_DIM), self.dtype)
    out = self.decode(q, k, k, jnp.zeros((batch, width), jnp.int32),
                      jnp.full((batch,), 5, jnp.int32))
    assert out.shape == q.shape and not np.asarray(out).any()


class MalformedInputContract(MalformedDecodeContract):
  """Malformed traced inputs, decode and ragged: every backend gives the
  reference's answer. Subclasses also define
  `ragged(q, k, v, tables, kv_lens, cu_q_lens, num_seqs, **kw)`."""

  def ragged(self, *args, **kwargs):
    raise NotImplementedError

  @pytest.mark.parametrize("row", RAGGED_ROWS, ids=str)
  def test_malformed_ragged_rows(self, row):
    c, used = ragged_case(row, seed=1)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
            c.num_seqs)
    out = jax.block_until_ready(self.ragged(*args))
    self.check_after_call()
    ref = reference.ragged_paged_attention_reference(*args)
    assert not ref[~used].any()
    cases.assert_rows_close(out, ref, jnp.float32)

  @pytest.mark.parametrize("num_tokens, max_num_seqs, width",
                           [(0, 2, WIDTH), (5, 0, WIDTH), (5, 2, 0)])
  def test_empty_ragged_gives_zeros(self, num_tokens, max_num_seqs, width):
    k = jnp.zeros((NUM_KV_HEADS, 4, BLOCK_SIZE, HEAD_DIM))
    q = jnp.ones((num_tokens, NUM_Q_HEADS, HEAD_DIM))
    cu = jnp.minimum(jnp.arange(max_num_seqs + 1, dtype=jnp.int32), num_tokens)
    out = self.ragged(q, k, k, jnp.zeros((max_num_seqs, width), jnp.int32),
                      jnp.full((max_num_seqs,), 5, jnp.int32), cu,
                      jnp.array([max_num_seqs], jnp.int32))
    assert out.shape == q.shape and not np.asarray(out).any()


QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)


class QuantizedContract:
  """8-bit pages: served within tolerance, or refused by name.

  Subclasses define `decode` and `ragged` as for `MalformedInputContract`
  (taking `k_scales=` / `v_scales=`), `refuses` (dtypes the backend must
  refuse, with a message matching `refusal`) and may set
  `quantized_block_size` (a multiple of BLOCK_SIZE that the backend serves
  8-bit pages at; the rows' lengths and window scale with it).
  """
  refuses: tuple = ()
  refusal: str = ""
  quantized_block_size: int = BLOCK_SIZE

  def decode(self, *args, **kwargs):
    raise NotImplementedError

  def ragged(self, *args, **kwargs):
    raise NotImplementedError

  def check_after_call(self):
    pass

  def _check(self, fn, ref_fn, q_case, args, kwargs):
    dtype = q_case.k_pages.dtype
    qargs = (args[0], q_case.k_pages, q_case.v_pages) + args[3:]
    if any(jnp.dtype(dtype) == jnp.dtype(d) for d in self.refuses):
      with pytest.raises(ValueError, match=self.refusal.format(
          dtype=jnp.dtype(dtype).name)):
        fn(*qargs, **q_case.scales(), **kwargs)
      return
    out = jax.block_until_ready(fn(*qargs, **q_case.scales(), **kwargs))
    self.check_after_call()
    exact = ref_fn(*qargs, **q_case.scales(), **kwargs)
    cases.assert_rows_close(out, exact, jnp.float32)
    cases.assert_rows_close(out, ref_fn(*args, **kwargs), dtype)

  @pytest.mark.parametrize("dtype", QUANTIZED_DTYPES, ids=["int8", "fp8"])
  def test_quantized_decode_rows(self, dtype):
    block_size = self.quantized_block_size
    c = decode_case(seed=3, block_size=block_size)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
    self._check(self.decode, reference.paged_attention_reference,
                cases.quantize_case(c, dtype), args,
                dict(sliding_window=_scaled_len(7, block_size), soft_cap=5.0))

  # fp8's ragged row behind -m slow (interpret mode; decode covers fp8).
  @pytest.mark.parametrize("dtype", [
      jnp.int8, pytest.param(jnp.float8_e4m3fn, marks=pytest.mark.slow)],
                           ids=["int8", "fp8"])
  def test_quantized_ragged_rows(self, dtype):
    c, _ = ragged_case(RAGGED_ROWS[0], seed=4,  # lengths and table entries
                       block_size=self.quantized_block_size)
    args = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens, c.cu_q_lens,
            c.num_seqs)
    self._check(self.ragged, reference.ragged_paged_attention_reference,
                cases.quantize_case(c, dtype), args, {})


# ----------------------------------------------------------------------------
# Static errors: one table, one message each, every backend.

f32, i32 = jnp.float32, jnp.int32


def _decode_shapes(**changes):
  s = jax.ShapeDtypeStruct
  shapes = dict(q=s((2, NUM_Q_HEADS, HEAD_DIM), f32),
                k=s((NUM_KV_HEADS, 6, BLOCK_SIZE, HEAD_DIM), f32),
                v=s((NUM_KV_HEADS, 6, BLOCK_SIZE, HEAD_DIM), f32),
                tables=s((2, WIDTH), i32), kv_lens=s((2,), i32))
  for name, (shape, dtype) in changes.items():
    shapes[name] = s(shape, dtype)
  return list(shapes.values())


def _ragged_shapes(**changes):
  s = jax.ShapeDtypeStruct
  shapes = dict(q=s((NUM_TOKENS, NUM_Q_HEADS, HEAD_DIM), f32),
                k=s((NUM_KV_HEADS, 6, BLOCK_SIZE, HEAD_DIM), f32),
                v=s((NUM_KV_HEADS, 6, BLOCK_SIZE, HEAD_DIM), f32),
                tables=s((3, WIDTH), i32), kv_lens=s((3,), i32),
                cu_q_lens=s((4,), i32), num_seqs=s((1,), i32))
  for name, (shape, dtype) in changes.items():
    shapes[name] = s(shape, dtype)
  return list(shapes.values())


KV = (NUM_KV_HEADS, 6, BLOCK_SIZE, HEAD_DIM)
# (op, changed shapes, options, message regex)
STATIC_ERRORS = [
    ("decode", dict(q=((2, 64), f32)), {},
     r"q must be \[batch, num_q_heads, head_dim\], got shape \(2, 64\)"),
    ("ragged", dict(q=((24, 64), f32)), {},
     r"q must be \[num_tokens, num_q_heads, head_dim\], got shape \(24, 64\)"),
    ("decode", dict(k=((6, BLOCK_SIZE, HEAD_DIM), f32)), {},
     r"k_pages must be \[num_kv_heads, num_blocks, block_size, head_dim\] "
     r"with every size at least 1, got shape \(6, 8, 64\)"),
    ("ragged", dict(k=((2, 0, 8, 64), f32), v=((2, 0, 8, 64), f32)), {},
     r"k_pages must be .* with every size at least 1, got shape \(2, 0, 8, 64\)"),
    ("decode", dict(v=((2, 6, 8, 32), f32)), {},
     r"v_pages must match k_pages: expected float32\[2, 6, 8, 64\], got "
     r"float32\[2, 6, 8, 32\]"),
    ("ragged", dict(v=(KV, jnp.bfloat16)), {},
     r"v_pages must match k_pages: expected float32\[2, 6, 8, 64\], got "
     r"bfloat16\[2, 6, 8, 64\]"),
    ("decode", dict(q=((2, 4, 64), i32)), {},
     r"q and k_pages must be floating \(k_pages may also be int8\), got int32 "
     "and float32"),
    ("decode", dict(q=((2, 4, 32), f32)), {},
     r"head_dim of q \(32\) must equal head_dim of k_pages \(64\)"),
    ("ragged", dict(q=((24, 3, 64), f32)), {},
     "num_q_heads=3 must be a multiple of num_kv_heads=2"),
    # The batch mismatch and float index arrays were TypeErrors on xla.
    ("decode", dict(tables=((3, WIDTH), i32)), {},
     r"block_tables must be i32\[batch=2, max_blocks_per_seq\], got "
     r"int32\[3, 3\]"),
    ("decode", dict(tables=((2, WIDTH), f32)), {},
     r"block_tables must be i32\[batch=2, max_blocks_per_seq\], got "
     r"float32\[2, 3\]"),
    ("ragged", dict(tables=((3,), i32)), {},
     r"block_tables must be i32\[max_num_seqs, max_blocks_per_seq\], got "
     r"int32\[3\]"),
    ("decode", dict(kv_lens=((3,), i32)), {},
     r"kv_lens must be i32\[block_tables.shape\[0\]\] = i32\[2\], got "
     r"int32\[3\]"),
    ("ragged", dict(kv_lens=((3,), f32)), {},
     r"kv_lens must be i32\[block_tables.shape\[0\]\] = i32\[3\], got "
     r"float32\[3\]"),
    ("ragged", dict(cu_q_lens=((3,), i32)), {},
     r"cu_q_lens must be i32\[max_num_seqs \+ 1\] = i32\[4\], got int32\[3\]"),
    ("ragged", dict(cu_q_lens=((4,), f32)), {},
     r"cu_q_lens must be i32\[max_num_seqs \+ 1\] = i32\[4\], got "
     r"float32\[4\]"),
    ("ragged", dict(num_seqs=((2,), i32)), {},
     r"num_seqs must be i32\[1\], got int32\[2\]"),
    ("decode", {}, dict(soft_cap=0.0),
     r"soft_cap must be positive or None, got soft_cap=0.0"),
    ("ragged", {}, dict(soft_cap=-1.0),
     r"soft_cap must be positive or None, got soft_cap=-1.0"),
    ("decode", dict(k=(KV, jnp.int8), v=(KV, jnp.int8)), {},
     r"int8 pages need k_scales f32\[2, 6, 8\], got None"),
    ("ragged", {}, dict(k_scales=jax.ShapeDtypeStruct(KV[:3], f32),
                        v_scales=jax.ShapeDtypeStruct(KV[:3], f32)),
     r"k_scales must be None for float32 pages \(only \['int8', "
     r"'float8_e4m3fn'\] pages carry scales\)"),
    ("decode", dict(k=(KV, jnp.float8_e4m3fn), v=(KV, jnp.float8_e4m3fn)),
     dict(k_scales=jax.ShapeDtypeStruct(KV[:3], f32),
          v_scales=jax.ShapeDtypeStruct((2, 6, 4), jnp.bfloat16)),
     r"v_scales must be f32\[2, 6, 8\] \(the pages' \[num_kv_heads, "
     r"num_blocks, block_size\]\), got bfloat16\[2, 6, 4\]"),
    ("decode", {}, dict(sliding_window=0),
     r"sliding_window must be a positive int or None, got sliding_window=0"),
    ("ragged", {}, dict(sliding_window=2.5),
     r"sliding_window must be a positive int or None, got sliding_window=2.5"),
]


def _error_id(e):
  op, change, kwargs, _ = e
  return f"{op}-{'-'.join(change) or '-'.join(kwargs)}"


class StaticErrorContract:
  """Static mistakes: the same `ValueError` message on every backend.

  Subclasses define `decode` and `ragged` as for `MalformedInputContract`.
  """

  def decode(self, *args, **kwargs):
    raise NotImplementedError

  def ragged(self, *args, **kwargs):
    raise NotImplementedError

  @pytest.mark.parametrize("error", STATIC_ERRORS, ids=map(_error_id,
                                                           STATIC_ERRORS))
  def test_static_error(self, error):
    op, change, kwargs, match = error
    fn, shapes = ((self.decode, _decode_shapes) if op == "decode" else
                  (self.ragged, _ragged_shapes))
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(functools.partial(fn, **kwargs), *shapes(**change))
