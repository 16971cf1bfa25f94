"""Tokenizers: text <-> token ids, streaming decode, chat templates.

A tokenizer here is anything with the methods of `Tokenizer`. Two ship:

* `ByteTokenizer`: pure Python, UTF-8 bytes offset by 3 special ids (0 pad,
  1 BOS, 2 EOS; ids 3..258 are the bytes 0..255). It fits the built-in tiny
  Llama (vocab 512, EOS 2), so text in and out works with no download.
* `HFTokenizer`: a checkpoint directory's `tokenizer.json` through Hugging
  Face `tokenizers`, with the chat template of `tokenizer_config.json`
  rendered by jinja2 as transformers does (both optional imports, needed only
  for such a directory); `HFTokenizer.from_gguf_metadata` builds the same
  from a GGUF file's `tokenizer.*` metadata (`paged_jax.models.gguf` reads
  the file).

Streaming decode (`Tokenizer.stream_decoder()`): `add(token_ids)` returns the
text those tokens complete, holding back a multi-byte character until its
last byte arrives; `flush()` returns what is left. The pieces concatenate to
the whole decode.

Example:
  >>> tok = ByteTokenizer()
  >>> ids = tok.encode("héllo")
  >>> d = tok.stream_decoder()
  >>> [d.add([i]) for i in ids[:3]]
  ['', 'h', '']
  >>> tok.decode(ids)
  'héllo'
"""

from __future__ import annotations

import codecs
import json
import pathlib
from typing import Protocol, Sequence


class StreamDecoder(Protocol):
  def add(self, token_ids: Sequence[int]) -> str: ...
  def flush(self) -> str: ...


class Tokenizer(Protocol):
  """What the text layer needs (`paged_jax.serving.text`)."""

  eos_token_ids: tuple[int, ...]

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
  def decode(self, token_ids: Sequence[int]) -> str: ...
  def stream_decoder(self) -> StreamDecoder: ...
  def apply_chat_template(self, messages: list[dict],
                          add_generation_prompt: bool = True) -> str: ...


# The byte tokenizer's chat format (plain text, no special tokens needed).
BYTE_CHAT_ROLES = ("system", "user", "assistant")


def _check_messages(messages) -> None:
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"messages must be a non-empty list, got {messages!r:.80}")
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get("content"), str) or \
        not isinstance(m.get("role"), str):
      raise ValueError("each message must be {\"role\": str, \"content\": str}, "
                       f"got {m!r:.80}")


class _ByteStream:
  def __init__(self):
    self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def add(self, token_ids: Sequence[int]) -> str:
    return self._dec.decode(ByteTokenizer.to_bytes(token_ids))

  def flush(self) -> str:
    return self._dec.decode(b"", final=True)


class ByteTokenizer:
  """UTF-8 bytes as ids 3..258; 0 pad, 1 BOS, 2 EOS (other ids decode to
  nothing)."""

  OFFSET = 3
  PAD, BOS, EOS = 0, 1, 2
  eos_token_ids = (2,)
  vocab_size = 259

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    ids = [b + self.OFFSET for b in text.encode("utf-8")]
    return [self.BOS] + ids if add_special_tokens else ids

  @classmethod
  def to_bytes(cls, token_ids: Sequence[int]) -> bytes:
    return bytes(t - cls.OFFSET for t in token_ids
                 if cls.OFFSET <= t < cls.OFFSET + 256)

  def decode(self, token_ids: Sequence[int]) -> str:
    return self.to_bytes(token_ids).decode("utf-8", errors="replace")

  def stream_decoder(self) -> StreamDecoder:
    return _ByteStream()

  def apply_chat_template(self, messages: list[dict],
                          add_generation_prompt: bool = True) -> str:
    _check_messages(messages)
    text = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)
    return text + ("<assistant>\n" if add_generation_prompt else "")


class _WindowStream:
  """Incremental decode for tokenizers that only decode whole id lists (the
  prefix-window method of vLLM and TGI): decode a short window before the new
  tokens and with them, emit the difference once it does not end in an
  incomplete character (U+FFFD)."""

  def __init__(self, decode, window: int = 6):
    self._decode = decode
    self._ids: list[int] = []
    self._prefix = 0  # window start
    self._read = 0  # tokens already emitted
    self._window = window

  def _step(self, final: bool) -> str:
    prefix_text = self._decode(self._ids[self._prefix:self._read])
    text = self._decode(self._ids[self._prefix:])
    if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
      return ""
    new = text[len(prefix_text):]
    self._read = len(self._ids)
    self._prefix = max(0, self._read - self._window)
    return new

  def add(self, token_ids: Sequence[int]) -> str:
    self._ids.extend(int(t) for t in token_ids)
    return self._step(final=False)

  def flush(self) -> str:
    return self._step(final=True)


def _token_text(value) -> str | None:
  """A special token in `tokenizer_config.json`: a string or an AddedToken
  object `{"content": ...}`."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


# llama.cpp's `tokenizer.ggml.pre` names -> (digits split one by one first,
# the split regex or None for GPT-2's own), as in its llama-vocab.cpp and the
# models' Hugging Face tokenizer.json.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {
    "default": (False, None), "gpt2": (False, None), "gpt-2": (False, None),
    "smollm": (True, None),
    "llama3": (False, _LLAMA3_SPLIT), "llama-v3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")),
}


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (+ `tokenizer_config.json`).

  Args:
    tokenizer_json: path of `tokenizer.json`, or a `tokenizers.Tokenizer`.
    config: the `tokenizer_config.json` dict (chat template, BOS/EOS tokens).
    extra_eos_ids: more EOS ids (e.g. `generation_config.json`'s).

  Raises:
    ImportError: without the `tokenizers` package.
  """

  def __init__(self, tokenizer_json, config: dict | None = None,
               extra_eos_ids: Sequence[int] = ()):
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("reading tokenizer.json needs the `tokenizers` package "
                        "(pip install tokenizers, or the `serve` extra)") from e
    self._tok = (tokenizer_json if isinstance(tokenizer_json, tokenizers.Tokenizer)
                 else tokenizers.Tokenizer.from_file(str(tokenizer_json)))
    self.config = dict(config or {})
    self.special = {k: _token_text(self.config.get(k))
                    for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    eos = list(extra_eos_ids)
    eos_text = self.special["eos_token"]
    if eos_text is not None and self._tok.token_to_id(eos_text) is not None:
      eos.append(self._tok.token_to_id(eos_text))
    self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos))
    template = self.config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    self.chat_template = template if isinstance(template, str) else None
    self._compiled = None

  @classmethod
  def from_directory(cls, path) -> "HFTokenizer":
    """The tokenizer of a checkpoint directory (`tokenizer.json`, optional
    `tokenizer_config.json` and `generation_config.json`).

    Raises:
      FileNotFoundError: no `tokenizer.json` there.
    """
    d = pathlib.Path(path)
    if not (d / "tokenizer.json").is_file():
      raise FileNotFoundError(f"{d}: no tokenizer.json")
    config = {}
    if (d / "tokenizer_config.json").is_file():
      config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    eos = []
    if (d / "generation_config.json").is_file():
      g = json.loads((d / "generation_config.json").read_text(encoding="utf-8"))
      e = g.get("eos_token_id")
      eos = e if isinstance(e, list) else [e] if isinstance(e, int) else []
    return cls(d / "tokenizer.json", config, eos)

  @classmethod
  def from_gguf_metadata(cls, meta: dict) -> "HFTokenizer":
    """The tokenizer a GGUF file's `tokenizer.*` metadata describes
    (llama.cpp's keys without the `tokenizer.ggml.` prefix, as
    `paged_jax.models.gguf` reads them), and its `chat_template`:

    * `model` "gpt2": a byte-level BPE (`tokens`, `merges`, `token_type`)
      whose pre-tokenizer follows `pre` as llama.cpp's does
      (`PRE_TOKENIZERS`; "qwen2" also NFC-normalises, as Qwen2's own
      tokenizer.json does);
    * `model` "llama": a SentencePiece BPE (Llama 2, Mistral, TinyLlama:
      `tokens`, `scores`, `token_type`, optional `merges`), as
      `sentencepiece_bpe` builds it.

    BOS is added when `add_bos_token` says so (default: yes for "llama",
    as llama.cpp and transformers do), EOS when `add_eos_token` does.

    Raises:
      ValueError: another tokenizer model or pre-tokenizer (named), or
        missing vocabulary keys.
    """
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("a GGUF tokenizer needs the `tokenizers` package "
                        "(pip install tokenizers, or the `gguf` extra)") from e
    from tokenizers import processors  # pylint: disable=import-outside-toplevel
    kind = meta.get("model")
    if kind == "gpt2":
      tok = _byte_level_bpe(meta)
      add_bos = bool(meta.get("add_bos_token"))
    elif kind == "llama":
      tok = sentencepiece_bpe(meta)
      add_bos = meta.get("add_bos_token", True) is not False
    else:
      raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only "
                       "'gpt2', byte-level BPE, and 'llama', SentencePiece BPE)")
    tokens = meta["tokens"]
    types = meta.get("token_type") or [1] * len(tokens)
    # llama.cpp token types: 3 control (special), 4 user-defined.
    special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == 3]
    added = [tokenizers.AddedToken(tokens[i], special=False, normalized=False)
             for i, t in enumerate(types) if t == 4]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    bos, eos = meta.get("bos_token_id"), meta.get("eos_token_id")
    name = lambda i: tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None  # noqa: E731
    add_bos = add_bos and name(bos) is not None
    add_eos = bool(meta.get("add_eos_token")) and name(eos) is not None
    if add_bos or add_eos:
      first = f"{name(bos)} " if add_bos else ""
      last = f" {name(eos)}" if add_eos else ""
      tok.post_processor = processors.TemplateProcessing(
          single=f"{first}$A{last}", pair=f"{first}$A{last} {first}$B{last}",
          special_tokens=[(name(i), i) for i, on in ((bos, add_bos), (eos, add_eos)) if on])
    config = {"bos_token": name(bos), "eos_token": name(eos),
              "unk_token": name(meta.get("unknown_token_id")),
              "pad_token": name(meta.get("padding_token_id")),
              "chat_template": meta.get("chat_template")}
    return cls(tok, config, [eos] if name(eos) is not None else [])

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, token_ids: Sequence[int]) -> str:
    return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=True)

  def stream_decoder(self) -> StreamDecoder:
    return _WindowStream(self.decode)

  def apply_chat_template(self, messages: list[dict],
                          add_generation_prompt: bool = True) -> str:
    """Renders the chat template as transformers does (jinja2 sandbox,
    `trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`); the result
    already holds the special tokens, so encode it with
    `add_special_tokens=False`.

    Raises:
      ValueError: no chat template, bad messages, or the template raised.
    """
    _check_messages(messages)
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
    if self._compiled is None:
      try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel
      except ImportError as e:
        raise ImportError("chat templates need the `jinja2` package") from e

      def raise_exception(message):
        raise ValueError(f"chat template: {message}")

      env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=["jinja2.ext.loopcontrols"])
      env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
          x, ensure_ascii=False, indent=indent)
      env.globals["raise_exception"] = raise_exception
      self._compiled = env.from_string(self.chat_template)
    tokens = {k: v or "" for k, v in self.special.items()}
    return self._compiled.render(messages=messages,
                                 add_generation_prompt=add_generation_prompt,
                                 **tokens)


def _byte_level_bpe(meta: dict):
  """GGUF `model` "gpt2": byte-level BPE with llama.cpp's pre-tokenizer `pre`."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, normalizers, pre_tokenizers  # pylint: disable=import-outside-toplevel
  pre = meta.get("pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: "
                     f"{', '.join(sorted(PRE_TOKENIZERS))}")
  tokens, merges = meta.get("tokens"), meta.get("merges")
  if not tokens or merges is None:
    raise ValueError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens or "
                     "tokenizer.ggml.merges")
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = [tuple(m.split(" ", 1)) for m in merges]
  tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
  digits, pattern = PRE_TOKENIZERS[pre]
  steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
  if pattern is not None:
    steps.append(pre_tokenizers.Split(tokenizers.Regex(pattern), "isolated"))
  steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern is None))
  tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
  if pre in NFC_PRE_TOKENIZERS:
    tok.normalizer = normalizers.NFC()
  tok.decoder = decoders.ByteLevel()
  return tok


# llama.cpp `pre` names whose Hugging Face tokenizer.json NFC-normalises
# the text first (Qwen2's `Qwen2Tokenizer`; llama.cpp itself does not).
NFC_PRE_TOKENIZERS = frozenset({"qwen2"})


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
  """BPE merges that replay SentencePiece's score order: every split of a
  piece into two pieces of the vocabulary, best-scored piece first (ties:
  the longer left, then right, part; then vocabulary order), as
  transformers' `generate_merges` and llama.cpp's SPM tokenizer rank them."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for piece, score in zip(tokens, scores):
    local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
             if piece[:k] in vocab and piece[k:] in vocab]
    local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    merges += [(l, r, float(score)) for l, r in local]
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(l, r) for l, r, _ in merges]


def sentencepiece_bpe(meta: dict):
  """GGUF `model` "llama" (SentencePiece BPE) as a `tokenizers.Tokenizer`.

  The vocabulary is `tokens` (ids in order); the merges are the file's, or
  `sentencepiece_merges` of `scores`. Spaces are "\u2581" (a Metaspace
  pre-tokenizer, no splitting), prefixed to the text when `add_space_prefix`
  (default yes); characters outside the vocabulary fall back to the
  `<0xNN>` byte tokens, else `unknown_token_id`. Decoding undoes both (and
  strips the prefixed space).

  Raises:
    ValueError: no `tokens`, or `scores` of another length (without merges).
  """
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  tokens, scores, merges = meta.get("tokens"), meta.get("scores"), meta.get("merges")
  if not tokens:
    raise ValueError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens")
  if merges is not None:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
  elif scores is not None and len(scores) == len(tokens):
    pairs = sentencepiece_merges(tokens, scores)
  else:
    raise ValueError(f"GGUF SentencePiece tokenizer needs tokenizer.ggml.scores, one "
                     f"per token ({len(tokens)}), or tokenizer.ggml.merges; got "
                     f"{'no scores' if scores is None else f'{len(scores)} scores'}")
  unk = meta.get("unknown_token_id")
  unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True,
                                        byte_fallback=True))
  prefix = meta.get("add_space_prefix", True) is not False
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
      replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
  steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  if prefix:
    steps.append(decoders.Strip(content=" ", left=1))
  tok.decoder = decoders.Sequence(steps)
  return tok


def load_tokenizer(checkpoint: str | None) -> Tokenizer:
  """`ByteTokenizer()` for the built-in tiny model (`checkpoint=None`), else
  the checkpoint directory's `HFTokenizer`."""
  if checkpoint is None:
    return ByteTokenizer()
  return HFTokenizer.from_directory(checkpoint)
