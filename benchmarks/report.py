"""Writes benchmarks/RESULTS.md from the JSON files under benchmarks/results/.

  PYTHONPATH=. python -m benchmarks.report
"""

from __future__ import annotations

import json
import pathlib

from benchmarks import common

RESULTS_MD = pathlib.Path(__file__).parent / "RESULTS.md"


def _load(out: pathlib.Path, name: str) -> dict | None:
  path = out / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%" if x >= 0.01 else f"{100 * x:.2f}%"


def _yes(ok: bool) -> str:
  return "yes" if ok else "**no**"


def _utilisation(d: dict) -> list[str]:
  res = d["results"]
  names = list(res)
  bss = list(res[names[0]]["paged"])
  lines = [
      "## 1. Utilisation: share of allocated KV slots holding tokens",
      "",
      "Time-integrated over the whole run (sum over steps of tokens held / slots "
      "allocated). Paged rows run through `paged_jax.block_manager`; contiguous rows "
      "reserve max_model_len slots, or the exact final length (an oracle), per request.",
      "",
      "| scheme | " + " | ".join(
          f"{n}-like ({res[n]['setup']['num_requests']} req, "
          f"{res[n]['setup']['kv_budget_tokens']} slots)" for n in names) + " |",
      "|---|" + "---:|" * len(names),
  ]
  for bs in bss:
    row = [_pct(res[n]["paged"][bs]["utilisation"]) if bs in res[n]["paged"] else "-"
           for n in names]
    lines.append(f"| paged, block_size {bs} | " + " | ".join(row) + " |")
  for label in ("exact_length", "max_length_2048", "max_length_8192"):
    row = [_pct(res[n]["contiguous"][label]["utilisation"])
           if label in res[n]["contiguous"] else "n/a (exceeds budget)" for n in names]
    lines.append(f"| contiguous, {label.replace('_', ' ')} | " + " | ".join(row) + " |")
  pre = ", ".join(f"{n}: {res[n]['paged']['16']['preemptions']}" for n in names
                  if "16" in res[n]["paged"])
  lines += ["", f"Preemptions (recompute) at block_size 16: {pre}.", "",
            "![utilisation](results/utilisation.png)", ""]
  return lines


def _concurrency(d: dict) -> list[str]:
  lines = [
      "## 2. Concurrency: requests running at once in a fixed KV budget",
      "",
      "Mean requests running over the steps with requests waiting (memory-bound). "
      "Paged: block_size 16 through the block manager.",
      "",
      "| trace | KV budget (slots) | paged | contiguous max-length 2048 | "
      "max-length 8192 | exact length (oracle) | paged / max-length 2048 |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, r in d["results"].items():
    runs = r["runs"]
    def cell(label):
      return f"{runs[label]['mean_running_saturated']:.1f}" if label in runs else "n/a"
    lines.append(
        f"| {name}-like ({r['setup']['num_requests']} req) | "
        f"{r['setup']['kv_budget_tokens']} | {cell('paged')} | {cell('max_length_2048')} | "
        f"{cell('max_length_8192')} | {cell('exact_length')} | "
        f"{r['paged_over']['max_length_2048']:.2f}x |")
  lines += ["", "![concurrency](results/concurrency.png)", ""]
  return lines


def _xla_paths(dec: dict | None, pre: dict | None) -> list[str]:
  rows = ["## XLA paths against dense attention on the same tokens (CPU)", ""]
  if dec:
    rows += [
        f"`benchmarks/xla_decode.py` ({dec['date']}, jax {dec['jax']}): "
        "`paged_attention(implementation=\"xla\")` over random non-contiguous "
        "block tables vs dense decode on contiguous `[batch, kv_heads, kv_len, "
        "head_dim]` K/V; 8 query / 2 KV heads, head_dim 128, float32. Goal "
        "<= 1.05.", "",
        "| batch | context | block_size | paged ms | dense ms | paged / dense |",
        "|---:|---:|---:|---:|---:|---:|"]
    for r in dec["decode"]:
      rows.append(f"| {r['batch']} | {r['context']} | {r['block_size']} | "
                  f"{r['paged_ms']:.3f} | {r['dense_ms']:.3f} | {r['ratio']:.2f} |")
    us = dec["reserve_us"]
    rows += ["", "Block manager, reserve + release of 64 sequences (jitted, "
             "donated): " + ", ".join(f"{k} blocks {v:.0f} us" for k, v in us.items())
             + f"; ratio {dec['reserve_ratio']:.2f} (goal <= 1.2).", ""]
  if pre:
    rows += [
        f"`benchmarks/xla_prefill.py` ({pre['date']}, jax {pre['jax']}): "
        "`ragged_paged_attention(implementation=\"xla\")` vs dense causal "
        "attention (full score matrix, masked) per sequence; 8 query / 2 KV heads, "
        "head_dim 64, float32. Goal <= 1.1.", "",
        "| sequences | new tokens | kv_len | paged ms | dense ms | paged / dense |",
        "|---:|---:|---:|---:|---:|---:|"]
    for r in pre["prefill"]:
      rows.append(f"| {r['num_seqs']} | {r['q_len']} | {r['kv_len']} | "
                  f"{r['paged_ms']:.2f} | {r['dense_ms']:.2f} | {r['ratio']:.2f} |")
    rows.append("")
  return rows


def _throughput(d: dict) -> list[str]:
  p, c = d["paged"], d["contiguous"]
  rows = [
      "## 3. Throughput: the Flax decoder's serving loop",
      "",
      f"{d['model']}; {d['requests']} seeded ShareGPT-like requests (lengths "
      f"scaled by 1/6), KV memory {d['kv_tokens']} tokens, max_model_len "
      f"{d['max_model_len']}, batch limit {d['max_batch']}. Greedy outputs "
      f"identical in both: {d['identical_outputs']}/{d['requests']}.",
      "",
      "| engine | tokens/s | ms per output token | running (mean / peak) | "
      "preemptions | host share of step |",
      "|---|---:|---:|---:|---:|---:|",
  ]
  for name, r in (("paged, continuous batching", p),
                  ("contiguous max-length, static batching", c)):
    rows.append(f"| {name} | {r['tokens_per_second']:.0f} | "
                f"{r['latency_per_output_token_ms']:.1f} | {r['mean_running']:.1f} / "
                f"{r['peak_running']} | {r['preemptions']} | {_pct(r['host_share'])} |")
  rows += ["", f"Tokens/s ratio: {d['tokens_per_second_ratio']:.2f}x.", "",
           "![throughput](results/throughput.png)", ""]
  return rows


def _host(d: dict) -> list[str]:
  lines = [
      "## 4. Host overhead",
      "",
      f"(a) Block-manager op cost, {d['batch']} sequences per call, block_size "
      f"{d['block_size']}, jitted with the state donated, median of 200 calls (pool sizes interleaved):",
      "",
      "| num_blocks | reserve (ms) | release (ms) |",
      "|---:|---:|---:|",
  ]
  for n, c in d["op_cost"].items():
    lines.append(f"| 2**{int(n).bit_length() - 1} | {1e3 * c['reserve']['median_s']:.3f} | "
                 f"{1e3 * c['release']['median_s']:.3f} |")
  r = d["largest_over_smallest"]
  s = d["step"]
  m = d["model"]
  lines += [
      "",
      f"Largest / smallest pool: reserve {r['reserve']:.1f}x, release "
      f"{r['release']:.1f}x (goal: flat).",
      "",
      f"(b) Per decode step at batch ~{s['batch']} (mean kv_len {s['kv_len']}), "
      f"ShareGPT-like trace, block_size {d['block_size']}:",
      "",
      "| part | ms per step |",
      "|---|---:|",
      f"| block manager (reserve/release, slot_mapping, gather_tables, stats) | "
      f"{s['manager_ms']:.2f} |",
      f"| scheduling (Python) | {s['scheduling_ms']:.2f} |",
      f"| XLA decode attention, {m['name']} shape x {m['num_layers']} layers (CPU, f32) | "
      f"{s['attention_ms']:.1f} |",
      "",
      f"Host share against attention alone on this CPU: {_pct(s['host_share'])} (goal "
      f"<= {_pct(d['goal_share'])}). This is a proxy: the model's matmuls are not in "
      "the denominator, and an accelerator's step is far shorter than this CPU's. "
      f"The host work stays under 5% of a device step of at least "
      f"{s['break_even_step_ms']:.1f} ms; the decoder's measured step time settles it.",
      "",
      "![host overhead](results/host_overhead.png)",
      "",
  ]
  eng = d.get("engine")
  if eng:
    lines += [
        f"(c) The serving engine itself (`paged_jax.serving`, tiny Llama, "
        f"{eng['requests']} requests, {eng['steps']} steps): host "
        f"{eng['host_ms_per_step']:.2f} ms and device {eng['device_ms_per_step']:.2f} ms "
        f"per step, host share {_pct(eng['host_share'])} (goal <= {_pct(d['goal_share'])}); "
        f"rows computed / real tokens {eng['padding_ratio']:.2f}x.",
        "",
    ]
  return lines


def _vllm(d: dict) -> list[str]:
  """The optional side-by-side run against vLLM's CPU build."""
  s = d["sizes"]
  lines = [
      "## 7. Against vLLM's CPU build (optional: `python benchmarks/vllm_compare.py`)",
      "",
      f"vLLM {d['vllm_version']}, the same {d['model']['parameters']:,}-parameter random "
      f"Llama (float32) as one Hugging Face checkpoint, {s['num_requests']} requests all "
      f"at once, greedy, EOS ignored, {s['kv_tokens']} KV tokens in blocks of "
      f"{s['block_size']}, max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
      f"{s['max_num_batched_tokens']}; runs interleaved A B A B, {s['repeats']} each, "
      "medians. TTFT includes queueing (every request arrives at t=0).",
      "",
      "| workload | paged-jax tokens/s | vLLM tokens/s | ratio | median TTFT (ms) | "
      "median TPOT (ms) | rows computed / real tokens | greedy identical |",
      "|---|---:|---:|---:|---|---|---:|---:|",
  ]

  def ms(a, b, key):
    x, y = a.get(key), b.get(key)
    return (f"{1e3 * x:.0f} vs {1e3 * y:.0f}" if x is not None and y is not None
            else "n/a")

  for name, r in d["workloads"].items():
    a, b, g = r["paged_jax"], r["vllm"], r["greedy"]
    pad = a.get("padding_ratio")
    lines.append(
        f"| {name} | {a['tokens_per_second_median']:.1f} | "
        f"{b['tokens_per_second_median']:.1f} | "
        f"{r['throughput_ratio_paged_jax_over_vllm']:.2f}x | "
        f"{ms(a, b, 'ttft_p50_s_median')} | {ms(a, b, 'tpot_p50_s_median')} | "
        f"{'-' if pad is None else f'{pad:.2f}x'} | "
        f"{g['identical_requests']}/{g['requests']} |")
  single = d.get("single_request", {})
  if single:
    lines += ["", "One request alone (ms per output token, paged-jax vs vLLM):", ""]
    for name, r in single.items():
      lines.append(f"- engine {name}: {r['paged_jax_ms_per_token']:.2f} vs "
                   f"{r['vllm_ms_per_token']:.2f} = {r['ratio']:.2f}x; greedy identical "
                   f"{r['greedy_identical']}")
  m = d.get("machine", {})
  lines += ["", f"Measured {m.get('date', '?')} on this machine (see the header); "
            f"{d['total_seconds']:.0f} s in all.", ""]
  return lines


def _block_size(d: dict, title: str) -> list[str]:
  s = d["shape"]
  lines = [
      f"## 5. Block size: decode attention time relative to the best ({title})",
      "",
      f"Platform {d['platform']}; batch {s['batch']}, {s['num_q_heads']} query / "
      f"{s['num_kv_heads']} KV heads, head_dim {s['head_dim']}, kv_len "
      f"{s['mean_kv_len']} +-50%, {s['dtype']}; blocks scattered at random.",
      "",
  ]
  for impl, res in d["implementations"].items():
    if "times" not in res:
      lines += [f"- {impl}: not run ({res['error']})", ""]
      continue
    bss = list(res["times"])
    lines += [
        f"| {impl} | " + " | ".join(bss) + " |",
        "|---|" + "---:|" * len(bss),
        "| time / best | " + " | ".join(f"{res['times'][b]['relative']:.3f}" for b in bss) + " |",
        "| median ms | " + " | ".join(f"{1e3 * res['times'][b]['median_s']:.2f}" for b in bss) + " |",
        "| p25-p75 ms | " + " | ".join(f"{1e3 * res['times'][b]['p25_s']:.0f}-"
                                        f"{1e3 * res['times'][b]['p75_s']:.0f}" for b in bss) + " |",
        "",
    ]
  lines += [f"![block size](results/{'block_size_gpu' if 'GPU' in title else 'block_size'}.png)", ""]
  return lines


def _sharded(d: dict) -> list[str]:
  c = d["config"]
  rows = [
      "## Scale-out: one device vs 8-device meshes (CPU, simulated devices)", "",
      f"`benchmarks/sharded.py` ({d['machine']['date']}, jax {d['machine']['jax']}): "
      f"the engine serving {d['requests']} greedy requests on a Llama with "
      f"{c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_heads']} "
      f"heads / {c['num_kv_heads']} KV heads (replicated when model > "
      f"{c['num_kv_heads']}), float32. Each data shard has its own pool and "
      "8 sequences. The 8 devices are simulated on the same CPU cores, so the "
      "step times show the sharded step runs, not how fast it is; the point is "
      "correctness. Logit error: one prefill + decode step against the "
      "unsharded dense forward.", "",
      "| mesh (data x model) | devices | completions identical to 1 device | "
      "max logit error | decode ms / step | sequences / step | KV MiB per device |",
      "|---|---:|---:|---:|---:|---:|---:|"]
  for r in d["steps"]:
    rows.append(
        f"| {r['data']} x {r['model']} | {r['devices']} | {r['identical']}/"
        f"{d['requests']} | {r['max_logit_error']:.1e} | "
        f"{r['device_ms_per_decode_step']:.2f} | {r['max_batch']} | "
        f"{r['kv_bytes_per_device'] / 2**20:.3f} |")
  rows += [
      "", f"KV capacity with {d['capacity_budget_mib_per_device']} MiB of pages "
      "on every device (measured from the shards of the created caches; "
      "float32, block_size 16):", "",
      "| model KV heads | mesh | cache KV heads | MiB per device | KV tokens | "
      "vs 1 device |", "|---:|---|---:|---:|---:|---:|"]
  for r in d["capacity"]:
    rows.append(
        f"| {r['model_kv_heads']} | {r['data']} x {r['model']} | "
        f"{r['cache_kv_heads']} | {r['max_bytes_per_device'] / 2**20:.2f} | "
        f"{r['kv_tokens']} | {r['tokens_vs_one_device']:.1f}x |")
  rows += ["", "Capacity grows with the devices: 8x on 8 devices when the KV "
           "heads split evenly; when the model axis exceeds the KV heads, each "
           "head is stored model / kv_heads times, so that part of the growth "
           "is spent on copies (2 KV heads: 2x on a 1 x 8 mesh, 8x on 8 x 1).",
           ""]
  return rows


def write(out: pathlib.Path = common.RESULTS_DIR, *, wall_s: dict | None = None,
          path: pathlib.Path = RESULTS_MD) -> pathlib.Path:
  util, conc = _load(out, "utilisation"), _load(out, "concurrency")
  host, bsz = _load(out, "host_overhead"), _load(out, "block_size")
  bsz_gpu = _load(out, "block_size_gpu")
  thr = _load(out, "throughput")
  first = next(d for d in (util, conc, host, bsz) if d)
  m = first["machine"]
  lines = [
      "# Benchmark results",
      "",
      "Written by `python -m benchmarks` (benchmarks/run_all.py); do not edit by hand.",
      "",
      f"- Machine: {m['cpu']}, {m['affinity'] or m['cpu_count']} CPU cores visible, "
      f"devices {', '.join(m['devices'])} (no accelerator unless listed)",
      f"- Date: {m['date']}; load average {m.get('load_average_1m', 0):.1f} when "
      "the last benchmark finished (the 2 cores are shared, so timings are noisy)",
      f"- Versions: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
      f"numpy {m['numpy']}",
  ]
  if wall_s:
    lines.append("- Wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in wall_s.items())
                 + f"; total {sum(wall_s.values()):.0f}s")
  lines += [
      "- Traces: seeded synthetic approximations of ShareGPT (mean prompt ~161, output "
      "~338 tokens, clipped at 2048) and Alpaca (~19, ~58); see `paged_jax/traces.py`.",
      "",
      "## Goals",
      "",
      "| benchmark | goal | measured | met |",
      "|---|---|---|---|",
  ]
  if util:
    lines.append(f"| 1. utilisation | >= 97% at block_size 16, ShareGPT-like | "
                 f"{_pct(util['sharegpt_block16_utilisation'])} | {_yes(util['goal_met'])} |")
  if conc:
    lines.append(f"| 2. concurrency | >= 4x max-length (2048) reservation, ShareGPT-like | "
                 f"{conc['sharegpt_paged_over_max_length_2048']:.2f}x | {_yes(conc['goal_met'])} |")
  if thr:
    p = thr["paged"]
    lines.append(f"| 3. throughput | >= 3x tokens/s, paged + continuous vs contiguous "
                 f"+ static, same KV memory | {thr['tokens_per_second_ratio']:.2f}x | "
                 f"{_yes(thr['tokens_per_second_ratio'] >= 3)} |")
    lines.append(f"| 4. host overhead | <= 5% of decoder step time (tiny model, CPU) | "
                 f"{_pct(p['host_share'])} | {_yes(p['host_share'] <= 0.05)} |")
  if host:
    r = host["largest_over_smallest"]
    flat = max(r.values()) <= 1.5
    lines.append(f"| 4. host overhead | op cost flat, 2**10 to 2**20 blocks | reserve "
                 f"{r['reserve']:.1f}x, release {r['release']:.1f}x | {_yes(flat)} |")
    lines.append(f"| 4. host overhead | <= 5% of step time | {_pct(host['step']['host_share'])} "
                 "of CPU attention-only step (proxy) | proxy only |")
  for d, label in ((bsz, "CPU"), (bsz_gpu, "GPU")):
    if not d:
      continue
    for impl, res in d["implementations"].items():
      if "times" in res:
        lines.append(f"| 5. block size ({label}, {impl}) | 8-64 within 10% of best | worst "
                     f"{res['worst_relative_8_to_64']:.3f}x | {_yes(res['goal_met'])} |")
  lines.append("")
  if util:
    lines += _utilisation(util)
  if conc:
    lines += _concurrency(conc)
  if thr:
    lines += _throughput(thr)
  if host:
    lines += _host(host)
  dec, pre = _load(out, "xla_decode"), _load(out, "xla_prefill")
  if dec or pre:
    lines += _xla_paths(dec, pre)
  shard = _load(out, "sharded")
  if shard:
    lines += _sharded(shard)
  vllm = _load(out, "vllm_compare")
  if vllm:
    lines += _vllm(vllm)
  if bsz:
    lines += _block_size(bsz, "CPU, XLA path")
  if bsz_gpu:
    lines += _block_size(bsz_gpu, "GPU")
  else:
    lines += ["The GPU run (`python -m benchmarks.block_size --gpu`) has not been "
              "run on a GPU yet.", ""]
  path.write_text("\n".join(lines))
  return path


if __name__ == "__main__":
  print(write())
