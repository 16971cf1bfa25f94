"""Hybrid local/global attention (issue #23): what skipping and the grouped
scan cost, measured without a device.

1. Page copies of one decode call against `kv_len`, with a 16-token window
   and without, in interpret mode (`tests.window_contract.page_copies`): the
   TPU kernel's DMAs and the Triton kernel's masked K/V loads; a local
   layer's copies stay flat.
2. XLA decode attention (`attention.paged_attention(implementation="xla")`)
   of a local layer (window 512) against the same call without a window, at
   kv_len 512 .. 8192 (batch 8, 8 query / 2 KV heads of 128, float32, pages
   of 16, random non-contiguous tables as wide as the longest): interleaved
   rounds (local, global at every length, repeated), medians, loaded-machine
   wall seconds; the local times should stay flat past the window.
3. The paged step of a Gemma 3-shaped random model (5 local : 1 global,
   hidden 256, 4 query / 2 KV heads of 64) lowered and compiled at 6, 12
   and 24 layers, against the same model with every layer local (one spec,
   scan period 1): HLO lines (exact) and compile CPU seconds (noisy; medians
   of interleaved repeats in one process, compile caches off).

  PYTHONPATH=. python -m benchmarks.hybrid_window           # all three
  PYTHONPATH=. python -m benchmarks.hybrid_window page_copies  # only 1.
  PYTHONPATH=. python -m benchmarks.hybrid_window xla_time     # only 2.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def page_copies(window=16, block_size=8, lens=(16, 32, 64, 128, 256)) -> list:
  """Pages copied (K and V counted apart) by one decode call, against
  `kv_len`: the TPU kernel's DMAs and the Triton kernel's masked loads
  (`tests.window_contract.page_copies`), both in interpret mode."""
  from pallas_kernels.gpu import paged_decode as gpu_pd  # pylint: disable=import-outside-toplevel
  from pallas_kernels.tpu import paged_decode as pd  # pylint: disable=import-outside-toplevel
  from tests import cases, window_contract  # pylint: disable=import-outside-toplevel
  kernels = {
      "tpu": lambda *a, **k: pd.paged_decode(
          *a, **k, interpret=True, config=pd.PagedDecodeConfig(pages_per_compute_block=2)),
      "triton": lambda *a, **k: gpu_pd.paged_decode(
          *a, **k, interpret=True, config=gpu_pd.PagedDecodeConfig(pages_per_compute_block=2)),
  }
  rng = np.random.default_rng(0)
  rows = []
  for kv in lens:
    c = cases.make_decode_case(
        rng, batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=block_size, max_blocks_per_seq=max(lens) // block_size,
        kv_lens=[kv])
    row = {"kv_len": kv}
    for kernel, fn in kernels.items():
      for name, w in (("local", window), ("global", None)):
        with window_contract.page_copies(c.k_pages.shape) as seen:
          jax.block_until_ready(fn(c.q, c.k_pages, c.v_pages, c.block_tables,
                                   c.kv_lens, sliding_window=w))
        row[f"{kernel}_{name}"] = len(seen)
    rows.append(row)
  return rows


def xla_decode_time(window=512, lens=(512, 1024, 2048, 4096, 8192), rounds=15,
                    batch=8, block_size=16) -> list:
  from paged_jax import attention  # pylint: disable=import-outside-toplevel
  from tests import cases  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  width = max(lens) // block_size
  c = cases.make_decode_case(
      rng, batch=batch, num_q_heads=8, num_kv_heads=2, head_dim=128,
      block_size=block_size, max_blocks_per_seq=width, kv_lens=[max(lens)] * batch)
  fns = {name: jax.jit(lambda q, k, v, t, n, w=w: attention.paged_attention(
      q, k, v, t, n, sliding_window=w, implementation="xla"))
         for name, w in (("local", window), ("global", None))}
  args = {n: (c.q, c.k_pages, c.v_pages, c.block_tables,
              jnp.full((batch,), n, jnp.int32)) for n in lens}
  times = {(name, n): [] for name in fns for n in lens}
  for r in range(rounds + 1):  # round 0 compiles and warms
    for n in lens:
      for name, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args[n]))
        if r:
          times[name, n].append(time.perf_counter() - t0)
  rows = []
  for n in lens:
    local, glob = (statistics.median(times[k, n]) for k in ("local", "global"))
    rows.append({"kv_len": n, "local_ms": round(local * 1e3, 3),
                 "global_ms": round(glob * 1e3, 3),
                 "local_vs_local_at_window": round(
                     local / statistics.median(times["local", lens[0]]), 2),
                 "global_over_local": round(glob / local, 2)})
  return rows


def _config(num_layers, hybrid):
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  types = tuple("full_attention" if hybrid and (i + 1) % 6 == 0 else
                "sliding_attention" for i in range(num_layers))
  return model_lib.LlamaConfig(
      vocab_size=1024, hidden_size=256, intermediate_size=512,
      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=64,
      rope_theta=1e6, rope_local_theta=1e4, sliding_window=64,
      layer_types=types, gemma_style=True, hidden_act="gelu_pytorch_tanh",
      qk_norm=True, query_pre_attn_scalar=64.0, tie_word_embeddings=True,
      architecture="Gemma3ForCausalLM")


def compile_cost(depths=(6, 12, 24), repeats=3) -> list:
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from paged_jax import block_manager as bm  # pylint: disable=import-outside-toplevel
  from paged_jax import step_metadata  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  state = bm.init(num_blocks=64, block_size=16, max_seqs=8, max_blocks_per_seq=8)
  ids = jnp.arange(8, dtype=jnp.int32)
  state, _ = bm.reserve(state, ids, jnp.full(8, 40, jnp.int32))
  meta = step_metadata.step_metadata(state, ids, jnp.ones(8, jnp.int32),
                                     num_tokens=8, decode_only=True)
  samples = {}
  for _ in range(repeats):
    for depth in depths:
      for hybrid in (True, False):
        model = model_lib.Llama.abstract(_config(depth, hybrid))
        graphdef, params = nnx.split(model)
        cache = jax.eval_shape(lambda: model.make_cache(64, 16))  # pylint: disable=cell-var-from-loop

        def fwd(params, cache, tokens):
          m = nnx.merge(graphdef, params)  # pylint: disable=cell-var-from-loop
          h, cache = m.paged_forward(tokens, meta, cache)
          return m.logits(h), cache

        jax.clear_caches()
        lowered = jax.jit(fwd, donate_argnums=1).lower(
            params, cache, jax.ShapeDtypeStruct((8,), jnp.int32))
        c0 = time.process_time()
        lowered.compile()
        key = (depth, hybrid)
        samples.setdefault(key, {"hlo_lines": lowered.as_text().count("\n"),
                                 "compile_cpu_s": []})
        samples[key]["compile_cpu_s"].append(time.process_time() - c0)
  return [{"layers": d, "pattern": "5 local : 1 global" if h else "all local",
           "hlo_lines": v["hlo_lines"],
           "compile_cpu_s": round(statistics.median(v["compile_cpu_s"]), 2)}
          for (d, h), v in samples.items()]


def main() -> int:
  jax.config.update("jax_enable_compilation_cache", False)
  if sys.argv[1:] == ["xla_time"]:
    out = {"xla_decode_time_w512": xla_decode_time(), "load_average": os.getloadavg()}
  elif sys.argv[1:] == ["page_copies"]:
    out = {"page_copies_decode_w16_bs8": page_copies()}
  else:
    out = {"page_copies_decode_w16_bs8": page_copies(),
           "xla_decode_time_w512": xla_decode_time(),
           "compile": compile_cost(), "load_average": os.getloadavg()}
  json.dump(out, sys.stdout, indent=1)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
