"""The quantised KV cache: accuracy, capacity and decode time, 8-bit vs float.

    PYTHONPATH=. python benchmarks/kv_quant.py            # CPU, ~10 min
    PYTHONPATH=. python benchmarks/kv_quant.py --quick    # smoke test
    PYTHONPATH=. python benchmarks/kv_quant.py --gpu      # GPU kernels only

Sections (results in benchmarks/results/kv_quant[_gpu].json):

* accuracy: a random Llama (hidden 256, 4 layers, 8 query / 2 KV heads of 64)
  whose weights are drawn as Hugging Face initialises them (N(0, 0.02)) and
  scaled by 4, so greedy choices are rarely near ties. A float32 cache decodes
  greedily; each 8-bit (and the bf16) cache then replays the same tokens
  (teacher-forced, so one flipped token does not change every later input)
  and we record the logit error against the float32 cache (max and mean
  |delta| over the vocabulary, per step) and the share of steps whose argmax
  equals the float32 one. Short (32-token prompt, `--steps` decode steps) and
  long context (a 2048-token prompt, then decode).
* capacity: `paged_jax.capacity.plan` for Llama 3.1 8B with a 16 GiB pool
  (tokens per GiB, concurrent 1k-token sequences), and the bytes per token
  read from an allocated `KVCache` of each dtype.
* decode time: `paged_attention(implementation="xla")` on CPU (or
  `pallas_gpu` and `xla` with `--gpu`), float vs 8-bit pages of the same
  tokens, calls interleaved round-robin, medians of `--repeats`.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from paged_jax.models.llama import model as model_lib
from paged_jax import attention
from paged_jax import block_manager as bm
from paged_jax import capacity
from paged_jax import kv_cache
from paged_jax import step_metadata
from tests import cases

CACHE_DTYPES = ("bfloat16", "int8", "fp8")
HF_STD = 0.02
# The float32 top-1 lead (logits) above which a greedy step is "clear".
CLEAR_MARGIN = 0.5


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def accuracy_model(seed=0, weight_scale=4.0) -> model_lib.Llama:
  """A random Llama with HF-style N(0, 0.02) weights times `weight_scale`
  (norms at 1)."""
  cfg = model_lib.LlamaConfig.tiny(
      vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
      num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
  model = model_lib.init_model(cfg, seed)
  graphdef, state = nnx.split(model)
  leaves, tree = jax.tree.flatten_with_path(state)
  key = jax.random.key(seed + 1)
  out = []
  for i, (path, x) in enumerate(leaves):
    name = jax.tree_util.keystr(path)
    if "weight" in name and x.ndim == 1:  # RMSNorm scales stay 1
      out.append(x)
    else:
      out.append(HF_STD * weight_scale * jax.random.normal(
          jax.random.fold_in(key, i), x.shape, x.dtype))
  return nnx.merge(graphdef, jax.tree.unflatten(tree, out))


def _stepper(model, cache_dtype, max_len, block_size=16):
  """`(step, state, cache)`: `step(tokens, q_len, decode_only)` -> the last
  row's logits, for one sequence over a paged cache of `cache_dtype`."""
  graphdef, params = nnx.split(model)
  nblocks = -(-max_len // block_size)
  state = bm.init(num_blocks=nblocks, block_size=block_size, max_seqs=1,
                  max_blocks_per_seq=nblocks)
  cache = model.make_cache(nblocks, block_size, cache_dtype)

  @functools.partial(jax.jit, static_argnames="decode_only",
                     donate_argnums=(1, 2))
  def step(params, state, cache, tokens, q_len, decode_only):
    ids, lens = jnp.zeros((1,), jnp.int32), q_len.reshape(1)
    state, _ = bm.reserve(state, ids, lens)
    meta = step_metadata.step_metadata(state, ids, lens,
                                       num_tokens=tokens.shape[0],
                                       decode_only=decode_only)
    m = nnx.merge(graphdef, params)
    h, cache = m.paged_forward(tokens, meta, cache)
    return m.logits(h[q_len - 1]), state, cache

  box = {"state": state, "cache": cache}

  def run(tokens, decode_only=False):
    tokens = np.asarray(tokens, np.int32)
    q_len = len(tokens)
    if not decode_only:  # pad prefill chunks to one shape
      tokens = np.pad(tokens, (0, PREFILL_CHUNK - q_len))
    logits, box["state"], box["cache"] = step(
        params, box["state"], box["cache"], jnp.asarray(tokens),
        jnp.int32(q_len), decode_only)
    return np.asarray(logits)

  return run, box


PREFILL_CHUNK = 256


def _prefill(run, prompt):
  logits = None
  for i in range(0, len(prompt), PREFILL_CHUNK):
    logits = run(prompt[i:i + PREFILL_CHUNK])
  return logits


def accuracy(model, *, prompt_len, steps, seed) -> dict:
  rng = np.random.default_rng(seed)
  prompt = rng.integers(3, model.config.vocab_size, prompt_len)
  max_len = prompt_len + steps + 1
  run, _ = _stepper(model, "float32", max_len)
  ref_logits = [_prefill(run, prompt)]
  tokens = []
  for _ in range(steps):
    tokens.append(int(np.argmax(ref_logits[-1])))
    ref_logits.append(run([tokens[-1]], decode_only=True))
  ref = np.stack(ref_logits)  # [steps + 1, vocab]
  top2 = np.sort(ref, axis=-1)[:, -2:]
  out = {"prompt_len": prompt_len, "decode_steps": steps,
         "float32_top1_margin_median": float(np.median(top2[:, 1] - top2[:, 0])),
         "float32_logit_std": float(ref.std())}
  for dtype in CACHE_DTYPES:
    t0 = time.perf_counter()
    run, _ = _stepper(model, dtype, max_len)
    got = [_prefill(run, prompt)]
    for t in tokens:
      got.append(run([t], decode_only=True))
    got = np.stack(got)
    err = np.abs(got - ref)
    match = got.argmax(-1) == ref.argmax(-1)
    clear = (top2[:, 1] - top2[:, 0]) >= CLEAR_MARGIN
    out[dtype] = {
        "max_logit_error": float(err.max()),
        "mean_logit_error": float(err.mean()),
        "greedy_match": float(np.mean(match)),
        "steps_compared": int(got.shape[0]),
        # Steps whose float32 top-1 leads by >= CLEAR_MARGIN (not near ties).
        "greedy_match_clear": float(np.mean(match[clear])) if clear.any() else None,
        "clear_steps": int(clear.sum()),
    }
    log(f"  {prompt_len}+{steps} {dtype:9s} {out[dtype]} "
        f"({time.perf_counter() - t0:.0f} s)")
  return out


def capacity_section() -> dict:
  """Llama 3.1 8B, 16 GiB of KV pool: tokens per GiB and concurrency."""
  shape = capacity.PRESETS["llama-3.1-8b"]
  out = {"model": "llama-3.1-8b", "kv_pool_gib": 16, "avg_tokens": 1024}
  base = None
  for dtype in CACHE_DTYPES:
    p = capacity.plan(kv_pool_bytes=16 * capacity.GIB,
                      num_layers=shape.num_layers,
                      num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                      block_size=16, avg_tokens=1024, max_model_len=8192,
                      kv_dtype=dtype)
    # The same figure from an allocated cache (2 blocks: bytes per token only).
    alloc = kv_cache.KVCache.create(
        num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
        num_blocks=2, block_size=16, head_dim=shape.head_dim, dtype=dtype)
    assert alloc.bytes_per_token == p.bytes_per_token, (dtype, alloc.bytes_per_token)
    tokens = p.num_blocks * p.block_size
    base = base or tokens
    out[dtype] = {"allocated_dtype": str(alloc.dtype),
                  "bytes_per_token": p.bytes_per_token,
                  "tokens_per_gib": tokens // 16,
                  "concurrent_1k_sequences": p.max_concurrency_paged,
                  "tokens_vs_bfloat16": tokens / base}
  return out


def decode_time(*, implementations, batch, context, repeats, interpret=False):
  """Median seconds per decode call, float pages vs 8-bit pages of the same
  tokens; every implementation and dtype interleaved round-robin."""
  rng = np.random.default_rng(0)
  c = cases.make_decode_case(
      rng, batch=batch, num_q_heads=32, num_kv_heads=8, head_dim=128,
      block_size=16, max_blocks_per_seq=context // 16,
      kv_lens=np.full(batch, context), poison=False, extra_blocks=0)
  variants = {"float32": c, "bfloat16": cases.PagedCase(
      c.q.astype(jnp.bfloat16), c.k_pages.astype(jnp.bfloat16),
      c.v_pages.astype(jnp.bfloat16), c.block_tables, c.kv_lens)}
  for name, dtype in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
    qc = cases.quantize_case(c, dtype)
    qc.q = variants["bfloat16"].q
    variants[name] = qc
  calls = {}
  for impl in implementations:
    for name, v in variants.items():
      if impl == "pallas_gpu" and name == "float32":
        continue
      fn = jax.jit(functools.partial(attention.paged_attention,
                                     implementation=impl, interpret=interpret))
      args = (v.q, v.k_pages, v.v_pages, v.block_tables, v.kv_lens)
      call = functools.partial(fn, *args, **v.scales())
      jax.block_until_ready(call())  # compile
      calls[(impl, name)] = call
  times = {k: [] for k in calls}
  for _ in range(repeats):
    for k, call in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      times[k].append(time.perf_counter() - t0)
  out = {"batch": batch, "context": context, "num_q_heads": 32,
         "num_kv_heads": 8, "head_dim": 128, "block_size": 16,
         "repeats": repeats}
  for impl in implementations:
    med = {n: statistics.median(times[(impl, n)]) for n in variants
           if (impl, n) in times}
    ref = med.get("bfloat16")
    out[impl] = {n: {"median_ms": 1e3 * t, "vs_bfloat16": t / ref}
                 for n, t in med.items()}
    if "float32" in med:
      for n in med:
        out[impl][n]["vs_float32"] = med[n] / med["float32"]
  return out


def main(argv=None):
  p = common.parser(__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=256, help="decode steps")
  p.add_argument("--long", type=int, default=2048, help="long-context prompt")
  p.add_argument("--long-steps", type=int, default=64)
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--weight-scale", type=float, nargs="+", default=[4.0],
                 help="HF-init multipliers of the accuracy model (each one "
                 "runs the short-context accuracy; the first also the long)")
  p.add_argument("--gpu", action="store_true",
                 help="decode time of pallas_gpu and xla only (on a GPU)")
  args = p.parse_args(argv)
  result = {}
  name = "kv_quant_gpu" if args.gpu else "kv_quant"

  def save():
    path = common.write_json(args.out, name, result, quick=args.quick)
    log(f"wrote {path}")

  if args.gpu:
    for batch, context in ((8, 4096), (32, 2048)):
      result.setdefault("decode", []).append(decode_time(
          implementations=("pallas_gpu", "xla"), batch=batch, context=context,
          repeats=args.repeats))
      log(json.dumps(result["decode"][-1]))
      save()
    return 0
  result["capacity"] = capacity_section()
  log(json.dumps(result["capacity"], indent=1))
  save()
  steps = 16 if args.quick else args.steps
  result["accuracy"] = []
  for scale in args.weight_scale:
    model = accuracy_model(weight_scale=scale)
    result["accuracy"].append({"weight_scale": scale, **accuracy(
        model, prompt_len=32, steps=steps, seed=0)})
    save()
  model = accuracy_model(weight_scale=args.weight_scale[0])
  batch, context = (2, 256) if args.quick else (8, 1024)
  result["decode_cpu"] = decode_time(implementations=("xla",), batch=batch,
                                     context=context, repeats=args.repeats)
  log(json.dumps(result["decode_cpu"]))
  save()
  if not args.quick and args.long:
    result["accuracy"].append({"weight_scale": args.weight_scale[0], **accuracy(
        model, prompt_len=args.long, steps=args.long_steps, seed=1)})
    save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
