"""A bounded load test of the OpenAI server (examples/serve.py) on loopback.

    python benchmarks/serve_load.py --requests 64 --concurrency 16

starts the server (the tiny model unless --checkpoint; engine flags as in
generate.py after `--`), sends a fixed number of streamed completions from
many concurrent clients (`httpx`, server-sent events), stops by itself
(every request has a deadline, the whole run `--time-limit`), and reports
requests/s, time to first token and inter-chunk latency percentiles (a chunk
is a server-sent event with text: about one token each, fewer while a
multi-byte character or a possible stop string is held back), the
status code of every request (each one is answered or refused), and the KV
blocks still held after every client is gone (read from /metrics; 0 = no
leak). Some clients disconnect mid-stream on purpose (`--disconnect-every`);
with `--hostile-every k` every k-th client sends, instead, one of the hostile
requests of issue 26 (`HOSTILE`: the old engine-killers, non-JSON numbers, a
body nested 10,000 deep), each expected to get 400 while the others are
served; the run fails if one does not, or if `/health` is not 200 at the end.
Writes JSON with --output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import re
import socket
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# Requests that once put the engine into a failed state or got a 500 (issue 26).
HOSTILE = (
    b'{"prompt":"hello","stop_token_ids":[[1]],"max_tokens":4}',
    b'{"prompt":"hello","stop_token_ids":[1180591620717411303424],"min_tokens":1,'
    b'"max_tokens":4}',
    b'{"prompt":"hello","stop_token_ids":["a"],"min_tokens":1,"max_tokens":4}',
    b'{"prompt":"hello","seed":-1,"n":2,"temperature":1,"max_tokens":4}',
    b'{"prompt":"hello","seed":2147483647,"n":2,"temperature":1,"max_tokens":4}',
    b'{"prompt":"hi","top_k":2147483648,"temperature":1,"max_tokens":4}',
    b'{"prompt":"hi","top_k":Infinity,"max_tokens":4}',
    b'[' * 10000 + b']' * 10000,
)


def _metric(text: str, name: str) -> float:
  m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
  return float(m.group(1)) if m else float("nan")


async def _client(http, url, i, args, results):
  import httpx  # pylint: disable=import-outside-toplevel
  body = {"model": args.model, "prompt": f"request {i}: " + "lorem ipsum " * (i % 4 + 1),
          "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
          "ignore_eos": True}
  t0 = time.perf_counter()
  times = []
  status = None
  cut = args.disconnect_every and i % args.disconnect_every == args.disconnect_every - 1
  if args.hostile_every and i % args.hostile_every == args.hostile_every - 1:
    bad = HOSTILE[(i // args.hostile_every) % len(HOSTILE)]
    try:
      r = await http.post(url + "/v1/completions", content=bad,
                          headers={"Content-Type": "application/json"},
                          timeout=args.request_timeout)
      status = f"hostile {r.status_code}"
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
      status = f"hostile {type(e).__name__}"
    results[i] = {"status": status, "start": t0, "token_times": []}
    return
  try:
    async with http.stream("POST", url + "/v1/completions", json=body,
                           timeout=args.request_timeout) as r:
      status = r.status_code
      if status == 200:
        async for line in r.aiter_lines():
          if line.startswith("data:") and line != "data: [DONE]":
            times.append(time.perf_counter())
            if cut and len(times) >= 3:
              status = "disconnected"
              break
      else:
        await r.aread()
  except (httpx.HTTPError, asyncio.TimeoutError) as e:
    status = type(e).__name__
  results[i] = {"status": status, "start": t0, "token_times": times}


async def _drive(url, args):
  import httpx  # pylint: disable=import-outside-toplevel
  results = {}
  sem = asyncio.Semaphore(args.concurrency)
  limits = httpx.Limits(max_connections=args.concurrency)
  async with httpx.AsyncClient(limits=limits) as http:
    async def one(i):
      async with sem:
        await _client(http, url, i, args, results)
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(args.requests))),
                           timeout=args.time_limit)
  return results


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--concurrency", type=int, default=16)
  p.add_argument("--max-tokens", type=int, default=24)
  p.add_argument("--disconnect-every", type=int, default=8,
                 help="every k-th client disconnects after 3 chunks (0: none)")
  p.add_argument("--hostile-every", type=int, default=0,
                 help="every k-th client sends a hostile request instead (0: none)")
  p.add_argument("--request-timeout", type=float, default=120.0)
  p.add_argument("--time-limit", type=float, default=600.0)
  p.add_argument("--output", metavar="FILE")
  args, server_argv = p.parse_known_args(argv)
  server_argv = [a for a in server_argv if a != "--"]
  import httpx  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import uvicorn  # pylint: disable=import-outside-toplevel
  from paged_jax.entrypoints.openai import api_server as serve  # pylint: disable=import-outside-toplevel

  port = _free_port()
  sargs = serve.parse_args(["--port", str(port), *server_argv])
  t = time.perf_counter()
  loop, app = serve.build(sargs)
  startup = time.perf_counter() - t
  loop.start()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                         log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.02)
  url = f"http://127.0.0.1:{port}"
  try:
    args.model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    t0 = time.perf_counter()
    results = asyncio.run(_drive(url, args))
    wall = time.perf_counter() - t0
    deadline = time.time() + 30
    while True:  # the aborted ones' blocks go back at the next step
      metrics = httpx.get(url + "/metrics").text
      held = _metric(metrics, "paged_jax_kv_cache_blocks_used")
      if held == 0 or time.time() > deadline:
        break
      time.sleep(0.05)
    health = httpx.get(url + "/health").status_code
  finally:
    server.should_exit = True
    thread.join(timeout=10)
    loop.close()
  codes = {}
  for r in results.values():
    codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
  ok = [r for r in results.values() if r["status"] == 200]
  ttft = [r["token_times"][0] - r["start"] for r in ok if r["token_times"]]
  itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
  pct = lambda xs: ({f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}  # noqa: E731
                    if xs else {})
  report = {
      "requests": args.requests, "answered_or_refused": len(results),
      "concurrency": args.concurrency, "max_tokens": args.max_tokens,
      "status_codes": codes, "wall_seconds": wall, "startup_seconds": startup,
      "requests_per_second": len(ok) / wall if wall > 0 else 0.0,
      "chunks_per_second": sum(len(r["token_times"]) for r in ok) / wall,
      "ttft_seconds": pct(ttft), "inter_chunk_seconds": pct(itl),
      "blocks_used_after": held,
      "blocks_total": _metric(metrics, "paged_jax_kv_cache_blocks_total"),
      "preemptions": _metric(metrics, "paged_jax_preemptions_total"),
      "aborted": _metric(metrics, "paged_jax_requests_aborted_total"),
      "failed": _metric(metrics, "paged_jax_requests_failed_total"),
      "health_after": health,
      "server_args": server_argv,
  }
  print(json.dumps(report, indent=1))
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(report, indent=1))
  leaked = held != 0
  missing = len(results) != args.requests
  harmed = health != 200 or any(k.startswith("hostile") and k != "hostile 400"
                                for k in codes)
  harmed |= any(k not in ("200", "503", "disconnected") and not k.startswith("hostile")
                for k in codes)
  if leaked or missing or harmed:
    print(f"error: {'blocks leaked' if leaked else ''} "
          f"{'requests unanswered' if missing else ''} "
          f"{'a request was answered with an error, or /health is not 200' if harmed else ''}",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
