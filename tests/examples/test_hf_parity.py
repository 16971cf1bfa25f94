"""Our Llama against Hugging Face transformers' `LlamaForCausalLM`.

Skipped where transformers (and torch) are not installed, as in CI. Builds a
small random Hugging Face checkpoint, loads it with `checkpoint.load_checkpoint`
and compares float32 logits, dense and paged, row by row.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax.models.llama import checkpoint  # noqa: E402
from paged_jax import block_manager as bm  # noqa: E402
from paged_jax import flax_attention  # noqa: E402

RTOL = 1e-5


def _hf_model(tmp_path, *, tie: bool, torch_dtype, rope_scaling):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=384, hidden_size=64, intermediate_size=160,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
      rope_theta=500000.0, rope_scaling=rope_scaling,
      tie_word_embeddings=tie, initializer_range=0.2)
  transformers.LlamaForCausalLM(cfg).to(torch_dtype).save_pretrained(
      tmp_path, safe_serialization=True)
  # Reload from disk in float32, as a user would: buffers such as the RoPE
  # frequencies are recomputed in float32, weights upcast from the file.
  return transformers.LlamaForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32).eval()


def _max_rel_err(ours, ref):
  """Largest per-row error, each row normalised by its own largest |logit|."""
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  err = np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)
  return float(err.max())


@pytest.mark.parametrize("tie,torch_dtype,scaling", [
    (False, "float32", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}),
    (True, "bfloat16", None),
])
def test_logits_match_transformers(tmp_path, tie, torch_dtype, scaling):
  hf = _hf_model(tmp_path, tie=tie, torch_dtype=getattr(torch, torch_dtype),
                 rope_scaling=scaling)
  # Float32 compute on the checkpoint's (possibly bfloat16-rounded) weights.
  model = checkpoint.load_checkpoint(tmp_path, dtype="float32")
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 384, size=(2, 150)).astype(np.int32)
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()

  dense = np.asarray(model.dense_logits(jnp.asarray(tokens)))
  dense_err = _max_rel_err(dense, ref)
  print(f"dense max per-row relative error vs transformers: {dense_err:.2e}")
  assert dense_err < RTOL

  # Paged: both sequences prefilled in one ragged step, 16-token blocks.
  state = bm.init(num_blocks=24, block_size=16, max_seqs=2, max_blocks_per_seq=12)
  cache = model.make_cache(24, 16)
  seq_ids, q_lens = jnp.array([0, 1]), jnp.array([150, 150])
  state, _ = bm.reserve(state, seq_ids, q_lens)
  meta = flax_attention.step_metadata(state, seq_ids, q_lens, num_tokens=300)
  hidden, _ = model.paged_forward(jnp.asarray(tokens.reshape(-1)), meta, cache)
  paged = np.asarray(model.logits(hidden)).reshape(2, 150, -1)
  paged_err = _max_rel_err(paged, ref)
  print(f"paged max per-row relative error vs transformers: {paged_err:.2e}")
  assert paged_err < RTOL


def test_greedy_generation_matches_transformers_generate(tmp_path):
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.requests import Request  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  hf = _hf_model(tmp_path, tie=False, torch_dtype=torch.float32, rope_scaling=None)
  model = checkpoint.load_checkpoint(tmp_path)
  engine = Engine(model, EngineConfig(num_blocks=32, block_size=8, max_batch=4,
                                      max_tokens_per_step=32, max_model_len=64))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 384, n).tolist() for n in (5, 17, 30)]
  for i, p in enumerate(prompts):
    engine.add_request(Request(i, p, SamplingParams(max_new_tokens=12)))
  outputs = {o.request_id: o for o in engine.run_until_done()}
  for i, p in enumerate(prompts):
    with torch.no_grad():
      ids = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                        eos_token_id=list(model.config.eos_token_ids) or None)
    assert outputs[i].completions[0].token_ids == ids[0, len(p):].tolist(), i
