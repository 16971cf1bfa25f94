"""Tokenizers: byte-level and Hugging Face `tokenizer.json`, streaming decode
across multi-byte characters, chat templates."""

from __future__ import annotations

import json

import pytest

from paged_jax.serving.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "aé€😀 ok ñ"


def _stream(tok, ids, chunk=1):
  d = tok.stream_decoder()
  pieces = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
  return pieces, pieces + [d.flush()]


def test_byte_tokenizer_roundtrip_and_streaming():
  tok = ByteTokenizer()
  ids = tok.encode(TEXT)
  assert ids[0] == tok.BOS and all(3 <= i < 259 for i in ids[1:])
  assert tok.decode(ids) == TEXT
  pieces, full = _stream(tok, ids)
  assert "".join(full) == TEXT
  assert "\ufffd" not in "".join(pieces)  # a character appears once complete
  euro = [b + 3 for b in "€".encode()]
  d = tok.stream_decoder()
  assert [d.add([i]) for i in euro] == ["", "", "€"]
  # Unknown ids and EOS decode to nothing; a cut-off character to U+FFFD at the end.
  d = tok.stream_decoder()
  assert d.add([500, 2, euro[0]]) == "" and d.flush() == "\ufffd"


def _hf_dir(tmp_path, template=True):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {"<s>": 0, "</s>": 1}
  for ch in sorted(alphabet):
    vocab[ch] = len(vocab)
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<s>", "</s>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
  if template:
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'bad' %}"
        "{{ raise_exception('no bad roles') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
  return tmp_path


def test_hf_tokenizer_streams_multibyte_characters(tmp_path):
  tok = load_tokenizer(str(_hf_dir(tmp_path)))
  assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (1, 7)
  ids = tok.encode(TEXT)
  assert len(ids) == len(TEXT.encode())  # one id per byte: characters split
  assert tok.decode(ids) == TEXT
  for chunk in (1, 2, 3):
    pieces, full = _stream(tok, ids, chunk)
    assert "".join(full) == TEXT
    assert "\ufffd" not in "".join(pieces)
  assert tok.decode(ids + [1]) == TEXT  # special tokens skipped


def test_hf_chat_template(tmp_path):
  tok = HFTokenizer.from_directory(_hf_dir(tmp_path))
  msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hé"}]
  assert tok.apply_chat_template(msgs) == "<s>[system]be brief</s>[user]hé</s>[assistant]"
  assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("hé</s>")
  with pytest.raises(ValueError, match="chat template: no bad roles"):
    tok.apply_chat_template([{"role": "bad", "content": "x"}])
  with pytest.raises(ValueError, match="each message must be"):
    tok.apply_chat_template([{"role": "user"}])
  with pytest.raises(ValueError, match="messages must be a non-empty list"):
    tok.apply_chat_template([])


def test_hf_without_template_or_file(tmp_path):
  tok = HFTokenizer.from_directory(_hf_dir(tmp_path, template=False))
  with pytest.raises(ValueError, match="has no chat_template"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    HFTokenizer.from_directory(tmp_path / "missing")


def test_byte_chat_template():
  tok = ByteTokenizer()
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
      "<user>\nhi\n<assistant>\n"
