"""int32 rules shared by the block manager and the KV cache (private module).

Block ids, sequence ids, token positions, lengths and flat cache slots
(`block * block_size + offset`) are int32 on device. Two rules keep every
computation on them exact:

* Sizes are checked once, when a pool or cache is built: every product that
  indexes one of those int32 quantities must stay below 2**31
  (`check_fits`), so no later sum or product of in-range values can wrap.
* Caller arrays are converted to int32 without wrapping (`as_int32`): a value
  outside int32 becomes `OUT_OF_RANGE` (-1), which every operation already
  treats as invalid (a negative id, count, position or slot), so it comes back
  as `ok == False` or is dropped, never truncated into a valid value.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
# What a caller value outside int32 becomes: invalid for every operation.
OUT_OF_RANGE = -1


def positive_int(name: str, value) -> int:
  """`value` as a Python int, after checking it is a positive integer.

  Raises:
    ValueError: if `value` is not an int (bools are not) or is <= 0.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int, got {name}={value}")
  return int(value)


def check_fits(what: str, **sizes: int) -> None:
  """Checks that the product of `sizes` is below 2**31 (Python ints, exact).

  Args:
    what: the int32 quantity the product bounds, for the message.
    **sizes: the factors, by name.

  Raises:
    ValueError: naming the factors, their product and `what`.
  """
  product = math.prod(sizes.values())
  if product <= INT32_MAX:
    return
  given = ", ".join(f"{k}={v}" for k, v in sizes.items())
  if len(sizes) == 1:
    raise ValueError(f"{given} must be < 2**31 (int32 {what})")
  raise ValueError(f"{' * '.join(sizes)} = {product} must be < 2**31 "
                   f"(int32 {what}), got {given}")


def as_int32(name: str, x, ndim: int = 1) -> jax.Array:
  """An `ndim`-D integer array as int32; values outside int32 become -1.

  Host values (lists, NumPy arrays) are checked exactly in NumPy; JAX arrays
  (traced or not) in their own dtype, so an int64 array under
  `jax_enable_x64` is checked inside `jit` too. Without x64, JAX arrays are
  already int32 and nothing is added to the computation. (Under `jax.jit`
  without x64, JAX itself converts int64 host arguments to int32 before this
  function sees them: pass int32 to jitted code.)

  Raises:
    ValueError: if `x` is not `ndim`-D or not of an integer dtype (a Python
      list with ints past 64 bits has dtype object).
  """
  if not isinstance(x, jax.Array):
    try:
      x = np.asarray(x)
    except (OverflowError, ValueError) as e:
      raise ValueError(f"{name} must be a {ndim}-D integer array: {e}") from None
  if x.ndim != ndim:
    raise ValueError(f"{name} must be a {ndim}-D integer array, got shape "
                     f"{x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")
  info = jnp.iinfo(x.dtype)
  if info.min < INT32_MIN or info.max > INT32_MAX:
    xp = np if isinstance(x, np.ndarray) else jnp
    fits = x <= INT32_MAX
    if info.min < 0:
      fits &= x >= INT32_MIN
    x = xp.where(fits, xp.where(fits, x, 0).astype(np.int32), OUT_OF_RANGE)
  return jnp.asarray(x, jnp.int32)
