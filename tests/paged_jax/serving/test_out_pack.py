"""`out_pack`: a step's outputs packed into one int32 buffer on the device
come back, fetched, bit for bit equal to the record fetched leaf by leaf."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.serving import out_pack
from paged_jax.serving.step import StepOutputs


@flax.struct.dataclass
class _Record:
  tokens: jax.Array  # i32[n]
  ok: jax.Array  # bool[n]
  scores: jax.Array  # f32[n, 3]
  fingerprint: jax.Array  # u32[5]
  small: jax.Array  # i8[n]: not 4 bytes wide, kept apart
  top_ids: jax.Array  # i32[n, 2]: apart by name


def _record(rng, n) -> _Record:
  scores = rng.standard_normal((n, 3)).astype(np.float32)
  scores.flat[::4] = np.nan  # NaN payloads survive the bitcast
  scores.flat[1::5] = -np.inf
  return _Record(
      tokens=rng.integers(-2**31, 2**31 - 1, n, dtype=np.int32),
      ok=rng.random(n) < 0.5,
      scores=scores,
      fingerprint=rng.integers(0, 2**32 - 1, 5, dtype=np.uint32),
      small=rng.integers(-128, 127, n, dtype=np.int8),
      top_ids=rng.integers(0, 100, (n, 2), dtype=np.int32))


def _assert_same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g.view(np.uint8) if g.dtype != bool else g,
                                  w.view(np.uint8) if w.dtype != bool else w)


@pytest.mark.parametrize("n", [1, 7, 32])
def test_packed_record_fetches_equal_to_the_plain_one(n):
  rng = np.random.default_rng(n)
  rec = _record(rng, n)
  step = jax.jit(out_pack.packs(lambda r, x: (x + 1, r)))
  x, packed = step(rec, jnp.int32(3))
  assert int(x) == 4  # other outputs pass through
  assert isinstance(packed, out_pack.Packed)
  # Everything but the apart leaves travels in the one buffer.
  assert packed.buf.dtype == jnp.int32 and packed.buf.shape == (n + n + 3 * n + 5,)
  assert len(packed.apart) == 2
  _assert_same(out_pack.fetch(packed), jax.device_get(rec))
  lean = out_pack.fetch(packed, top=False)
  assert lean.top_ids is None
  np.testing.assert_array_equal(lean.small, rec.small)  # apart, not named: kept
  _assert_same(lean.replace(top_ids=rec.top_ids), jax.device_get(rec))
  assert out_pack.is_ready(packed)


def test_unpacked_records_fetch_leaf_by_leaf():
  rec = jax.tree.map(jnp.asarray, _record(np.random.default_rng(0), 4))
  _assert_same(out_pack.fetch(rec), jax.device_get(rec))
  assert out_pack.fetch(rec, top=False).top_ids is None
  assert out_pack.is_ready(rec)


def test_step_outputs_pack_and_round_trip():
  rng = np.random.default_rng(1)
  s, L, B = 6, 3, 4
  out = StepOutputs(
      tokens=rng.integers(0, 1000, s, dtype=np.int32),
      top_logprobs=rng.standard_normal((s, L)).astype(np.float32),
      top_ids=rng.integers(0, 1000, (s, L), dtype=np.int32),
      ok=rng.random(s) < 0.5, fork_ok=rng.random(B) < 0.5,
      token_logprobs=-rng.random(s).astype(np.float32),
      fingerprint=rng.integers(0, 2**32 - 1, 5, dtype=np.uint32))
  packed = jax.jit(out_pack.pack)(out)
  assert len(packed.apart) == 2  # the top log-probs and ids, apart
  got = out_pack.fetch(packed, top=False)
  assert got.top_logprobs is None and got.top_ids is None
  _assert_same(got.replace(top_logprobs=out.top_logprobs, top_ids=out.top_ids), out)


def test_per_pool_packing_keeps_each_data_shard_s_row_and_fetches_per_pool():
  """`pack(per_pool=True)`: `buf` is `[data, n]` (on a mesh each shard's row
  stays on its devices: no gather), and `fetch(pools=)` gives each pool's
  record, equal to its row of the plain record."""
  rng = np.random.default_rng(1)
  recs = [_record(rng, 3) for _ in range(2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *recs)
  packed = jax.jit(lambda r: out_pack.pack(r, per_pool=True))(stacked)
  assert packed.buf.ndim == 2 and packed.buf.shape[0] == 2
  got = out_pack.fetch(packed, pools=2)
  for g, want in zip(got, recs):
    _assert_same(g, jax.device_get(want))
