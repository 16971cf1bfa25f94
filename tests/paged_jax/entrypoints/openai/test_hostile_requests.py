"""No request can harm the server (issue 26): a table of hostile requests, each
with its expected status, message and field, all sent over ONE keep-alive
connection; after each, a normal request on that same connection succeeds
and `/health` is 200. Hypothesis then sends generated bodies of the same
class. Finally the pool is whole (`check_invariants`, every block free)."""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402

from paged_jax import block_manager as bm  # noqa: E402
from tests.paged_jax.entrypoints.openai.server_harness import (  # noqa: E402
    NUM_BLOCKS, Server)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
INF = "the body is not valid JSON: Infinity is not a JSON number"
# Words that must never reach a client: Python's and the engine's internals.
INTERNALS = ("Traceback", "object is not", "invalid literal", "max_new_tokens",
             "CompletionRequest", "ChatMessage", "StreamOptions", "pydantic", "Value error")


def _raw(text: str) -> bytes:
  return text.encode()


# (name, path, body: dict or raw bytes, status, message regex, param)
CASES = [
    # The five engine-killers of the issue (and seed 2**31 - 1 with n = 2).
    ("stop id a list", CMPL, dict(prompt="hello", stop_token_ids=[[1]], max_tokens=4),
     400, r"stop_token_ids\[0\] must be an integer, got an array", "stop_token_ids[0]"),
    ("stop id past int32", CMPL, _raw('{"prompt":"hello","stop_token_ids":'
                                      '[1180591620717411303424],"min_tokens":1,'
                                      '"max_tokens":4}'),
     400, r"stop_token_ids\[0\] must be <= 2\*\*31 - 1, got 1180591620717411303424",
     "stop_token_ids[0]"),
    ("stop id a string", CMPL, dict(prompt="hello", stop_token_ids=["a"], min_tokens=1,
                                    max_tokens=4),
     400, r'stop_token_ids\[0\] must be an integer, got "a"', "stop_token_ids[0]"),
    ("seed -1", CMPL, dict(prompt="hello", seed=-1, n=2, temperature=1, max_tokens=4),
     400, r"seed must be an int in \[0, 2\*\*31\), got -1", "seed"),
    ("seed + index overflows", CMPL, dict(prompt="hello", seed=2**31 - 1, n=2,
                                          temperature=1, max_tokens=4),
     400, r"seed \+ 1 \(sample i uses seed \+ i\) must be < 2\*\*31, got seed=2147483647",
     "seed"),
    ("top_k past int32", CMPL, dict(prompt="hi", top_k=2**31, temperature=1, max_tokens=4),
     400, r"top_k must be <= 2\*\*31 - 1, got 2147483648", "top_k"),
    # Not JSON numbers, and nesting too deep.
    ("top_k Infinity", CMPL, _raw('{"prompt":"hi","top_k":Infinity}'), 400, INF, None),
    ("n Infinity", CMPL, _raw('{"prompt":"hi","n":Infinity}'), 400, INF, None),
    ("seed -Infinity", CMPL, _raw('{"prompt":"hi","seed":-Infinity}'), 400,
     "-Infinity is not a JSON number", None),
    ("min_tokens NaN", CMPL, _raw('{"prompt":"hi","min_tokens":NaN}'), 400,
     "NaN is not a JSON number", None),
    ("an integer of 5,000 digits", CMPL, _raw('{"prompt":"hi","n":1' + "0" * 5000 + "}"),
     400, "a number has too many digits", None),
    ("temperature 1e400", CMPL, _raw('{"prompt":"hi","temperature":1e400}'), 400,
     "temperature must be a finite number, got inf", "temperature"),
    ("a lone surrogate", CMPL, _raw('{"prompt":"hi \\ud800"}'), 400,
     "a string that is not Unicode text", None),
    ("a lone surrogate salt", CMPL, _raw('{"prompt":"hi","cache_salt":"\\uDFFF"}'), 400,
     "a string that is not Unicode text", None),
    ("nested 10,000 deep", CMPL, _raw("[" * 10000 + "]" * 10000), 400,
     "the body is nested too deeply", None),
    ("a field nested 10,000 deep", CMPL, _raw('{"prompt":"hi","stop":' + "[" * 10000
                                              + "]" * 10000 + "}"),
     400, "the body is nested too deeply", None),
    ("a prompt nested 500 deep", CMPL, _raw('{"prompt":' + "[" * 500 + "]" * 500 + "}"),
     400, "prompt must be a string, an array of token ids, or an array holding one",
     "prompt"),
    # Nonsense once accepted or coerced.
    ("max_tokens 0", CMPL, dict(prompt="hi", max_tokens=0), 400,
     "max_tokens must be >= 1, got 0", "max_tokens"),
    ("max_tokens past int32", CMPL, dict(prompt="hi", max_tokens=2**31), 400,
     r"max_tokens must be >= 1 and < 2\*\*31, got 2147483648", "max_tokens"),
    ("min_tokens -1", CMPL, dict(prompt="hi", min_tokens=-1), 400,
     "min_tokens must be >= 0, got -1", "min_tokens"),
    ("n 0", CMPL, dict(prompt="hi", n=0), 400, "n must be >= 1, got 0", "n"),
    ("n 2.9", CMPL, dict(prompt="hi", n=2.9), 400, "n must be an integer, got 2.9", "n"),
    ("n 2.0", CMPL, dict(prompt="hi", n=2.0), 400, "n must be an integer, got 2.0", "n"),
    ("top_k 2.7", CMPL, dict(prompt="hi", top_k=2.7), 400,
     "top_k must be an integer, got 2.7", "top_k"),
    ("seed 2**70", CMPL, dict(prompt="hi", seed=2**70), 400,
     r"seed must be an int in \[0, 2\*\*31\), got 1180591620717411303424", "seed"),
    ("stop an object", CMPL, dict(prompt="hi", stop={"a": 1}), 400,
     "stop must be a string or an array of strings, got an object", "stop"),
    ("max_tokens true", CMPL, dict(prompt="hi", max_tokens=True), 400,
     "max_tokens must be an integer, got true", "max_tokens"),
    ("max_tokens a string", CMPL, dict(prompt="hi", max_tokens="4"), 400,
     'max_tokens must be an integer, got "4"', "max_tokens"),
    ("temperature -1", CMPL, dict(prompt="hi", temperature=-1), 400,
     "temperature must be >= 0 and finite, got -1.0", "temperature"),
    ("temperature a string", CMPL, dict(prompt="hi", temperature="hot"), 400,
     'temperature must be a number, got "hot"', "temperature"),
    ("top_p 0", CMPL, dict(prompt="hi", top_p=0), 400, r"top_p must be in \(0, 1\], got 0.0",
     "top_p"),
    ("top_p 1e-300", CMPL, dict(prompt="hi", top_p=1e-300), 400,
     r"top_p must be in \(0, 1\] in float32, got 1e-300", "top_p"),
    ("temperature 1e300", CMPL, dict(prompt="hi", temperature=1e300), 400,
     r"temperature must be <= 3.403e\+38 \(float32\), got 1e\+300", "temperature"),
    ("top_p 1.5", CMPL, dict(prompt="hi", top_p=1.5), 400, r"top_p must be in \(0, 1\], got 1.5",
     "top_p"),
    ("top_k -2", CMPL, dict(prompt="hi", top_k=-2), 400, "top_k must be >= -1, got -2",
     "top_k"),
    ("min_tokens past max_tokens", CMPL, dict(prompt="hi", max_tokens=2, min_tokens=5), 400,
     r"min_tokens must be in \[0, max_tokens=2\], got 5", "min_tokens"),
    ("min_tokens past the default max_tokens", CMPL, dict(prompt="hi", min_tokens=9), 400,
     r"min_tokens must be in \[0, max_tokens=8\], got 9", "min_tokens"),
    ("stream a string", CMPL, dict(prompt="hi", stream="yes"), 400,
     'stream must be a boolean, got "yes"', "stream"),
    ("stream_options without stream", CMPL,
     dict(prompt="hi", stream_options={"include_usage": True}), 400,
     "stream_options needs stream: true", "stream_options"),
    ("stream_options a number", CMPL, dict(prompt="hi", stream=True, stream_options=3), 400,
     "stream_options must be an object, got 3", "stream_options"),
    ("stream_options unknown", CMPL, dict(prompt="hi", stream=True,
                                          stream_options={"x": 1}), 400,
     "unrecognized request argument: stream_options.x", "stream_options.x"),
    ("stop an empty string", CMPL, dict(prompt="hi", stop=[""]), 400,
     "stop must not hold empty strings", "stop"),
    ("17 stop strings", CMPL, dict(prompt="hi", stop=[str(i) for i in range(17)]), 400,
     "stop must hold at most 16 strings, got 17", "stop"),
    ("cache_salt a number", CMPL, dict(prompt="hi", cache_salt=7), 400,
     "cache_salt must be a string, got 7", "cache_salt"),
    ("cache_salt too long", CMPL, dict(prompt="hi", cache_salt="s" * 1025), 400,
     "cache_salt must hold at most 1024 characters", "cache_salt"),
    ("cache_salt empty", CMPL, dict(prompt="hi", cache_salt=""), 400,
     "cache_salt must not be empty", "cache_salt"),
    # Prompts.
    ("no prompt", CMPL, dict(max_tokens=3), 400, "prompt is required", "prompt"),
    ("prompt empty list", CMPL, dict(prompt=[]), 400, "prompt must not be empty", "prompt"),
    ("prompt [[]]", CMPL, dict(prompt=[[]]), 400, "prompt must not be empty", "prompt"),
    ("prompt bools", CMPL, dict(prompt=[True]), 400,
     "prompt must be a string, an array of token ids", "prompt"),
    ("prompt negative id", CMPL, dict(prompt=[-1]), 400,
     r"prompt must hold token ids in \[0, 2\*\*31\), got -1", "prompt"),
    ("prompt id past the vocabulary", CMPL, dict(prompt=[512]), 400,
     r"request rejected: prompt token 512 is outside the vocabulary \[0, 512\)", None),
    ("prompt an object", CMPL, dict(prompt={"a": 1}), 400,
     "prompt must be a string, an array of token ids, or an array holding one of these, "
     "got an object", "prompt"),
    ("two prompts", CMPL, dict(prompt=["a", "b"]), 400,
     "prompt holds 2 prompts; one request serves one prompt", "prompt"),
    ("two id prompts", CMPL, dict(prompt=[[65], [66]]), 400,
     "prompt holds 2 prompts", "prompt"),
    ("prompt too long", CMPL, dict(prompt="x" * 80), 400,
     "maximum context length is 64 tokens; the prompt has 81", "prompt"),
    ("prompt + max_tokens too long", CMPL, dict(prompt="x" * 40, max_tokens=30), 400,
     "the prompt has 41 and max_tokens asks for 30 more", "max_tokens"),
    # The body itself.
    ("not JSON", CMPL, _raw("{prompt: hi}"), 400,
     "the body is not valid JSON: Expecting property name", None),
    ("empty body", CMPL, b"", 400, "the body is not valid JSON", None),
    ("not UTF-8", CMPL, b'{"prompt": "\xff"}', 400, "the body is not UTF-8", None),
    ("a list body", CMPL, _raw("[1]"), 400, "the body must be a JSON object, got an array",
     None),
    ("unknown field", CMPL, dict(prompt="hi", foo=1), 400,
     "unrecognized request argument: foo", "foo"),
    ("unknown model", CMPL, dict(prompt="hi", model="gpt-4"), 404,
     'The model "gpt-4" does not exist; this server serves "tiny"', "model"),
    # Supported up to a limit, or refused by name.
    ("n past the batch", CMPL, dict(prompt="hi", n=5), 400,
     r"n \(5\) exceeds the 4 sequences this server runs at once", "n"),
    ("best_of past the batch", CMPL, dict(prompt="hi", best_of=5), 400,
     r"best_of \(5\) exceeds the 4 sequences", "best_of"),
    ("best_of below n", CMPL, dict(prompt="hi", best_of=1, n=2), 400,
     r"best_of \(1\) must be >= n \(2\)", "best_of"),
    ("best_of streamed", CMPL, dict(prompt="hi", best_of=2, stream=True), 400,
     "best_of > n cannot be streamed", "best_of"),
    ("logprobs 1000", CMPL, dict(prompt="hi", logprobs=1000), 400,
     r"logprobs must be <= 8 \(the engine's max_logprobs\), got 1000", "logprobs"),
    ("logprobs 9", CMPL, dict(prompt="hi", logprobs=9), 400,
     r"logprobs must be <= 8 \(the engine's max_logprobs\), got 9", "logprobs"),
    ("logprobs 2**31", CMPL, dict(prompt="hi", logprobs=2**31), 400,
     r"logprobs must be <= 2\*\*31 - 1", "logprobs"),
    ("echo with logprobs", CMPL, dict(prompt="hi", echo=True, logprobs=0), 400,
     "echo with logprobs needs the prompt's log-probabilities", "echo"),
    ("logit_bias NaN", CMPL, _raw('{"prompt":"hi","logit_bias":{"65":NaN}}'), 400,
     "the body is not valid JSON: NaN is not a JSON number", None),
    ("logit_bias 1e9", CMPL, dict(prompt="hi", logit_bias={"65": 1e9}), 400,
     r"logit_bias values must be numbers in \[-100, 100\], got 1000000000.0 for token 65",
     "logit_bias"),
    ("logit_bias -101", CHAT, dict(messages=MSG, logit_bias={"65": -101}), 400,
     r"logit_bias values must be numbers in \[-100, 100\], got -101", "logit_bias"),
    ("logit_bias true", CMPL, dict(prompt="hi", logit_bias={"65": True}), 400,
     r"logit_bias values must be numbers .* got true for token 65", "logit_bias"),
    ("logit_bias string value", CMPL, dict(prompt="hi", logit_bias={"65": "5"}), 400,
     r'logit_bias values must be numbers .* got "5" for token 65', "logit_bias"),
    ("logit_bias out of vocab", CMPL, dict(prompt="hi", logit_bias={"512": 1}), 400,
     r"logit_bias token id 512 is outside the vocabulary \[0, 512\)", "logit_bias"),
    ("logit_bias past int32", CMPL, dict(prompt="hi", logit_bias={"2147483648": 1}), 400,
     r"logit_bias keys must be token ids \(strings of decimal digits, < 2\*\*31\), got "
     '"2147483648"', "logit_bias"),
    ("logit_bias key a", CHAT, dict(messages=MSG, logit_bias={"a": 1}), 400,
     r'logit_bias keys must be token ids .* got "a"', "logit_bias"),
    ("logit_bias key 1.5", CMPL, dict(prompt="hi", logit_bias={"1.5": 1}), 400,
     r'logit_bias keys must be token ids .* got "1\.5"', "logit_bias"),
    ("logit_bias key -1", CMPL, dict(prompt="hi", logit_bias={"-1": 1}), 400,
     r'logit_bias keys must be token ids .* got "-1"', "logit_bias"),
    ("logit_bias key ' 1'", CMPL, dict(prompt="hi", logit_bias={" 1": 1}), 400,
     r'logit_bias keys must be token ids .* got " 1"', "logit_bias"),
    ("logit_bias 7 and 07", CMPL, dict(prompt="hi", logit_bias={"7": 1, "07": 2}), 400,
     "logit_bias names token 7 twice", "logit_bias"),
    ("logit_bias 301 entries", CMPL,
     dict(prompt="hi", logit_bias={str(i): 1 for i in range(301)}), 400,
     "logit_bias must hold at most 300 entries, got 301", "logit_bias"),
    ("logit_bias an array", CMPL, dict(prompt="hi", logit_bias=[[65, 1]]), 400,
     "logit_bias must be an object from token ids to biases, got an array",
     "logit_bias"),
    ("presence_penalty", CMPL, dict(prompt="hi", presence_penalty=0.5), 400,
     "presence_penalty is not supported; give 0", "presence_penalty"),
    ("frequency_penalty", CMPL, dict(prompt="hi", frequency_penalty=1), 400,
     "frequency_penalty is not supported; give 0", "frequency_penalty"),
    ("repetition_penalty", CMPL, dict(prompt="hi", repetition_penalty=1.2), 400,
     "repetition_penalty is not supported; give 1", "repetition_penalty"),
    ("min_p", CMPL, dict(prompt="hi", min_p=0.1), 400, "min_p is not supported", "min_p"),
    ("suffix", CMPL, dict(prompt="hi", suffix="x"), 400,
     r"suffix \(insertion\) is not supported", "suffix"),
    ("too many stop ids for min_tokens", CMPL,
     dict(prompt="hi", min_tokens=1, stop_token_ids=list(range(10, 19))), 400,
     "request rejected: min_tokens needs at most 8 EOS and stop token ids, got 10", None),
    # Chat.
    ("no messages", CHAT, dict(max_tokens=2), 400, "messages is required", "messages"),
    ("messages empty", CHAT, dict(messages=[]), 400, "messages must not be empty", "messages"),
    ("messages a string", CHAT, dict(messages="hi"), 400,
     'messages must be an array, got "hi"', "messages"),
    ("a message a number", CHAT, dict(messages=[3]), 400,
     "messages\\[0\\] must be an object, got 3", "messages[0]"),
    ("a role unknown", CHAT, dict(messages=[{"role": "bot", "content": "x"}]), 400,
     r"messages\[0\].role must be one of 'system', 'developer', 'user', 'assistant' or "
     "'tool', got \"bot\"", "messages[0].role"),
    ("a content image", CHAT, dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     r'messages\[0\].content must hold text parts only, got type "image_url"',
     "messages[0].content"),
    ("a content number", CHAT, dict(messages=[{"role": "user", "content": 5}]), 400,
     r"messages\[0\].content must be a string or a non-empty array of text parts, got 5",
     "messages[0].content"),
    ("a message without content", CHAT, dict(messages=[{"role": "user"}]), 400,
     r"messages\[0\].content is required", "messages[0].content"),
    ("a message field unknown", CHAT,
     dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400,
     r"unrecognized request argument: messages\[0\].tool_call_id",
     "messages[0].tool_call_id"),
    ("tools", CHAT, dict(messages=MSG, tools=[{"type": "function"}]), 400,
     "tools are not supported", "tools"),
    ("response_format json", CHAT, dict(messages=MSG, response_format={"type": "json_object"}),
     400, "response_format other than text is not supported", "response_format"),
    ("top_logprobs without logprobs", CHAT, dict(messages=MSG, top_logprobs=0), 400,
     "top_logprobs needs logprobs: true", "top_logprobs"),
    ("top_logprobs 9", CHAT, dict(messages=MSG, logprobs=True, top_logprobs=9), 400,
     r"top_logprobs must be <= 8 \(the engine's max_logprobs\), got 9", "top_logprobs"),
    ("top_logprobs -1", CHAT, dict(messages=MSG, logprobs=True, top_logprobs=-1), 400,
     "top_logprobs must be >= 0, got -1", "top_logprobs"),
    ("max_completion_tokens 0", CHAT, dict(messages=MSG, max_completion_tokens=0), 400,
     "max_completion_tokens must be >= 1, got 0", "max_completion_tokens"),
    ("max_tokens disagree", CHAT, dict(messages=MSG, max_tokens=2, max_completion_tokens=3),
     400, "max_tokens and max_completion_tokens disagree", "max_completion_tokens"),
    ("chat echo", CHAT, dict(messages=MSG, echo=True), 400,
     "unrecognized request argument: echo", "echo"),
    ("chat unknown model", CHAT, dict(messages=MSG, model="nope"), 404,
     'The model "nope" does not exist', "model"),
]


@pytest.fixture(scope="module")
def server(model):
  s = Server(model)
  yield s
  s.close()


class _Conn:
  """One keep-alive HTTP/1.1 connection; every request must reuse its socket."""

  def __init__(self, port):
    self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    self.http.connect()
    self.sock = self.http.sock

  def request(self, method, path, body: bytes | None = None):
    headers = {"Content-Type": "application/json"} if body is not None else {}
    self.http.request(method, path, body=body, headers=headers)
    r = self.http.getresponse()
    data = r.read()
    assert (r.getheader("connection") or "").lower() != "close", (path, r.status, data)
    assert self.http.sock is self.sock, "the server dropped the keep-alive connection"
    return r, data

  def normal_request_succeeds(self):
    r, data = self.request("POST", CMPL, json.dumps({"prompt": "ok", "max_tokens": 1,
                                                     "temperature": 0}).encode())
    assert r.status == 200, data
    assert json.loads(data)["choices"][0]["finish_reason"] in ("stop", "length")
    r, data = self.request("GET", "/health")
    assert (r.status, data) == (200, b"ok")


def _check_error(r, data, status, match, param):
  import re  # pylint: disable=import-outside-toplevel
  assert r.status == status, data
  assert r.getheader("content-type") == "application/json"
  assert int(r.getheader("content-length")) == len(data)
  err = json.loads(data)["error"]
  assert set(err) == {"message", "type", "param", "code"}
  assert err["type"] == "invalid_request_error" and isinstance(err["code"], str)
  assert re.search(match, err["message"]), err["message"]
  assert err["param"] == param, err
  assert not any(w in err["message"] for w in INTERNALS), err["message"]


def test_hostile_requests_table(server):
  conn = _Conn(server.port)
  assert len({c[0] for c in CASES}) == len(CASES)
  wrong = []
  for name, path, body, status, match, param in CASES:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r, data = conn.request("POST", path, raw)
    try:
      _check_error(r, data, status, match, param)
    except AssertionError as e:
      wrong.append(f"case {name!r}: {str(e).splitlines()[0]}")
    conn.normal_request_succeeds()
  assert not wrong, "\n".join(wrong)
  server.wait_idle()
  assert int(server.loop.engine.block_state.num_free) == NUM_BLOCKS


def test_an_unknown_path_or_method_is_an_openai_error(server):
  conn = _Conn(server.port)
  for method, path, status, match in (("POST", "/v1/embeddings", 404, "Not Found"),
                                      ("GET", CMPL, 405, "Method Not Allowed")):
    r, data = conn.request(method, path, b"{}" if method == "POST" else None)
    err = json.loads(data)["error"]
    assert r.status == status and err["message"] == f"{method} {path}: {match}"
  conn.normal_request_succeeds()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_past_the_limit_is_413_and_closes_the_connection(server, chunked):
  body = json.dumps({"prompt": "x" * 2**17}).encode()  # the harness allows 64 KiB
  conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
  if chunked:  # no Content-Length: the server finds out while reading
    conn.request("POST", CMPL, body=iter([body[:2**15], body[2**15:]]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
  else:
    conn.request("POST", CMPL, body=body, headers={"Content-Type": "application/json"})
  r = conn.getresponse()
  data = r.read()
  assert r.status == 413 and r.getheader("connection") == "close"
  assert "larger than this server's limit of 65536 bytes" in json.loads(data)["error"][
      "message"]
  conn.close()
  _Conn(server.port).normal_request_succeeds()


@pytest.mark.parametrize("path,body", [
    (CMPL, dict(prompt=[65], max_tokens=2)),  # one token id is a valid prompt
    (CMPL, dict(prompt="a \U0001F600 pair of surrogates", max_tokens=2)),
    (CMPL, dict(prompt=[[65, 66]], max_tokens=2)),
    (CMPL, dict(prompt=["hi"], max_tokens=2, top_k=-1, presence_penalty=0,
                frequency_penalty=0, logit_bias={}, user="u", model="tiny")),
    (CMPL, dict(prompt="hi", max_tokens=2, stop="x", stop_token_ids=[], n=2, seed=2**31 - 2,
                temperature=0.5, top_p=0.9, top_k=3, min_tokens=1, ignore_eos=True,
                cache_salt="t")),
    (CHAT, dict(messages=[{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                max_completion_tokens=2, logprobs=True, top_logprobs=0,
                response_format={"type": "text"}, tool_choice="none")),
    (CMPL, dict(prompt="hi", max_tokens=2, logprobs=8, n=2, temperature=1)),
    (CMPL, dict(prompt="hi", max_tokens=2, logit_bias={str(i): -100 for i in range(300)})),
    (CHAT, dict(messages=MSG, max_tokens=2, logit_bias={"0": 100, "511": -1.5})),
    (CHAT, dict(messages=MSG, max_tokens=2, logprobs=True, top_logprobs=8)),
])
def test_unusual_but_valid_requests_are_served(server, path, body):
  conn = _Conn(server.port)
  r, data = conn.request("POST", path, json.dumps(body).encode())
  assert r.status == 200, data
  out = json.loads(data)
  assert len(out["choices"]) == body.get("n", 1)
  assert out["usage"]["completion_tokens"] >= 1


def test_echo_and_best_of(server):
  c = server.client
  plain = c.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0,
                               extra_body={"ignore_eos": True})
  echoed = c.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0,
                                echo=True, extra_body={"ignore_eos": True})
  assert echoed.choices[0].text == "ab" + plain.choices[0].text
  streamed = c.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0,
                                  echo=True, stream=True, extra_body={"ignore_eos": True})
  assert "".join(x.choices[0].text for x in streamed) == echoed.choices[0].text
  best = c.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=1,
                              seed=5, best_of=3, n=1, logprobs=0,
                              extra_body={"ignore_eos": True})
  samples = c.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=1,
                                 seed=5, n=3, logprobs=0, extra_body={"ignore_eos": True})
  means = [sum(s.logprobs.token_logprobs) / 3 for s in samples.choices]
  (choice,) = best.choices
  assert choice.text == samples.choices[means.index(max(means))].text
  assert best.usage.completion_tokens == 9  # every sample generated counts


def test_the_openai_client_gets_its_own_error_types(server):
  import openai  # pylint: disable=import-outside-toplevel
  with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1") as e:
    server.client.completions.create(model="tiny", prompt="hi", max_tokens=0)
  assert e.value.status_code == 400 and e.value.param == "max_tokens"
  assert e.value.code == "invalid_value" and e.value.type == "invalid_request_error"
  with pytest.raises(openai.NotFoundError, match="does not exist") as e:
    server.client.chat.completions.create(model="gpt-4o", messages=MSG)
  assert e.value.code == "model_not_found" and e.value.param == "model"
  with pytest.raises(openai.BadRequestError, match="presence_penalty is not supported"):
    server.client.chat.completions.create(model="tiny", messages=MSG, presence_penalty=1)


# ---------------------------------------------------------------- generated

_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stop_token_ids", "min_tokens", "ignore_eos", "cache_salt", "stream",
           "stream_options", "logprobs", "echo", "best_of", "user", "model", "logit_bias",
           "presence_penalty", "suffix", "max_completion_tokens", "zzz"]
_INTS = st.one_of(st.integers(-3, 70), st.sampled_from([2**31 - 1, 2**31, 2**63, -2**31,
                                                        2**70]))
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS,
                     st.floats(allow_nan=False, allow_infinity=False, width=32),
                     st.text(max_size=6))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=2)),
                     max_leaves=6)
_VALUE = st.one_of(_INTS, _JSON, st.lists(_INTS, max_size=3))
# Plausible values, so that about half the generated requests are served.
_VALID = {
    "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 600), "n": st.integers(1, 4),
    "seed": st.integers(0, 2**31 - 5), "min_tokens": st.integers(0, 1),
    "stop": st.one_of(st.text(min_size=1, max_size=2),
                      st.lists(st.text(min_size=1, max_size=2), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3),
    "ignore_eos": st.booleans(), "cache_salt": st.text(min_size=1, max_size=4),
    "stream": st.booleans(), "logprobs": st.integers(0, 9), "echo": st.booleans(),
    "best_of": st.integers(1, 4), "user": st.text(max_size=4), "model": st.just("tiny"),
    "logit_bias": st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100),
                                  max_size=3),
    "presence_penalty": st.just(0),
}


def _mostly(valid):
  """`valid` four times in five, else any JSON value."""
  return st.integers(0, 4).flatmap(lambda i: valid if i else _VALUE)


_BODIES = st.sets(st.sampled_from(_FIELDS), max_size=5).flatmap(
    lambda keys: st.fixed_dictionaries(
        {k: _mostly(_VALID[k]) if k in _VALID else _VALUE
         for k in sorted(keys)}))


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(body=_BODIES, chat=st.booleans())
def test_generated_requests_never_harm_the_server(server, body, chat):
  if chat:
    body = {"messages": MSG, **{k: v for k, v in body.items() if k != "prompt"}}
  else:
    body.setdefault("prompt", "hi")  # (a missing prompt is in the table)
  if body.get("max_tokens") is None or isinstance(body.get("max_tokens"), int):
    body.setdefault("max_tokens", 2)  # keep each served request short
  conn = _Conn(server.port)
  r, data = conn.request("POST", CHAT if chat else CMPL, json.dumps(body).encode())
  assert r.status in (200, 400, 404), (body, r.status, data)
  if r.status != 200:
    err = json.loads(data)["error"]
    assert isinstance(err["message"], str) and err["code"]
    assert not any(w in err["message"] for w in INTERNALS), (body, err)
  elif body.get("stream") is True:
    assert data.rstrip().endswith(b"data: [DONE]"), data
    assert b'"error"' not in data
  conn.normal_request_succeeds()


def test_the_pool_is_whole_after_all_that(server):
  server.wait_idle()
  server.loop.close()  # the engine thread stops; its state can be read safely
  state = server.loop.engine.block_state
  bm.check_invariants(state)
  assert int(state.num_free) == NUM_BLOCKS


def test_a_refused_body_is_drained_only_up_to_its_bound():
  """Past the limit the server reads on (so that the client's send completes
  and it reads the 413, not a reset), but at most `_DRAIN_BYTES` more."""
  import asyncio  # pylint: disable=import-outside-toplevel
  from paged_jax.entrypoints.openai import api_server  # pylint: disable=import-outside-toplevel
  taken = []

  async def chunks():
    for i in range(100):
      taken.append(i)
      yield b"x" * (api_server._DRAIN_BYTES // 4)  # pylint: disable=protected-access

  asyncio.run(api_server._drain(chunks().__aiter__(), api_server._DRAIN_BYTES))  # pylint: disable=protected-access
  assert len(taken) == 5  # 4 chunks make the budget, the 5th passes it
  taken.clear()

  async def short():
    for i in range(3):
      taken.append(i)
      yield b"x"

  asyncio.run(api_server._drain(short().__aiter__(), api_server._DRAIN_BYTES))  # pylint: disable=protected-access
  assert taken == [0, 1, 2]  # a body under the bound is read to its end
