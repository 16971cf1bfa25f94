"""The prefix cache's host level (`--kv-offloading-size`, issue #24), on vs
off, on the main job's tiny Llama (float32, CPU), prefix caching on in both.

* `mooncake`: the real Mooncake conversation trace
  (`data/mooncake_conversation_first2000.jsonl`, Apache-2.0), scaled as in
  `prefix_engine.py` (16 token ids per 512-token hash id, outputs capped at
  `--max-new`): the first `--mooncake-requests` requests of conversations
  that have another turn in the file (their second hash id, the first after
  the shared system block, appears twice or more), all at once in trace
  order; the device pool about 1/8 of the prompts'
  working set (distinct full blocks), the host level 8x the device pool. The
  hit rate is compared with the ideal that device + host allow: an LRU
  cache of that many blocks over the same prompts in the same order (block
  hits along each prompt's chain, its last token always computed).
* `no-sharing`: distinct random prompts on a pool that keeps evicting (so
  the tier stores every step and never hits): the cost of the tier at 0%
  host hits, as TPOT (and tokens/s) on / off. One engine per arm, kept
  across the repeats (so the host level fills up and stays full, as in
  serving; its pages are touched before timing: a first write into a page
  of the NumPy host pool costs a page fault, ~5 us per 4 KiB on the 2-core
  container, once per page in a server's life); each pair serves fresh
  prompts (a new seed, the same in both arms), in the order off, on, then
  on, off (ABBA), so drift cancels.

Runs alternate off, on (`--repeats` pairs, after one discarded run of each:
the first run of an engine size in a process was 3-8x slower), medians, and
the on / off ratio of each pair (tokens/s, TPOT, and the serving thread's CPU
time, `time.thread_time`, which moves less with the machine's load than wall
time); greedy tokens are compared between on and off. `--model 30m`: the
30.7M-parameter random Llama of `vllm_compare.py` instead of the tiny one (a
step ~10-30x longer); `--batch`: sequences per step.

  PYTHONPATH=. python -m benchmarks.prefix_offload [--quick] [--repeats N]
      [--cases mooncake,no-sharing] [--model tiny|30m] [--batch 16]
"""

from __future__ import annotations

import collections
import os
import statistics
import time

import jax
import numpy as np

from benchmarks import common
from benchmarks import vllm_compare
from benchmarks import prefix_cache_trace as trace_lib
from benchmarks import prefix_engine as pe
from paged_jax import prefix_cache
from paged_jax import prefix_tier
from paged_jax.models.llama import model as model_lib
from paged_jax.serving import Engine, EngineConfig
from paged_jax.serving.driver import Driver
from paged_jax.serving.requests import Request

SIZES = dict(block_size=16, max_batch=16, max_tokens_per_step=128,
             max_model_len=1024, min_bucket=8, bucket_midpoints=False,
             enable_prefix_caching=True)


def working_set(requests, bs: int) -> int:
  """Distinct full prompt blocks (chains) of `requests`."""
  return len({tuple(r.prompt[:(j + 1) * bs]) for r in requests
              for j in range(len(r.prompt) // bs)})


def lru_ideal(requests, bs: int, capacity: int) -> float:
  """Prompt tokens an LRU cache of `capacity` blocks serves / prompt tokens."""
  cache: collections.OrderedDict = collections.OrderedDict()
  hit = total = 0
  for r in requests:
    p = r.prompt
    chains = [tuple(p[:(j + 1) * bs]) for j in range(len(p) // bs)]
    limit = prefix_cache.max_hit_blocks(len(p), bs)
    h = 0
    while h < limit and chains[h] in cache:
      h += 1
    hit, total = hit + h * bs, total + len(p)
    for c in chains:
      cache[c] = None
      cache.move_to_end(c)
    while len(cache) > capacity:
      cache.popitem(last=False)
  return hit / total


def serve(model, requests, num_blocks: int, host_blocks: int, sizes=None):
  sizes = SIZES if sizes is None else sizes
  per_block = None
  size = 0.0
  if host_blocks:
    probe = Engine(model, EngineConfig(num_blocks=4, **sizes))
    per_block = probe.cache.bytes_per_block
    size = host_blocks * per_block / prefix_tier.GIB
  engine = Engine(model, EngineConfig(num_blocks=num_blocks, kv_offloading_size=size,
                                      **sizes))
  engine.warmup()
  t0, cpu0 = time.perf_counter(), time.thread_time()
  driver = Driver(engine)
  for r in requests:
    driver.add_request(r, None)
  outs = driver.run_until_done()
  jax.block_until_ready(engine.block_state.num_free)
  cpu = time.thread_time() - cpu0
  wall = time.perf_counter() - t0 - engine.stats.compile_seconds
  st = engine.stats
  lat = st.latency_summary()
  row = {"wall_s": wall, "tokens_per_s": st.generated_tokens / wall,
         "cpu_s": cpu - st.compile_seconds, "steps": st.steps,
         "ttft_mean_s": lat["ttft"]["mean"], "ttft_p50_s": lat["ttft"]["p50"],
         "tpot_mean_s": lat["tpot"]["mean"], "tpot_p50_s": lat["tpot"]["p50"],
         "hit_rate": st.prefix_cache_hit_rate,
         "host_hit_tokens": st.external_prefix_hit_tokens,
         "computed_tokens": st.computed_tokens,
         "bytes_to_host": st.offload_bytes_to_host,
         "bytes_to_device": st.offload_bytes_to_device,
         "compile_s": st.compile_seconds}
  tokens = {o.request_id: [c.token_ids for c in o.completions] for o in outs}
  return row, tokens


def measure(name, model, requests, num_blocks, host_blocks, repeats, sizes=None):
  runs = {0: [], host_blocks: []}
  toks = {}
  for h in (0, host_blocks):  # discarded: an engine size's first run pays one-off costs
    serve(model, requests, num_blocks, h, sizes)
  for _ in range(repeats):
    for h in (0, host_blocks):
      r, t = serve(model, requests, num_blocks, h, sizes)
      runs[h].append(r)
      toks[h] = t
  med = lambda h, k: statistics.median(r[k] for r in runs[h])
  row = {"workload": name, "requests": len(requests), "num_blocks": num_blocks,
         "host_blocks": host_blocks,
         "prompt_tokens": sum(len(r.prompt) for r in requests),
         "same_greedy_tokens": toks[0] == toks[host_blocks]}
  for h, tag in ((0, "off"), (host_blocks, "on")):
    for k in runs[h][0]:
      row[f"{k}_{tag}"] = med(h, k)
    row[f"runs_tokens_per_s_{tag}"] = [r["tokens_per_s"] for r in runs[h]]
  row["ttft_ratio"] = row["ttft_mean_s_on"] / row["ttft_mean_s_off"]
  print(f"{name}: hit rate off {100 * row['hit_rate_off']:.1f}% on "
        f"{100 * row['hit_rate_on']:.1f}%; bytes to device "
        f"{row['bytes_to_device_on']:.0f}; TTFT mean x{row['ttft_ratio']:.3f}", flush=True)
  return _ratios(name, row, runs, host_blocks)


def measure_kept(name, model, make_requests, num_blocks, host_blocks, repeats,
                 sizes):
  """`measure` with one engine per arm, kept across the runs (module
  docstring); `make_requests(seed)` gives each pair its prompts."""
  engines = {}
  for h in (0, host_blocks):
    size = 0.0
    if h:
      probe = Engine(model, EngineConfig(num_blocks=4, **sizes))
      size = h * probe.cache.bytes_per_block / prefix_tier.GIB
    engines[h] = Engine(model, EngineConfig(num_blocks=num_blocks,
                                            kv_offloading_size=size, **sizes))
    engines[h].warmup()
    if h:  # a server's host pool has been written all over: no first touches
      for a in engines[h]._runner.host_cache.arrays.values():  # pylint: disable=protected-access
        a.fill(0)

  def run(h, seed):
    engine, st = engines[h], engines[h].stats
    keys = ("generated_tokens", "steps", "offload_bytes_to_host",
            "external_prefix_hit_tokens", "compile_seconds")
    before = [getattr(st, k) for k in keys]
    t0, cpu0 = time.perf_counter(), time.thread_time()
    driver = Driver(engine)
    for r in make_requests(seed):
      driver.add_request(r, None)
    outs = driver.run_until_done()
    jax.block_until_ready(engine.block_state.num_free)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
    tokens, steps, to_host, hits, compiled = (
        getattr(st, k) - b for k, b in zip(keys, before))
    wall -= compiled
    tpots = [o.tpot for o in outs if o.tpot is not None]
    row = {"wall_s": wall, "tokens_per_s": tokens / wall, "cpu_s": cpu - compiled,
           "tpot_mean_s": statistics.mean(tpots), "steps": steps,
           "bytes_to_host": to_host, "host_hit_tokens": hits, "compile_s": compiled}
    return row, {o.request_id: [c.token_ids for c in o.completions] for o in outs}

  for h in (0, host_blocks):  # discarded
    run(h, 0)
  runs = {0: [], host_blocks: []}
  same = True
  for i in range(repeats):
    order = (0, host_blocks) if i % 2 == 0 else (host_blocks, 0)
    toks = {}
    for h in order:
      r, toks[h] = run(h, i + 1)
      runs[h].append(r)
    same = same and toks[0] == toks[host_blocks]
  row = {"workload": name, "num_blocks": num_blocks, "host_blocks": host_blocks,
         "engines": "kept", "same_greedy_tokens": same}
  for h, tag in ((0, "off"), (host_blocks, "on")):
    for k in runs[h][0]:
      row[f"{k}_{tag}"] = statistics.median(r[k] for r in runs[h])
  return _ratios(name, row, runs, host_blocks)


def _ratios(name, row, runs, host_blocks):
  """Adds the on / off ratios, pair by pair and of the medians; prints."""
  for k in ("tokens_per_s", "tpot_mean_s", "cpu_s"):
    pairs = [on[k] / off[k] for off, on in zip(runs[0], runs[host_blocks])]
    row[f"pairs_{k}_ratio"] = pairs
    row[f"median_pair_{k}_ratio"] = statistics.median(pairs)
  row["tokens_per_s_ratio"] = row["tokens_per_s_on"] / row["tokens_per_s_off"]
  row["tpot_ratio"] = row["tpot_mean_s_on"] / row["tpot_mean_s_off"]
  print(f"{name}: pool {row['num_blocks']} + host {host_blocks} blocks; host hits "
        f"{row['host_hit_tokens_on']:.0f} tokens, bytes to host {row['bytes_to_host_on']:.0f}"
        f"; tokens/s off {row['tokens_per_s_off']:.0f} on {row['tokens_per_s_on']:.0f}"
        f" (x{row['tokens_per_s_ratio']:.3f}); TPOT mean x{row['tpot_ratio']:.3f}; "
        f"same tokens {row['same_greedy_tokens']}", flush=True)
  print(f"  per pair on/off: tokens/s {_fmt(row['pairs_tokens_per_s_ratio'])} (median "
        f"{row['median_pair_tokens_per_s_ratio']:.3f}); TPOT "
        f"{_fmt(row['pairs_tpot_mean_s_ratio'])} (median "
        f"{row['median_pair_tpot_mean_s_ratio']:.3f}); thread CPU "
        f"{_fmt(row['pairs_cpu_s_ratio'])} (median {row['median_pair_cpu_s_ratio']:.3f}); "
        f"TPOT off/on {1e3 * row['tpot_mean_s_off']:.2f}/{1e3 * row['tpot_mean_s_on']:.2f} ms, "
        f"steps {row['steps_off']:.0f}/{row['steps_on']:.0f}", flush=True)
  return row


def _fmt(xs):
  return ", ".join(f"{x:.3f}" for x in xs)


def conversations(n, vocab, max_new):
  """The first `n` requests of trace conversations with a later turn."""
  rows = trace_lib.load()
  second = collections.Counter(r["hash_ids"][1] for r in rows if len(r["hash_ids"]) > 1)
  keep = [i for i, r in enumerate(rows)
          if len(r["hash_ids"]) > 1 and second[r["hash_ids"][1]] >= 2][:n]
  scaled = trace_lib.Scaled(rows, tokens_per_hash=16)
  out = []
  for i in keep:
    new = min(scaled.output_len(i), max_new)
    prompt = (scaled.prompt(i) % vocab).tolist()[:SIZES["max_model_len"] - new]
    out.append(Request(i, prompt, pe._greedy(new)))  # pylint: disable=protected-access
  return out


def no_sharing(n, vocab, seed=1):
  rng = np.random.default_rng(seed)
  return [Request(f"{seed}-{i}", rng.integers(3, vocab, 64).tolist(), pe._greedy(64))  # pylint: disable=protected-access
          for i in range(n)]


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--mooncake-requests", type=int, default=100)
  p.add_argument("--max-new", type=int, default=8)
  p.add_argument("--cases", default="mooncake,no-sharing",
                 help="comma-separated: mooncake, no-sharing")
  p.add_argument("--model", default="tiny", choices=("tiny", "30m"),
                 help="tiny: LlamaConfig.tiny(); 30m: vllm_compare.MODEL (30.7M)")
  p.add_argument("--batch", type=int, default=SIZES["max_batch"],
                 help="no-sharing: sequences per step (max_batch)")
  args = p.parse_args(argv)
  cases = set(args.cases.split(","))
  if not cases or cases - {"mooncake", "no-sharing"}:
    p.error(f"--cases: expected mooncake and/or no-sharing, got {args.cases!r}")
  config = (model_lib.LlamaConfig.tiny() if args.model == "tiny"
            else model_lib.LlamaConfig(**vllm_compare.MODEL))
  model = model_lib.init_model(config, seed=0)
  vocab = model.config.vocab_size
  repeats = 1 if args.quick else args.repeats
  bs = SIZES["block_size"]
  reqs = conversations(40 if args.quick else args.mooncake_requests, vocab,
                       args.max_new)
  ws = working_set(reqs, bs)
  device = max(ws // 8, SIZES["max_model_len"] // bs + 8)
  host = 8 * device
  load0 = os.getloadavg()
  rows = []
  if "mooncake" in cases:
    rows.append(_mooncake(model, reqs, ws, device, host, repeats, bs))
  if "no-sharing" in cases:
    # 3 x `batch` prompts of 64 tokens + 64 new (8 blocks each at most), a
    # pool of 10 blocks per sequence slot: it keeps evicting, never preempts.
    n = args.batch if args.quick else 3 * args.batch
    sizes = dict(SIZES, max_batch=args.batch)
    rows.append(measure_kept("no-sharing", model,
                             lambda seed: no_sharing(n, vocab, seed),
                             10 * args.batch, 80 * args.batch, repeats, sizes))
  path = common.write_json(args.out, "prefix_offload",
                           {"machine": common.machine(), "sizes": SIZES,
                            "model": args.model, "batch": args.batch,
                            "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                            "rows": rows}, quick=args.quick)
  print(f"wrote {path}; load average {load0} -> {os.getloadavg()}")


def _mooncake(model, reqs, ws, device, host, repeats, bs) -> dict:
  row = measure("mooncake", model, reqs, device, host, repeats)
  row.update(working_set_blocks=ws,
             ideal_unbounded=pe.ideal_hit_rate(reqs, bs),
             ideal_device=lru_ideal(reqs, bs, device),
             ideal_device_host=lru_ideal(reqs, bs, device + host))
  row["of_ideal_on"] = row["hit_rate_on"] / row["ideal_device_host"]
  row["of_ideal_off"] = row["hit_rate_off"] / row["ideal_device"]
  print(f"mooncake: working set {ws} blocks; ideal unbounded "
        f"{100 * row['ideal_unbounded']:.1f}%, LRU device {100 * row['ideal_device']:.1f}%, "
        f"LRU device+host {100 * row['ideal_device_host']:.1f}%; on = "
        f"{100 * row['of_ideal_on']:.0f}% of its ideal", flush=True)
  return row


if __name__ == "__main__":
  main()
