"""Llama config and Hugging Face checkpoint loading (no transformers needed)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from paged_jax.models.llama import checkpoint
from paged_jax.models.llama import model as model_lib
from paged_jax import rope

dense_logits = nnx.jit(lambda m, t: m.dense_logits(t))
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)


def small(**kw):
  return model_lib.LlamaConfig.tiny(**{"vocab_size": 256, "num_layers": 1, **kw})


@pytest.mark.parametrize("tie", [False, True])
def test_save_and_load_round_trip(tmp_path, tie):
  model = model_lib.init_model(small(tie_word_embeddings=tie), seed=1)
  checkpoint.save_checkpoint(model, tmp_path)
  loaded = checkpoint.load_checkpoint(tmp_path)
  assert loaded.config == model.config
  np.testing.assert_array_equal(dense_logits(loaded, TOKENS), dense_logits(model, TOKENS))
  as_bf16 = checkpoint.load_checkpoint(tmp_path, dtype="bfloat16")
  assert as_bf16.embed_tokens.embedding[...].dtype == jnp.bfloat16
  checkpoint.save_checkpoint(as_bf16, tmp_path / "bf16")  # bfloat16 on disk
  again = checkpoint.load_checkpoint(tmp_path / "bf16")
  assert again.config.dtype == "bfloat16"
  np.testing.assert_array_equal(dense_logits(again, TOKENS), dense_logits(as_bf16, TOKENS))


def test_config_from_hf_rope_forms():
  base = dict(vocab_size=32, hidden_size=64, intermediate_size=96,
              num_hidden_layers=1, num_attention_heads=4)
  llama3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
  new = checkpoint.config_from_hf(
      {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
  old = checkpoint.config_from_hf(
      {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}})
  assert new.rope_scaling == old.rope_scaling == rope.Llama3Scaling(factor=32.0)
  assert new.rope_theta == old.rope_theta == 5e5
  assert new.head_dim == 16 and new.num_kv_heads == 4 and new.dtype == "float32"
  lin = checkpoint.config_from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 2}})
  assert lin.rope_scaling == rope.LinearScaling(2.0)
  assert checkpoint.config_from_hf({**base, "eos_token_id": [1, 2]}).eos_token_ids == (1, 2)


BASE = dict(vocab_size=32, hidden_size=64, intermediate_size=96,
            num_hidden_layers=1, num_attention_heads=4)


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
    (dict(architectures=["GPT2LMHeadModel"]),
     "architecture 'GPT2LMHeadModel' is not supported \\(supported: LlamaForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Gemma2ForCausalLM, "
     "Gemma3ForCausalLM\\)"),
    (dict(hidden_size=None), "missing required field 'hidden_size'"),
    (dict(num_hidden_layers="2"), "'num_hidden_layers' must be int"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "unsupported rope scaling type 'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 rope scaling lacks"),
    (dict(rope_scaling="big"), "rope scaling must be an object"),
    (dict(torch_dtype="int8"), "unsupported dtype 'int8'"),
    (dict(eos_token_id="x"), "eos_token_id must be int or list of int"),
    (dict(eos_token_id=99), "eos token id 99 is outside the vocabulary"),
    (dict(num_key_value_heads=3), "must be a multiple of num_kv_heads=3"),
    (dict(hidden_size=66), "not divisible by num_attention_heads=4"),
])
def test_config_errors(change, match):
  d = {k: v for k, v in {**BASE, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    checkpoint.config_from_hf(d)


def test_config_must_be_an_object():
  with pytest.raises(ValueError, match="must hold a JSON object"):
    checkpoint.config_from_hf([1, 2])


@pytest.mark.parametrize("kw,match", [
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(dtype="int8"), "dtype must be one of"),
])
def test_llama_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    small(**kw)


@pytest.fixture
def ckpt(tmp_path):
  checkpoint.save_checkpoint(model_lib.init_model(small(), seed=2), tmp_path)
  return tmp_path


def _rewrite(ckpt, fn):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  tensors = fn(load_file(str(ckpt / "model.safetensors")))
  save_file(tensors, str(ckpt / "model.safetensors"))


def test_checkpoint_file_errors(tmp_path, ckpt):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.load_checkpoint(tmp_path / "nope")
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="config.json' not found"):
    checkpoint.load_checkpoint(empty)
  (empty / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    checkpoint.load_checkpoint(empty)
  (empty / "config.json").write_text((ckpt / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
    checkpoint.load_checkpoint(empty)
  (empty / "model.safetensors").write_bytes(b"garbage")
  with pytest.raises(ValueError, match=r"not a safetensors file \(7 bytes, shorter"):
    checkpoint.load_checkpoint(empty)


def test_checkpoint_tensor_errors(ckpt):
  _rewrite(ckpt, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
  with pytest.raises(ValueError, match="lacks tensor 'model.norm.weight'"):
    checkpoint.load_checkpoint(ckpt)
  _rewrite(ckpt, lambda t: {**t, "model.norm.weight": np.ones(3, np.float32)})
  with pytest.raises(ValueError, match="has shape \\(3,\\).*expected \\(64,\\)"):
    checkpoint.load_checkpoint(ckpt)
  _rewrite(ckpt, lambda t: {**t, "model.norm.weight": np.ones(64, np.float32),
                            "model.extra.weight": np.ones(2, np.float32)})
  with pytest.raises(ValueError, match=r"has 1 tensors this LlamaForCausalLM does not use, e.g. \[.model.extra.weight.\]"):
    checkpoint.load_checkpoint(ckpt)


def test_sharded_checkpoint_loads(ckpt):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  tensors = load_file(str(ckpt / "model.safetensors"))
  keys = sorted(tensors)
  (ckpt / "model.safetensors").unlink()
  save_file({k: tensors[k] for k in keys[:5]}, str(ckpt / "model-00001-of-00002.safetensors"))
  save_file({k: tensors[k] for k in keys[5:]}, str(ckpt / "model-00002-of-00002.safetensors"))
  cfg = json.loads((ckpt / "config.json").read_text())
  assert checkpoint.load_checkpoint(ckpt).config.vocab_size == cfg["vocab_size"]
