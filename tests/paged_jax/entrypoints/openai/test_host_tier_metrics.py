"""The host tier's `/metrics` series (issue #24): the Prometheus text parses,
the counters are the engine's stats, the gauges its usage, all 0 without a
tier. Read from the collector directly (no HTTP: `test_serve` covers it)."""

from __future__ import annotations

import pytest

prom = pytest.importorskip("prometheus_client")
from prometheus_client import parser  # noqa: E402

from paged_jax.entrypoints.openai.engine_loop import EngineLoop  # noqa: E402
from paged_jax.serving.tokenizer import ByteTokenizer  # noqa: E402
from tests.examples.conftest import (SMALL_POOL, make_engine,  # noqa: E402
                                     random_requests, serve)

SERIES = ("paged_jax_num_requests_swapped",
          "paged_jax_kv_offload_host_cache_usage_fraction",
          'paged_jax_kv_offload_total_bytes_total{transfer_type="device_to_host"}',
          'paged_jax_kv_offload_total_bytes_total{transfer_type="host_to_device"}',
          'paged_jax_swaps_total{direction="out"}', 'paged_jax_swaps_total{direction="in"}',
          "paged_jax_external_prefix_cache_queries_total",
          "paged_jax_external_prefix_cache_hits_total")


def scrape(engine, usage=None) -> dict:
  """`{series: value}` parsed from the registry's text exposition."""
  registry = prom.CollectorRegistry()
  loop = EngineLoop(engine, ByteTokenizer(), registry)  # not started
  if usage is not None:
    loop.usage = usage
  text = prom.generate_latest(registry).decode()
  out = {}
  for family in parser.text_string_to_metric_families(text):
    for s in family.samples:
      labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
      out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
  return out


def test_host_tier_series_follow_the_engine(model):
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0,
                       preemption_mode="swap", swap_space_blocks=16)
  seen = []

  def on_step(e, _):
    u = e.usage()
    if u["swapped"] and not seen:
      seen.append((u, scrape(e, u)))

  for r in random_requests(1, 8, prompt=(8, 24), new=(8, 16)):
    assert engine.add_request(r) is None
  engine.run_until_done(on_step=on_step)
  assert seen, "no step saw a sequence swapped out"
  (u, m), = seen
  assert m["paged_jax_num_requests_swapped"] == u["swapped"] > 0
  assert m["paged_jax_kv_offload_host_cache_usage_fraction"] == pytest.approx(
      u["host_blocks_used"] / 16)
  engine.flush()
  st, m = engine.stats, scrape(engine, engine.usage())
  assert m['paged_jax_kv_offload_total_bytes_total{transfer_type="device_to_host"}'] \
      == st.offload_bytes_to_host > 0
  assert m['paged_jax_kv_offload_total_bytes_total{transfer_type="host_to_device"}'] \
      == st.offload_bytes_to_device == st.offload_bytes_to_host
  assert m['paged_jax_swaps_total{direction="out"}'] == st.swapped_out > 0
  assert m['paged_jax_swaps_total{direction="in"}'] == st.swapped_in
  assert m["paged_jax_num_requests_swapped"] == 0


def test_host_tier_series_are_zero_without_a_tier(model):
  engine = make_engine(model, num_blocks=SMALL_POOL, admission_headroom_steps=0)
  serve(engine, random_requests(1, 4, prompt=(8, 24), new=(8, 16)))
  m = scrape(engine, engine.usage())
  assert {k: m[k] for k in SERIES} == dict.fromkeys(SERIES, 0.0)


def test_prefix_host_level_series_follow_the_engine(model):
  """The prefix cache's host level (`kv_offloading_size`): usage, bytes each
  way and the external prefix-cache queries / hits are the engine's."""
  from tests.examples.test_prefix_engine import TWO_SHAPES, _phases, _run  # pylint: disable=import-outside-toplevel
  from tests.examples.test_prefix_offload_engine import gib  # pylint: disable=import-outside-toplevel
  engine = make_engine(model, **TWO_SHAPES, enable_prefix_caching=True,
                       kv_offloading_size=gib(model, 64))
  for reqs in _phases()[:3]:  # the third hits the host
    _run(engine, reqs, checked=False)
  st, u = engine.stats, engine.usage()
  m = scrape(engine, u)
  assert 0 < u["host_blocks_used"] <= u["host_blocks_total"] == 64
  assert m["paged_jax_kv_offload_host_cache_usage_fraction"] == pytest.approx(
      u["host_blocks_used"] / 64)
  assert m['paged_jax_kv_offload_total_bytes_total{transfer_type="device_to_host"}'] \
      == st.offload_bytes_to_host > 0
  assert m['paged_jax_kv_offload_total_bytes_total{transfer_type="host_to_device"}'] \
      == st.offload_bytes_to_device > 0
  assert m["paged_jax_external_prefix_cache_queries_total"] \
      == st.external_prefix_queried_tokens > 0
  assert m["paged_jax_external_prefix_cache_hits_total"] == st.external_prefix_hit_tokens > 0
  assert m["paged_jax_num_requests_swapped"] == 0
