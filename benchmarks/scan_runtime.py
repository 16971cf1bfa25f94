"""Run time of the scanned decode forward: the K/V written in place into the
carried 5-D cache at the layer index (this tree) vs the layer's pages sliced
out of the carry, written and put back (the previous scan body).

The model is SmolLM2-135M's shape (hidden 576, 9 query / 3 KV heads of 64,
intermediate 1536, vocab 49,152, tied embeddings, float32, seeded random
weights) at 30 layers. The measured call is the paged forward plus logits of
a decode step of 16 sequences of 200 tokens, jitted with the cache donated,
with a small cache (256 blocks of 16: 180 MiB) and a large one (1,024 blocks:
720 MiB). Both forms run in one process on the same model, their calls
interleaved (old, new, old, new, ...), after a check that their first call
gives equal logits and caches; medians of the wall time and of the process
CPU time (all threads) per call are reported.

  PYTHONPATH=. python -m benchmarks.scan_runtime [--cache-dtype int8]
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks import common
from benchmarks.compile_layers import SMOLLM2

CACHE_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")


def slice_scan_forward(model, tokens, meta, cache):
  """The previous scan body (the baseline): each layer's arrays sliced out of
  the carried cache, written by the one-layer `write_and_attend`, and put
  back with `dynamic_update_slice`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  graphdef, params = nnx.split(model.layers)
  names = [n for n in CACHE_FIELDS if getattr(cache, n) is not None]

  def body(carry, layer_params):
    x, arrays, i = carry
    layer = nnx.merge(graphdef, layer_params)
    pages = {n: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
             for n, a in zip(names, arrays)}
    x, pages = layer(x, meta, pages)
    arrays = tuple(jax.lax.dynamic_update_index_in_dim(a, pages[n], i, 0)
                   for n, a in zip(names, arrays))
    return (x, arrays, i + 1), None

  carry = (model.embed_tokens(tokens), tuple(getattr(cache, n) for n in names),
           jnp.int32(0))
  (x, arrays, _), _ = jax.lax.scan(body, carry, params)
  return x, cache.replace(**dict(zip(names, arrays)))


def measure(num_layers: int, num_blocks: int, calls: int,
            cache_dtype=None) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from paged_jax import block_manager as bm  # pylint: disable=import-outside-toplevel
  from paged_jax import step_metadata  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel

  model = model_lib.init_model(
      model_lib.LlamaConfig(num_layers=num_layers, **SMOLLM2), seed=0)
  n, bs = 16, 16
  state = bm.init(num_blocks=num_blocks, block_size=bs, max_seqs=n,
                  max_blocks_per_seq=16)
  seq_ids = jnp.arange(n, dtype=jnp.int32)
  state, _ = bm.reserve(state, seq_ids, jnp.full(n, 199, jnp.int32))
  state, _ = bm.reserve(state, seq_ids, jnp.ones(n, jnp.int32))
  meta = step_metadata.step_metadata(state, seq_ids, jnp.ones(n, jnp.int32),
                                     num_tokens=n, decode_only=True)
  graphdef, params = nnx.split(model)

  def jitted(forward):
    def fwd(params, cache, tokens, meta):
      m = nnx.merge(graphdef, params)
      hidden, cache = forward(m, tokens, meta, cache)
      return m.logits(hidden), cache
    return jax.jit(fwd, donate_argnums=1)

  forms = {"slice_scan": jitted(slice_scan_forward),
           "inplace_scan": jitted(lambda m, *a: m.paged_forward(*a))}
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, SMOLLM2["vocab_size"], n), jnp.int32)
  caches, first = {}, {}
  for name, fwd in forms.items():
    cache = model.make_cache(num_blocks, bs, cache_dtype)
    t0, c0 = time.perf_counter(), time.process_time()
    fwd = fwd.lower(params, cache, tokens, meta).compile()
    forms[name] = fwd
    compile_s = (time.perf_counter() - t0, time.process_time() - c0)
    logits, cache = fwd(params, cache, tokens, meta)
    first[name] = (np.asarray(logits),
                   [np.asarray(a, np.float32) for a in cache.arrays()])
    caches[name] = cache
    print(f"  {name}: compiled in {compile_s[0]:.1f} s (CPU {compile_s[1]:.1f} s)",
          flush=True)
  (la, ca), (lb, cb) = first.values()
  logits_max_diff = float(np.abs(la - lb).max())
  caches_equal = all(np.array_equal(a, b) for a, b in zip(ca, cb))
  del first, ca, cb
  times = {name: {"wall_ms": [], "cpu_ms": []} for name in forms}
  for i in range(calls + 2):
    for name, fwd in forms.items():
      t0, c0 = time.perf_counter(), time.process_time()
      logits, caches[name] = fwd(params, caches[name], tokens, meta)
      logits.block_until_ready()
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      if i >= 2:  # two warm-up calls each
        times[name]["wall_ms"].append(1e3 * wall)
        times[name]["cpu_ms"].append(1e3 * cpu)
  cache_mib = caches["inplace_scan"].nbytes / 2**20
  out = {"num_layers": num_layers, "num_blocks": num_blocks,
         "cache_dtype": str(caches["inplace_scan"].dtype),
         "cache_mib": cache_mib, "calls": calls,
         "logits_max_abs_diff": logits_max_diff, "caches_equal": caches_equal,
         "median": {name: {k: statistics.median(v) for k, v in t.items()}
                    for name, t in times.items()},
         "times": times}
  return out


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=30)
  p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024])
  p.add_argument("--calls", type=int, default=15)
  p.add_argument("--cache-dtype", default=None,
                 help="as kv_cache.cache_dtype (default: the model's, float32)")
  args = p.parse_args(argv)
  if args.quick:
    args.layers, args.blocks, args.calls = 2, [256], 3
  results = []
  for blocks in args.blocks:
    print(f"{args.layers} layers, {blocks} blocks:", flush=True)
    r = measure(args.layers, blocks, args.calls, args.cache_dtype)
    results.append(r)
    m = r["median"]
    print(f"  {r['cache_mib']:.0f} MiB cache, logits max |diff| "
          f"{r['logits_max_abs_diff']:.3g}, caches equal {r['caches_equal']}: "
          + ", ".join(f"{k} {v['wall_ms']:.0f} ms (CPU {v['cpu_ms']:.0f} ms)"
                      for k, v in m.items()), flush=True)
  name = "scan_runtime" + (f"_{args.cache_dtype}" if args.cache_dtype else "")
  path = common.write_json(args.out, name, {
      "model": "SmolLM2-135M shape, float32, random weights",
      "layers": args.layers,
      "step": "paged forward + logits, decode of 16 sequences of 200 tokens, "
              "jitted with the cache donated",
      "forms": {"slice_scan": "layer's pages sliced out of the carry, written, "
                              "put back (previous body)",
                "inplace_scan": "K/V scattered into the 5-D carry at the layer "
                                "index, attention reads the layer from it"},
      "conditions": "one process, the two forms' calls interleaved, 2 warm-up "
                    "calls each, medians; 2 CPU cores shared with other jobs",
      "results": results}, quick=args.quick)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
