"""`--disable-sliding-window` (vLLM's flag; `LlamaConfig.disable_sliding_window`,
`Llama.without_sliding_window`): full attention in every layer, nothing
reclaimed, `max_model_len` capped at the window (the default lowered, a
longer explicit value refused). Within the window the outputs are the
windowed model's, exactly: attention over at most `w` tokens is the same."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.entrypoints import engine_args, generate
from paged_jax.entrypoints.openai import api_server
from paged_jax.models import loader
from paged_jax.models.llama import checkpoint
from paged_jax.models.llama import model as model_lib
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams

WINDOW = 16
# Local and global layers, the local ones with their own RoPE (Gemma 3's
# `rope_local_base_freq`): dropping the window must keep the local layers'
# RoPE (vLLM's Gemma 3 does), or the tokens change.
TYPES = ("sliding_attention", "full_attention")
SIZES = dict(block_size=4, max_batch=4, max_tokens_per_step=16, min_bucket=16,
             bucket_midpoints=False)


@pytest.fixture(scope="module")
def gemma():
  return model_lib.init_model(model_lib.LlamaConfig.tiny(
      num_layers=2, sliding_window=WINDOW, layer_types=TYPES,
      rope_local_theta=10000.0), seed=4)


def test_dense_logits_equal_within_the_window_and_differ_past_it(gemma):
  full = gemma.without_sliding_window()
  assert full.config.disabled_sliding_window == WINDOW
  assert {s.sliding_window for s in full.config.layer_specs} == {None}
  assert ([s.rope for s in full.config.layer_specs]
          == [s.rope for s in gemma.config.layer_specs])  # RoPE kept
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 512, (2, WINDOW + 8)))
  a, b = gemma.dense_logits(tokens), full.dense_logits(tokens)
  np.testing.assert_array_equal(np.asarray(a[:, :WINDOW]), np.asarray(b[:, :WINDOW]))
  assert float(jnp.abs(a[:, WINDOW:] - b[:, WINDOW:]).max()) > 1e-2


def test_greedy_engine_outputs_equal_the_windowed_models(gemma):
  rng = np.random.default_rng(1)
  reqs = []
  for i in range(6):
    n = int(rng.integers(4, WINDOW - 2))
    reqs.append(Request(i, rng.integers(3, 512, n).tolist(),
                        SamplingParams(max_new_tokens=WINDOW - n, ignore_eos=True)))
  # Reclamation off: the windowed model's tokens with the plain step
  # (test_window_engine shows reclamation does not change them).
  windowed = Engine(gemma, EngineConfig(num_blocks=64, max_model_len=WINDOW,
                                         sliding_window_reclamation=False, **SIZES))
  full = Engine(gemma.without_sliding_window(), EngineConfig(num_blocks=64, **SIZES))
  assert full.max_model_len == WINDOW  # the default, capped
  assert not full.reclamation.on
  assert "disable_sliding_window" in full.reclamation.reason

  def tokens(engine):
    for r in reqs:
      assert engine.add_request(r) is None
    return {o.request_id: o.completions[0].token_ids for o in engine.run_until_done()}
  want = tokens(windowed)
  assert tokens(full) == want
  assert all(len(reqs[i].prompt) + len(t) == WINDOW for i, t in want.items())
  longer = full.add_request(Request("long", [5] * WINDOW, SamplingParams(max_new_tokens=1)))
  assert longer is not None and f"max_model_len={WINDOW}" in longer.rejected


def test_an_explicit_longer_max_model_len_is_refused(gemma):
  full = gemma.without_sliding_window()
  with pytest.raises(ValueError, match=(
      rf"max_model_len=17 is longer than the model's sliding window of {WINDOW} "
      rf"tokens: with disable_sliding_window .* give max_model_len <= {WINDOW}")):
    Engine(full, EngineConfig(num_blocks=64, max_model_len=WINDOW + 1, **SIZES))
  with pytest.raises(ValueError, match="sliding_window_reclamation=True: the model "
                     r"runs without its sliding window \(disable_sliding_window\)"):
    Engine(full, EngineConfig(num_blocks=64, sliding_window_reclamation=True, **SIZES))


def test_a_model_without_a_window_is_unchanged():
  loaded = loader.load("tiny", disable_sliding_window=True)
  assert loaded.model.config.disabled_sliding_window is None
  assert loaded.model.without_sliding_window() is loaded.model
  with pytest.raises(ValueError, match="disable_sliding_window must be True or "
                     "False, got 1"):
    model_lib.LlamaConfig.tiny(disable_sliding_window=1)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("mistral")
  checkpoint.save_checkpoint(model_lib.init_model(model_lib.LlamaConfig.tiny(
      architecture="MistralForCausalLM", sliding_window=WINDOW), seed=2), path)
  return str(path)


CLI = ["--block-size", "4", "--num-blocks", "32", "--max-batch", "4",
       "--max-tokens-per-step", "16", "--no-compile-cache", "--min-bucket", "16",
       "--disable-sliding-window"]


@pytest.mark.parametrize("main", [generate.main, api_server.main])
def test_cli_refuses_a_longer_max_model_len_in_one_line(mistral_dir, main, capsys):
  rc = main(["--model", mistral_dir, *CLI, "--max-model-len", "40"])
  err = capsys.readouterr().err
  assert rc == 2
  assert err.startswith(f"error: --max-model-len 40 is longer than the model's sliding "
                        f"window of {WINDOW} tokens: with --disable-sliding-window")
  assert err.endswith(f"give --max-model-len <= {WINDOW}, or keep the window "
                      "(without --disable-sliding-window)\n")
  assert err.count("\n") == 1


@pytest.mark.parametrize("given, want", [(None, WINDOW), ("12", 12)])
def test_cli_caps_the_default_max_model_len(mistral_dir, given, want):
  """The default (256) lowered to the window, an explicit shorter value
  kept (the engine then runs with it: the engine test above)."""
  argv = ["--model", mistral_dir, *CLI] + (["--max-model-len", given] if given else [])
  args = generate.parse_args(argv)
  loaded = engine_args.load_model(args)
  assert args.max_model_len == want
  assert loaded.model.config.disabled_sliding_window == WINDOW
