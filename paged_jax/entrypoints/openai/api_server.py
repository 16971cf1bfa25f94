"""An OpenAI-compatible HTTP server over the paged-KV engine.

    pip install -e ".[serve]"
    python examples/serve.py                      # the tiny model, 127.0.0.1:8000
    python examples/serve.py --checkpoint DIR     # a Hugging Face Llama

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`"stream": true` for server-sent events), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus: KV-cache usage, running / waiting requests,
preemptions, time to first token and inter-token latency histograms; the
host tier's usage, swaps and bytes moved each way).

One engine loop runs in its own thread beside the HTTP event loop
(`engine_loop.EngineLoop`): requests from every client join its continuous
batch; a client that disconnects has its request aborted, so its blocks
return at the next step.

No request can harm the engine. Each body is validated once, against the
pydantic model of its endpoint (`protocol.py`: strict types, ranges bounded
to what the engine holds, unsupported fields refused by name); errors come
back in OpenAI's shape with 400 (404 for another `model`), naming the field.
A request that can never be served (too long for `--max-model-len`, more
samples than `--max-batch`) gets 400; while more than `--max-waiting`
requests wait, new ones get 503 with `Retry-After`. An error while serving
one request fails it alone: 500 with a JSON body, or an error event that
ends its stream (never `[DONE]`). Every error response is a complete JSON
response, so a keep-alive connection stays usable. Only an engine fault
marks the server unhealthy (`/health` 503); it then fails the requests in
flight, shuts down and exits with status 1, for a supervisor to restart it.

The built-in tiny model has random weights (its text is noise) and a
byte-level tokenizer; a checkpoint directory's `tokenizer.json` (and the chat
template of `tokenizer_config.json`) is used when present. The model and
engine flags are generate.py's (`add_engine_flags`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import traceback
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import (JSONResponse, PlainTextResponse, Response,
                               StreamingResponse)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from paged_jax.entrypoints import engine_args
from paged_jax.entrypoints import generate as gen
from paged_jax.entrypoints import workload
from paged_jax.entrypoints.openai import protocol
from paged_jax.entrypoints.openai.engine_loop import EngineLoop
from paged_jax.entrypoints.openai.protocol import (ChatCompletionRequest,
                                                   CompletionRequest, RequestError)
from paged_jax import _cli
from paged_jax._int32 import INT32_MAX
from paged_jax.serving.engine import Engine
from paged_jax.serving.requests import Request
from paged_jax.serving.text import TextDelta
from paged_jax.serving.tokenizer import Tokenizer

__all__ = ["EngineLoop", "make_app", "parse_args", "build", "main"]

INTERNAL_ERROR = "internal error while serving this request; the server goes on"


def _error(status: int, body: dict, headers=None) -> JSONResponse:
  return JSONResponse(body, status_code=status, headers=headers)


class _CatchAll:
  """ASGI middleware: an exception that escapes a route becomes a complete
  JSON 500 (Starlette's own handler answers in plain text and re-raises, and
  the server then drops the keep-alive connection). After a response has
  started nothing can be sent; the exception goes on and the server closes
  the connection, so the client sees a cut response, never a normal end."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    started = False

    async def send_(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, receive, send_)
    except Exception:  # pylint: disable=broad-except  # this request alone
      if started:
        raise
      traceback.print_exc(file=sys.stderr)
      body = json.dumps(protocol.error_body(INTERNAL_ERROR, 500,
                                            code="internal_error")).encode()
      await send({"type": "http.response.start", "status": 500,
                  "headers": [(b"content-type", b"application/json"),
                              (b"content-length", str(len(body)).encode())]})
      await send({"type": "http.response.body", "body": body})


MAX_BODY_BYTES = 32 * 2**20


# Of a body refused as too large, up to this much more is read and dropped
# (for at most _DRAIN_SECONDS), so that a client still sending it finishes
# and reads the 413: closing on unread data makes the peer's TCP reset the
# connection, and the client may see the reset instead of the answer.
_DRAIN_BYTES = 1 << 20
_DRAIN_SECONDS = 2.0


async def _drain(chunks, budget: int) -> None:
  """Reads and drops `chunks` (an async iterator of bytes) until it ends or
  `budget` bytes have gone."""
  async for chunk in chunks:
    budget -= len(chunk)
    if budget < 0:
      return


async def _read_body(http: HTTPRequest, limit: int) -> bytes | None:
  """The whole body, or None past `limit` bytes (then the connection must
  close; a bounded rest of the body is read first, `_DRAIN_BYTES`)."""
  length = http.headers.get("content-length", "")
  chunks = http.stream().__aiter__()
  body = bytearray()
  if not (length.isdigit() and int(length) > limit):
    async for chunk in chunks:
      body += chunk
      if len(body) > limit:
        break
    else:
      return bytes(body)
  try:
    await asyncio.wait_for(_drain(chunks, _DRAIN_BYTES), _DRAIN_SECONDS)
  except (asyncio.TimeoutError, ClientDisconnect, OSError):
    pass  # the connection closes anyway
  return None


def make_app(loop: EngineLoop, tokenizer: Tokenizer, *, model_name: str,
             registry, max_waiting: int, default_max_tokens: int = 16,
             retry_after: int = 1, max_body_bytes: int = MAX_BODY_BYTES):
  """The FastAPI app over a running `EngineLoop`.

  Args:
    loop: the `EngineLoop` (started).
    tokenizer: the `Tokenizer`.
    model_name: the model id `/v1/models` lists (another `model` gets 404).
    registry: the `prometheus_client` registry `/metrics` exposes.
    max_waiting: requests that may wait; past it new ones get 503.
    default_max_tokens: `max_tokens` when a request gives none (cut to what
      the context leaves).
    retry_after: seconds in the 503's `Retry-After`.
    max_body_bytes: a larger body gets 413 and `Connection: close` (at most
      `_DRAIN_BYTES` more of it is read, and dropped).
  """
  import prometheus_client as prom  # pylint: disable=import-outside-toplevel

  app = FastAPI(title="paged-jax")
  app.add_middleware(_CatchAll)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(http: HTTPRequest, e: StarletteHTTPException):
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    message = f"{http.method} {http.url.path}: {e.detail}"
    return _error(e.status_code, protocol.error_body(message, e.status_code,
                                                     code=str(e.detail).lower().replace(" ", "_")),
                  headers=e.headers)
  created = int(time.time())
  engine = loop.engine

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

  def prepare(req, chat: bool):
    """`(engine Request, prompt text, prompt ids)` (raises RequestError)."""
    if chat:
      try:
        text = tokenizer.apply_chat_template(
            req.message_dicts(), add_generation_prompt=req.add_generation_prompt)
      except ValueError as e:
        raise RequestError(_cli.one_line(e), "messages") from None
      prompt = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(req.prompt, str):
      text, prompt = req.prompt, tokenizer.encode(req.prompt)
    else:
      text, prompt = None, list(req.prompt)
    max_tokens = protocol.default_max_tokens(
        req, prompt_len=len(prompt), max_model_len=engine.max_model_len,
        default_max_tokens=default_max_tokens)
    seed = req.seed if req.seed is not None else random.randint(
        0, INT32_MAX - req.num_seqs + 1)
    try:  # SamplingParams' own rules (the seed with n, min_tokens, ...)
      params = req.sampling_params(max_tokens, seed)
    except ValueError as e:
      raise protocol.sampling_error(e, req) from None
    protocol.check_limits(
        req, params, prompt_len=len(prompt), max_model_len=engine.max_model_len,
        max_seqs=engine.config.max_batch, max_logprobs=engine.max_logprobs,
        max_logit_bias=engine.config.max_logit_bias,
        vocab_size=engine.model_config.vocab_size)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    return Request(rid, prompt, params, cache_salt=req.cache_salt), text, prompt

  async def serve(http: HTTPRequest, kind):
    chat = kind is ChatCompletionRequest
    # Read whole, so that the connection stays usable after any answer.
    body = await _read_body(http, max_body_bytes)
    if body is None:
      return _error(413, protocol.error_body(
          f"the body is larger than this server's limit of {max_body_bytes} bytes", 413,
          code="body_too_large"), headers={"Connection": "close"})
    try:
      req = protocol.parse_request(body, kind)
      protocol.check_model(req, model_name)
    except RequestError as e:
      return _error(e.status, e.body())
    if not loop.alive:
      return _error(503, protocol.error_body(loop.error or "engine stopped", 503,
                                             code="engine_failed"))
    if loop.num_waiting() >= max_waiting:
      loop.refused.labels("503").inc()
      return _error(503, protocol.error_body(
          f"server busy: {loop.num_waiting()} requests waiting (limit {max_waiting}); "
          "retry later", 503, code="server_busy"),
                    headers={"Retry-After": str(retry_after)})
    try:
      request, prompt_text, prompt = prepare(req, chat)
    except RequestError as e:
      return _error(e.status, e.body())
    rid = request.request_id
    # Before the engine has it, so that an error here leaves nothing running.
    reply = _Reply(req, chat, rid, model_name, tokenizer, prompt_text, prompt)
    events: asyncio.Queue = asyncio.Queue()
    aloop = asyncio.get_running_loop()
    loop.submit(request, lambda d: aloop.call_soon_threadsafe(events.put_nowait, d))
    first = await _next(events, http, loop, rid)
    if first.error is not None:
      return _error(500, protocol.error_body(first.error, 500, code=_code(loop)))
    if first.output is not None and first.output.rejected:
      return _error(400, protocol.error_body(f"request rejected: {first.output.rejected}",
                                             400, code="request_rejected"))
    if req.stream:
      return StreamingResponse(_sse(reply, first, events, http, loop),
                               media_type="text/event-stream")
    final = first
    try:
      while final.output is None and final.error is None:
        final = await _next(events, http, loop, rid)
    finally:
      if final.output is None and final.error is None:  # cancelled: the client left
        loop.abort(rid)
    if final.error is not None:
      return _error(500, protocol.error_body(final.error, 500, code=_code(loop)))
    try:
      return JSONResponse(reply.whole(final))
    except Exception:  # pylint: disable=broad-except  # this request alone
      traceback.print_exc(file=sys.stderr)
      return _error(500, protocol.error_body(INTERNAL_ERROR, 500, code="internal_error"))

  @app.post("/v1/completions")
  async def completions(http: HTTPRequest):
    return await serve(http, CompletionRequest)

  @app.post("/v1/chat/completions")
  async def chat_completions(http: HTTPRequest):
    return await serve(http, ChatCompletionRequest)

  return app


async def _next(events: asyncio.Queue, http, loop: EngineLoop, rid) -> TextDelta:
  """The next `TextDelta` of `rid`; aborts it if the client disconnects."""
  while True:
    try:
      return await asyncio.wait_for(events.get(), timeout=0.5)
    except asyncio.TimeoutError:
      if await http.is_disconnected():
        loop.abort(rid)
        raise asyncio.CancelledError() from None


async def _sse(reply: "_Reply", first: TextDelta, events, http, loop: EngineLoop):
  """The server-sent events of one request: chunks, then `[DONE]` only when
  it finished; an error ends the stream with an error event instead."""
  rid, done = reply.rid, False
  try:
    for chunk in reply.opening():
      yield chunk
    d = first
    while d.error is None:
      if d.output is not None:
        done = True
        break
      # A delta without text (held back, or tokens that decode to nothing)
      # still carries its tokens' log-probs when they were asked for.
      if d.text or d.finish_reason or (reply.logprobs and d.token_ids):
        yield reply.chunk(d)
      d = await _next(events, http, loop, rid)
    if done:
      if reply.include_usage:
        yield reply.usage_chunk(d)
      yield "data: [DONE]\n\n"
    else:
      yield _event({"error": protocol.error_body(d.error, 500, code=_code(loop))["error"]})
  except Exception:  # pylint: disable=broad-except  # this request alone
    traceback.print_exc(file=sys.stderr)
    yield _event({"error": protocol.error_body(INTERNAL_ERROR, 500,
                                               code="internal_error")["error"]})
  finally:
    if not done:  # the client went away, or this request failed: free it
      loop.abort(rid)


def _code(loop: EngineLoop) -> str:
  """The error code of a request that failed: its own failure, or the engine's."""
  return "internal_error" if loop.alive else "engine_failed"


def _event(obj) -> str:
  return "data: " + json.dumps(obj) + "\n\n"


class _Reply:
  """The response objects of one request (OpenAI's completions and chat shapes)."""

  def __init__(self, req, chat: bool, rid: str, model: str, tokenizer: Tokenizer,
               prompt_text: str | None, prompt: list[int]):
    self.req, self.chat, self.rid, self.model = req, chat, rid, model
    self.tokenizer = tokenizer
    self.prompt = prompt
    self.logprobs = bool(req.logprobs) if chat else req.logprobs is not None
    self.echo = None
    if not chat and req.echo:
      self.echo = prompt_text if prompt_text is not None else tokenizer.decode(prompt)
    self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
    self.offsets: dict[int, int] = {}  # completions' text_offset, per choice

  def _obj(self, choices, kind, **extra) -> dict:
    return {"id": self.rid, "object": kind, "created": int(time.time()),
            "model": self.model, "choices": choices, **extra}

  def _usage(self, completions) -> dict:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(self.prompt), "completion_tokens": generated,
            "total_tokens": len(self.prompt) + generated}

  def _lp(self, index, token_ids, logprobs, start: int = 0, top=None):
    """OpenAI's `logprobs` object of these tokens: chat's `content` list, or
    the completions' legacy `tokens` / `token_logprobs` / `top_logprobs` /
    `text_offset`. `top`: per token its `(id, log-prob)` alternatives (the
    request's `top_logprobs` / `logprobs` N, best first); the legacy
    `top_logprobs` dict also holds the sampled token, as OpenAI's does
    (keyed by text, so tokens of equal text collide; the sampled one wins)."""
    if not self.logprobs or logprobs is None:
      return None
    decode = lambda t: self.tokenizer.decode([t])  # pylint: disable=unnecessary-lambda-assignment
    tokens = [decode(t) for t in token_ids]
    top = top if top is not None else [[] for _ in token_ids]
    if self.chat:
      def entry(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
      return {"content": [{**entry(t, lp),
                           "top_logprobs": [entry(decode(i), v) for i, v in alts]}
                          for t, lp, alts in zip(tokens, logprobs, top)]}
    offsets, at = [], self.offsets.get(index, start)
    for t in tokens:
      offsets.append(at)
      at += len(t)
    self.offsets[index] = at
    tops = []
    for t, lp, alts in zip(tokens, logprobs, top):
      d = {decode(i): v for i, v in alts}
      d[t] = lp  # texts may collide: the sampled token's entry is its own
      tops.append(d)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": tops, "text_offset": offsets}

  def opening(self) -> list[str]:
    """The first events of a stream: the chat role, the echoed prompt."""
    n = self.req.n or 1
    if self.chat:
      return [_event(self._obj([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
                               "chat.completion.chunk")) for i in range(n)]
    if self.echo:
      return [_event(self._obj([{"index": i, "text": self.echo, "logprobs": None,
                                 "finish_reason": None}], "text_completion"))
              for i in range(n)]
    return []

  def chunk(self, d: TextDelta) -> str:
    start = len(self.echo or "")
    lp = self._lp(d.index, d.token_ids, d.logprobs, start, d.top_logprobs)
    if self.chat:
      choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                "logprobs": lp, "finish_reason": d.finish_reason}
      return _event(self._obj([choice], "chat.completion.chunk"))
    choice = {"index": d.index, "text": d.text, "logprobs": lp,
              "finish_reason": d.finish_reason}
    return _event(self._obj([choice], "text_completion"))

  def usage_chunk(self, final: TextDelta) -> str:
    kind = "chat.completion.chunk" if self.chat else "text_completion"
    return _event(self._obj([], kind, usage=self._usage(final.completions)))

  def whole(self, final: TextDelta) -> dict:
    """The non-streamed response from the request's last delta."""
    comps = list(final.completions)
    best = comps
    n = self.req.n or 1
    if len(comps) > n:  # best_of: the n with the highest mean token log-prob
      def mean(c):
        lps = c.logprobs or []
        return sum(lps) / len(lps) if lps else float("-inf")
      best = sorted(comps, key=mean, reverse=True)[:n]
    choices = []
    for i, c in enumerate(best):
      text = (self.echo or "") + c.text
      lp = self._lp(i, c.token_ids, c.logprobs, len(self.echo or ""), c.top_logprobs)
      if self.chat:
        choices.append({"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": lp, "finish_reason": c.finish_reason})
      else:
        choices.append({"index": i, "text": text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
    kind = "chat.completion" if self.chat else "text_completion"
    return self._obj(choices, kind, usage=self._usage(comps))


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
  srv.add_argument("--max-tokens", type=_cli.integer, default=16,
                   help="max_tokens of a request that gives none (cut to what "
                   "the context leaves; SamplingParams.max_new_tokens)")
  srv.add_argument("--model-name", help="the model id served (default: the "
                   "model's name, or paged-jax-tiny)")
  srv.add_argument("--max-body-bytes", type=_cli.int_in(1024, 2**31 - 1),
                   default=MAX_BODY_BYTES,
                   help="a request body past it gets 413 (and the connection closes)")
  srv.add_argument("--max-logprobs", type=_cli.integer, default=20,
                   help="most top log-probs a request may ask for (completions' "
                   "logprobs, chat's top_logprobs); the device step computes this "
                   "many per sampled row (EngineConfig.max_logprobs)")
  srv.add_argument("--max-logit-bias", type=_cli.integer,
                   default=protocol.MAX_LOGIT_BIAS,
                   help="most logit_bias entries a request may give; every step "
                   "sends 8 bytes per entry and sampled row (EngineConfig."
                   "max_logit_bias); 0 turns logit_bias off")
  srv.add_argument("--no-warmup", action="store_true",
                   help="compile step shapes on first use, not at start")
  args = p.parse_args(argv)
  try:
    check_server_args(args)
  except ValueError as e:
    p.error(str(e))
  return args


def check_server_args(args) -> None:
  """The engine flags through `EngineConfig` (`check_engine_args`, which
  also takes `--max-logprobs` and `--max-logit-bias`), `--max-tokens`
  through `SamplingParams`; ValueError naming the flags. Left here: the
  request schema's own bound on `--max-logit-bias` (OpenAI's 300 entries,
  `protocol.MAX_LOGIT_BIAS`: a request cannot give more)."""
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  gen.check_engine_args(args)
  try:
    SamplingParams(max_new_tokens=args.max_tokens)
  except ValueError as e:
    raise engine_args.as_flags(e, args, {"max_new_tokens": "max_tokens"}) from None
  if args.max_logit_bias > protocol.MAX_LOGIT_BIAS:
    raise ValueError(f"--max-logit-bias must be <= {protocol.MAX_LOGIT_BIAS} (a request's "
                     f"logit_bias holds at most that many entries), got {args.max_logit_bias}")


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
      enable_prefix_caching=args.enable_prefix_caching,
      admission_headroom_steps=args.admission_headroom_steps,
      num_scheduler_steps=args.num_scheduler_steps, max_logprobs=args.max_logprobs, max_logit_bias=args.max_logit_bias,
      speculative_config=args.speculative_config,
      preemption_mode=args.preemption_mode, swap_space_blocks=args.swap_space_blocks,
      kv_offloading_size=args.kv_offloading_size,
      sliding_window_reclamation=args.sliding_window_reclamation)
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
                 max_waiting=args.max_waiting, default_max_tokens=args.max_tokens,
                 max_body_bytes=args.max_body_bytes)
  return loop, app


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    loop, app = build(args)
  except (ValueError, FileNotFoundError, ImportError) as e:
    print(f"error: {_cli.one_line(e)}", file=sys.stderr)
    return 2
  import uvicorn  # pylint: disable=import-outside-toplevel
  server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                         log_level="warning",
                                         timeout_graceful_shutdown=10))

  def on_fatal():  # engine thread: the requests in flight have their error
    server.should_exit = True

  loop.on_fatal = on_fatal
  loop.start()
  print(f"serving on http://{args.host}:{args.port}/v1", flush=True)
  try:
    server.run()
  finally:
    loop.close()
  if loop.error is not None:
    print(f"error: {loop.error}; exiting with status 1 for a supervisor to restart "
          "the server", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
