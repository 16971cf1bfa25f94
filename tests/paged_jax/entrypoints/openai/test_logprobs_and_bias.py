"""Top log-probs and `logit_bias` through the OpenAI server: the OpenAI shapes
(completions' legacy `logprobs`, chat's `content`), streamed and not, and the
`--max-logprobs` bound (the harness's engine: `EngineConfig.max_logprobs` 8)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from paged_jax.serving.tokenizer import ByteTokenizer  # noqa: E402
from tests.paged_jax.entrypoints.openai.server_harness import Server  # noqa: E402

MSG = [{"role": "user", "content": "hi"}]
TOK = ByteTokenizer()  # the harness's
GREEDY = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(model):
  s = Server(model)
  yield s
  s.close()


def _legacy(lp, n):
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
  assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
  for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    vals = list(top.values())
    # The top N plus the sampled token, keyed by text (the byte tokenizer
    # decodes many ids to ""); greedy: the sampled one is the best.
    assert 1 <= len(top) <= n + 1
    assert math.isclose(top[tok], tok_lp, abs_tol=1e-6)
    assert tok_lp >= max(vals) - 1e-6 and all(v <= 0 for v in vals)


def test_completions_top_logprobs(server):
  c = server.client
  whole = c.completions.create(prompt="ab", logprobs=3, **GREEDY)
  _legacy(whole.choices[0].logprobs, 3)
  chunks = list(c.completions.create(prompt="ab", logprobs=3, stream=True, **GREEDY))
  streamed = [x.choices[0].logprobs for x in chunks if x.choices and x.choices[0].logprobs]
  lp = whole.choices[0].logprobs
  assert sum((s.tokens for s in streamed), []) == lp.tokens
  assert sum((s.top_logprobs for s in streamed), []) == lp.top_logprobs
  assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_top_logprobs(server):
  c = server.client
  whole = c.chat.completions.create(messages=MSG, logprobs=True, top_logprobs=2, **GREEDY)
  content = whole.choices[0].logprobs.content
  assert len(content) == 4
  for e in content:
    assert len(e.top_logprobs) == 2
    vals = [a.logprob for a in e.top_logprobs]
    assert vals == sorted(vals, reverse=True)
    assert math.isclose(e.logprob, vals[0], abs_tol=1e-6)  # greedy: the best one
    assert e.bytes == list(e.token.encode())
    assert all(a.bytes == list(a.token.encode()) for a in e.top_logprobs)
  chunks = list(c.chat.completions.create(messages=MSG, logprobs=True, top_logprobs=2,
                                          stream=True, **GREEDY))
  streamed = sum((x.choices[0].logprobs.content for x in chunks
                  if x.choices and x.choices[0].logprobs), [])
  assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
  plain = c.chat.completions.create(messages=MSG, logprobs=True, **GREEDY)
  assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


@pytest.mark.parametrize("chat", [False, True])
def test_above_max_logprobs_is_400(server, chat):
  c = server.client
  with pytest.raises(openai.BadRequestError, match=r"must be <= 8 \(the engine's "
                     r"max_logprobs\), got 9") as e:
    if chat:
      c.chat.completions.create(messages=MSG, logprobs=True, top_logprobs=9, **GREEDY)
    else:
      c.completions.create(prompt="ab", logprobs=9, **GREEDY)
  assert e.value.param == ("top_logprobs" if chat else "logprobs")


def test_logit_bias_through_the_server(server):
  c = server.client
  base = c.completions.create(prompt="ab", **GREEDY).choices[0].text
  assert "z" not in base
  forced = c.completions.create(prompt="ab", logit_bias={str(TOK.encode("z", add_special_tokens=False)[0]): 100}, logprobs=1,
                                **GREEDY).choices[0]
  assert forced.text == "zzzz"
  assert all(math.isclose(lp, 0.0, abs_tol=1e-3) for lp in forced.logprobs.token_logprobs)
  chat = dict(messages=MSG, **GREEDY)
  plain = c.chat.completions.create(**chat).choices[0].message.content
  ids = {str(t): -100 for t in set(TOK.encode(plain, add_special_tokens=False))}
  banned = c.chat.completions.create(logit_bias=ids, stream=True, **chat)
  text = "".join(x.choices[0].delta.content or "" for x in banned if x.choices)
  # (Ids that are no whole UTF-8 character decode to U+FFFD, so compare the
  # rest; the engine's tests compare ids.)
  assert text and text != plain and not (set(text) & set(plain)) - {"\ufffd"}
  # An unbiased request is served as before, whatever its neighbours asked.
  assert c.completions.create(prompt="ab", **GREEDY).choices[0].text == base


def test_logit_bias_past_the_servers_bound(model):
  s = Server(model, max_logit_bias=2)
  try:
    with pytest.raises(openai.BadRequestError, match=r"logit_bias must hold at most 2 "
                       r"entries \(the engine's max_logit_bias\), got 3") as e:
      s.client.completions.create(prompt="ab", logit_bias={"1": 1, "2": 1, "3": 1},
                                  **GREEDY)
    assert e.value.param == "logit_bias"
  finally:
    s.close()
