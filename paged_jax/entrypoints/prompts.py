"""The prompt files `generate` reads: token-id JSON (`--prompt-ids`) and text
(`--prompts-file`), each malformed entry one ValueError naming the file,
the entry and what was expected."""

from __future__ import annotations

import argparse
import json
import pathlib

from paged_jax import _cli


def token_ids(text: str) -> tuple[int, ...]:
  """`--stop-token-ids`: comma-separated integers (their range is
  `SamplingParams`' rule, checked with the flag's name)."""
  parts = [t.strip() for t in text.split(",") if t.strip()]
  if not parts or not all(t.lstrip("-").isascii() and t.lstrip("-").isdigit()
                          and len(t) <= 30 for t in parts):
    raise argparse.ArgumentTypeError(
        f"expected comma-separated token ids, got {_cli.shown(text)}")
  return tuple(int(t) for t in parts)


def load_text_prompts(path: str) -> list[tuple[str, int | None]]:
  """Text prompts of `--prompts-file`: a JSONL file (every non-empty line an
  object with "prompt", optionally "max_new_tokens") or plain text (one
  prompt a line); `(prompt, max_new_tokens or None)` each.

  Raises:
    FileNotFoundError: missing file.
    ValueError: unreadable, empty, or a JSONL line without a "prompt" string.
  """
  f = pathlib.Path(path)
  if not f.is_file():
    raise FileNotFoundError(f"prompts file {_cli.shown(path)} not found")
  try:
    lines = [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
  except (ValueError, OSError) as e:
    raise ValueError(f"{path}: cannot read it ({e})") from None
  if not lines:
    raise ValueError(f"{path}: no prompts (expected one a line, or JSONL)")
  if not lines[0].lstrip().startswith("{"):
    return [(ln, None) for ln in lines]
  out = []
  for i, ln in enumerate(lines):
    try:
      d = json.loads(ln)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: line {i + 1}: not valid JSON ({e})") from None
    new = d.get("max_new_tokens") if isinstance(d, dict) else None
    if (not isinstance(d, dict) or not isinstance(d.get("prompt"), str)
        or new is not None and (not _is_int(new) or new < 1)):
      raise ValueError(f"{path}: line {i + 1}: expected an object with a "
                       '"prompt" string and optionally "max_new_tokens" >= 1')
    out.append((d["prompt"], new))
  return out


def load_prompts(path: str) -> list[tuple[list[int], int | None]]:
  """Reads a JSON list of prompts: token-id lists, or objects
  `{"prompt_ids": [...], "max_new_tokens": n}` (`max_new_tokens` optional).

  Returns:
    `(prompt_ids, max_new_tokens or None)` per prompt.

  Raises:
    FileNotFoundError: missing file.
    ValueError: unreadable, not JSON, nested too deeply, or not a non-empty
      list of prompts as above (a float or bool token id is a type error).
  """
  f = pathlib.Path(path)
  if not f.is_file():
    raise FileNotFoundError(f"prompt file {_cli.shown(path)} not found")
  try:
    data = json.loads(f.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  except RecursionError:
    raise ValueError(f"{path}: JSON nested too deeply (expected a list of "
                     "token-id lists)") from None
  except (ValueError, OSError) as e:  # bad UTF-8, > 4300-digit ints, unreadable
    raise ValueError(f"{path}: cannot read it ({e})") from None
  if not isinstance(data, list) or not data:
    raise ValueError(f"{path}: expected a non-empty JSON list of prompts "
                     "(token-id lists or objects with prompt_ids)")
  return [_prompt_entry(path, i, entry) for i, entry in enumerate(data)]


def _prompt_entry(path, i, entry) -> tuple[list[int], int | None]:
  max_new = None
  if isinstance(entry, dict):
    unknown = sorted(set(entry) - {"prompt_ids", "max_new_tokens"})
    if unknown or "prompt_ids" not in entry:
      raise ValueError(f"{path}: prompt {i}: expected keys prompt_ids and "
                       f"optionally max_new_tokens, got {sorted(entry)}")
    max_new = entry.get("max_new_tokens")
    if max_new is not None and (not _is_int(max_new) or max_new < 1):
      raise ValueError(f"{path}: prompt {i}: max_new_tokens must be an int "
                       f">= 1, got {max_new!r}")
    entry = entry["prompt_ids"]
  if not isinstance(entry, list) or not entry:
    raise ValueError(f"{path}: prompt {i} must be a non-empty list of ints")
  for j, t in enumerate(entry):
    if not _is_int(t):
      raise ValueError(f"{path}: prompt {i}, token {j}: expected an int "
                       f"token id, got {_cli.one_line(repr(t), 40)} "
                       f"({type(t).__name__})")
  return entry, max_new


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def check_vocab(prompts, vocab_size: int):
  """Raises ValueError naming the first prompt with an id outside the
  vocabulary (the engine's rule, `admission.vocab_rejection`)."""
  from paged_jax.serving.admission import vocab_rejection  # pylint: disable=import-outside-toplevel
  for i, prompt in enumerate(prompts):
    why = vocab_rejection(prompt, vocab_size)
    if why:
      raise ValueError(f"prompt {i}: {why}")
