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

On CPU the steps of at most `CPU_XLA_DOTS_MAX_ROWS` token rows (decode
steps) compile without XLA's YNNPACK library fusions (`CPU_COMPILER_OPTIONS`:
`xla_cpu_experimental_ynn_fusion_type` empty), so their dots run on XLA's own
kernels: on the 2-core AMD EPYC (AVX2) YNNPACK's dots of a batch-32 decode
step (`[32, 512] @ [512, 2048]`, weights read once per step) ran at ~15-30
GFLOP/s, and the decode step of the random 30.7M Llama took 0.84x the time
without them, the 8 layers' matmuls alone 0.4-0.8x at 4-32 rows; at 64 rows
and more YNNPACK was faster, so wider steps keep it (`benchmarks/RESULTS.md`
7f). Mixed (prefill) steps keep XLA's defaults at every size: a batch-1
engine's 32-token prefill step took 0.84-0.87x the CPU time with them than
without (12 tokens: 0.93x; the devstep3 note). The runners pass rows for
their decode steps only, and only for a model whose LM head is not its tied
embedding table (`xla_dots_suit`). A setting of that flag in your own
`XLA_FLAGS` wins.
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
# XLA debug options of the CPU steps of at most `CPU_XLA_DOTS_MAX_ROWS` token
# rows (see the module doc); the benchmarks set it to {} to compare. Keys
# already in `XLA_FLAGS` are left to the flag.
CPU_COMPILER_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}
CPU_XLA_DOTS_MAX_ROWS = 32


def compiler_options(rows: int | None) -> dict[str, str] | None:
  """The options `compile_all` passes to XLA for a step of `rows` token rows
  (None: not a model step): `CPU_COMPILER_OPTIONS` on the CPU backend up to
  `CPU_XLA_DOTS_MAX_ROWS` rows, less those the user's `XLA_FLAGS` sets; None
  otherwise (XLA's defaults)."""
  if rows is None or rows > CPU_XLA_DOTS_MAX_ROWS or jax.default_backend() != "cpu":
    return None
  flags = os.environ.get("XLA_FLAGS", "")
  return {k: v for k, v in CPU_COMPILER_OPTIONS.items() if k not in flags} or None


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


def xla_dots_suit(model) -> bool:
  """Whether `model`'s decode steps may take `CPU_COMPILER_OPTIONS` (XLA's
  own dots): not when its LM head is its tied embedding table
  (`config.tie_word_embeddings`, e.g. SmolLM2, Gemma).

  That head contracts the `[vocab, hidden]` table on its minor dimension,
  which XLA's own dot kernel ran 12-14x slower than YNNPACK's at 2-5 rows
  and 1.2-1.4x at 8-32 rows (SmolLM2's `[rows, 576] x [49152, 576]^T`, the
  2-core AMD EPYC, loaded; as fast at 1 row). SmolLM2's decode step took 2.4x
  the time at batch 5 with XLA's dots and 1.07x at batch 16 (RESULTS 7m).
  """
  config = getattr(model, "config", None)
  return not getattr(config, "tie_word_embeddings", False)


def check_traced_once(seen: dict[Hashable, Hashable], jobs: dict) -> None:
  """`EngineConfig.check_traces`' rule: an engine traces each of its
  programs at most once.

  A runner's job keys are `(its part, *the program)`: its part
  (`Runner._key`: the model, the mesh and the held arrays' shapes, dtypes
  and shardings) fixes its executables, the rest names one of them (a
  bucket; `"multistep", K, bucket`; `"spec", bucket, k, budget`; ...).
  `seen`, the engine's own `{program: its part}`, keeps the first part each
  program was asked under; a job for a program already seen under another
  part would trace that program a second time (an engine whose key drifts,
  e.g. taking the shardings a step returned its arrays with). The programs
  themselves stay shared in the process table, so a trace-checked engine
  whose programs another engine compiled traces none of them, and the check
  costs no compile. Updates `seen`.

  Raises:
    AssertionError: a program of `jobs` was seen under another part (says
      which items of the part differ).
  """
  for key in jobs:
    part, program = key[0], key[1:]
    first = seen.setdefault(program, part)
    if first != part:
      differ = [i for i, (a, b) in enumerate(zip(first, part)) if a != b]
      raise AssertionError(
          f"program {program} would be traced a second time: the engine asked "
          f"for it under another key (items {differ} of its part differ)")


def compile_all(jobs: dict[Hashable, Callable[[], jax.stages.Lowered]],
                workers: int | None = None, *,
                rows: dict[Hashable, int] | None = None) -> tuple[dict, float]:
  """The executables of `jobs` (`{key: function returning the Lowered}`),
  compiling those the process does not have yet, concurrently.

  Args:
    jobs: what to compile, by key (see `signature`).
    workers: compile threads (default: the CPU count).
    rows: the token rows of the model steps among `jobs`, by key (they pick
      the compile options: `compiler_options`); other jobs compile with
      XLA's defaults.

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
      rows = rows or {}
      options = {k: compiler_options(rows.get(k)) for k in lowered}
      if n == 1:
        done = {k: lo.compile(options[k]) for k, lo in lowered.items()}
      else:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
          futures = {k: pool.submit(lo.compile, options[k]) for k, lo in lowered.items()}
          done = {k: f.result() for k, f in futures.items()}
      _TABLE.update(done)
      _COUNT += len(done)
    out = {k: _TABLE[k] for k in jobs}
  return out, (time.perf_counter() - t0) if todo else 0.0
