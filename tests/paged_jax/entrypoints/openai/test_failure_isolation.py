"""Failures stay with their request (issue 26): an exception injected while
serving one request fails it alone (an error event ends its stream, never
`[DONE]`; 500 with a JSON body when not streamed) while the requests beside
it are served and `/health` stays 200. An engine fault (a step raises) marks
the server unhealthy, ends every request in flight with an error and calls
`on_fatal`; `api_server.main` then returns 1, for a supervisor to restart it."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

import prometheus_client as prom  # noqa: E402

from paged_jax.entrypoints.openai import api_server  # noqa: E402
from paged_jax.serving import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.tokenizer import ByteTokenizer  # noqa: E402
from tests.paged_jax.entrypoints.openai import server_harness  # noqa: E402
from tests.paged_jax.entrypoints.openai.server_harness import (  # noqa: E402
    NUM_BLOCKS, Server, sse_events)
from tests.paged_jax.entrypoints.openai.test_hostile_requests import _Conn  # noqa: E402

MARK = "FAIL-ME"


class Injected(RuntimeError):
  pass


@pytest.fixture(scope="module")
def server(model):
  s = Server(model)
  yield s
  s.close()


def _marked(server, request) -> bool:
  return MARK in server.loop.text.tokenizer.decode(request.prompt)


def _fail_decoding_after(server, monkeypatch, tokens: int):
  """The text layer raises for the marked request once it has `tokens` tokens."""
  text = server.loop.text
  real = text._tokens  # pylint: disable=protected-access

  def tokens_(r, index, token_ids, logprobs, finish_reason, *rest):
    if _marked(server, r.request) and len(r.seqs.get(index).token_ids
                                          if index in r.seqs else []) >= tokens:
      raise Injected("injected into one request's decoding")
    return real(r, index, token_ids, logprobs, finish_reason, *rest)

  monkeypatch.setattr(text, "_tokens", tokens_)


async def _stream(client, url, prompt, max_tokens):
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "ignore_eos": True}
  async with client.stream("POST", url + "/v1/completions", json=body) as r:
    assert r.status_code == 200
    return sse_events([line async for line in r.aiter_lines()])


def _run_side_by_side(server, *coros):
  async def main():
    async with httpx.AsyncClient(timeout=60) as client:
      return await asyncio.gather(*(c(client, server.url) for c in coros))
  return asyncio.run(main())


def test_a_failure_while_streaming_ends_that_stream_alone(server, monkeypatch):
  _fail_decoding_after(server, monkeypatch, tokens=3)
  good, bad, good2 = _run_side_by_side(
      server,
      lambda c, u: _stream(c, u, "a neighbour", 24),
      lambda c, u: _stream(c, u, MARK, 24),
      lambda c, u: _stream(c, u, "another one", 20))
  # The failed stream: some chunks, then one error event, and no [DONE].
  assert bad[-1] != "[DONE]" and "[DONE]" not in bad
  err = json.loads(bad[-1])["error"]
  assert err["type"] == "server_error" and err["code"] == "internal_error"
  assert "internal error while serving this request" in err["message"]
  # Its neighbours in the same batch are served to their end.
  for events, n in ((good, 24), (good2, 20)):
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  m = server.wait_idle()
  assert m["paged_jax_requests_failed_total"] >= 1
  assert httpx.get(server.url + "/health").text == "ok"
  assert int(server.loop.engine.block_state.num_free) == NUM_BLOCKS


def test_a_failure_not_streamed_is_a_json_500_on_a_live_connection(server, monkeypatch):
  _fail_decoding_after(server, monkeypatch, tokens=1)
  conn = _Conn(server.port)
  r, data = conn.request("POST", "/v1/completions", json.dumps(
      {"prompt": MARK, "max_tokens": 8, "ignore_eos": True}).encode())
  assert r.status == 500 and r.getheader("content-type") == "application/json"
  err = json.loads(data)["error"]
  assert err["type"] == "server_error" and "internal error" in err["message"]
  conn.normal_request_succeeds()
  server.wait_idle()


def test_a_failure_while_adding_a_request_fails_it_alone(server, monkeypatch):
  engine = server.loop.engine
  real = engine.add_request

  def add_request(request):
    if _marked(server, request):
      raise Injected("injected into add_request")
    return real(request)

  monkeypatch.setattr(engine, "add_request", add_request)
  conn = _Conn(server.port)
  r, data = conn.request("POST", "/v1/completions", json.dumps(
      {"prompt": MARK, "max_tokens": 2}).encode())
  assert r.status == 500 and "internal error while adding" in json.loads(data)["error"][
      "message"]
  conn.normal_request_succeeds()


def test_a_failure_in_the_http_handler_is_a_json_500(server, monkeypatch):
  tok = server.loop.text.tokenizer
  real = tok.encode

  def encode(text, add_special_tokens=True):
    if MARK in text:
      raise Injected("injected into the tokenizer")
    return real(text, add_special_tokens)

  monkeypatch.setattr(tok, "encode", encode)
  conn = _Conn(server.port)
  r, data = conn.request("POST", "/v1/completions", json.dumps({"prompt": MARK}).encode())
  assert r.status == 500 and int(r.getheader("content-length")) == len(data)
  assert json.loads(data)["error"]["code"] == "internal_error"
  conn.normal_request_succeeds()


def test_an_engine_fault_marks_the_server_unhealthy_and_ends_every_request(model):
  s = Server(model)
  try:
    step = s.loop.engine.step
    calls = [0]

    def faulty_step():  # once both requests are in the engine, a few steps in
      calls[0] += len(s.loop._sinks) >= 2  # pylint: disable=protected-access
      if calls[0] == 3:
        raise Injected("injected engine fault")
      return step()

    s.loop.engine.step = faulty_step  # an instance of its own: nothing to restore

    async def whole(client, url):
      r = await client.post(url + "/v1/completions", json={
          "prompt": "whole", "max_tokens": 30, "ignore_eos": True})
      return r.status_code, r.json()

    streamed, (status, body) = _run_side_by_side(
        s, lambda c, u: _stream(c, u, "streamed", 30), whole)
    assert "[DONE]" not in streamed
    err = json.loads(streamed[-1])["error"]
    assert "engine failed" in err["message"] and err["code"] == "engine_failed"
    assert status == 500 and "engine failed" in body["error"]["message"]
    assert s.fatal.wait(timeout=30)
    health = httpx.get(s.url + "/health")
    assert health.status_code == 503 and "engine failed" in health.text
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "later"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
  finally:
    s.close()


def test_an_engine_fault_makes_main_exit_1_for_a_supervisor(model, monkeypatch):
  engine = Engine(model, EngineConfig(**server_harness.CONFIG))
  engine.warmup()
  step, calls = engine.step, [0]

  def faulty_step():
    calls[0] += 1
    if calls[0] == 4:
      raise Injected("injected engine fault")
    return step()

  engine.step = faulty_step
  tok, registry = ByteTokenizer(), prom.CollectorRegistry()
  loop = api_server.EngineLoop(engine, tok, registry)
  app = api_server.make_app(loop, tok, model_name="tiny", registry=registry, max_waiting=8)
  monkeypatch.setattr(api_server, "build", lambda args: (loop, app))
  port, got = server_harness.free_port(), {}

  def client():
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):  # until the server is up (bounded)
      try:
        if httpx.get(url + "/health").status_code == 200:
          break
      except httpx.HTTPError:
        pass
      threading.Event().wait(0.05)
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}) as r:
      got["events"] = sse_events(r.iter_lines())

  thread = threading.Thread(target=client, daemon=True)
  thread.start()
  # Bounded: should the fault never come, a watchdog ends the server (and the test fails).
  watchdog = threading.Timer(120, lambda: loop._fail("test watchdog"))  # pylint: disable=protected-access
  watchdog.start()
  try:
    assert api_server.main(["--port", str(port)]) == 1
  finally:
    watchdog.cancel()
  thread.join(timeout=30)
  assert calls[0] >= 4, "the watchdog ended the server, not the fault"
  assert "[DONE]" not in got["events"]
  assert json.loads(got["events"][-1])["error"]["code"] == "engine_failed"
