"""The CPU compile options of the engine's steps (`compiler.CPU_COMPILER_OPTIONS`):
dots on XLA's own kernels, not YNNPACK's library fusions (RESULTS 7f)."""

import jax
import jax.numpy as jnp
import pytest

from paged_jax.serving import compiler

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU compile options")


def _compiled_text(key, monkeypatch, options):
  monkeypatch.setattr(compiler, "CPU_COMPILER_OPTIONS", options)
  f = jax.jit(lambda x, w: jax.nn.silu(x @ w).sum(-1))
  lowered = lambda: f.lower(jnp.ones((32, 64)), jnp.ones((64, 128)))  # noqa: E731
  out, _ = compiler.compile_all({key: lowered}, workers=1)
  return out[key].as_text()


@cpu_only
def test_cpu_steps_compile_without_ynn_fusions(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  assert compiler.compiler_options() == {"xla_cpu_experimental_ynn_fusion_type": ""}
  text = _compiled_text(("test_compiler_options", "default"), monkeypatch,
                        dict(compiler.CPU_COMPILER_OPTIONS))
  assert "__ynn_fusion" not in text
  # Without the option XLA picks YNNPACK for the dot: the check above can fail.
  text = _compiled_text(("test_compiler_options", "none"), monkeypatch, {})
  assert "__ynn_fusion" in text


@cpu_only
def test_the_users_xla_flags_win(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
  assert compiler.compiler_options() is None
