"""Hybrid local/global attention (issue #23): what skipping and the grouped
scan cost, measured without a device.

1. Page copies of one TPU decode call (interpret mode, the interpreter's DMAs
   counted by `tests.window_contract.page_copies`) against `kv_len`, with a
   16-token window and without: a local layer's copies stay flat.
2. The paged step of a Gemma 3-shaped random model (5 local : 1 global,
   hidden 256, 4 query / 2 KV heads of 64) lowered and compiled at 6, 12
   and 24 layers, against the same model with every layer local (one spec,
   scan period 1): HLO lines (exact) and compile CPU seconds (noisy; medians
   of interleaved repeats in one process, compile caches off).

  PYTHONPATH=. python -m benchmarks.hybrid_window
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def page_copies(window=16, block_size=8, lens=(16, 32, 64, 128, 256)) -> list:
  from pallas_kernels.tpu import paged_decode as pd  # pylint: disable=import-outside-toplevel
  from tests import cases, window_contract  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  rows = []
  for kv in lens:
    c = cases.make_decode_case(
        rng, batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=block_size, max_blocks_per_seq=max(lens) // block_size,
        kv_lens=[kv])
    row = {"kv_len": kv}
    for name, w in (("local", window), ("global", None)):
      with window_contract.page_copies(c.k_pages.shape) as seen:
        jax.block_until_ready(pd.paged_decode(
            c.q, c.k_pages, c.v_pages, c.block_tables, c.kv_lens,
            sliding_window=w, interpret=True,
            config=pd.PagedDecodeConfig(pages_per_compute_block=2)))
      row[name] = len(seen)
    rows.append(row)
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
  out = {"page_copies_tpu_interpret_decode_w16_bs8": page_copies(),
         "compile": compile_cost()}
  json.dump(out, sys.stdout, indent=1)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
