"""`paged_jax.models`: from_hf, load_hf, tiny, the registry (no transformers)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax.models as models
from paged_jax.models import safetensors_io
from paged_jax.models.llama import checkpoint
from paged_jax.serving.protocol import ServingModel

dense_logits = nnx.jit(lambda m, t: m.dense_logits(t))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)

# One small config per family (as a Hugging Face config.json dict).
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128)
FAMILIES = {
    "LlamaForCausalLM": dict(tie_word_embeddings=True),
    "Qwen2ForCausalLM": dict(),
    "Qwen3ForCausalLM": dict(head_dim=32),
    "MistralForCausalLM": dict(sliding_window=5),
    "Gemma2ForCausalLM": dict(sliding_window=5, query_pre_attn_scalar=16),
    "Gemma3ForCausalLM": dict(sliding_window=5, sliding_window_pattern=2,
                              rope_local_base_freq=100.0),
}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def hf_config(arch: str, **kw) -> dict:
  return {**BASE, "architectures": [arch], **FAMILIES[arch], **kw}


def random_tensors(cfg: dict, seed=0) -> dict[str, np.ndarray]:
  """Random Hugging Face-named tensors for `cfg` (from our own model's names)."""
  model = models.tiny(seed, **{
      k: v for k, v in vars(models.config_from_hf(cfg)).items()})
  return checkpoint.to_tensors(model)


def test_architectures_are_the_registered_families():
  assert models.ARCHITECTURES == tuple(FAMILIES)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_from_hf_round_trip_per_family(arch):
  cfg = hf_config(arch)
  tensors = random_tensors(cfg)
  names = set(tensors)
  assert ("model.layers.1.self_attn.q_proj.bias" in names) == (arch == "Qwen2ForCausalLM")
  assert ("model.layers.0.self_attn.o_proj.bias" in names) is False
  assert ("model.layers.1.self_attn.q_norm.weight" in names) == (
      arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"))
  assert ("model.layers.1.pre_feedforward_layernorm.weight" in names) == (arch in GEMMA)
  assert ("lm_head.weight" in names) == (arch not in ("LlamaForCausalLM",) + GEMMA)
  model = models.from_hf(cfg, tensors)
  assert isinstance(model, ServingModel)
  assert model.config.architecture == arch
  assert model.config.sliding_window == (
      5 if arch in ("MistralForCausalLM",) + GEMMA else None)
  if arch in GEMMA:  # every other layer local, from the default or the pattern
    assert model.config.layer_types == ("sliding_attention", "full_attention")
  for name, t in checkpoint.to_tensors(model).items():
    np.testing.assert_array_equal(t, tensors[name], err_msg=name)
  half = models.from_hf(cfg, tensors, dtype="bfloat16")
  assert half.layers.mlp.up_proj.kernel[...].dtype == jnp.bfloat16
  assert half.layers.mlp.up_proj.kernel[...].shape == (2, 64, 96)  # stacked


def test_load_hf_sharded_index_and_half_precision(tmp_path):
  cfg = hf_config("Qwen3ForCausalLM", torch_dtype="bfloat16")
  tensors = random_tensors(cfg, seed=3)
  bf16 = {k: v.astype(jnp.bfloat16) for k, v in tensors.items()}
  names = sorted(bf16)
  shards = {"model-00001-of-00002.safetensors": names[:7],
            "model-00002-of-00002.safetensors": names[7:]}
  for f, keys in shards.items():
    safetensors_io.save({k: bf16[k] for k in keys}, tmp_path / f)
  (tmp_path / checkpoint.INDEX_FILE).write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  model = models.load_hf(tmp_path)
  assert model.config.dtype == "bfloat16"
  want = models.from_hf(cfg, bf16)
  np.testing.assert_array_equal(dense_logits(model, TOKENS), dense_logits(want, TOKENS))
  as_f16 = models.load_hf(tmp_path, dtype="float16")
  assert as_f16.embed_tokens.embedding[...].dtype == jnp.float16


def test_load_hf_reads_files_written_by_the_safetensors_package(tmp_path):
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  cfg = hf_config("LlamaForCausalLM")
  tensors = random_tensors(cfg, seed=4)
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  np.testing.assert_array_equal(dense_logits(models.load_hf(tmp_path), TOKENS),
                                dense_logits(models.from_hf(cfg, tensors), TOKENS))


def test_tiny_is_seeded():
  a, b = models.tiny(1, num_layers=3), models.tiny(1, num_layers=3)
  assert a.config.num_layers == 3
  np.testing.assert_array_equal(dense_logits(a, TOKENS), dense_logits(b, TOKENS))
  assert not np.array_equal(dense_logits(models.tiny(2, num_layers=3), TOKENS),
                            dense_logits(a, TOKENS))


@pytest.mark.parametrize("arch", GEMMA)
def test_gemma_checkpoint_round_trip(tmp_path, arch):
  # config_to_hf writes the layer pattern, caps, scalar and local RoPE back.
  cfg = hf_config(arch, num_hidden_layers=3, attn_logit_softcapping=7.0)
  model = models.from_hf(cfg, random_tensors(cfg, seed=2))
  checkpoint.save_checkpoint(model, tmp_path)
  again = models.load_hf(tmp_path)
  assert again.config == model.config
  assert again.config.layer_types == (
      "sliding_attention", "full_attention", "sliding_attention")
  np.testing.assert_array_equal(np.asarray(dense_logits(again, TOKENS)),
                                np.asarray(dense_logits(model, TOKENS)))
