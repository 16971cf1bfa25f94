"""Malformed inputs to `paged_jax.models`: one clear error line each, raised
before any tensor is read."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import paged_jax.models as models
from paged_jax.models import safetensors_io
from paged_jax.models.llama import checkpoint
from tests.paged_jax.models.test_api import hf_config, random_tensors


def _one_line(excinfo):
  assert "\n" not in str(excinfo.value), str(excinfo.value)


@pytest.mark.parametrize("change,match", [
    (dict(architectures=["GPT2LMHeadModel"]),
     r"architecture 'GPT2LMHeadModel' is not supported \(supported: "
     r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
     r"Gemma2ForCausalLM, Gemma3ForCausalLM\)"),
    (dict(architectures="LlamaForCausalLM"), "architectures must be a list of one name"),
    (dict(architectures=["LlamaForCausalLM", "Qwen2ForCausalLM"]),
     "architectures must be a list of one name"),
    (dict(num_hidden_layers=10**12), r"num_layers=1000000000000 is absurd \(more than 2\*\*31 - 1\)"),
    (dict(vocab_size=2**30, hidden_size=2**20, num_attention_heads=4, head_dim=None),
     r"describes 2.26e\+15 parameters, which is absurd"),
    (dict(hidden_size=-64), "hidden_size must be a positive int, got -64"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(sliding_window=0), "sliding_window must be a positive int or None, got 0"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "x"}), "non-numeric field"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}),
     "rope_theta must be a number"),
])
def test_config_errors(change, match):
  arch = change.get("architectures", ["MistralForCausalLM"])
  base = hf_config("MistralForCausalLM")
  d = {k: v for k, v in {**base, **change, "architectures": arch}.items() if v is not None}
  with pytest.raises(ValueError, match=match) as e:
    models.config_from_hf(d)
  _one_line(e)


@pytest.mark.parametrize("arch,change,match", [
    ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention"]),
     r"layer_types must be a tuple of num_layers=2 entries"),
    ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention", "chunked"]),
     r"layer_types must be a tuple of num_layers=2 entries"),
    ("Gemma2ForCausalLM", dict(hidden_activation="relu"),
     "hidden_activation 'relu' is not supported"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping=-1.0),
     "attn_logit_softcapping must be a positive number or None, got -1.0"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention is not supported"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 2.0}}),
     "unsupported rope scaling type 'yarn'"),
])
def test_gemma_config_errors(arch, change, match):
  with pytest.raises(ValueError, match=match) as e:
    models.config_from_hf(hf_config(arch, **change))
  _one_line(e)


def test_qwen_sliding_window_layers_are_refused():
  for cfg in (hf_config("Qwen2ForCausalLM", use_sliding_window=True),
              hf_config("Qwen3ForCausalLM", layer_types=["full_attention",
                                                          "sliding_attention"])):
    with pytest.raises(ValueError, match="with sliding-window layers"):
      models.config_from_hf(cfg)


class _Unreadable:
  """An array stand-in with a shape and a dtype whose data must not be read."""

  def __init__(self, a):
    self.shape, self.dtype = a.shape, a.dtype

  def __array__(self, *args, **kwargs):
    raise AssertionError("tensor data read before the checks finished")


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
     "checkpoint lacks tensor 'model.layers.1.mlp.down_proj.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64))}),
     r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(16, 64\), expected "
     r"\(32, 64\) from the config"),
    (lambda t: t.update({"model.norm.weight": np.zeros(64, np.int32)}),
     "tensor 'model.norm.weight' has dtype int32, expected a float dtype"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64))}),
     r"has 1 tensors this MistralForCausalLM does not use, e.g. "
     r"\['model.layers.2.mlp.up_proj.weight'\]"),
])
def test_tensor_errors_before_any_read(edit, match):
  cfg = hf_config("MistralForCausalLM")
  tensors = random_tensors(cfg)
  edit(tensors)
  lazy = {k: _Unreadable(v) for k, v in tensors.items()}
  with pytest.raises(ValueError, match=match) as e:
    models.from_hf(cfg, lazy)
  _one_line(e)


@pytest.fixture
def ckpt(tmp_path):
  cfg = hf_config("LlamaForCausalLM")
  checkpoint.save_checkpoint(models.from_hf(cfg, random_tensors(cfg)), tmp_path)
  return tmp_path


def _header_bytes(header: dict) -> bytes:
  raw = json.dumps(header).encode()
  return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("corrupt,match", [
    (lambda b: b[:-10], r"truncated file \(the tensor ends at byte \d+ of the data, "
                        r"the file holds \d+\)"),
    (lambda b: b[:5], r"not a safetensors file \(5 bytes, shorter than the 8-byte"),
    (lambda b: struct.pack("<Q", 10**6) + b[8:100],
     r"not a safetensors file or truncated \(header length 1000000 bytes, file 100 bytes\)"),
    (lambda b: b[:8] + b"\xff" * (len(b) - 8), r"corrupt safetensors header \(not JSON"),
    (lambda b: _header_bytes({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}})
     + b"xx", r"tensor 'w': unsupported dtype 'Q4' \(supported: F64, F32"),
    (lambda b: _header_bytes({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})
     + b"x" * 8, r"tensor 'w': holds 8 bytes, but shape \(3,\) of F32 needs 12"),
    (lambda b: _header_bytes({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})
     + b"x" * 4, r"tensor 'w': corrupt shape \[-1\]"),
    (lambda b: _header_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})
     + b"x" * 4, r"tensor 'w': corrupt data_offsets \[4, 0\]"),
    (lambda b: _header_bytes([1, 2]), r"corrupt safetensors header \(not a JSON object\)"),
])
def test_corrupt_safetensors(ckpt, corrupt, match):
  path = ckpt / "model.safetensors"
  path.write_bytes(corrupt(path.read_bytes()))
  with pytest.raises(ValueError, match=match) as e:
    models.load_hf(ckpt)
  _one_line(e)
  assert str(path) in str(e.value)


def test_sharded_index_errors(ckpt):
  tensors = {k: np.asarray(v) for k, v in checkpoint.read_tensors(ckpt)[0].items()}
  names = sorted(tensors)
  (ckpt / "model.safetensors").unlink()
  safetensors_io.save({k: np.asarray(tensors[k]) for k in names[:4]}, ckpt / "a.safetensors")
  safetensors_io.save({k: np.asarray(tensors[k]) for k in names[4:]}, ckpt / "b.safetensors")
  index = ckpt / checkpoint.INDEX_FILE
  weight_map = {k: "a.safetensors" if i < 4 else "b.safetensors" for i, k in enumerate(names)}

  def write(m):
    index.write_text(json.dumps({"weight_map": m}))

  write(weight_map)
  assert models.load_hf(ckpt).config.num_layers == 2
  write({**weight_map, names[0]: "c.safetensors"})
  with pytest.raises(FileNotFoundError, match="names 'c.safetensors', which is not in"):
    models.load_hf(ckpt)
  write({**weight_map, names[0]: "b.safetensors"})
  with pytest.raises(ValueError, match=f"holds tensor '{names[0]}', which "
                     "model.safetensors.index.json puts in 'b.safetensors'"):
    models.load_hf(ckpt)
  write({**weight_map, "model.extra.weight": "a.safetensors"})
  with pytest.raises(ValueError, match="lists 1 tensors that no file holds"):
    models.load_hf(ckpt)
  index.write_text("{}")
  with pytest.raises(ValueError, match="not a valid index"):
    models.load_hf(ckpt)
  index.unlink()
  safetensors_io.save({names[0]: np.asarray(tensors[names[0]])}, ckpt / "c.safetensors")
  with pytest.raises(ValueError, match=f"tensor '{names[0]}' is in both a.safetensors "
                     "and c.safetensors"):
    models.load_hf(ckpt)


def test_missing_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    models.load_hf(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="config.json' not found"):
    models.load_hf(tmp_path)
