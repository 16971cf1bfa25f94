"""An OpenAI-compatible HTTP server over the paged-KV engine.

    pip install -e ".[serve]"
    python examples/serve.py                      # the tiny model, 127.0.0.1:8000
    python examples/serve.py --checkpoint DIR     # a Hugging Face Llama

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`"stream": true` for server-sent events), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus: KV-cache usage, running / waiting requests,
preemptions, time to first token and inter-token latency histograms).

One engine loop runs in its own thread beside the HTTP event loop: requests
from every client join its continuous batch; a client that disconnects has
its request aborted (`Engine.abort_request`), so its blocks return at the
next step. Backpressure: a request that can never be served (too long for
`--max-model-len` or the pool) gets 400 with the engine's reason; while more
than `--max-waiting` requests wait, new ones get 503 with `Retry-After`.

The built-in tiny model has random weights (its text is noise) and a
byte-level tokenizer; a checkpoint directory's `tokenizer.json` (and the chat
template of `tokenizer_config.json`) is used when present. The model and
engine flags are generate.py's (`add_engine_flags`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import queue
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import (JSONResponse, PlainTextResponse, Response,
                               StreamingResponse)
from paged_jax.entrypoints import engine_args
from paged_jax.entrypoints import generate as gen
from paged_jax.entrypoints import workload
from paged_jax import _cli
from paged_jax.serving.engine import Engine
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax.serving.text import TextDelta, TextEngine
from paged_jax.serving.tokenizer import Tokenizer

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class EngineLoop:
  """The engine's own thread: takes requests and aborts from any thread,
  steps the engine while it has work, hands each request's `TextDelta`s to
  the callback given with it (called in the engine thread).

  Args:
    engine: the `Engine` (warmed up or not).
    tokenizer: the `Tokenizer`.
    registry: a `prometheus_client.CollectorRegistry` for the metrics.
  """

  def __init__(self, engine: Engine, tokenizer: Tokenizer, registry):
    import prometheus_client as prom  # pylint: disable=import-outside-toplevel
    self.engine = engine
    self.text = TextEngine(engine, tokenizer)
    self._commands: queue.Queue = queue.Queue()
    self._sinks: dict = {}
    self._pending = 0  # requests queued for the engine thread, not added yet
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self.error: str | None = None
    self.usage = engine.usage()
    self._times: dict = {}  # (request id, index) -> last token time
    self._arrivals: dict = {}
    self.ttft = prom.Histogram("paged_jax_time_to_first_token_seconds",
                               "Time from arrival to the first token.",
                               buckets=TTFT_BUCKETS, registry=registry)
    self.itl = prom.Histogram("paged_jax_inter_token_latency_seconds",
                              "Time between two tokens of a sequence.",
                              buckets=ITL_BUCKETS, registry=registry)
    self.finished = prom.Counter("paged_jax_requests_finished",
                                 "Requests finished, by finish reason.",
                                 ["finish_reason"], registry=registry)
    self.refused = prom.Counter("paged_jax_requests_refused",
                                "Requests refused, by HTTP status.", ["status"],
                                registry=registry)
    registry.register(_EngineCollector(self))
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

  def start(self):
    self._thread.start()

  def close(self):
    self._stop.set()
    self._commands.put(None)
    self._thread.join(timeout=30)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  def num_waiting(self) -> int:
    """Requests waiting: the engine's queue and those not handed to it yet."""
    with self._lock:
      return self._pending + self.engine.num_waiting

  def submit(self, request: Request, sink) -> None:
    """Queues `request`; `sink(delta)` gets its `TextDelta`s (engine thread),
    `sink(None)` if the engine failed."""
    with self._lock:
      self._pending += 1
    self._commands.put(("add", request, sink, time.perf_counter()))

  def abort(self, request_id) -> None:
    self._commands.put(("abort", request_id))

  # --------------------------------------------------------- engine thread
  def _command(self, cmd):
    if cmd[0] == "add":
      _, request, sink, arrival = cmd
      self._sinks[request.request_id] = sink
      self._arrivals[request.request_id] = arrival
      with self._lock:
        self._pending -= 1
        self.text.add_request(request)
    elif cmd[0] == "abort":
      self.text.abort_request(cmd[1])

  def _deliver(self, deltas: list[TextDelta]):
    now = time.perf_counter()
    for d in deltas:
      rid = d.request_id
      if d.output is None and d.token_ids:
        last = self._times.get((rid, d.index))
        if last is None:
          if rid in self._arrivals:
            self.ttft.observe(now - self._arrivals.pop(rid))
        else:
          self.itl.observe((now - last) / len(d.token_ids))
        self._times[(rid, d.index)] = now
      sink = self._sinks.get(rid)
      if d.output is not None:
        self._sinks.pop(rid, None)
        self._arrivals.pop(rid, None)
        for key in [k for k in self._times if k[0] == rid]:
          del self._times[key]
        if d.output.rejected:
          self.refused.labels("400").inc()
        else:
          for c in d.completions or []:
            self.finished.labels(c.finish_reason or "unknown").inc()
      if sink is not None:
        sink(d)

  def _run(self):
    while not self._stop.is_set():
      work = self.text.has_unfinished()
      held = self.engine.usage()["blocks_used"] > 0  # releases still to run
      try:
        cmd = self._commands.get(timeout=0 if work else 0.01 if held else None)
      except queue.Empty:
        cmd = False
      try:
        while cmd is not False:
          if cmd is None:
            return
          self._command(cmd)
          try:
            cmd = self._commands.get_nowait()
          except queue.Empty:
            cmd = False
        deltas = self.text.take()  # rejections
        if self.engine.has_unfinished() or self.engine.usage()["blocks_used"] > 0:
          deltas += self.text.step()
        self.usage = self.engine.usage()
        self._deliver(deltas)
      except Exception as e:  # pylint: disable=broad-except  # report, never hang
        self.error = f"engine failed: {_cli.one_line(repr(e))}"
        print(f"error: {self.error}", file=sys.stderr)
        for sink in self._sinks.values():
          sink(None)
        self._sinks.clear()
        return


class _EngineCollector:
  """Prometheus gauges and counters read from the engine's last step."""

  def __init__(self, loop: EngineLoop):
    self.loop = loop

  def collect(self):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # pylint: disable=import-outside-toplevel
    u, st = self.loop.usage, self.loop.engine.stats
    total = max(u["blocks_total"], 1)
    yield GaugeMetricFamily("paged_jax_kv_cache_usage_fraction",
                            "KV blocks in use / blocks in the pool.",
                            value=u["blocks_used"] / total)
    yield GaugeMetricFamily("paged_jax_kv_cache_blocks_used", "KV blocks in use.",
                            value=u["blocks_used"])
    yield GaugeMetricFamily("paged_jax_kv_cache_blocks_total", "KV blocks in the pool.",
                            value=u["blocks_total"])
    yield GaugeMetricFamily("paged_jax_num_requests_running",
                            "Sequences running in the engine.", value=u["running"])
    yield GaugeMetricFamily("paged_jax_num_requests_waiting",
                            "Sequences waiting for admission.",
                            value=self.loop.num_waiting())
    yield CounterMetricFamily("paged_jax_preemptions", "Sequences preempted.",
                              value=st.preemptions)
    yield CounterMetricFamily("paged_jax_requests_aborted",
                              "Requests aborted (clients that went away).",
                              value=st.aborted)
    yield CounterMetricFamily("paged_jax_generation_tokens", "Tokens generated.",
                              value=st.generated_tokens)
    yield CounterMetricFamily("paged_jax_engine_steps", "Engine steps run.",
                              value=st.steps)
    # vLLM's pair: hit rate = hits / queries (prompt tokens, first admission).
    yield CounterMetricFamily("paged_jax_prefix_cache_queries",
                              "Prompt tokens looked up in the prefix cache.",
                              value=st.prefix_queried_tokens)
    yield CounterMetricFamily("paged_jax_prefix_cache_hits",
                              "Prompt tokens served from the prefix cache.",
                              value=st.prefix_hit_tokens)
    yield GaugeMetricFamily("paged_jax_kv_cache_blocks_cached",
                            "Free KV blocks that keep their content for "
                            "prefix-cache hits.", value=u.get("blocks_cached", 0))


# ------------------------------------------------------------------ the app

class _BadRequest(ValueError):
  pass


def _error(status: int, message: str, kind: str, headers=None):
  return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}, status_code=status, headers=headers)


def _params(body: dict, default_max: int) -> SamplingParams:
  """`SamplingParams` from an OpenAI request body (raises _BadRequest)."""
  stop = body.get("stop") or ()
  if isinstance(stop, str):
    stop = (stop,)
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or default_max
  seed = body.get("seed")
  temperature = body.get("temperature")
  try:
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
        top_k=int(body.get("top_k") or 0),
        n=int(body.get("n") or 1),
        seed=0 if seed is None else int(seed) % 2**31,
        stop=tuple(stop), stop_token_ids=tuple(body.get("stop_token_ids") or ()),
        min_tokens=int(body.get("min_tokens") or 0),
        eos_token_ids=(-1,) if body.get("ignore_eos") else ())
  except (ValueError, TypeError) as e:
    raise _BadRequest(str(e)) from None


def make_app(loop: EngineLoop, tokenizer: Tokenizer, *, model_name: str,
             registry, max_waiting: int, default_max_tokens: int = 16,
             retry_after: int = 1):
  """The FastAPI app over a running `EngineLoop`.

  Args:
    loop: the `EngineLoop` (started).
    tokenizer: the `Tokenizer`.
    model_name: the model id `/v1/models` lists.
    registry: the `prometheus_client` registry `/metrics` exposes.
    max_waiting: requests that may wait; past it new ones get 503.
    default_max_tokens: `max_tokens` when a request gives none.
    retry_after: seconds in the 503's `Retry-After`.
  """
  import prometheus_client as prom  # pylint: disable=import-outside-toplevel

  app = FastAPI(title="paged-jax")
  created = int(time.time())

  @app.get("/health")
  async def health():
    if not loop.alive:
      return PlainTextResponse(loop.error or "engine stopped", status_code=503)
    return PlainTextResponse("ok")

  @app.get("/metrics")
  async def metrics():
    return Response(prom.generate_latest(registry), media_type=prom.CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": created, "owned_by": "paged-jax"}]}

  async def serve(http: HTTPRequest, chat: bool):
    try:
      body = await http.json()
      if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    except (json.JSONDecodeError, UnicodeDecodeError):
      return _error(400, "the body is not valid JSON", "invalid_request_error")
    except _BadRequest as e:
      return _error(400, str(e), "invalid_request_error")
    if not loop.alive:
      return _error(503, loop.error or "engine stopped", "server_error")
    if loop.num_waiting() >= max_waiting:
      loop.refused.labels("503").inc()
      return _error(503, f"server busy: {loop.num_waiting()} requests waiting "
                    f"(limit {max_waiting}); retry later", "server_busy",
                    headers={"Retry-After": str(retry_after)})
    try:
      params = _params(body, default_max_tokens)
      if chat:
        text = tokenizer.apply_chat_template(body.get("messages"))
        prompt = tokenizer.encode(text, add_special_tokens=False)
      else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
          p = p[0]
        if isinstance(p, str):
          prompt = tokenizer.encode(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
          prompt = list(p)
        else:
          raise _BadRequest("prompt must be a string, one string in a list, or "
                            f"a list of token ids, got {str(p)[:60]!r}")
      salt = body.get("cache_salt")  # vLLM's field: tenants share no blocks
      if salt is not None and not isinstance(salt, str):
        raise _BadRequest(f"cache_salt must be a string, got {str(salt)[:60]!r}")
    except (_BadRequest, ValueError) as e:
      return _error(400, str(e), "invalid_request_error")
    logprobs = bool(body.get("logprobs"))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    events: asyncio.Queue = asyncio.Queue()
    aloop = asyncio.get_running_loop()
    loop.submit(Request(rid, prompt, params, cache_salt=salt),
                lambda d: aloop.call_soon_threadsafe(events.put_nowait, d))
    first = await _next(events, http, loop, rid)
    if first is None:
      return _error(500, loop.error or "engine stopped", "server_error")
    if first.output is not None and first.output.rejected:
      return _error(400, f"request rejected: {first.output.rejected}",
                    "invalid_request_error")
    kind = "chat.completion" if chat else "text_completion"
    if body.get("stream"):
      return StreamingResponse(_sse(first, events, http, loop, rid, chat, kind,
                                    model_name, logprobs),
                               media_type="text/event-stream")
    final = first
    while final is not None and final.output is None:
      final = await _next(events, http, loop, rid)
    if final is None:
      return _error(500, loop.error or "engine stopped", "server_error")
    choices = []
    for i, c in enumerate(final.completions):
      lp = _logprobs(tokenizer, c.token_ids, c.logprobs, chat) if logprobs else None
      if chat:
        choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish_reason})
      else:
        choices.append({"index": i, "text": c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
    gen_tokens = sum(len(c.token_ids) for c in final.completions)
    return JSONResponse({
        "id": rid, "object": kind, "created": int(time.time()), "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": gen_tokens,
                  "total_tokens": len(prompt) + gen_tokens}})

  async def _sse(first, events, http, loop_, rid, chat, kind, model, logprobs):
    obj = "chat.completion.chunk" if chat else "text_completion"
    done = False
    try:
      if chat:
        yield _chunk(rid, obj, model, [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                        "finish_reason": None}])
      d = first
      while d is not None:
        if d.output is not None:
          done = True
          break
        if d.text or d.finish_reason:
          lp = (_logprobs(tokenizer, d.token_ids, d.logprobs, chat)
                if logprobs and d.logprobs is not None else None)
          if chat:
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                      "logprobs": lp, "finish_reason": d.finish_reason}
          else:
            choice = {"index": d.index, "text": d.text, "logprobs": lp,
                      "finish_reason": d.finish_reason}
          yield _chunk(rid, obj, model, [choice])
        d = await _next(events, http, loop_, rid)
      yield "data: [DONE]\n\n"
    finally:
      if not done:  # the client went away (or the engine failed): free it
        loop_.abort(rid)

  @app.post("/v1/completions")
  async def completions(http: HTTPRequest):
    return await serve(http, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(http: HTTPRequest):
    return await serve(http, chat=True)

  return app


async def _next(events: asyncio.Queue, http, loop: EngineLoop, rid):
  """The next `TextDelta` of `rid`; aborts it if the client disconnects."""
  while True:
    try:
      return await asyncio.wait_for(events.get(), timeout=0.5)
    except asyncio.TimeoutError:
      if await http.is_disconnected():
        loop.abort(rid)
        raise asyncio.CancelledError() from None


def _chunk(rid, obj, model, choices) -> str:
  return "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                "model": model, "choices": choices}) + "\n\n"


def _logprobs(tokenizer, token_ids, logprobs, chat):
  logprobs = logprobs or []
  tokens = [tokenizer.decode([t]) for t in token_ids]
  if chat:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": []} for t, lp in zip(tokens, logprobs)]}
  return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
          "text_offset": []}


# ------------------------------------------------------------------ command line

def parse_args(argv=None) -> argparse.Namespace:
  p = _cli.OneLineParser(description=__doc__.split("\n\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  gen.add_engine_flags(p)
  srv = p.add_argument_group("server")
  srv.add_argument("--host", default="127.0.0.1")
  srv.add_argument("--port", type=_cli.int_in(0, 65535), default=8000)
  srv.add_argument("--max-waiting", type=_cli.int_in(1, 10**6), default=256,
                   help="waiting requests past which new ones get 503 + Retry-After")
  srv.add_argument("--max-tokens", type=_cli.int_in(1, gen.MAX_MODEL_LEN), default=16,
                   help="max_tokens of a request that gives none")
  srv.add_argument("--model-name", help="the model id served (default: the "
                   "model's name, or paged-jax-tiny)")
  srv.add_argument("--no-warmup", action="store_true",
                   help="compile step shapes on first use, not at start")
  args = p.parse_args(argv)
  try:
    gen.check_engine_args(args)
  except ValueError as e:
    p.error(str(e))
  return args


def build(args):
  """`(EngineLoop, app)` from the flags (raises ValueError)."""
  import prometheus_client as prom  # pylint: disable=import-outside-toplevel
  loaded = gen.load_model(args)
  model = loaded.model
  kv_tokens, mesh = gen.engine_memory(args, model.config)
  engine_args.compile_cache(args)
  config = workload.engine_config(
      "paged", kv_tokens=kv_tokens, block_size=args.block_size,
      max_batch=args.max_batch, max_tokens_per_step=args.max_tokens_per_step,
      max_model_len=args.max_model_len, min_bucket=args.min_bucket,
      bucket_midpoints=not args.no_bucket_midpoints,
      cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling,
      enable_prefix_caching=args.enable_prefix_caching)
  engine = Engine(model, config, mesh=mesh)
  if not args.no_warmup:
    engine.warmup()
  tokenizer = loaded.tokenizer
  if tokenizer is None:
    raise FileNotFoundError(f"{loaded.source}: no tokenizer.json")
  registry = prom.CollectorRegistry()
  loop = EngineLoop(engine, tokenizer, registry)
  name = args.model_name or (loaded.name if loaded.source != "tiny" else "paged-jax-tiny")
  app = make_app(loop, tokenizer, model_name=name, registry=registry,
                 max_waiting=args.max_waiting, default_max_tokens=args.max_tokens)
  return loop, app


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    loop, app = build(args)
  except (ValueError, FileNotFoundError, ImportError) as e:
    print(f"error: {_cli.one_line(e)}", file=sys.stderr)
    return 2
  import uvicorn  # pylint: disable=import-outside-toplevel
  loop.start()
  print(f"serving on http://{args.host}:{args.port}/v1", flush=True)
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
  finally:
    loop.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
