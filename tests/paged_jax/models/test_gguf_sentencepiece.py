"""SentencePiece-tokenizer GGUFs (`tokenizer.ggml.model` "llama": Llama 2,
Mistral, TinyLlama): a small vocabulary laid out as Llama 2's (<unk>, <s>,
</s>, the 256 byte tokens, merged pieces by score, single characters), written
with the `gguf` package, against transformers' own GGUF tokenizer converter;
round trips through bytes and characters outside the vocabulary."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from paged_jax.models import gguf as gguf_lib  # noqa: E402
from paged_jax.models.llama import model as model_lib  # noqa: E402
from paged_jax.serving.tokenizer import HFTokenizer, sentencepiece_merges  # noqa: E402
from tests.paged_jax.models.test_gguf import hf_tensors, write_gguf  # noqa: E402

SP = "\u2581"
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "a tokenizer splits text into pieces", "the the the world of pieces"]
TEXTS = ["hello world", "The quick brown fox.", "  two leading spaces", "trailing  ",
         "new\nlines\n\nand\ttabs", "unknown: é€🙂 中文 \u0000", "hello", "", " ",
         "<s> is not special in text", "pieces of the world"]


def _vocab() -> tuple[list[str], list[float], list[int]]:
  """tokens, scores, token types (llama.cpp's: 1 normal, 2 unknown, 3
  control, 6 byte) of a SentencePiece BPE trained here, in Llama 2's layout."""
  from tokenizers import models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="first",
                                               split=True)
  tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=120))
  trained = tok.get_vocab()
  chars = sorted({t for t in trained if len(t) == 1})
  pieces = sorted((t for t in trained if len(t) > 1), key=trained.get)  # merge order
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
  scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) + len(chars))]
  types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
  return tokens, scores, types


@pytest.fixture(scope="module")
def path(tmp_path_factory):
  tokens, scores, types = _vocab()

  def add(w):
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

  cfg = model_lib.LlamaConfig.tiny(vocab_size=len(tokens), rope_scaling=None)
  p = tmp_path_factory.mktemp("sp") / "sp.gguf"
  write_gguf(p, hf_tensors(cfg), cfg, types={}, tokenizer=add)
  return p


@pytest.fixture(scope="module")
def ours(path):
  return gguf_lib.read_gguf(path).tokenizer()


def test_ids_equal_transformers_gguf_converter(path, ours):
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  assert isinstance(ours, HFTokenizer) and ours.eos_token_ids == (2,)
  for text in TEXTS:
    for special in (False, True):
      want = ref.encode(text, add_special_tokens=special)
      assert ours.encode(text, add_special_tokens=special) == want, (text, special)
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_round_trips_spaces_bytes_and_unknown_characters(ours):
  for text in TEXTS:
    if "<s>" in text:  # the special token, matched in text and not decoded
      continue
    ids = ours.encode(text)
    assert ids[:1] == [1]  # BOS (add_bos_token)
    # A text that starts with a space gets no "▁" prefix (it has one), so
    # decoding strips one of its own spaces: transformers' Metaspace "first"
    # scheme, which the test above matches (sentencepiece would keep it).
    want = text[1:] if text.startswith(" ") else text
    assert ours.decode(ids) == want, text
  ids = ours.encode("é🙂", add_special_tokens=False)
  # Not in the vocabulary: their UTF-8 bytes (<0xNN> = id 3 + NN), after "▁".
  assert ids[1:] == [3 + b for b in "é🙂".encode()]
  stream = ours.stream_decoder()
  assert "".join(stream.add([t]) for t in ids) + stream.flush() == "é🙂"


def test_merges_replay_the_scores_and_unknown_without_byte_tokens():
  assert sentencepiece_merges(["a", "b", "ab", "abb", "bb"], [0, 0, -1, -3, -2]) == [
      ("a", "b"), ("b", "b"), ("ab", "b"), ("a", "bb")]  # a tie: the longer left part first
  tok = HFTokenizer.from_gguf_metadata({
      "model": "llama", "tokens": ["<unk>", "<s>", "</s>", SP, "h", "i", SP + "h", SP + "hi"],
      "scores": [0, 0, 0, -5, -6, -7, -1, -2], "token_type": [2, 3, 3, 1, 1, 1, 1, 1],
      "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0})
  assert tok.encode("hi") == [1, 7]
  assert tok.encode("hi€ih", add_special_tokens=False) == [7, 0, 5, 4]  # € -> <unk>, fused
  assert tok.decode([7, 3, 6]) == "hi  h"
  no_prefix = HFTokenizer.from_gguf_metadata({
      "model": "llama", "tokens": ["<unk>", "h", "i", SP, SP + "h"],
      "scores": [0, -1, -2, -3, -4],
      "add_space_prefix": False, "add_bos_token": False, "unknown_token_id": 0})
  assert no_prefix.encode("hi h") == [1, 2, 4]  # no "▁" before "hi"
  assert no_prefix.decode([1, 2, 4]) == "hi h"


def test_a_sentencepiece_gguf_without_scores_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r"needs tokenizer.ggml.scores, one per token \(3\), "
                     r"or tokenizer.ggml.merges; got 2 scores"):
    HFTokenizer.from_gguf_metadata({"model": "llama", "tokens": ["a", "b", "ab"],
                                    "scores": [0, 0]})
