"""`serving.compiler`'s table: use counts, and a clear that keeps some keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.serving import compiler


def _jobs(*names):
  spec = jax.ShapeDtypeStruct((3,), jnp.float32)
  fns = {"add": lambda x: x + 1, "mul": lambda x: x * 2}
  return {("test_compiler", n): (lambda n=n: jax.jit(fns[n]).lower(spec)) for n in names}


def test_use_counts_and_a_clear_that_keeps_what_is_asked():
  compiler.clear(keep=lambda k: k[0] != "test_compiler")
  count = compiler.compiled_count()
  done, _ = compiler.compile_all(_jobs("add", "mul"))
  compiler.compile_all(_jobs("add"))  # found: not compiled again
  assert compiler.compiled_count() == count + 2
  uses = compiler.use_counts()
  assert uses[("test_compiler", "add")] == 2 and uses[("test_compiler", "mul")] == 1
  assert float(done[("test_compiler", "add")](jnp.ones(3))[0]) == 2.0
  assert compiler.clear(keep=lambda k: k != ("test_compiler", "mul")) == 1
  assert ("test_compiler", "mul") not in compiler.use_counts()
  assert compiler.use_counts()[("test_compiler", "add")] == 2
  compiler.compile_all(_jobs("add", "mul"))  # only the dropped one compiles
  assert compiler.compiled_count() == count + 3
  assert compiler.use_counts()[("test_compiler", "mul")] == 1
  compiler.clear(keep=lambda k: k[0] != "test_compiler")
  assert not [k for k in compiler.use_counts() if k[0] == "test_compiler"]
