"""Scale-out on 8 devices: one device vs every 8-device mesh, and KV capacity.

  PYTHONPATH=. python -m benchmarks.sharded [--quick]

On a CPU-only machine it simulates 8 host devices
(`--xla_force_host_platform_device_count=8`, set before JAX starts). They
share the machine's cores, so the step times show that the sharded step runs,
not how fast it would be on 8 accelerators; on GPUs or TPUs the same script
uses the real devices.

1. Correctness and decode step: the same greedy workload served by the engine
   on one device and on each mesh (data x model = 8, plus 2 x 2), with the
   model tensor-parallel over `model` and one pool per data shard: identical
   completions, max |logit difference| of one prefill + decode step against
   the single-device model, decode-step milliseconds (each data shard runs
   `max_batch` sequences, so a mesh with `data` shards runs `data` times the
   batch per step).
2. Capacity: with the same KV budget on every device, the KV tokens a mesh
   holds (measured from the shards of the caches created on it), for a model
   with 8 KV heads (no replication) and one with 2 (replicated when the model
   axis exceeds 2).

Writes `benchmarks/results/sharded.json`.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in \
    os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import common  # noqa: E402
from paged_jax.models.llama import model as model_lib  # noqa: E402
from paged_jax.models.llama import tensor_parallel  # noqa: E402
from paged_jax.entrypoints import workload  # noqa: E402
from paged_jax import block_manager as bm  # noqa: E402
from paged_jax import flax_attention  # noqa: E402
from paged_jax import sharding as ps  # noqa: E402

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2)]
BUDGET_MIB = 4  # KV bytes per device in the capacity table


def bench_config(quick: bool, num_kv_heads: int = 2) -> model_lib.LlamaConfig:
  """A small Llama with 8 query heads so every model axis up to 8 splits."""
  if quick:
    return model_lib.LlamaConfig.tiny(num_heads=8, num_kv_heads=num_kv_heads)
  return model_lib.LlamaConfig(
      vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4,
      num_heads=8, num_kv_heads=num_kv_heads, head_dim=32,
      max_position_embeddings=1024, eos_token_ids=(2,))


def logit_error(model, mesh, prompts_per_shard: int = 2) -> float:
  """Max |logits| difference of one prefill + one decode step on `mesh`
  against the unsharded model's dense forward."""
  data = mesh.shape[ps.DATA]
  sharded = tensor_parallel.shard_model(model, mesh)
  c = sharded.config
  bs, blocks, T = 8, 16, 32
  cache = ps.create_cache(mesh, num_layers=c.num_layers,
                          num_kv_heads=c.num_kv_heads,
                          num_blocks_per_shard=blocks, block_size=bs,
                          head_dim=c.head_dim, dtype=jnp.float32)
  states = ps.init_block_states(mesh, num_blocks_per_shard=blocks,
                                block_size=bs,
                                max_seqs_per_shard=prompts_per_shard,
                                max_blocks_per_seq=blocks)
  graphdef, params = nnx.split(sharded)
  rng = np.random.default_rng(0)
  lens = rng.integers(4, T // prompts_per_shard, (data, prompts_per_shard))
  prompts = [[rng.integers(3, c.vocab_size, int(n)).tolist() for n in row]
             for row in lens]

  @jax.jit
  def step(params, cache, states, tokens, q_lens):
    mdl = nnx.merge(graphdef, params)
    ids = jnp.broadcast_to(jnp.arange(q_lens.shape[1], dtype=jnp.int32), q_lens.shape)
    states, res = jax.vmap(bm.reserve)(states, ids, q_lens)
    meta = flax_attention.sharded_step_metadata(
        mesh, states, ids, q_lens, num_tokens=tokens.shape[1], active=res.ok)
    hidden, cache = mdl.paged_forward(tokens.reshape(-1), meta, cache)
    return mdl.logits(hidden).reshape(data, tokens.shape[1], -1), cache, states

  tokens = np.zeros((data, T), np.int32)
  for i, row in enumerate(prompts):
    flat = [t for p in row for t in p]
    tokens[i, :len(flat)] = flat
  pre, cache, states = step(params, cache, states, tokens, lens.astype(np.int32))
  nxt = np.zeros((data, T), np.int32)
  last = np.cumsum(lens, axis=1) - 1
  nxt[:, :prompts_per_shard] = np.take_along_axis(
      np.asarray(jnp.argmax(pre, -1)), last, axis=1)
  # The decode step reuses the mixed layout: one new token per sequence.
  dec, _, _ = step(params, cache, states, nxt,
                   np.ones((data, prompts_per_shard), np.int32))
  dense = jax.jit(model_lib.Llama.dense_logits)
  err = 0.0
  for i, row in enumerate(prompts):
    start = 0
    for j, p in enumerate(row):
      full = np.zeros((1, T + 1), np.int32)
      full[0, :len(p) + 1] = p + [int(nxt[i, j])]
      want = np.asarray(dense(model, full))[0]
      err = max(err, float(np.abs(pre[i, start:start + len(p)] - want[:len(p)]).max()),
                float(np.abs(dec[i, j] - want[len(p)]).max()))
      start += len(p)
  return err


def serve(model, requests, mesh, quick):
  kw = dict(kv_tokens=1024 if quick else 4096, block_size=16, max_batch=8,
            max_tokens_per_step=64, max_model_len=256, progress=False)
  return workload.run_workload("paged", model, requests, mesh=mesh, **kw)


def capacity(quick: bool) -> list[dict]:
  """KV tokens held with `BUDGET_MIB` of pages per device, by mesh."""
  rows = []
  budget = BUDGET_MIB * 2**20
  for kv_heads in (8, 2):
    cfg = bench_config(quick, kv_heads)
    for data, tp in [(1, 1)] + MESHES:
      mesh = ps.make_mesh(data, tp)
      heads = ps.cache_kv_heads(cfg.num_kv_heads, tp)
      bs = 16
      # Bytes one block takes on one device: its share of the heads, K and V.
      block_bytes = 2 * cfg.num_layers * (heads // tp) * bs * cfg.head_dim * 4
      blocks = budget // block_bytes
      cache = ps.create_cache(mesh, num_layers=cfg.num_layers,
                              num_kv_heads=heads, num_blocks_per_shard=blocks,
                              block_size=bs, head_dim=cfg.head_dim,
                              dtype=jnp.float32)
      per_device = ps.per_device_cache_bytes(cache)
      rows.append({
          "model_kv_heads": cfg.num_kv_heads, "data": data, "model": tp,
          "cache_kv_heads": heads, "devices": len(per_device),
          "max_bytes_per_device": max(per_device.values()),
          "blocks_per_shard": blocks, "kv_tokens": data * blocks * bs,
          "total_bytes": cache.nbytes})
      del cache
    base = rows[-1 - len(MESHES)]["kv_tokens"]
    for r in rows[-1 - len(MESHES):]:
      r["tokens_vs_one_device"] = r["kv_tokens"] / base
  return rows


def run(quick: bool = False, out=common.RESULTS_DIR) -> dict:
  if len(jax.devices()) < 8:
    raise SystemExit("benchmarks.sharded needs 8 devices (run it in a fresh "
                     "process so that it can simulate them on CPU)")
  cfg = bench_config(quick)
  model = model_lib.init_model(cfg, seed=0)
  requests = workload.synthetic_requests(
      16 if quick else 32, vocab_size=cfg.vocab_size, max_model_len=256,
      seed=0, exclude_ids=cfg.eos_token_ids)
  base_stats, base_out = serve(model, requests, None, quick)
  rows = [{"data": 1, "model": 1, "devices": 1, "identical": len(base_out),
           "max_logit_error": 0.0, **_pick(base_stats)}]
  print(f"{'mesh':>8} {'dev':>3} {'same':>7} {'logit err':>9} {'decode ms':>9} "
        f"{'rows/step':>9} {'tok/s':>7} {'KV/dev MiB':>10}")
  _print(rows[0], len(requests))
  for data, tp in MESHES:
    mesh = ps.make_mesh(data, tp)
    stats, outs = serve(model, requests, mesh, quick)
    same = sum(a.completions == b.completions for a, b in zip(base_out, outs))
    row = {"data": data, "model": tp, "devices": data * tp, "identical": same,
           "max_logit_error": logit_error(model, mesh), **_pick(stats)}
    rows.append(row)
    _print(row, len(requests))
  cap = capacity(quick)
  print(f"\nKV capacity with {BUDGET_MIB} MiB of pages per device (float32, "
        "block_size 16):")
  print(f"{'KV heads':>8} {'mesh':>6} {'cache heads':>11} {'MiB/dev':>8} "
        f"{'KV tokens':>9} {'vs 1 dev':>8}")
  for r in cap:
    print(f"{r['model_kv_heads']:>8} {r['data']}x{r['model']:<4} "
          f"{r['cache_kv_heads']:>11} {r['max_bytes_per_device'] / 2**20:>8.2f} "
          f"{r['kv_tokens']:>9} {r['tokens_vs_one_device']:>7.1f}x")
  result = {"config": {k: getattr(cfg, k) for k in (
      "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
      "vocab_size")}, "requests": len(requests), "steps": rows,
      "capacity_budget_mib_per_device": BUDGET_MIB, "capacity": cap}
  common.write_json(out, "sharded", result, quick=quick)
  return result


def _pick(stats: dict) -> dict:
  keys = ("served", "steps", "decode_steps", "device_ms_per_decode_step",
          "device_ms_per_step", "tokens_per_second", "kv_bytes",
          "kv_bytes_per_device", "max_batch", "peak_running", "compile_seconds")
  return {k: stats[k] for k in keys}


def _print(r: dict, n: int):
  print(f"{r['data']}x{r['model']:<6} {r['devices']:>3} {r['identical']:>3}/{n:<3} "
        f"{r['max_logit_error']:>9.1e} {r['device_ms_per_decode_step']:>9.2f} "
        f"{r['max_batch']:>9} {r['tokens_per_second']:>7.0f} "
        f"{r['kv_bytes_per_device'] / 2**20:>10.3f}", flush=True)


def main(argv=None):
  args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
  run(args.quick, args.out)


if __name__ == "__main__":
  main()
