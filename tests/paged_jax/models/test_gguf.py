"""`paged_jax.models.gguf`: GGUF files written by the `gguf` package's own
writer, read back as Hugging Face tensors and compared with an independent
NumPy dequantisation; the tokenizer against `tokenizers` on a tokenizer.json;
malformed files; the real SmolLM2 file where it is installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from paged_jax.models import gguf as gguf_lib  # noqa: E402
from paged_jax.models import loader  # noqa: E402
from paged_jax.models.llama import checkpoint  # noqa: E402
from paged_jax.models.llama import model as model_lib  # noqa: E402
from paged_jax.serving.tokenizer import HFTokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
CFG = model_lib.LlamaConfig.tiny(rope_scaling=None, rope_theta=10000.0,
                                 tie_word_embeddings=False, intermediate_size=256)


# Independent dequantisers (ggml's block layouts), for the comparison.
def np_q8_0(raw: np.ndarray) -> np.ndarray:
  b = raw.reshape(-1, 34)
  d = b[:, :2].copy().view(np.float16).astype(np.float32)
  return (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def np_q4_0(raw: np.ndarray) -> np.ndarray:
  b = raw.reshape(-1, 18)
  d = b[:, :2].copy().view(np.float16).astype(np.float32)
  q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1).astype(np.float32)
  return (d * (q - 8)).reshape(-1)


def np_q4_1(raw: np.ndarray) -> np.ndarray:
  b = raw.reshape(-1, 20)
  d = b[:, :2].copy().view(np.float16).astype(np.float32)
  m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
  q = np.concatenate([b[:, 4:] & 15, b[:, 4:] >> 4], axis=1).astype(np.float32)
  return (d * q + m).reshape(-1)


NP_DEQUANT = {Q.Q8_0: np_q8_0, Q.Q4_0: np_q4_0, Q.Q4_1: np_q4_1}
# GGUF name -> type written, one of each kind.
TYPES = {"token_embd.weight": Q.Q8_0, "attn_q.weight": Q.Q4_1, "attn_k.weight": Q.Q4_1,
         "attn_v.weight": Q.Q4_0, "attn_output.weight": Q.F16,
         "ffn_gate.weight": Q.Q8_0, "ffn_up.weight": Q.BF16,
         "ffn_down.weight": Q.Q6_K, "output.weight": Q.F16}
# The package cannot quantise K-quants: random blocks with a sane f16 scale
# at the byte offsets of ggml's layouts.
K_SCALE_OFFSETS = {Q.Q6_K: (210, (208,)), Q.Q4_K: (144, (0, 2))}


def random_k_blocks(kind, shape, seed=0) -> np.ndarray:
  size, offsets = K_SCALE_OFFSETS[kind]
  rows, cols = shape
  raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, size), np.uint8)
  for o in offsets:
    raw[..., o:o + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
  return raw.reshape(rows, -1)


def hf_tensors(cfg=CFG, seed=0) -> dict[str, np.ndarray]:
  return {k: np.asarray(v, np.float32)
          for k, v in checkpoint.to_tensors(model_lib.init_model(cfg, seed=seed)).items()}


def gguf_name(hf: str) -> str:
  inverse = {v: k for k, v in gguf_lib._GLOBAL_NAMES.items()}  # pylint: disable=protected-access
  if hf in inverse:
    return inverse[hf]
  layer, key = hf.removeprefix("model.layers.").split(".", 1)
  inv = {v: k for k, v in gguf_lib._LAYER_NAMES.items()}  # pylint: disable=protected-access
  return f"blk.{layer}.{inv[key]}"


def write_gguf(path, tensors: dict, cfg=CFG, *, types=None, tokenizer=None,
               arch="llama", extra_tensors=()) -> dict[str, tuple]:
  """Writes `tensors` (HF names) as llama.cpp would (q/k permuted); returns
  GGUF name -> (type, raw array written)."""
  types = TYPES if types is None else types
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name("tiny test llama")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_eos_token_id(2)
  w.add_bos_token_id(1)
  if tokenizer:
    tokenizer(w)
  written = {}
  for hf, t in tensors.items():
    name = gguf_name(hf)
    kind = types.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F32)
    if t.ndim == 1:
      kind = Q.F32
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
      t = gguf_lib.permute(t, heads)
    if kind in K_SCALE_OFFSETS:
      raw = random_k_blocks(kind, t.shape)
    else:
      raw = gguf.quants.quantize(t, kind) if kind != Q.F32 else t
    w.add_tensor(name, raw, raw_dtype=kind)
    written[name] = (kind, raw)
  for name, t in extra_tensors:
    w.add_tensor(name, t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return written


def test_round_trip_matches_numpy_dequantisation_and_hf_layout(tmp_path):
  hf = hf_tensors()
  written = write_gguf(tmp_path / "m.gguf", hf)
  ckpt = gguf_lib.read_gguf(tmp_path / "m.gguf")
  assert ckpt.name == "tiny test llama"
  assert {"Q8_0", "Q4_1", "Q4_0", "F16", "BF16", "Q6_K", "F32"} <= set(ckpt.tensor_types)
  assert set(ckpt.tensors) == set(hf)
  for name, (kind, raw) in written.items():
    hf_name = gguf_lib._hf_name(name, CFG.num_layers)  # pylint: disable=protected-access
    got = ckpt.tensors[hf_name]
    assert got.dtype == np.float32 and got.shape == hf[hf_name].shape, name
    if kind in NP_DEQUANT:
      want = NP_DEQUANT[kind](np.asarray(raw)).reshape(got.shape)
    elif kind == Q.BF16:
      want = (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif kind in (Q.F16, Q.F32):
      want = np.asarray(raw, np.float32)
    else:  # K-quants: the package's own dequantiser is the reference
      want = gguf.quants.dequantize(raw, kind).reshape(got.shape)
    if name.endswith(("attn_q.weight", "attn_k.weight")):  # undo llama.cpp's order
      heads = CFG.num_heads if "attn_q" in name else CFG.num_kv_heads
      want = gguf_lib.unpermute(want.reshape(got.shape), heads)
    np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=name)
    if kind in K_SCALE_OFFSETS:
      continue
    # ... and close to what was quantised (the permutation really undone).
    scale = np.abs(hf[hf_name]).max()
    assert np.abs(got - hf[hf_name]).max() <= 0.25 * scale + 1e-6, name
  c = ckpt.config
  assert c["architectures"] == ["LlamaForCausalLM"]
  assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
          c["num_key_value_heads"], c["head_dim"], c["intermediate_size"],
          c["vocab_size"]) == (CFG.num_layers, CFG.hidden_size, CFG.num_heads,
                               CFG.num_kv_heads, CFG.head_dim, CFG.intermediate_size,
                               CFG.vocab_size)
  assert c["rope_theta"] == CFG.rope_theta and c["rms_norm_eps"] == CFG.rms_norm_eps
  assert c["tie_word_embeddings"] is False
  assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_f32_gguf_serves_the_hf_checkpoints_logits(tmp_path):
  """Unquantised, the GGUF path is the HF path: same logits, to the bit."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  cfg = model_lib.LlamaConfig.tiny(rope_scaling=None, tie_word_embeddings=True)
  hf = hf_tensors(cfg, seed=3)
  hf.pop("lm_head.weight", None)
  write_gguf(tmp_path / "m.gguf", hf, cfg, types={})
  ckpt = gguf_lib.read_gguf(tmp_path / "m.gguf")
  assert ckpt.config["tie_word_embeddings"] is True
  from_gguf = loader.load_gguf(tmp_path / "m.gguf").model
  reference = model_lib.init_model(cfg, seed=3)
  ids = jnp.asarray([[5, 17, 300, 2, 9, 44]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(from_gguf.dense_logits(ids)),
                                np.asarray(reference.dense_logits(ids)))


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
  factors = gguf_lib.llama3_rope_factors(500000.0, CFG.head_dim, 32.0)
  cfg = model_lib.LlamaConfig.tiny(rope_scaling=None, rope_theta=500000.0)
  write_gguf(tmp_path / "m.gguf", hf_tensors(cfg), cfg, types={},
             extra_tensors=[("rope_freqs.weight", factors)])
  scaling = gguf_lib.read_gguf(tmp_path / "m.gguf").config["rope_scaling"]
  assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  write_gguf(tmp_path / "bad.gguf", hf_tensors(cfg), cfg, types={},
             extra_tensors=[("rope_freqs.weight", factors[::-1].copy())])
  with pytest.raises(gguf_lib.GGUFError, match="rope_freqs.weight does not match"):
    gguf_lib.read_gguf(tmp_path / "bad.gguf")


# --- the tokenizer ---------------------------------------------------------

TEXTS = ["Hello world, it's 2026!", "  leading spaces\tand\ttabs\n\nnewlines",
         "numbers 1234567 and 3.14159", "ünïcödé — emoji 🙂 and 中文",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
         "I'M SHOUTING, you're not; they'll've",
         # NFC changes these: e + combining acute -> é, the Angstrom sign -> Å.
         "cafe\u0301 au \u212b lait"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# HF's tokenizer.json pre-tokenizers for these llama.cpp `pre` names.
HF_PRE = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]},
    "gpt2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True},
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]},
    # Qwen2's tokenizer.json: its split (digits one by one) after an NFC normaliser.
    "qwen2": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]},
}
NORMALIZERS = {"qwen2": {"type": "NFC"}}


def trained_tokenizer_json(pre: str) -> dict:
  """A small byte-level BPE trained here, as a tokenizer.json dict with HF's
  pre-tokenizer for `pre`."""
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50,
                          trainer)
  d = json.loads(tok.to_str())
  d["pre_tokenizer"] = HF_PRE[pre]
  d["normalizer"] = NORMALIZERS.get(pre)
  return d


def gguf_tokenizer_metadata(d: dict, pre: str):
  vocab = d["model"]["vocab"]
  tokens = [None] * len(vocab)
  for t, i in vocab.items():
    tokens[i] = t
  merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
  types = [3 if t in SPECIAL else 1 for t in tokens]

  def add(w):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  return add


@pytest.mark.parametrize("pre", sorted(HF_PRE))
def test_gguf_tokenizer_gives_the_tokenizer_json_ids(tmp_path, pre):
  d = trained_tokenizer_json(pre)
  (tmp_path / "tokenizer.json").write_text(json.dumps(d))
  reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  cfg = model_lib.LlamaConfig.tiny(vocab_size=len(d["model"]["vocab"]), rope_scaling=None)
  write_gguf(tmp_path / "m.gguf", hf_tensors(cfg), cfg, types={},
             tokenizer=gguf_tokenizer_metadata(d, pre))
  tok = gguf_lib.read_gguf(tmp_path / "m.gguf").tokenizer()
  assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (2,)
  for text in TEXTS:
    want = reference.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=False) == want, text
    assert tok.decode(want) == reference.decode(want, skip_special_tokens=True)
  chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  ids = tok.encode(chat, add_special_tokens=False)
  assert ids[0] == d["model"]["vocab"]["<|im_start|>"]


def test_qwen2_normalises_to_nfc_first(tmp_path):
  """A string that NFC changes encodes as its NFC form, as Qwen2's own
  tokenizer does (and the other byte-level pre-tokenizers do not)."""
  import unicodedata  # pylint: disable=import-outside-toplevel
  text = "cafe\u0301 au \u212b lait"
  composed = unicodedata.normalize("NFC", text)
  assert composed != text
  toks = {}
  for pre in ("qwen2", "llama-bpe"):
    d = trained_tokenizer_json(pre)
    cfg = model_lib.LlamaConfig.tiny(vocab_size=len(d["model"]["vocab"]), rope_scaling=None)
    write_gguf(tmp_path / f"{pre}.gguf", hf_tensors(cfg), cfg, types={},
               tokenizer=gguf_tokenizer_metadata(d, pre))
    toks[pre] = gguf_lib.read_gguf(tmp_path / f"{pre}.gguf").tokenizer()
  qwen, llama = toks["qwen2"], toks["llama-bpe"]
  assert qwen.encode(text, add_special_tokens=False) == qwen.encode(composed, add_special_tokens=False)
  assert qwen.decode(qwen.encode(text, add_special_tokens=False)) == composed
  assert llama.decode(llama.encode(text, add_special_tokens=False)) == text  # no NFC


def test_unknown_tokenizer_is_refused_by_name():
  with pytest.raises(ValueError, match="GGUF pre-tokenizer 'mystery' is not supported"):
    HFTokenizer.from_gguf_metadata({"model": "gpt2", "pre": "mystery"})
  with pytest.raises(ValueError, match="GGUF tokenizer model 'rwkv' is not supported"):
    HFTokenizer.from_gguf_metadata({"model": "rwkv"})


# --- malformed files: one GGUFError line each -------------------------------

@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "good.gguf"
  write_gguf(path, hf_tensors())
  return path


@pytest.mark.parametrize("cut", [3, 100, 0.5, -7])
def test_truncated_file(tmp_path, good_file, cut):
  data = good_file.read_bytes()
  n = int(len(data) * cut) if isinstance(cut, float) else cut % len(data)
  (tmp_path / "cut.gguf").write_bytes(data[:n])
  with pytest.raises(gguf_lib.GGUFError) as e:
    gguf_lib.read_gguf(tmp_path / "cut.gguf")
  msg = str(e.value)
  assert msg.startswith(str(tmp_path / "cut.gguf")) and "\n" not in msg


def test_not_gguf_and_missing(tmp_path):
  (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(200))
  with pytest.raises(gguf_lib.GGUFError, match="not a readable GGUF file"):
    gguf_lib.read_gguf(tmp_path / "x.gguf")
  with pytest.raises(FileNotFoundError, match="not found"):
    gguf_lib.read_gguf(tmp_path / "nope.gguf")


def test_unsupported_architecture_and_tensor(tmp_path):
  write_gguf(tmp_path / "a.gguf", hf_tensors(), types={}, arch="rwkv6")
  with pytest.raises(gguf_lib.GGUFError, match="architecture 'rwkv6' is not supported"):
    gguf_lib.read_gguf(tmp_path / "a.gguf")
  write_gguf(tmp_path / "b.gguf", hf_tensors(), types={},
             extra_tensors=[("blk.0.mystery.weight", np.zeros(4, np.float32))])
  with pytest.raises(gguf_lib.GGUFError, match="'blk.0.mystery.weight' has no Hugging"):
    gguf_lib.read_gguf(tmp_path / "b.gguf")


def test_weights_that_do_not_fit_the_config(tmp_path):
  hf = hf_tensors()
  hf["model.layers.0.mlp.up_proj.weight"] = hf["model.layers.0.mlp.up_proj.weight"][:64]
  write_gguf(tmp_path / "m.gguf", hf, types={})
  with pytest.raises(gguf_lib.GGUFError, match="up_proj.weight' has shape"):
    loader.load_gguf(tmp_path / "m.gguf")


# --- the real file -----------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
  try:
    return loader.smollm2_path(fetch=False)
  except loader.ModelNotAvailable as e:
    pytest.skip(f"the real model is not installed ({e})")


def test_real_smollm2_file_loads_and_answers(smollm2):
  from paged_jax.serving.llm import LLM  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  loaded = loader.load(str(smollm2))
  cfg = loaded.model.config
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta) == (
              30, 576, 9, 3, 49152, True, 100000.0)
  tok = loaded.tokenizer
  assert tok.eos_token_ids == (2,)
  # SmolLM2's tokenizer.json ids (digits one by one, ChatML specials).
  assert tok.encode("Hello world, 123", add_special_tokens=False) == [
      19556, 905, 28, 216, 33, 34, 35]
  chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
  # The engine of test_serve_gguf's server (its SIZES, the server's default
  # max_logprobs and max_logit_bias): one compile of the real model's two
  # step shapes serves both tests (in one process, or through the session's
  # compilation cache).
  llm = LLM(loaded.model, num_blocks=32, block_size=4, max_batch=4,
            max_tokens_per_step=16, max_model_len=128, min_bucket=16,
            bucket_midpoints=False, max_logprobs=20, max_logit_bias=300)
  (out,) = llm.generate([tok.encode(chat, add_special_tokens=False)],
                        SamplingParams(max_new_tokens=12, eos_token_ids=tok.eos_token_ids))
  assert tok.decode(out.completions[0].token_ids) == "The capital of France is Paris."
