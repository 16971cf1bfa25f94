import os

import pytest

# Tests run on CPU; kernels run in Pallas interpret mode. Eight simulated
# devices let the sharding tests build every mesh that divides 8; the other
# tests use the first device only.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No test fetches the real model (paged_jax.models.loader): the tests that
# need it find it installed or in the cache, or skip saying why.
os.environ.setdefault("PAGED_JAX_NO_FETCH", "1")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

# Most of the suite's time is XLA CPU compiling small programs that then run
# a few times on tiny arrays. The legacy CPU emitters at LLVM -O0 compile a
# serving step of the tiny model in about 40% of the default's CPU time
# (2026-12-01, JAX 0.10.2: 2 step shapes 11-16 s -> 4.4-5 s) and run the
# tests no slower; the results are the same programs' (tests compare with
# tolerances, never against one backend's bits). How to ask for the legacy
# emitters depends on the jaxlib:
# - before 0.11, the flag `--xla_cpu_use_fusion_emitters=false`;
# - 0.11 has no such flag (it aborts on an unknown flag) but keeps the legacy
#   path behind a backend option, `xla_cpu_disable_new_fusion_emitters`: the
#   three step shapes of `tests/examples` compile in 4.9 s of CPU instead of
#   13.6 s (2026-12-04, 0.11.2, loaded 2-core AMD EPYC, process CPU time;
#   0.10.2 with its flag: 4.75 s). Without it each of the ~290 fusions of a
#   step runs the MLIR emitters' fixed pass pipeline (perf: 26% of the
#   probe's samples in `FusionCompiler::Compile`), ~10 ms of CPU more each:
#   most of why the 0.11.2 leg cost ~1.45x the 0.10.2 leg (BUILD.md).
# - 0.12 removed the legacy path (the option is gone from its binary and
#   changes nothing: 11.4 s either way), and none of 0.12's CPU flags we
#   tried shortens the MLIR pipeline (BUILD.md lists them).
# Every jaxlib gets -O0; an explicit setting of a flag in XLA_FLAGS wins.
def _jaxlib_version() -> tuple[int, ...]:
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])


def _legacy_emitter_flags(version: tuple[int, ...]) -> tuple[str, ...]:
  if version < (0, 11):
    return ("--xla_cpu_use_fusion_emitters=false",)
  if version < (0, 12):
    return ("--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters",)
  return ()


# On 0.12 Eigen's intra-op threads only contend with the other xdist worker
# for the 2 cores: without them a compile-heavy test took 2.6% less CPU
# (2026-12-06, loaded 2-core AMD EPYC, test_draft_engine's preemption test,
# `-n 0`, interleaved A/B/A/B: user+sys 43.4 / 42.2 s and 43.8 / 42.7 s).
def _thread_flags(version: tuple[int, ...]) -> tuple[str, ...]:
  return ("--xla_cpu_multi_thread_eigen=false",) if version >= (0, 12) else ()


TEST_XLA_FLAGS = (("--xla_backend_optimization_level=0",)
                  + _legacy_emitter_flags(_jaxlib_version())
                  + _thread_flags(_jaxlib_version()))
for _flag in TEST_XLA_FLAGS:
  if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _flag

_CACHE_ENV = "PAGED_JAX_TEST_COMPILE_CACHE"


def pytest_configure(config):
  """One persistent XLA compilation cache per test session, shared by the
  xdist workers (they inherit the directory through the environment): a
  step shape that one worker compiled, the other loads from disk instead of
  compiling it again. Fresh for every session (removed at its end), so a
  run never reuses a previous run's executables."""
  import tempfile  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  if _CACHE_ENV not in os.environ:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="paged-jax-test-xla-cache-")
    config._paged_jax_cache_owner = True  # pylint: disable=protected-access
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def pytest_unconfigure(config):
  if getattr(config, "_paged_jax_cache_owner", False):
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


# Which xdist worker runs what. Each distinct engine configuration compiles
# its step programs once per process (`paged_jax.serving.compiler`); a second
# worker pays the tracing and lowering again (about half of a step's compile
# on CPU: the persistent cache above saves only XLA's part). So the engine
# test modules whose engines share sizes (tests/examples/conftest.py's
# `SIZES`, `BIG_POOL`, `SMALL_POOL`, and test_generate's 32-block CLI pool)
# are one unit of work, run on one worker one after another, and every other
# test module is a unit of its own (its configurations and module fixtures
# compile on one worker; before 2026-12-07 each test outside tests/examples
# was its own unit, and e.g. test_slot_state's seeds or test_logprobs_and_bias's
# module engine compiled on both workers: tests/paged_jax/serving +
# entrypoints on JAX 0.12, -n 2, run side by side on a loaded machine,
# 350 -> 329 s of CPU, BUILD.md). (pytest-xdist's `--dist loadgroup` would do it with marks,
# but 3.8 renames the node ids to group them, which pytest 9 ignores.) On
# 2026-12-04 (loaded 2-core AMD EPYC, JAX 0.10.2) the default scheduling
# compiled 43 of tests/examples' step programs on both workers; BUILD.md's
# suite section has the times.
SHARED_ENGINE_SIZES = frozenset({
    f"tests/examples/{m}.py" for m in (
        "test_async", "test_engine", "test_engine_model", "test_engine_text_support",
        "test_generate", "test_generate_text", "test_multihost", "test_multistep",
        "test_prefix_engine", "test_prefix_offload_engine", "test_resize_engine",
        "test_serving_api", "test_spec_engine", "test_spec_loop_engine", "test_swap_engine")} | {
    # `SIZES` at `BIG_POOL` blocks, with and without a logit bias of 2
    # (test_spec_engine's fall-back test); after tests/examples in the unit.
    "tests/paged_jax/serving/test_logprobs_and_bias.py"})


def work_unit(nodeid: str) -> str:
  """The unit of work (run whole by one worker) that test `nodeid` is in."""
  module = nodeid.split("::", 1)[0]
  return "shared-sizes" if module in SHARED_ENGINE_SIZES else module


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
  """xdist's default (`--dist load`) becomes `work_unit`'s scheduling (its
  largest units first); any other `--dist` is xdist's own."""
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=import-outside-toplevel

  class WorkUnits(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return work_unit(nodeid)

  return WorkUnits(config, log)


# Compiled executables keep memory maps: a small program about six, an
# engine's serving step hundreds (the CPU backend maps each piece of generated
# code separately). `paged_jax.serving.compiler` keeps every engine step a
# process compiled, and jit caches keep the rest, so a test worker compiling
# thousands of programs reached Linux's default limit of 65,530 maps per
# process (`vm.max_map_count`) on JAX 0.11.2, and XLA segfaulted when mmap
# failed (`backend_compile_and_load`, `put_executable_and_time`; each failing
# test passed alone). So after a module, a worker whose map count passed
# 20,000 drops both tables (the next module recompiles what it needs, or
# loads it from the persistent cache above).
_MAPS_HIGH_WATER = 20_000


def _map_count() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
  yield
  if _map_count() > _MAPS_HIGH_WATER:
    import gc  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    from paged_jax.serving import compiler  # pylint: disable=import-outside-toplevel
    compiler.clear()
    jax.clear_caches()
    gc.collect()
