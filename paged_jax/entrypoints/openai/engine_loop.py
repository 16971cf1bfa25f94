"""The engine's own thread beside the HTTP event loop, and its metrics.

`EngineLoop` takes requests and aborts from any thread, steps the engine while
it has work, and hands each request's `TextDelta`s to the callback given with
it. Failures are kept to their request:

- A request whose own serving raises (adding it, decoding its text, handing
  its deltas over) fails alone: it is aborted in the engine (its blocks come
  back at the next step) and its last delta carries `error`; the engine and
  every other request go on.
- Anything else that raises in the engine thread (a step, an abort: the
  engine's own state) is an engine fault. The loop then marks itself failed
  (`error`, `alive` False: `/health` answers 503), ends every request it
  holds or that arrives later with an error delta, and calls `on_fatal`; the
  server (`api_server.main`) then shuts down and exits with status 1 so that
  a supervisor restarts it. The engine is not reused: its pool state after a
  fault is not known.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback

from paged_jax import _cli
from paged_jax.serving.engine import Engine
from paged_jax.serving.requests import Request
from paged_jax.serving.driver import Driver
from paged_jax.serving.text import TextDelta
from paged_jax.serving.tokenizer import Tokenizer

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class EngineLoop:
  """The engine's thread (see the module docstring).

  Args:
    engine: the `Engine` (warmed up or not).
    tokenizer: the `Tokenizer`.
    registry: a `prometheus_client.CollectorRegistry` for the metrics.
    on_fatal: called once (engine thread) after an engine fault.
  """

  def __init__(self, engine: Engine, tokenizer: Tokenizer, registry, on_fatal=None):
    import prometheus_client as prom  # pylint: disable=import-outside-toplevel
    self.engine = engine
    self.driver = Driver(engine, tokenizer)
    self.text = self.driver.text  # adds, aborts and fails requests
    self.on_fatal = on_fatal
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
    self.failed = prom.Counter("paged_jax_requests_failed",
                               "Requests failed by an error while serving them "
                               "(each alone; the engine went on).", registry=registry)
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
    """Queues `request`; `sink(delta)` gets its `TextDelta`s (engine thread,
    or here if the engine has failed); the last one has `output` or `error`."""
    with self._lock:
      if self.error is None:
        self._pending += 1
        self._commands.put(("add", request, sink, time.perf_counter()))
        return
    sink(TextDelta(request.request_id, -1, error=self.error))

  def abort(self, request_id) -> None:
    self._commands.put(("abort", request_id))

  # --------------------------------------------------------- engine thread
  def _command(self, cmd):
    if cmd[0] == "add":
      _, request, sink, arrival = cmd
      rid = request.request_id
      with self._lock:
        self._pending -= 1
      try:
        self.text.add_request(request)
      except Exception:  # pylint: disable=broad-except  # this request alone
        traceback.print_exc(file=sys.stderr)
        self.failed.inc()
        _call(sink, TextDelta(rid, -1, error="internal error while adding this "
                              "request; the server goes on"))
        return
      self._sinks[rid] = sink
      self._arrivals[rid] = arrival
    elif cmd[0] == "abort":
      self.text.abort_request(cmd[1])

  def _deliver(self, deltas: list[TextDelta]):
    now = time.perf_counter()
    for d in deltas:
      rid = d.request_id
      try:
        self._account(d, now)
      except Exception:  # pylint: disable=broad-except  # metrics never fail a request
        traceback.print_exc(file=sys.stderr)
      last = d.output is not None or d.error is not None
      sink = self._sinks.pop(rid, None) if last else self._sinks.get(rid)
      if last:
        self._forget(rid)
      if sink is not None and not _call(sink, d) and not last:
        # Its receiver is gone (the HTTP side failed): fail it here too.
        self._sinks.pop(rid, None)
        self._forget(rid)
        self.text.fail_request(rid, "its response could not be sent")

  def _account(self, d: TextDelta, now: float):
    rid = d.request_id
    if d.error is not None:
      self.failed.inc()
    elif d.output is None and d.token_ids:
      last = self._times.get((rid, d.index))
      if last is None:
        if rid in self._arrivals:
          self.ttft.observe(now - self._arrivals.pop(rid))
      else:
        self.itl.observe((now - last) / len(d.token_ids))
      self._times[(rid, d.index)] = now
    elif d.output is not None:
      if d.output.rejected:
        self.refused.labels("400").inc()
      else:
        for c in d.completions or []:
          self.finished.labels(c.finish_reason or "unknown").inc()

  def _forget(self, rid):
    self._arrivals.pop(rid, None)
    for key in [k for k in self._times if k[0] == rid]:
      del self._times[key]

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
        deltas = self.driver.step()  # a step, or a flush when idle
        self.usage = self.engine.usage()
        self._deliver(deltas)
      except Exception as e:  # pylint: disable=broad-except  # an engine fault
        traceback.print_exc(file=sys.stderr)
        self._fail(f"engine failed: {_cli.one_line(repr(e))}")
        return

  def _fail(self, error: str):
    """An engine fault: every request held or queued ends with `error`."""
    print(f"error: {error}", file=sys.stderr)
    with self._lock:
      self.error = error
      queued = []
      while True:
        try:
          queued.append(self._commands.get_nowait())
        except queue.Empty:
          break
    sinks = list(self._sinks.items())
    sinks += [(c[1].request_id, c[2]) for c in queued if c and c[0] == "add"]
    self._sinks.clear()
    for rid, sink in sinks:
      _call(sink, TextDelta(rid, -1, error=error))
    if self.on_fatal is not None:
      self.on_fatal()


def _call(sink, delta) -> bool:
  """`sink(delta)`; False (logged) if it raised."""
  try:
    sink(delta)
    return True
  except Exception:  # pylint: disable=broad-except  # the receiver's failure
    traceback.print_exc(file=sys.stderr)
    return False


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
    yield from _host_tier_metrics(u, st)


def _host_tier_metrics(u: dict, st):
  """The host tier's series (vLLM's names where it has them: v0's
  `num_requests_swapped`, the offloading connector's `kv_offload_total_bytes`
  and `external_prefix_cache_*`; `kv_offload_cpu_cache_usage_perc` as a
  fraction, like `paged_jax_kv_cache_usage_fraction`). All 0 without a tier."""
  from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # pylint: disable=import-outside-toplevel
  yield GaugeMetricFamily("paged_jax_num_requests_swapped",
                          "Sequences swapped out to host memory.",
                          value=u.get("swapped", 0))
  total = u.get("host_blocks_total", 0)
  yield GaugeMetricFamily("paged_jax_kv_offload_host_cache_usage_fraction",
                          "Host-tier KV blocks in use / blocks in the host tier "
                          "(0 without one).",
                          value=u.get("host_blocks_used", 0) / total if total else 0.0)
  moved = CounterMetricFamily("paged_jax_kv_offload_total_bytes",
                              "Bytes of KV blocks copied between device and host "
                              "memory.", labels=["transfer_type"])
  moved.add_metric(["device_to_host"], st.offload_bytes_to_host)
  moved.add_metric(["host_to_device"], st.offload_bytes_to_device)
  yield moved
  swaps = CounterMetricFamily("paged_jax_swaps",
                              "Sequences swapped out to / in from host memory.",
                              labels=["direction"])
  swaps.add_metric(["out"], st.swapped_out)
  swaps.add_metric(["in"], st.swapped_in)
  yield swaps
  yield CounterMetricFamily("paged_jax_external_prefix_cache_queries",
                            "Prompt tokens looked up in the host prefix-cache "
                            "level after a device miss.",
                            value=st.external_prefix_queried_tokens)
  yield CounterMetricFamily("paged_jax_external_prefix_cache_hits",
                            "Prompt tokens served from the host prefix-cache level.",
                            value=st.external_prefix_hit_tokens)
