"""`examples/generate.py` with text prompts: --prompt, --prompts-file, --stop,
--stop-token-ids, --min-tokens."""

from __future__ import annotations

import json

import pytest

from paged_jax.entrypoints import generate
from tests.examples.test_generate import SMALL, run


def test_text_prompts_stream_and_write_text(tmp_path, capsys):
  out = tmp_path / "o.json"
  rc, text, err = run(SMALL + ["--prompt", "Hello", "--prompt", "héllo", "--max-new-tokens", "6",
                               "--min-tokens", "2", "--stop-token-ids", "7,9",
                               "--output", str(out)], capsys)
  assert rc == 0, err
  assert "[0] '" in text and "[1] '" in text and "paged KV cache" in text
  assert "contiguous" not in text  # no baseline for text
  doc = json.loads(out.read_text())
  for r in doc["requests"]:
    (c,) = r["completions"]
    assert isinstance(c["text"], str) and len(c["token_logprobs"]) == len(c["token_ids"])
    assert not {7, 9, 2} & set(c["token_ids"][:2])  # min_tokens masks them


def test_prompts_file_lines_and_jsonl(tmp_path):
  f = tmp_path / "p.txt"
  f.write_text("first prompt\n\nsecond\n")
  assert generate.load_text_prompts(str(f)) == [("first prompt", None), ("second", None)]
  f.write_text('{"prompt": "a"}\n{"prompt": "b", "max_new_tokens": 3}\n')
  assert generate.load_text_prompts(str(f)) == [("a", None), ("b", 3)]


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "a"}\n{"text": "b"}\n',
     'line 2: expected an object with a "prompt" string and optionally "max_new_tokens" >= 1'),
    ('{"prompt": "a", "max_new_tokens": 0}\n', "line 1: expected an object"),
    ('{"prompt": "a"\n', "line 1: not valid JSON"),
    ("\n\n", "no prompts (expected one a line, or JSONL)"),
])
def test_bad_prompts_file(tmp_path, capsys, content, match):
  f = tmp_path / "p.jsonl"
  f.write_text(content)
  rc, _, err = run(["--model", "tiny", "--prompts-file", str(f), "--no-progress"], capsys)
  assert rc == 2 and match in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args,match", [
    (["--stop", "x"], "error: --stop needs text prompts (--prompt or --prompts-file)\n"),
    (["--prompt", "a", "--prompts-file", "f"],
     "error: give one of --prompt, --prompts-file and --prompt-ids\n"),
    (["--stop-token-ids", "1,x"],
     "error: argument --stop-token-ids: expected comma-separated token ids, got '1,x'\n"),
    (["--min-tokens", "9", "--max-new-tokens", "4"],
     "error: --min-tokens must be in [0, --max-new-tokens 4], got 9\n"),
    (["--prompts-file", "/nonexistent.txt"], "error: prompts file '/nonexistent.txt' not found\n"),
])
def test_text_flag_errors(args, match, capsys):
  rc, _, err = run(args + ["--no-progress"], capsys)
  assert rc == 2 and err == match, err
