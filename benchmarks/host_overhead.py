"""Benchmark 4, host overhead: block-manager cost against pool size and step time.

(a) Op cost against pool size: `reserve` (64 new sequences of one block each)
    and `release` (the same 64) at num_blocks 2**10 .. 2**20, jitted with the
    state donated (`jax.jit(..., donate_argnums=0)`), median of many calls.
    Goal: flat (we report largest / smallest).
(b) Share of step time: the per-step host work of a serving loop (FCFS
    scheduling, reserve/release, slot_mapping, gather_tables, statistics;
    `benchmarks.sim` with engine metadata on, after warm-up; median over the
    memory-bound steps, where the batch is largest) against a decode
    step's attention on the XLA path for a small real shape (Llama-3.2-1B:
    16 layers, 32 query / 8 KV heads, head_dim 64) at the same batch. The
    model's matmuls are left out, so this share is an upper bound; the full
    decoder's step time completes it (see RESULTS.md). Goal: <= 5%.
(c) The engine's own host share (`paged_jax.serving`): the tiny Llama
    serving the ShareGPT-like mini workload at the CLI's default sizes;
    `EngineStats.host_seconds` (scheduling with the exact host model of the
    block state, building inputs, applying results) over host + device
    seconds, after warm-up. Timings on a shared CPU are noisy.

  PYTHONPATH=. python -m benchmarks.host_overhead [--quick]
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks import sim
from paged_jax import attention
from paged_jax import block_manager
from paged_jax import traces

BATCH = 64
BLOCK_SIZE = 16
POOL_EXPONENTS = tuple(range(10, 21))
GOAL_SHARE = 0.05
# Llama-3.2-1B attention shape; float32 (the CPU's native type).
MODEL = dict(name="llama-3.2-1b", num_layers=16, num_q_heads=32, num_kv_heads=8,
             head_dim=64)
SIM = dict(num_requests=200, kv_budget_tokens=16384, max_seqs=128,
           request_rate=20.0)


@functools.partial(jax.jit, donate_argnums=0)
def _reserve(state, seq_ids, num_new_tokens):
  return block_manager.reserve(state, seq_ids, num_new_tokens)


@functools.partial(jax.jit, donate_argnums=0)
def _release(state, seq_ids):
  return block_manager.release(state, seq_ids)


def op_costs(pool_sizes, *, repeats: int) -> dict:
  """Median seconds of reserve and release for BATCH sequences, per pool size.

  The pools are timed in interleaved rounds (every size once per round), so
  load that comes and goes on a shared machine lands on all sizes alike.
  """
  ids = jnp.arange(BATCH, dtype=jnp.int32)
  n = jnp.full((BATCH,), BLOCK_SIZE, jnp.int32)
  states = {nb: block_manager.init(num_blocks=nb, block_size=BLOCK_SIZE,
                                   max_seqs=BATCH, max_blocks_per_seq=64)
            for nb in pool_sizes}
  times = {nb: {"reserve": [], "release": []} for nb in pool_sizes}
  for i in range(repeats + 2):  # the first two rounds compile and warm up
    for nb in pool_sizes:
      state = states[nb]
      t0 = time.perf_counter()
      state, res = _reserve(state, ids, n)
      jax.block_until_ready(state)
      t1 = time.perf_counter()
      state, ok = _release(state, ids)
      jax.block_until_ready(state)
      t2 = time.perf_counter()
      states[nb] = state
      if i >= 2:
        times[nb]["reserve"].append(t1 - t0)
        times[nb]["release"].append(t2 - t1)
  for state in states.values():
    block_manager.check_invariants(state)
    assert int(state.num_free) == state.num_blocks
  return {str(nb): {op: {"median_s": statistics.median(t), "repeats": len(t)}
                    for op, t in times[nb].items()} for nb in pool_sizes}


def attention_step(batch: int, kv_len: int, *, repeats: int) -> dict:
  """Median seconds of one layer's XLA decode attention, and x num_layers."""
  hq, hkv, d = MODEL["num_q_heads"], MODEL["num_kv_heads"], MODEL["head_dim"]
  blocks_per_seq = -(-kv_len // BLOCK_SIZE)
  num_blocks = batch * blocks_per_seq
  rng = np.random.default_rng(0)
  k_pages = jnp.asarray(rng.standard_normal((hkv, num_blocks, BLOCK_SIZE, d), np.float32))
  v_pages = jnp.asarray(rng.standard_normal((hkv, num_blocks, BLOCK_SIZE, d), np.float32))
  tables = jnp.asarray(rng.permutation(num_blocks).reshape(batch, blocks_per_seq)
                       .astype(np.int32))
  kv_lens = jnp.full((batch,), kv_len, jnp.int32)
  q = jnp.asarray(rng.standard_normal((batch, hq, d), np.float32))
  fn = jax.jit(functools.partial(attention.paged_attention, implementation="xla"))
  t = common.time_calls(lambda: jax.block_until_ready(
      fn(q, k_pages, v_pages, tables, kv_lens)), repeats=repeats)
  return t | {"batch": batch, "kv_len": kv_len,
              "step_s": t["median_s"] * MODEL["num_layers"]}


def plot(data: dict, path) -> None:
  plt = common.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  sizes = [int(k) for k in data["op_cost"]]
  for op in ("reserve", "release"):
    ax1.plot(sizes, [1e3 * data["op_cost"][str(n)][op]["median_s"] for n in sizes],
             "o-", label=f"{op} ({BATCH} seqs)")
  ax1.set_xscale("log", base=2)
  ax1.set_ylim(bottom=0)
  ax1.set_xlabel("num_blocks in the pool")
  ax1.set_ylabel("median ms per call (donated state)")
  ax1.set_title("block-manager op cost vs pool size (goal: flat)")
  ax1.grid(alpha=0.3, which="both")
  ax1.legend()
  s = data["step"]
  parts = {"block manager": s["manager_ms"], "scheduling (python)": s["scheduling_ms"],
           f"XLA attention x{MODEL['num_layers']} layers": s["attention_ms"]}
  ax2.barh(list(parts), list(parts.values()))
  ax2.set_xscale("log")
  ax2.set_xlabel("ms per decode step")
  ax2.set_title(f"per step at batch ~{s['batch']}: host share {100 * s['host_share']:.2f}%"
                " (CPU)")
  ax2.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def engine_share(num_requests: int) -> dict:
  """(c): host share of the engine's steps on the tiny model (see the module
  docstring)."""
  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib
  from paged_jax.entrypoints import workload
  cfg = model_lib.LlamaConfig.tiny()
  model = model_lib.init_model(cfg)
  reqs = workload.synthetic_requests(num_requests, vocab_size=cfg.vocab_size,
                                     exclude_ids=cfg.eos_token_ids)
  stats, _ = workload.run_workload("paged", model, reqs, kv_tokens=1024,
                                   progress=False)
  host, device = stats["host_ms_per_step"], stats["device_ms_per_step"]
  return {"requests": num_requests, "steps": stats["steps"], "host_ms_per_step": host,
          "device_ms_per_step": device, "host_share": host / (host + device),
          "padding_ratio": stats["padding_ratio"]}


def run(quick: bool = False, out=common.RESULTS_DIR) -> dict:
  exps = (10, 14) if quick else POOL_EXPONENTS
  costs = op_costs([2**e for e in exps], repeats=10 if quick else 200)
  for e in exps:
    c = costs[str(2**e)]
    print(f"  num_blocks=2**{e}: reserve {1e3 * c['reserve']['median_s']:.3f} ms, "
          f"release {1e3 * c['release']['median_s']:.3f} ms", flush=True)
  ratios = {op: costs[str(2**exps[-1])][op]["median_s"] / costs[str(2**exps[0])][op]["median_s"]
            for op in ("reserve", "release")}

  # (b) Host work per step (second run: everything compiled) vs attention.
  setup = SIM | ({"num_requests": 40} if quick else {})
  trace = traces.make_trace("sharegpt", setup["num_requests"],
                            request_rate=setup["request_rate"], seed=0)
  kwargs = dict(block_size=BLOCK_SIZE, num_blocks=setup["kv_budget_tokens"] // BLOCK_SIZE,
                max_seqs=setup["max_seqs"], engine_metadata=True)
  sim.simulate_paged(trace, **kwargs)  # warm-up: compiles every call size
  r = sim.simulate_paged(trace, **kwargs)
  # Memory-bound steps (requests waiting): the batch is as large as it gets.
  sat = r.saturated() if r.saturated().any() else r.running > 0
  host_ms = 1e3 * float(np.median(r.step_s[sat]))
  manager_ms = host_ms * r.manager_s / r.host_s  # its share of host time
  batch = int(round(r.running[sat].mean()))
  kv_len = int(round(r.tokens[sat].sum() / r.running[sat].sum()))
  att = attention_step(batch, kv_len, repeats=3 if quick else 10)
  attention_ms = 1e3 * att["step_s"]
  step = {"batch": batch, "kv_len": kv_len, "steps": r.steps,
          "host_ms": host_ms, "manager_ms": manager_ms,
          "scheduling_ms": host_ms - manager_ms,
          "attention_layer_ms": 1e3 * att["median_s"], "attention_ms": attention_ms,
          "host_share": host_ms / (host_ms + attention_ms),
          "break_even_step_ms": host_ms / GOAL_SHARE * (1 - GOAL_SHARE)}
  print(f"  per step: host {host_ms:.2f} ms (block manager {manager_ms:.2f} ms), "
        f"XLA attention {attention_ms:.1f} ms ({MODEL['num_layers']} layers, batch "
        f"{batch}, kv_len {kv_len}) -> host share {100 * step['host_share']:.2f}%; "
        f"<= 5% needs a device step of >= {step['break_even_step_ms']:.1f} ms")
  eng = engine_share(16 if quick else 48)
  print(f"  engine (tiny Llama, {eng['steps']} steps): host {eng['host_ms_per_step']:.2f} "
        f"ms/step, device {eng['device_ms_per_step']:.2f} ms/step -> host share "
        f"{100 * eng['host_share']:.1f}% (noisy)")
  data = {"batch": BATCH, "block_size": BLOCK_SIZE, "model": MODEL, "sim": setup,
          "op_cost": costs, "largest_over_smallest": ratios, "step": step,
          "engine": eng, "goal_share": GOAL_SHARE}
  common.write_json(out, "host_overhead", data, quick=quick)
  plot(data, common.figure_path(out, "host_overhead", quick=quick))
  print(f"op cost 2**{exps[-1]} / 2**{exps[0]} blocks: reserve {ratios['reserve']:.1f}x, "
        f"release {ratios['release']:.1f}x (goal: flat)")
  return data


def main(argv=None):
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  run(args.quick, args.out)


if __name__ == "__main__":
  main()
