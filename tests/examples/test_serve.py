"""The OpenAI-compatible server (`paged_jax.entrypoints.openai.api_server`),
driven by the real `openai` client over loopback: completions, streamed chat,
stop strings, 400 for a request that can never fit, a disconnect mid-stream
frees its blocks, 503 past the waiting limit, /metrics. Hostile requests and
failure isolation: `tests/paged_jax/entrypoints/openai/`."""

from __future__ import annotations

import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
prom = pytest.importorskip("prometheus_client")

from tests.paged_jax.entrypoints.openai.server_harness import (  # noqa: E402
    NUM_BLOCKS, Server)


@pytest.fixture(scope="module")
def server(model):
  s = Server(model, max_waiting=3)
  yield s
  s.close()


def test_models_health_and_completion(server):
  assert httpx.get(server.url + "/health").text == "ok"
  assert [m.id for m in server.client.models.list().data] == ["tiny"]
  r = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                       temperature=0, logprobs=0)
  (choice,) = r.choices
  assert choice.finish_reason in ("stop", "length")
  assert r.usage.prompt_tokens == 6 and 1 <= r.usage.completion_tokens <= 6
  lps = choice.logprobs.token_logprobs
  assert len(lps) == r.usage.completion_tokens and all(lp <= 0 for lp in lps)
  assert [list(d.values()) for d in choice.logprobs.top_logprobs] == [[lp] for lp in lps]
  again = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                           temperature=0)
  assert again.choices[0].text == choice.text  # greedy is deterministic


def test_streamed_chat_matches_the_unstreamed_answer(server):
  msgs = [{"role": "user", "content": "héllo €"}]
  whole = server.client.chat.completions.create(model="tiny", messages=msgs,
                                                max_tokens=10, temperature=0)
  stream = server.client.chat.completions.create(model="tiny", messages=msgs,
                                                 max_tokens=10, temperature=0,
                                                 stream=True)
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks)
  assert text == whole.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_string_cuts_the_text(server):
  kw = dict(model="tiny", prompt="abc", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
  full = server.client.completions.create(**kw).choices[0].text
  if len(full) < 3:
    pytest.skip("the random model decoded too little text here")
  stop = full[2:4] if len(full) >= 4 else full[2]
  want = full[:full.index(stop)]
  r = server.client.completions.create(**kw, stop=[stop])
  assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
  streamed = server.client.completions.create(**kw, stop=[stop], stream=True)
  assert "".join(c.choices[0].text for c in streamed) == want
  server.wait_idle()


def test_a_request_that_can_never_fit_is_400(server):
  with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens; "
                     "the prompt has 81"):
    server.client.completions.create(model="tiny", prompt="x" * 80, max_tokens=4)
  with pytest.raises(openai.BadRequestError, match="the prompt has 41 and max_tokens "
                     "asks for 30 more"):
    server.client.completions.create(model="tiny", prompt="x" * 40, max_tokens=30)
  with pytest.raises(openai.BadRequestError, match=r"min_tokens must be in \[0, "
                     r"max_tokens=2\], got 5"):
    server.client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                     extra_body={"min_tokens": 5})
  assert httpx.get(server.url + "/health").text == "ok"  # still serving


def test_disconnect_mid_stream_frees_the_blocks(server, monkeypatch):
  # No race with the engine: once the stream has sent two chunks, the engine
  # thread waits (before its next step) until the server has queued the
  # abort of the disconnected request; so it cannot finish first.
  driver, loop = server.loop.driver, server.loop
  step, abort = driver.step, loop.abort
  chunks, aborted = [0], threading.Event()

  def gated_step():
    if chunks[0] >= 2:
      assert aborted.wait(timeout=60), "the disconnect was never noticed"
    deltas = step()
    chunks[0] += sum(1 for d in deltas if d.text)
    return deltas

  def noted_abort(rid):
    abort(rid)
    aborted.set()

  monkeypatch.setattr(driver, "step", gated_step)
  monkeypatch.setattr(loop, "abort", noted_abort)
  with httpx.stream("POST", server.url + "/v1/completions", json={
      "model": "tiny", "prompt": "disconnect me", "max_tokens": 40,
      "temperature": 0, "stream": True, "ignore_eos": True}) as r:
    assert r.status_code == 200
    lines = r.iter_lines()
    got = [next(lines) for _ in range(3)]
    assert all(x.startswith("data:") or not x for x in got)
    assert server.metrics()["paged_jax_kv_cache_blocks_used"] > 0
  m = server.wait_idle()
  assert aborted.is_set()
  assert m["paged_jax_requests_aborted_total"] >= 1
  assert int(server.loop.engine.block_state.num_free) == NUM_BLOCKS


def test_past_the_waiting_limit_is_503_then_serving_goes_on(server):
  client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
  import asyncio

  async def one(i):
    try:
      await client.completions.create(model="tiny", prompt=f"q{i} " * 5, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
      return 200
    except openai.APIStatusError as e:
      assert e.status_code == 503 and e.response.headers["retry-after"] == "1"
      return e.status_code

  async def burst():
    return await asyncio.gather(*(one(i) for i in range(16)))

  codes = asyncio.run(burst())
  # Every request is answered or refused; the burst outruns admission.
  assert set(codes) == {200, 503}
  m = server.wait_idle()
  assert m['paged_jax_requests_refused_total{status="503"}'] == codes.count(503)
  assert m["paged_jax_time_to_first_token_seconds_count"] >= codes.count(200)
  assert m["paged_jax_inter_token_latency_seconds_count"] > 0
  assert m["paged_jax_kv_cache_blocks_total"] == NUM_BLOCKS
  r = server.client.completions.create(model="tiny", prompt="after", max_tokens=3)
  assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_samples_with_usage_match_the_whole_answer(server):
  kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            n=2, temperature=1, seed=3, extra_body={"ignore_eos": True})
  whole = server.client.chat.completions.create(**kw)
  chunks = list(server.client.chat.completions.create(
      **kw, stream=True, stream_options={"include_usage": True}))
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
  for i in range(2):
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1]
                   if c.choices[0].index == i)
    assert text == whole.choices[i].message.content  # the same seed, the same samples
  assert whole.usage.completion_tokens == 8
