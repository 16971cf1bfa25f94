"""Sliding windows: blocks wholly outside every window are skipped, not masked.

A test base every backend's tests rerun (as `tests/contract.py`):

* `WindowDecodeContract.test_blocks_outside_the_window_are_never_read`:
  decode rows with long `kv_lens` and a short window; every block that no
  query of its sequence can see is NaN-poisoned, and in every other sequence
  its table entry is `NULL_BLOCK`, as a local layer group's table holds after
  reclamation (`paged_jax.block_groups`). The output must be finite and equal
  the float32 reference on the untouched pages and tables.
* `WindowContract.test_ragged_blocks_outside_the_window_are_never_read`: the
  same for a ragged batch (prefill chunks and decode rows), a block being
  outside when it is before the window of the sequence's first new token.
* `page_copies` / `CountedCopiesContract`: where an interpreter exposes its
  copies (TPU interpret mode's DMAs, the Mosaic GPU interpreter's TMA
  copies) or a kernel's loads can be watched (the Triton kernels' masked
  `plgpu.load`s of K and V, in Pallas interpret mode), the tests count the
  pages a call copies: only visible blocks, each sequence at most
  `ceil(w / block_size) + 1` pages per KV head for decode (O(w) work however
  long the sequence).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import reference
from paged_jax.block_manager import NULL_BLOCK
from tests import cases

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, WIDTH = 4, 2, 64, 8, 8
WINDOW = 11  # not a multiple of the block size: partial blocks at both ends
DECODE_LENS = (64, 40, 11, 12, 3, 57)  # long, at and under the window
RAGGED = ((1, 64), (9, 50), (1, 19), (16, 16), (5, 33))  # (q_len, kv_len)


def hidden_blocks(tables, kv_lens, first_query_pos, window, block_size):
  """bool[num_seqs, max_blocks]: table slots wholly before the window of the
  sequence's first query (no query of it can see them), inside `kv_len`."""
  n, width = tables.shape
  out = np.zeros((n, width), bool)
  for s in range(n):
    start = int(first_query_pos[s]) - window + 1  # first visible position
    for j in range(min(width, -(-int(kv_lens[s]) // block_size))):
      out[s, j] = (j + 1) * block_size <= start
  return out


def reclaim(case: cases.PagedCase, hidden) -> cases.PagedCase:
  """`case` with every hidden block NaN-poisoned, and its table entry
  `NULL_BLOCK` in every other sequence."""
  tables = np.asarray(case.block_tables).copy()
  k, v = np.array(case.k_pages), np.array(case.v_pages)
  for s, j in zip(*np.nonzero(hidden)):
    k[:, tables[s, j]] = np.nan
    v[:, tables[s, j]] = np.nan
    if s % 2:
      tables[s, j] = NULL_BLOCK
  return dataclasses.replace(case, k_pages=jnp.asarray(k, case.k_pages.dtype),
                             v_pages=jnp.asarray(v, case.v_pages.dtype),
                             block_tables=jnp.asarray(tables))


def decode_case(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  c = cases.make_decode_case(
      rng, batch=len(DECODE_LENS), num_q_heads=NUM_Q_HEADS,
      num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
      max_blocks_per_seq=WIDTH, dtype=dtype, kv_lens=DECODE_LENS)
  lens = np.asarray(DECODE_LENS)
  hidden = hidden_blocks(np.asarray(c.block_tables), lens, lens - 1, WINDOW,
                         BLOCK_SIZE)
  assert hidden.sum() >= 10, hidden  # the test has blocks to skip
  return c, reclaim(c, hidden), hidden


def ragged_case(seed=0):
  rng = np.random.default_rng(seed)
  q_lens, kv_lens = map(np.asarray, zip(*RAGGED))
  c = cases.make_ragged_case(
      rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=NUM_Q_HEADS,
      num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
      max_blocks_per_seq=WIDTH, num_tokens=int(q_lens.sum()) + 3)
  hidden = hidden_blocks(np.asarray(c.block_tables), kv_lens, kv_lens - q_lens,
                         WINDOW, BLOCK_SIZE)
  assert hidden.sum() >= 8, hidden
  return c, reclaim(c, hidden), hidden


def _args(c, ragged):
  base = (c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens)
  return base + (c.cu_q_lens, c.num_seqs) if ragged else base


class WindowDecodeContract:
  """Subclasses define `decode(q, k, v, tables, kv_lens, **kw)`, and may set
  `dtype` and override `check_after_call()`."""
  dtype = jnp.float32

  def decode(self, *args, **kwargs):
    raise NotImplementedError

  def check_after_call(self):
    pass

  def test_blocks_outside_the_window_are_never_read(self):
    full, reclaimed, _ = decode_case(dtype=self.dtype)
    kw = dict(sliding_window=WINDOW, soft_cap=5.0)
    out = jax.block_until_ready(self.decode(*_args(reclaimed, False), **kw))
    self.check_after_call()
    ref = reference.paged_attention_reference(*_args(full, False), **kw)
    cases.assert_rows_close(out, ref, self.dtype)


class WindowContract(WindowDecodeContract):
  """Also `ragged(q, k, v, tables, kv_lens, cu_q_lens, num_seqs, **kw)`."""

  def ragged(self, *args, **kwargs):
    raise NotImplementedError

  def test_ragged_blocks_outside_the_window_are_never_read(self):
    full, reclaimed, _ = ragged_case()
    kw = dict(sliding_window=WINDOW)
    out = jax.block_until_ready(self.ragged(*_args(reclaimed, True), **kw))
    self.check_after_call()
    ref = reference.ragged_paged_attention_reference(*_args(full, True), **kw)
    n = int(np.asarray(full.cu_q_lens)[-1])
    cases.assert_rows_close(out[:n], ref[:n], jnp.float32)


def max_decode_pages(window=WINDOW, block_size=BLOCK_SIZE) -> int:
  """The most pages a decode query of a local layer can see."""
  return math.ceil(window / block_size) + 1


def _triton_loads(k_pages_shape, seen):
  """The hook on `plgpu.load` (Triton, read when a kernel is traced): a
  masked load from one KV head's pages (`[num_blocks * block_size,
  head_dim]`, how both Triton kernels see them, KV head = program id 1)
  records `(head, block)` for every block with a row the mask lets through,
  at run time (`jax.debug.callback` in the interpreted kernel). A masked-out
  row is not read (on a GPU it issues no memory access)."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  heads, num_blocks, block_size, head_dim = k_pages_shape
  del heads
  orig, orig_program_id = plgpu.load, pl.program_id
  # The kernels read `program_id(1)` at their top level; the loads run in a
  # loop body, where the interpreter cannot evaluate a new `program_id`:
  # the callback takes the value the kernel read.
  program_ids = {}

  def program_id(axis):
    program_ids[axis] = orig_program_id(axis)
    return program_ids[axis]

  def record(head, rows, mask):
    rows, mask = np.asarray(rows)[:, 0], np.asarray(mask)[:, 0]
    seen.extend((int(head), int(b)) for b in np.unique(rows[mask] // block_size))

  def load(ref, *a, mask=None, **k):
    base = getattr(getattr(ref, "ref", None), "shape", None)
    if mask is not None and tuple(base or ()) == (num_blocks * block_size, head_dim):
      (indexer,) = ref.transforms
      rows = indexer.indices[0]  # i32[block_k, 1 | head_dim]
      jax.debug.callback(record, program_ids[1], rows, mask)
    return orig(ref, *a, mask=mask, **k)

  return [(plgpu, "load", load), (pl, "program_id", program_id)]


@contextlib.contextmanager
def page_copies(k_pages_shape):
  """Records the `(head, block)` of every copy out of an array shaped
  `k_pages_shape` (the K or V pages) that an interpreter makes while the
  context is open: TPU interpret mode's DMAs, the Mosaic GPU
  interpreter's global-to-shared copies, and the Triton kernels' masked
  loads (`_triton_loads`). Yields the list; the caller must
  run a fresh trace (`jax.clear_caches()` is called on entry), since the
  hooks are read when the kernel is traced. Yields None where this JAX's
  interpreter does not expose them (a private API)."""
  hooks = []
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu  # pylint: disable=import-outside-toplevel
    hooks.append((tpu, "dma_start", lambda a, k: a[5] if len(a) > 5 else k.get("src_transforms")))
  except ImportError:
    pass
  try:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gpu  # pylint: disable=import-outside-toplevel
    hooks.append((gpu, "copy_gmem_to_smem", lambda a, k: k.get("src_transforms")))
  except ImportError:
    pass
  hooks = [h for h in hooks if hasattr(h[0], h[1])]
  if not hooks:
    yield None
    return
  seen = []
  shape = tuple(k_pages_shape)

  def wrap(fn, transforms_of):
    def counting(*a, **k):
      for t in jax.tree.leaves(transforms_of(a, k),
                               is_leaf=lambda x: hasattr(x, "indices")):
        if hasattr(t, "indices") and tuple(t.shape) == shape:
          seen.append((int(t.indices[0]), int(t.indices[1])))
      return fn(*a, **k)
    return counting

  saved = [(m, name, getattr(m, name)) for m, name, _ in hooks]
  for m, name, transforms_of in hooks:
    setattr(m, name, wrap(getattr(m, name), transforms_of))
  for m, name, fn in _triton_loads(shape, seen):
    saved.append((m, name, getattr(m, name)))
    setattr(m, name, fn)
  jax.clear_caches()
  try:
    yield seen
  finally:
    for m, name, fn in saved:
      setattr(m, name, fn)
    jax.clear_caches()


def check_page_copies(copied, full: cases.PagedCase, hidden, *, decode: bool):
  """Every copied page is a visible block (hidden ones never are) and, for
  decode, each sequence copies at most `max_decode_pages()` pages per head
  (and per K or V)."""
  tables = np.asarray(full.block_tables)
  lens = np.asarray(full.kv_lens)
  owner = {}
  for s in range(tables.shape[0]):
    for j in range(min(tables.shape[1], -(-int(lens[s]) // BLOCK_SIZE))):
      owner[int(tables[s, j])] = (s, j)
  assert copied, "no page copy was recorded"
  per_seq_head = {}
  for head, block in copied:
    assert block in owner, f"copied block {block}, which no sequence owns"
    s, j = owner[block]
    assert not hidden[s, j], (f"sequence {s}'s block {j} (id {block}) is "
                              "outside every window, yet it was copied")
    per_seq_head[s, head] = per_seq_head.get((s, head), 0) + 1
  if decode:
    for (s, head), n in per_seq_head.items():
      assert n <= 2 * max_decode_pages(), (s, head, n)  # K and V


class CountedCopiesContract:
  """The pages a call copies, counted (`page_copies`): with the window only
  visible blocks, each decode row at most `max_decode_pages()` per KV head
  (and per K or V); without it every owned page, so the count is real.
  Subclasses define `decode` and `ragged` (as `WindowContract`)."""

  @pytest.mark.parametrize("ragged", [False, True], ids=["decode", "ragged"])
  def test_only_visible_pages_are_copied(self, ragged):
    full, _, hidden = ragged_case() if ragged else decode_case()
    fn = self.ragged if ragged else self.decode
    args = _args(full, ragged)
    with page_copies(full.k_pages.shape) as copied:
      if copied is None:
        pytest.skip("this JAX's interpreter exposes no copy hook")
      jax.block_until_ready(fn(*args, sliding_window=WINDOW))
    check_page_copies(copied, full, hidden, decode=not ragged)
    with page_copies(full.k_pages.shape) as all_copied:
      jax.block_until_ready(fn(*args))
    assert len(all_copied) >= len(copied) + 2 * hidden.sum(), (
        len(all_copied), len(copied))
