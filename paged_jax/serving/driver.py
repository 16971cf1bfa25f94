"""The one loop that drives `Engine.step()`.

Every caller that serves requests -- `Engine.run_until_done`, `LLM.generate`
and `LLM.stream`, the workload runner (offline and with arrival times),
`paged-jax generate`'s text loop and the OpenAI server's engine thread --
goes through a `Driver`. Each `Driver.step()`:

1. adds the requests whose arrival time has passed (in arrival order; ties in
   the order given);
2. runs one engine step when the engine has work; otherwise flushes it (the
   step still in flight is applied, queued releases run: the pool is empty
   when idle) and, if only later arrivals remain, sleeps until the next one;
3. returns what came out since the last call, in one of three forms fixed at
   construction: `RequestOutput`s of finished (or rejected) requests,
   per-token `RequestDelta`s (`stream=True`), or `TextDelta`s (a tokenizer
   given: text, stop strings; see `text.TextEngine`).

`run()` steps until nothing is left (no arrivals to come, no unfinished
requests), then flushes, yielding every item; `run_until_done()` returns them
as a list.

Example:
  >>> driver = Driver(engine)
  >>> driver.add_request(Request(0, [1, 2, 3], SamplingParams(max_new_tokens=4)))
  >>> driver.add_request(Request(1, [4, 5], SamplingParams(max_new_tokens=4)), arrival=0.5)
  >>> outputs = driver.run_until_done()   # request 1 joins 0.5 s after the start
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Callable, Iterator

from paged_jax.serving.requests import Request, RequestDelta, RequestOutput
from paged_jax.serving.text import TextDelta, TextEngine

if TYPE_CHECKING:
  from paged_jax.serving.engine import Engine
  from paged_jax.serving.tokenizer import Tokenizer

Item = RequestOutput | RequestDelta | TextDelta


class Driver:
  """Adds requests at their arrival times, steps, collects (module docstring).

  Args:
    engine: the `Engine` (or anything with its `add_request`, `abort_request`,
      `has_unfinished`, `step`, `flush`, `stream_deltas`, `take_deltas`).
    tokenizer: with one, items are `TextDelta`s (through a `TextEngine`,
      `self.text`); without, `RequestDelta`s if `stream` else `RequestOutput`s.
    stream: per-token `RequestDelta`s (turns the engine's deltas on until
      `close()`); implied by a tokenizer.
    clock: seconds (float), monotonic; arrival times count from its value
      when the driver is built (`self.t0`).
    sleep: `sleep(seconds)`, called while only later arrivals remain.

  Raises:
    ValueError: from `add_request` on a negative or non-finite arrival time.
  """

  def __init__(self, engine: "Engine", tokenizer: "Tokenizer | None" = None, *,
               stream: bool = False, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep):
    self.engine = engine
    self.text = TextEngine(engine, tokenizer) if tokenizer is not None else None
    self.stream = stream or tokenizer is not None
    if self.stream:
      engine.stream_deltas(True)
    self._clock, self._sleep = clock, sleep
    self.t0 = clock()
    self._arrivals: list[tuple[float, int, Request]] = []  # a heap
    self._added = 0

  # ----------------------------------------------------------------- requests
  def add_request(self, request: Request, arrival: float | None = None
                  ) -> RequestOutput | None:
    """Adds `request` now (`arrival` None), or once `arrival` seconds have
    passed since `self.t0` (at the first `step` after that).

    Returns:
      For a request added now, the engine's answer: None when accepted, its
      `RequestOutput` (`rejected` set) otherwise, which also comes out of the
      next `step`. None for a request added later.
    """
    if arrival is None:
      return self._add(request)
    arrival = float(arrival)
    if not 0.0 <= arrival < float("inf"):
      raise ValueError(f"arrival must be seconds >= 0 (finite), got {arrival!r} "
                       f"for request {request.request_id!r:.80}")
    heapq.heappush(self._arrivals, (arrival, self._added, request))
    self._added += 1
    return None

  def _add(self, request: Request) -> RequestOutput | None:
    return (self.text or self.engine).add_request(request)

  def abort_request(self, request_id) -> bool:
    """Drops a request: not added yet, waiting or running (`Engine.abort_request`)."""
    kept = [a for a in self._arrivals if a[2].request_id != request_id]
    if len(kept) != len(self._arrivals):
      self._arrivals = kept
      heapq.heapify(self._arrivals)
      return True
    return (self.text or self.engine).abort_request(request_id)

  def has_unfinished(self) -> bool:
    """Arrivals still to come, or requests unfinished (their text included)."""
    return bool(self._arrivals) or (self.text or self.engine).has_unfinished()

  def elapsed(self) -> float:
    """Seconds since `self.t0`."""
    return self._clock() - self.t0

  @property
  def num_arrivals_left(self) -> int:
    """Requests given with an arrival time that is yet to come."""
    return len(self._arrivals)

  # -------------------------------------------------------------------- steps
  def step(self) -> list[Item]:
    """Adds the due arrivals, then one engine step (or a flush, and a sleep
    until the next arrival when nothing else is left); returns the items
    since the last call."""
    now = self.elapsed()
    while self._arrivals and self._arrivals[0][0] <= now:
      self._add(heapq.heappop(self._arrivals)[2])
    if self.engine.has_unfinished():
      outputs = self.engine.step()
    else:
      outputs = self.engine.flush()
      if self._arrivals and not (self.text or self.engine).has_unfinished():
        self._sleep(max(0.0, self._arrivals[0][0] - self.elapsed()))
    return self._collect(outputs)

  def _collect(self, outputs) -> list[Item]:
    if self.text is not None:
      return self.text.take()
    if self.stream:
      return self.engine.take_deltas()
    return list(outputs or ())

  def run(self, max_steps: int | None = None,
          on_step: Callable[["Engine", list[Item]], None] | None = None
          ) -> Iterator[Item]:
    """Steps until `has_unfinished()` is False, then flushes; yields every item.

    Args:
      max_steps: most `step` calls (None: no limit).
      on_step: `on_step(engine, items)` after each step (progress bars).

    Raises:
      RuntimeError: if requests are still unfinished after `max_steps` steps.
    """
    steps = 0
    while self.has_unfinished():
      if max_steps is not None and steps >= max_steps:
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
      items = self.step()
      steps += 1
      if on_step is not None:
        on_step(self.engine, items)
      yield from items
    yield from self._collect(self.engine.flush())

  def run_until_done(self, max_steps: int | None = None,
                     on_step: Callable[["Engine", list[Item]], None] | None = None
                     ) -> list[Item]:
    """`list(self.run(max_steps, on_step))`."""
    return list(self.run(max_steps, on_step))

  def close(self):
    """Turns the engine's deltas off again (if `stream` turned them on) and
    drops any not taken."""
    if self.stream:
      self.engine.stream_deltas(False)
      self.engine.take_deltas()
