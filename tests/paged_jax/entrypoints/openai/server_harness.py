"""A live OpenAI server over loopback for tests: one tiny engine, uvicorn in a
thread, the real `openai` client, and helpers to read `/metrics`."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import openai
import prometheus_client as prom
import uvicorn

from paged_jax.entrypoints.openai import api_server
from paged_jax.serving import Engine, EngineConfig
from paged_jax.serving.tokenizer import ByteTokenizer

NUM_BLOCKS = 32
# Two compiled shapes only (decode 4 rows, mixed 16), as test_generate.SMALL.
CONFIG = dict(num_blocks=NUM_BLOCKS, block_size=4, max_batch=4, max_tokens_per_step=16,
              max_model_len=64, min_bucket=16, bucket_midpoints=False,
              max_logit_bias=300)  # the server's default (OpenAI's bound)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """`api_server.make_app` over a warmed-up engine, served on 127.0.0.1."""

  def __init__(self, model, max_waiting=64, tokenizer=None, max_body_bytes=2**16,
               **config):
    engine = Engine(model, EngineConfig(**{**CONFIG, **config}))
    engine.warmup()
    self.registry = prom.CollectorRegistry()
    tok = tokenizer or ByteTokenizer()
    self.fatal = threading.Event()
    self.loop = api_server.EngineLoop(engine, tok, self.registry,
                                      on_fatal=self.fatal.set)
    self.loop.start()
    app = api_server.make_app(self.loop, tok, model_name="tiny", registry=self.registry,
                              max_waiting=max_waiting, default_max_tokens=8,
                              max_body_bytes=max_body_bytes)
    self.port = free_port()
    self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                log_level="critical"))
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


def sse_events(lines) -> list:
  """The `data:` payloads of a server-sent event stream, in order."""
  return [x[len("data: "):] for x in lines if x.startswith("data: ")]
