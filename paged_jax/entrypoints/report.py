"""The text generate prints: a served engine's stats (`workload_stats`'s
dict) as report lines, the KV cache line, one-line text."""

from __future__ import annotations


def fmt_latency(lat: dict) -> list[str]:
  rows = []
  for name, label in (("ttft", "time to first token"), ("tpot", "time per output token"),
                      ("itl", "inter-token latency")):
    d = lat[name]
    rows.append(f"  {label:<22}mean {1e3 * d['mean']:.1f} ms, p50 {1e3 * d['p50']:.1f},"
                f" p90 {1e3 * d['p90']:.1f}, p99 {1e3 * d['p99']:.1f} ms")
  return rows


def kv_cache_line(kv: dict) -> str:
  """The KV cache the engine allocated, as read from its arrays
  (`workload.allocated_cache`): a requested dtype that was not allocated
  shows here."""
  return (f"  KV cache allocated  {kv['dtype']}"
          + (" + float32 scales" if kv["scales"] else "")
          + f", {kv['bytes_per_token']} bytes per token, {kv['bytes']} bytes")


def fmt_stats(stats: dict) -> list[str]:
  return [
      f"  requests served     {stats['served']} of {stats['requests']}"
      f" ({stats['rejected']} rejected)",
      f"  tokens generated    {stats['generated_tokens']}",
      f"  wall time           {stats['wall_seconds']:.2f} s "
      f"(+ {stats['compile_seconds']:.1f} s compile)",
      f"  throughput          {stats['tokens_per_second']:.1f} tokens/s",
      *fmt_latency(stats["latency_seconds"]),
      f"  KV blocks used      peak {stats['peak_blocks_used']}/{stats['num_blocks']}"
      f" ({100 * stats['peak_kv_fraction']:.0f}%), mean "
      f"{stats['mean_blocks_used']:.1f} ({100 * stats['mean_kv_fraction']:.0f}%)"
      f" of {stats['block_size']}-token blocks",
      f"  sequences at once   peak {stats['peak_running']}, mean "
      f"{stats['mean_running']:.1f} (batch limit {stats['max_batch']})",
      f"  KV memory           {stats['kv_bytes'] / 2**20:.2f} MiB, "
      f"{stats['kv_bytes_per_device'] / 2**20:.3f} MiB on each of "
      f"{stats['devices']} device(s)",
      f"  preemptions         {stats['preemptions']} ({stats['recomputed_tokens']} tokens"
      f" recomputed); admissions deferred for blocks {stats['deferred_admissions']}",
      f"  steps               {stats['steps']} ({stats['decode_steps']} decode,"
      f" {stats['mixed_steps']} prefill/mixed); host "
      f"{stats['host_ms_per_step']:.2f} ms/step"
      + (f" ({stats['exposed_host_ms_per_step']:.2f} not overlapped)"
         if stats["async_scheduling"] else "")
      + f", waiting {stats['wait_ms_per_step']:.2f} ms/step: host share "
      f"{100 * stats['host_share']:.1f}%",
      f"  rows computed       {stats['padded_rows']} for {stats['computed_tokens']} real"
      f" tokens ({stats['padding_ratio']:.2f}x) in {stats['buckets_compiled']}"
      f" step shapes",
      *fmt_prefix(stats),
      *fmt_spec(stats),
  ]


def fmt_spec(stats: dict) -> list[str]:
  if not stats.get("speculative"):
    return []
  return [
      f"  speculative         acceptance rate {100 * stats['acceptance_rate']:.1f}%"
      f" ({stats['spec_accepted_tokens']} of {stats['spec_proposed_tokens']} draft"
      f" tokens) in {stats['spec_steps']} verification steps; mean accepted"
      f" length {stats['mean_accepted_length']:.2f}; drafting"
      f" {stats.get('spec_draft_seconds', 0.0):.2f} s"]


def fmt_prefix(stats: dict) -> list[str]:
  if not stats["prefix_caching"]:
    return ["  prefix cache        off"] if stats["kind"] == "paged" else []
  return [
      f"  prefix cache        hit rate {100 * stats['prefix_cache_hit_rate']:.1f}%"
      f" ({stats['prefix_hit_tokens']} of {stats['prefix_queried_tokens']} prompt"
      f" tokens), {stats['prefill_tokens_saved']} prefill tokens saved; blocks"
      f" cached {stats['prefix_blocks_registered']}, evicted"
      f" {stats['prefix_blocks_evicted']}, {stats['blocks_cached']} held at the end"]


def short(text: str, limit: int) -> str:
  text = text.replace("\n", "\\n")
  return text if len(text) <= limit else text[:limit - 1] + "…"
