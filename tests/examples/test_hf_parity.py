"""Our models against Hugging Face transformers, one small random checkpoint
per registered family.

Skipped where transformers (and torch) are not installed. Per family: a small
random Hugging Face model saved with `save_pretrained`, loaded with
`paged_jax.models.load_hf`; float32 logits, dense and paged, row by row, and
greedy tokens through our engine against transformers' `generate`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="parity needs transformers")

import paged_jax.models as models  # noqa: E402
from paged_jax import block_manager as bm  # noqa: E402
from paged_jax import flax_attention  # noqa: E402

RTOL = 1e-5
VOCAB = 384
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# (transformers config class, model class, its own fields).
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(  # tied, theta 1e5
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # Hybrid: local layers of a short window that slides within the prompts,
    # global layers; a layer count that leaves a partial period at the end.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=6, num_hidden_layers=3, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=4, num_hidden_layers=5, sliding_window_pattern=3,
        query_pre_attn_scalar=16, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0,
                               "rope_theta": 100000.0}})),
}


def _hf_model(tmp_path, family: str, torch_dtype=torch.float32):
  config_cls, model_cls, own = FAMILIES[family]
  torch.manual_seed(0)
  cfg = getattr(transformers, config_cls)(**{**COMMON, **own})
  model_cls = getattr(transformers, model_cls)
  model_cls(cfg).to(torch_dtype).save_pretrained(tmp_path, safe_serialization=True)
  # Reload from disk in float32, as a user would: buffers such as the RoPE
  # frequencies are recomputed in float32, weights upcast from the file.
  return model_cls.from_pretrained(tmp_path, dtype=torch.float32).eval()


def _max_rel_err(ours, ref):
  """Largest per-row error, each row normalised by its own largest |logit|."""
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  err = np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)
  return float(err.max())


@pytest.mark.parametrize("family,torch_dtype", [
    ("llama3", "float32"), ("smollm2", "bfloat16"), ("qwen2", "float32"),
    ("qwen3", "float16"), ("mistral", "float32"), ("gemma2", "float32"),
    ("gemma3", "bfloat16")])
def test_logits_match_transformers(tmp_path, family, torch_dtype):
  hf = _hf_model(tmp_path, family, getattr(torch, torch_dtype))
  # Float32 compute on the checkpoint's (possibly half-precision) weights.
  model = models.load_hf(tmp_path, dtype="float32")
  assert model.config.architecture == FAMILIES[family][1]
  assert model.config.sliding_window == FAMILIES[family][2].get("sliding_window")
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, size=(2, 150)).astype(np.int32)
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()

  dense = np.asarray(model.dense_logits(jnp.asarray(tokens)))
  dense_err = _max_rel_err(dense, ref)
  print(f"{family}: dense max per-row relative error vs transformers: {dense_err:.2e}")
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
  print(f"{family}: paged max per-row relative error vs transformers: {paged_err:.2e}")
  assert paged_err < RTOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers_generate(tmp_path, family):
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.requests import Request  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  hf = _hf_model(tmp_path, family)
  model = models.load_hf(tmp_path)
  # 2 step shapes (decode 4, mixed 32): each family compiles its own. (The
  # buckets only pad; the engine tests of tests/examples cover several.)
  engine = Engine(model, EngineConfig(num_blocks=32, block_size=8, max_batch=4,
                                      max_tokens_per_step=32, max_model_len=64,
                                      min_bucket=32, bucket_midpoints=False))
  rng = np.random.default_rng(1)
  # Prompts shorter and longer than the windows (4-8 tokens) and blocks.
  prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 23, 40)]
  for i, p in enumerate(prompts):
    engine.add_request(Request(i, p, SamplingParams(max_new_tokens=12)))
  outputs = {o.request_id: o for o in engine.run_until_done()}
  for i, p in enumerate(prompts):
    with torch.no_grad():
      ids = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                        eos_token_id=list(model.config.eos_token_ids) or None)
    assert outputs[i].completions[0].token_ids == ids[0, len(p):].tolist(), (family, i)
