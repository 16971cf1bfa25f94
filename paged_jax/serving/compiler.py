"""Ahead-of-time compilation of the engine's functions, in parallel, once per
process.

The engine runs a small static set of shapes (`buckets.py`), each a separate
XLA executable. `compile_all` traces and lowers each one (in order: tracing
is Python) and then compiles them on a thread pool (XLA releases the GIL
while it compiles, so `n` cores compile about `n` shapes at once). The
executables are kept in one process-wide table keyed by everything that fixes
them (the function, its static arguments and the shapes, dtypes and
shardings of its inputs), so engines of equal sizes share them, and an
executable is never compiled twice in a process. JAX's persistent
compilation cache (`jax_compilation_cache_dir`, on by default in
`examples/generate.py`) serves the compiles of a later process.

Why ahead of time rather than `jax.jit`'s own cache: compiling the warm-up
set concurrently needs no inputs (shapes only, nothing runs), and the count
of compiles is exact (`compiled_count`), which the tests assert.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Callable, Hashable

import jax

_TABLE: dict[Hashable, jax.stages.Compiled] = {}
_USES: dict[Hashable, int] = {}  # `compile_all` calls that asked for each key
_LOCK = threading.Lock()
_COUNT = 0


def compiled_count() -> int:
  """Executables this process has compiled through `compile_all`."""
  return _COUNT


def signature(*trees) -> tuple:
  """A hashable key for the shapes, dtypes and shardings of `trees`' leaves
  (and their tree structure)."""
  leaves, treedef = jax.tree.flatten(trees)
  return (treedef,) + tuple(
      (tuple(a.shape), str(a.dtype), getattr(a, "sharding", None)) for a in leaves)


def spec(a, sharding=None) -> jax.ShapeDtypeStruct:
  """The abstract value of array `a` (NumPy or JAX), with `sharding`."""
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def use_counts() -> dict[Hashable, int]:
  """`{key: how many compile_all calls asked for it}` (compiled or found)
  for every executable in the table."""
  with _LOCK:
    return {k: _USES.get(k, 0) for k in _TABLE}


def clear(keep: Callable[[Hashable], bool] | None = None) -> int:
  """Forgets the executables in the process-wide table (all, or those whose
  key `keep` does not accept), so that they can be freed (an engine that
  still holds its own keeps them alive); later engines compile again. For
  processes that build many engines of different sizes (tests, sweeps):
  each CPU executable of a serving step keeps hundreds of memory maps, and
  Linux's default limit per process is 65,530 (`vm.max_map_count`). Returns
  how many were dropped; `compiled_count` is not reset."""
  with _LOCK:
    drop = [k for k in _TABLE if keep is None or not keep(k)]
    for k in drop:
      del _TABLE[k]
      _USES.pop(k, None)
  return len(drop)


def compile_all(jobs: dict[Hashable, Callable[[], jax.stages.Lowered]],
                workers: int | None = None) -> tuple[dict, float]:
  """The executables of `jobs` (`{key: function returning the Lowered}`),
  compiling those the process does not have yet, concurrently.

  Args:
    jobs: what to compile, by key (see `signature`).
    workers: compile threads (default: the CPU count).

  Returns:
    `({key: Compiled}, seconds spent compiling here)`.
  """
  global _COUNT
  t0 = time.perf_counter()
  with _LOCK:
    for k in jobs:
      _USES[k] = _USES.get(k, 0) + 1
    todo = {k: fn for k, fn in jobs.items() if k not in _TABLE}
    if todo:
      lowered = {k: fn() for k, fn in todo.items()}  # tracing: one at a time
      n = min(len(lowered), workers or os.cpu_count() or 1)
      if n == 1:
        done = {k: lo.compile() for k, lo in lowered.items()}
      else:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
          futures = {k: pool.submit(lo.compile) for k, lo in lowered.items()}
          done = {k: f.result() for k, f in futures.items()}
      _TABLE.update(done)
      _COUNT += len(done)
    out = {k: _TABLE[k] for k in jobs}
  return out, (time.perf_counter() - t0) if todo else 0.0
