"""RoPE: Llama 3 frequency scaling and the rotation itself."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import rope


def llama3_frequencies_float64(head_dim, theta, s: rope.Llama3Scaling):
  """The Llama 3.1 reference formula, written out in float64."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  out = []
  for f in inv:
    wavelen = 2 * math.pi / f
    if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
      out.append(f)
    elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
      out.append(f / s.factor)
    else:
      smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                / (s.high_freq_factor - s.low_freq_factor))
      out.append((1 - smooth) * f / s.factor + smooth * f)
  return np.array(out)


@pytest.mark.parametrize("head_dim,original", [(16, 64), (64, 8192), (128, 8192)])
def test_llama3_scaling_matches_formula(head_dim, original):
  s = rope.Llama3Scaling(original_max_position_embeddings=original)
  got = rope.inverse_frequencies(rope.RopeConfig(head_dim, 500000.0, s))
  want = llama3_frequencies_float64(head_dim, 500000.0, s)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  plain = rope.inverse_frequencies(rope.RopeConfig(head_dim, 500000.0))
  assert got[0] == plain[0]  # highest frequency untouched
  np.testing.assert_allclose(got[-1], plain[-1] / 8, rtol=1e-6)  # lowest divided


def test_linear_scaling_divides_every_frequency():
  plain = rope.inverse_frequencies(rope.RopeConfig(32))
  lin = rope.inverse_frequencies(rope.RopeConfig(32, scaling=rope.LinearScaling(4.0)))
  np.testing.assert_allclose(lin, plain / 4, rtol=1e-7)


def test_rotation_keeps_norms_and_depends_on_relative_position():
  cfg = rope.RopeConfig(32, 10000.0, rope.Llama3Scaling(original_max_position_embeddings=64))
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 2, 32)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 2, 32)), jnp.float32)
  rq = rope.apply_rope(q, jnp.array([7]), cfg)
  np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1),
                             rtol=1e-5)
  dots = [float(jnp.sum(rope.apply_rope(q, jnp.array([p + d]), cfg)
                        * rope.apply_rope(k, jnp.array([p]), cfg)))
          for p in (0, 5, 40) for d in (3,)]
  np.testing.assert_allclose(dots, dots[0], rtol=1e-4)
  np.testing.assert_array_equal(rope.apply_rope(q, jnp.array([0]), cfg), q)


def test_rope_errors():
  with pytest.raises(ValueError, match="positive even head_dim"):
    rope.RopeConfig(15)
  with pytest.raises(ValueError, match="theta must be positive"):
    rope.RopeConfig(16, theta=0.0)
  with pytest.raises(ValueError, match="does not match RoPE"):
    rope.apply_rope(jnp.zeros((1, 1, 8)), jnp.zeros(1, jnp.int32), rope.RopeConfig(16))
