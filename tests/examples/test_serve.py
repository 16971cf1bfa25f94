"""The OpenAI-compatible server (examples/serve.py), driven by the real
`openai` client over loopback: completions, streamed chat, stop strings,
400 for a request that can never fit, a disconnect mid-stream frees its
blocks, 503 past the waiting limit, /metrics."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
prom = pytest.importorskip("prometheus_client")

from paged_jax.entrypoints.openai import api_server as serve  # noqa: E402
from paged_jax.serving import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.tokenizer import ByteTokenizer  # noqa: E402

NUM_BLOCKS = 32
# Two compiled shapes only (decode 4 rows, mixed 16), as test_generate.SMALL.
CONFIG = dict(num_blocks=NUM_BLOCKS, block_size=4, max_batch=4, max_tokens_per_step=16,
              max_model_len=64, min_bucket=16, bucket_midpoints=False)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Server:
  def __init__(self, model, max_waiting=64):
    engine = Engine(model, EngineConfig(**CONFIG))
    engine.warmup()
    self.registry = prom.CollectorRegistry()
    tok = ByteTokenizer()
    self.loop = serve.EngineLoop(engine, tok, self.registry)
    self.loop.start()
    app = serve.make_app(self.loop, tok, model_name="tiny", registry=self.registry,
                         max_waiting=max_waiting, default_max_tokens=8)
    self.port = _free_port()
    self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    deadline = time.time() + 30
    while not self.server.started:
      assert time.time() < deadline, "server did not start"
      time.sleep(0.02)
    self.url = f"http://127.0.0.1:{self.port}"
    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

  def metrics(self) -> dict:
    text = httpx.get(self.url + "/metrics").text
    out = {}
    for line in text.splitlines():
      m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
      if m:
        out[m.group(1)] = float(m.group(2))
    return out

  def wait_idle(self, timeout=30):
    deadline = time.time() + timeout
    while True:
      m = self.metrics()
      if (m["paged_jax_kv_cache_blocks_used"] == 0 and m["paged_jax_num_requests_running"] == 0
          and m["paged_jax_num_requests_waiting"] == 0):
        return m
      assert time.time() < deadline, f"blocks still held: {m}"
      time.sleep(0.05)

  def close(self):
    self.server.should_exit = True
    self.thread.join(timeout=10)
    self.loop.close()


@pytest.fixture(scope="module")
def server(model):
  s = _Server(model, max_waiting=3)
  yield s
  s.close()


def test_models_health_and_completion(server):
  assert httpx.get(server.url + "/health").text == "ok"
  assert [m.id for m in server.client.models.list().data] == ["tiny"]
  r = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                       temperature=0, logprobs=1)
  (choice,) = r.choices
  assert choice.finish_reason in ("stop", "length")
  assert r.usage.prompt_tokens == 6 and 1 <= r.usage.completion_tokens <= 6
  lps = choice.logprobs.token_logprobs
  assert len(lps) == r.usage.completion_tokens and all(lp <= 0 for lp in lps)
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
  with pytest.raises(openai.BadRequestError, match="exceeds max_model_len=64"):
    server.client.completions.create(model="tiny", prompt="x" * 80, max_tokens=4)
  with pytest.raises(openai.BadRequestError, match="min_tokens must be in"):
    server.client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                     extra_body={"min_tokens": 5})
  assert httpx.get(server.url + "/health").text == "ok"  # still serving


def test_disconnect_mid_stream_frees_the_blocks(server):
  with httpx.stream("POST", server.url + "/v1/completions", json={
      "model": "tiny", "prompt": "disconnect me", "max_tokens": 40,
      "temperature": 0, "stream": True, "ignore_eos": True}) as r:
    assert r.status_code == 200
    lines = r.iter_lines()
    got = [next(lines) for _ in range(3)]
    assert all(x.startswith("data:") or not x for x in got)
    assert server.metrics()["paged_jax_kv_cache_blocks_used"] > 0
  m = server.wait_idle()
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
