"""The real SmolLM2 GGUF file against transformers' own GGUF reader
(`transformers.modeling_gguf_pytorch_utils`, its tokenizer converter and
dequantisation, independent of `paged_jax.models.gguf` but for the `gguf`
package's block decoders): the same token ids, chat prompt, logits and
greedy tokens. Skips where torch, transformers or the file are missing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from paged_jax.models import loader  # noqa: E402
from paged_jax.serving.llm import LLM  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402
from tests.paged_jax.models.test_gguf import TEXTS  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
             "Write a haiku about the sea.", "What is 12 + 7?"]


@pytest.fixture(scope="module")
def path():
  try:
    return loader.smollm2_path(fetch=False)
  except loader.ModelNotAvailable as e:
    pytest.skip(f"the real model is not installed ({e})")


@pytest.fixture(scope="module")
def hf_tokenizer(path):
  return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(path):
  return loader.load(str(path))


def test_tokenizer_and_chat_template(hf_tokenizer, ours):
  tok = hf_tokenizer
  for text in TEXTS:
    assert ours.tokenizer.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False), text
  for q in QUESTIONS:
    m = [{"role": "user", "content": q}]
    assert ours.tokenizer.apply_chat_template(m) == tok.apply_chat_template(
        m, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow  # about 3.5 min on the shared 2-core CPU (two model loads, compiles)
def test_logits_and_greedy_tokens(path, hf_tokenizer, ours):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # pylint: disable=import-outside-toplevel
  tok = hf_tokenizer
  cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
  hf = transformers.LlamaForCausalLM(cfg).float().eval()
  tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
  hf.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
  hf.tie_weights()
  prompts = [ours.tokenizer.encode(ours.tokenizer.apply_chat_template(
      [{"role": "user", "content": q}]), add_special_tokens=False) for q in QUESTIONS]
  with torch.no_grad():
    want = np.asarray(hf(torch.tensor([prompts[1]])).logits[0])
  got = np.asarray(ours.model.dense_logits(jnp.asarray([prompts[1]], jnp.int32)))[0]
  np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
  llm = LLM(ours.model, num_blocks=64, block_size=16, max_batch=4, max_tokens_per_step=64,
            max_model_len=256, min_bucket=4, bucket_midpoints=False)
  outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, eos_token_ids=(-1,)))
  for q, p, o in zip(QUESTIONS, prompts, outs):
    ids = torch.tensor([p])
    # An explicit mask: the prompt holds <|im_end|> = the pad id, which
    # generate would otherwise mask out.
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                    do_sample=False, eos_token_id=None, pad_token_id=None)
    assert o.completions[0].token_ids == g[0, len(p):].tolist(), (q, tok.decode(g[0, len(p):]))
