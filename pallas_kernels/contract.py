"""The attention input contract, shared by every backend (xla, GPU, TPU).

Static mistakes (shapes, dtypes, options) are found at trace time by
`check_attention_inputs`, one validator with one set of messages, which every
kernel entry point and `paged_jax.attention` call. Traced values cannot raise,
so malformed ones follow one rule on every backend:

* `kv_lens` are clamped to `[0, max_blocks_per_seq * block_size]`
  (`clamp_kv_lens`); empty shapes (no query, sequence or table column) give
  zeros (`is_empty`);
* a block-table entry inside a sequence's (clamped) `kv_len` that is
  `NULL_BLOCK` (-1) or otherwise outside `[0, num_blocks)` contributes no
  tokens and is never dereferenced (`valid_block`);
* ragged batches: `num_seqs` is clamped to `[0, max_num_seqs]`, and only the
  leading sequences whose `cu_q_lens` are well formed are served: sequence `s`
  is served if `cu_q_lens[0] == 0` and `cu_q_lens[0] <= ... <= cu_q_lens[s+1]
  <= num_tokens`. From the first violation on, sequences are dropped and their
  rows (like every row no served sequence owns) are zeros
  (`sanitize_ragged_metadata`). A served sequence with more new tokens than
  `kv_len` puts its first rows at negative positions: they see no key and
  are zeros.

`debug_check_decode` / `debug_check_ragged` state the same contract as
`jax.experimental.checkify.debug_check`s: free unless the caller runs under
`checkify.checkify(f, errors=checkify.user_checks)`, where each violation
becomes an error.
"""

from __future__ import annotations

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantization

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_TRACER = jax.core.Tracer


def _spec(x) -> str:
  return f"{jnp.dtype(x.dtype)}{list(x.shape)}"


def _i32_vector_error(name, x, length, what) -> str | None:
  if tuple(x.shape) != (length,) or jnp.dtype(x.dtype) != jnp.int32:
    want = f"i32[{length}]" if what == str(length) else (
        f"i32[{what}] = i32[{length}]")
    return f"{name} must be {want}, got {_spec(x)}"
  return None


def attention_input_error(q, k_pages, block_tables, *, v_pages=None,
                          kv_lens=None, cu_q_lens=None, num_seqs=None,
                          ragged: bool = False, soft_cap=None,
                          sliding_window=None, k_scales=None,
                          v_scales=None) -> str | None:
  """What is statically wrong with these attention inputs, or None.

  Only `.shape` and `.dtype` are read (arrays or `jax.ShapeDtypeStruct`s).
  Arguments left as None are not checked.

  Args:
    q: `[batch, num_q_heads, head_dim]` (decode) or `[num_tokens, ...]`
      (`ragged=True`), floating.
    k_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`, floating,
      or int8 / float8_e4m3fn with scales (`pallas_kernels.quantization`).
    block_tables: `i32[batch or max_num_seqs, max_blocks_per_seq]`.
    v_pages: same shape and dtype as `k_pages`.
    kv_lens: `i32[block_tables.shape[0]]`.
    cu_q_lens: `i32[max_num_seqs + 1]` (ragged).
    num_seqs: `i32[1]` (ragged).
    ragged: whether `q` rows are tokens of several sequences (ragged) or one
      query per block-table row (decode).
    soft_cap: None or a positive number.
    sliding_window: None or a positive int.
    k_scales, v_scales: `f32[num_kv_heads, num_blocks, block_size]` for
      quantised pages, None for float pages (checked only with `v_pages`).
  """
  rows = "num_tokens" if ragged else "batch"
  if len(q.shape) != 3:
    return f"q must be [{rows}, num_q_heads, head_dim], got shape {q.shape}"
  if len(k_pages.shape) != 4 or min(k_pages.shape) < 1:
    return ("k_pages must be [num_kv_heads, num_blocks, block_size, head_dim]"
            f" with every size at least 1, got shape {k_pages.shape}")
  if v_pages is not None and (tuple(v_pages.shape) != tuple(k_pages.shape) or
                              v_pages.dtype != k_pages.dtype):
    return (f"v_pages must match k_pages: expected {_spec(k_pages)}, got"
            f" {_spec(v_pages)}")
  if not (jnp.issubdtype(q.dtype, jnp.floating)
          and (jnp.issubdtype(k_pages.dtype, jnp.floating)
               or quantization.is_quantized(k_pages.dtype))):
    return (f"q and k_pages must be floating (k_pages may also be int8), got"
            f" {jnp.dtype(q.dtype)} and {jnp.dtype(k_pages.dtype)}")
  if v_pages is not None:
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
      error = quantization.scales_error(k_pages, scales, name)
      if error is not None:
        return error
  _, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  if k_pages.shape[3] != head_dim:
    return (f"head_dim of q ({head_dim}) must equal head_dim of k_pages"
            f" ({k_pages.shape[3]})")
  if num_q_heads % num_kv_heads:
    return f"{num_q_heads=} must be a multiple of {num_kv_heads=}"
  if ragged:
    table_ok = len(block_tables.shape) == 2
    table_rows = "max_num_seqs"
  else:
    table_ok = (len(block_tables.shape) == 2
                and block_tables.shape[0] == q.shape[0])
    table_rows = f"batch={q.shape[0]}"
  if not table_ok or jnp.dtype(block_tables.dtype) != jnp.int32:
    return (f"block_tables must be i32[{table_rows}, max_blocks_per_seq],"
            f" got {_spec(block_tables)}")
  max_num_seqs = block_tables.shape[0]
  for name, x, length, what in (
      ("kv_lens", kv_lens, max_num_seqs, "block_tables.shape[0]"),
      ("cu_q_lens", cu_q_lens, max_num_seqs + 1, "max_num_seqs + 1"),
      ("num_seqs", num_seqs, 1, "1")):
    if x is not None:
      error = _i32_vector_error(name, x, length, what)
      if error is not None:
        return error
  if soft_cap is not None and not (isinstance(soft_cap, (int, float))
                                   and soft_cap > 0):
    return f"soft_cap must be positive or None, got {soft_cap=}"
  if sliding_window is not None and not (
      isinstance(sliding_window, (int, np.integer)) and sliding_window > 0):
    return f"sliding_window must be a positive int or None, got {sliding_window=}"
  return None


def check_attention_inputs(q, k_pages, block_tables, **kwargs) -> None:
  """`attention_input_error(...)` as a `ValueError` (same arguments).

  Raises:
    ValueError: saying which argument is wrong, what was expected and what was
      given.
  """
  error = attention_input_error(q, k_pages, block_tables, **kwargs)
  if error is not None:
    raise ValueError(error)


def saturate_to_int32(x):
  """An integer array as int32, out-of-range values saturated (never wrapped).

  Other dtypes (and int32) pass through unchanged for the validator to judge;
  a NumPy array stays NumPy. A value past the int32 range becomes INT32_MIN or
  INT32_MAX, which the contract treats as out of range, where a wrapping cast
  could turn it into a valid block id or length.
  """
  dtype = jnp.dtype(x.dtype)
  if not jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.int32:
    return x
  info = np.iinfo(dtype)
  lo, hi = max(int(info.min), INT32_MIN), min(int(info.max), INT32_MAX)
  if isinstance(x, np.ndarray):
    return np.clip(x, lo, hi).astype(np.int32)
  return jnp.clip(x, lo, hi).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Traced rules: one function per rule, used by every backend.


def is_empty(q, block_tables) -> bool:
  """Static: no query row, no sequence or no table column.

  The output is then all zeros (every `kv_len` clamps to 0, or no sequence
  exists) and every backend returns `zeros(q.shape, q.dtype)` without running.
  """
  return 0 in (q.shape[0], block_tables.shape[0], block_tables.shape[1])


def valid_block(ids, num_blocks: int):
  """Whether block-table entries name a real block: `0 <= id < num_blocks`.

  Works on arrays and on scalars (inside kernels too).
  """
  return (ids >= 0) & (ids < num_blocks)


def clamp_kv_lens(kv_lens, max_blocks_per_seq: int, block_size: int):
  """`kv_lens` clamped to `[0, max_blocks_per_seq * block_size]`."""
  return jnp.clip(kv_lens, 0, max_blocks_per_seq * block_size)


def served_sequences(cu_q_lens, num_seqs, num_tokens: int):
  """How many leading sequences a ragged batch serves (i32 scalar).

  `min(num_seqs, max_num_seqs)`, cut at the first sequence whose rows are
  malformed: `cu_q_lens[0] != 0`, a decrease, or an end past `num_tokens`.
  """
  max_num_seqs = cu_q_lens.shape[0] - 1
  n = jnp.clip(jnp.asarray(num_seqs).reshape(-1)[0], 0, max_num_seqs)
  starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
  ok = (cu_q_lens[0] == 0) & (starts <= ends) & (ends <= num_tokens)
  ok &= jnp.arange(max_num_seqs) < n
  # Leading run of well-formed sequences.
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32)


def sanitize_ragged_metadata(cu_q_lens, num_seqs, num_tokens: int):
  """`(cu_q_lens, num_seqs)` that every kernel can trust.

  Returns the served count `m = served_sequences(...)` as `i32[1]` and
  `cu_q_lens` with entries past `m` set to `cu_q_lens[m]` (all zeros when
  `m == 0`): starting at 0, non-decreasing, at most `num_tokens`. Rows past
  `cu_q_lens[m]` belong to no sequence and come back as zeros.
  """
  m = served_sequences(cu_q_lens, num_seqs, num_tokens)
  idx = jnp.arange(cu_q_lens.shape[0], dtype=jnp.int32)
  cu = jnp.where(idx <= m, cu_q_lens, cu_q_lens[m])
  cu = jnp.where(m > 0, cu, 0).astype(jnp.int32)
  return cu, m.reshape(1)


# ----------------------------------------------------------------------------
# Checked mode (jax.experimental.checkify).


def _traced(*arrays) -> bool:
  """Whether any array is being traced: checkify only ever sees traced
  values, so an eager call skips the checks (and their op-by-op cost)."""
  return any(isinstance(x, _TRACER) for x in arrays)


def _debug_check_tables(block_tables, kv_lens, num_blocks, block_size, live):
  block_tables, kv_lens = jnp.asarray(block_tables), jnp.asarray(kv_lens)
  if block_tables.size == 0:  # nothing to check (and argmax needs an element)
    return
  max_blocks_per_seq = block_tables.shape[1]
  cap = max_blocks_per_seq * block_size
  bad_len = live & ((kv_lens < 0) | (kv_lens > cap))
  checkify.debug_check(
      ~jnp.any(bad_len),
      "kv_lens must be in [0, max_blocks_per_seq * block_size = {cap}]: "
      "sequence {s} has kv_len {n}", cap=jnp.int32(cap),
      s=jnp.argmax(bad_len), n=kv_lens[jnp.argmax(bad_len)])
  used = (jnp.arange(max_blocks_per_seq)[None, :]
          < -(-clamp_kv_lens(kv_lens, max_blocks_per_seq, block_size)
              // block_size)[:, None]) & live[:, None]
  bad = used & ~valid_block(block_tables, num_blocks)
  flat = jnp.argmax(bad.reshape(-1))
  s, j = flat // max_blocks_per_seq, flat % max_blocks_per_seq
  checkify.debug_check(
      ~jnp.any(bad),
      "block_tables[{s}, {j}] = {id} is inside kv_len but not a block in "
      "[0, num_blocks = {nb})", s=s, j=j, id=block_tables[s, j],
      nb=jnp.int32(num_blocks))


def debug_check_decode(q, k_pages, block_tables, kv_lens) -> None:
  """checkify debug checks of the decode contract (see the module doc)."""
  if not _traced(q, k_pages, block_tables, kv_lens):
    return
  _, num_blocks, block_size, _ = k_pages.shape
  _debug_check_tables(block_tables, kv_lens, num_blocks, block_size,
                      jnp.ones(kv_lens.shape, bool))


def debug_check_ragged(q, k_pages, block_tables, kv_lens, cu_q_lens,
                       num_seqs) -> None:
  """checkify debug checks of the ragged contract (see the module doc)."""
  if not _traced(q, k_pages, block_tables, kv_lens, cu_q_lens, num_seqs):
    return
  cu_q_lens = jnp.asarray(cu_q_lens)
  max_num_seqs = block_tables.shape[0]
  if max_num_seqs == 0:
    return
  n = jnp.asarray(num_seqs).reshape(-1)[0]
  checkify.debug_check(
      (n >= 0) & (n <= max_num_seqs),
      "num_seqs must be in [0, max_num_seqs = {m}], got {n}",
      m=jnp.int32(max_num_seqs), n=n)
  n = jnp.clip(n, 0, max_num_seqs)
  checkify.debug_check(
      (n == 0) | (cu_q_lens[0] == 0),
      "cu_q_lens[0] must be 0, got {c}", c=cu_q_lens[0])
  idx = jnp.arange(max_num_seqs)
  live = idx < n
  dec = live & (cu_q_lens[1:] < cu_q_lens[:-1])
  checkify.debug_check(
      ~jnp.any(dec),
      "cu_q_lens must be non-decreasing: cu_q_lens[{s}] = {a} > "
      "cu_q_lens[{s1}] = {b}", s=jnp.argmax(dec),
      a=cu_q_lens[jnp.argmax(dec)], s1=jnp.argmax(dec) + 1,
      b=cu_q_lens[jnp.argmax(dec) + 1])
  checkify.debug_check(
      cu_q_lens[n] <= q.shape[0],
      "cu_q_lens[num_seqs] = {c} must be at most num_tokens = {t}",
      c=cu_q_lens[n], t=jnp.int32(q.shape[0]))
  _, num_blocks, block_size, _ = k_pages.shape
  _debug_check_tables(block_tables, kv_lens, num_blocks, block_size, live)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  short = live & (q_lens > jnp.asarray(kv_lens))
  checkify.debug_check(
      ~jnp.any(short),
      "sequence {s} has q_len {q} > kv_len {n} (kv_len counts the new tokens)",
      s=jnp.argmax(short), q=q_lens[jnp.argmax(short)],
      n=jnp.asarray(kv_lens)[jnp.argmax(short)])
