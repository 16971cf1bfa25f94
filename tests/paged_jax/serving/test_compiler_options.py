"""The CPU compile options of the engine's steps (`compiler.compiler_options`):
decode-sized steps' dots on XLA's own kernels, not YNNPACK's library fusions;
wider steps and other programs keep XLA's defaults (RESULTS 7f)."""

import jax
import jax.numpy as jnp
import pytest

from paged_jax.serving import compiler

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU compile options")
YNN = "__ynn_fusion"


def _compiled_text(name, rows):
  f = jax.jit(lambda x, w: jax.nn.silu(x @ w).sum(-1))
  key = ("test_compiler_options", name, rows)
  lowered = lambda: f.lower(jnp.ones((32, 64)), jnp.ones((64, 128)))  # noqa: E731
  out, _ = compiler.compile_all({key: lowered}, workers=1,
                                rows=None if rows is None else {key: rows})
  return out[key].as_text()


@cpu_only
def test_decode_sized_steps_compile_without_ynn_fusions(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  limit = compiler.CPU_XLA_DOTS_MAX_ROWS
  assert compiler.compiler_options(limit) == {"xla_cpu_experimental_ynn_fusion_type": ""}
  assert compiler.compiler_options(limit + 1) is None
  assert compiler.compiler_options(None) is None
  assert YNN not in _compiled_text("decode", limit)
  # Wider steps and jobs without rows keep XLA's choice, YNNPACK for this
  # dot: the check above can fail.
  assert YNN in _compiled_text("wide", limit + 1)
  assert YNN in _compiled_text("other", None)


@cpu_only
def test_the_users_xla_flags_win(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
  assert compiler.compiler_options(1) is None


@cpu_only
def test_engine_gives_the_option_to_decode_steps_only(monkeypatch):
  # A mixed (prefill) step of as few rows as a decode step keeps XLA's
  # defaults: a batch-1 engine's 32-token prefill ran faster with them.
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.buckets import Bucket  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XLA_FLAGS", "")
  compiler.clear()  # the table's keys do not hold the options
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(hidden_size=128))
  engine = Engine(model, EngineConfig(num_blocks=16, block_size=8, max_batch=4,
                                      max_tokens_per_step=8, max_model_len=64,
                                      min_bucket=8, bucket_midpoints=False))
  decode, mixed = Bucket(4, 4, True), Bucket(8, 4, False)
  assert set(engine.buckets) == {decode, mixed}
  engine.warmup()
  steps = engine._runner._steps  # pylint: disable=protected-access
  assert YNN not in steps[decode].as_text()
  assert YNN in steps[mixed].as_text()
  compiler.clear()


@cpu_only
def test_a_tied_lm_head_keeps_xla_defaults_in_decode_steps(monkeypatch):
  # The tied head contracts the [vocab, hidden] table on its minor dimension,
  # which XLA's own dot ran 12x slower than YNNPACK's at a few rows (SmolLM2):
  # such a model's decode steps keep XLA's defaults.
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.buckets import Bucket  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XLA_FLAGS", "")
  compiler.clear()
  texts = {}
  for tied in (False, True):
    config = model_lib.LlamaConfig.tiny(hidden_size=128, tie_word_embeddings=tied)
    model = model_lib.init_model(config)
    assert compiler.xla_dots_suit(model) is not tied
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=8, max_batch=4,
                                        max_tokens_per_step=8, max_model_len=64,
                                        min_bucket=8, bucket_midpoints=False))
    engine.warmup()
    texts[tied] = engine._runner._steps[Bucket(4, 4, True)].as_text()  # pylint: disable=protected-access
  assert YNN not in texts[False]
  assert YNN in texts[True]
  compiler.clear()
