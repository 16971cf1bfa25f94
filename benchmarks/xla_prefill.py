"""XLA ragged paged attention vs dense causal attention on the same tokens (CPU).

Prefill batches (sequences of L new tokens, no cached prefix) and a mixed batch
(prefill chunks with cached prefixes plus decode tokens). The dense baseline is
plain masked softmax attention per sequence on contiguous `[seq, heads, L, d]`
K/V (the best layout for XLA), computing the full L x L score matrix; the
paged path walks block tables and skips KV blocks above the causal diagonal.

Writes `benchmarks/results/xla_prefill.json` and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention

HERE = os.path.dirname(os.path.abspath(__file__))


def median_time(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


@jax.jit
def dense_causal(q, k, v, kv_lens):
  """q [s, hkv, g, Lq, d]; k, v [s, hkv, Lk, d]; queries are the last Lq positions."""
  lq, lk = q.shape[3], k.shape[2]
  sc = jnp.einsum("shgqd,shkd->shgqk", q, k) * q.shape[-1] ** -0.5
  qpos = (kv_lens[:, None] - lq + jnp.arange(lq))[:, None, None, :, None]
  kpos = jnp.arange(lk)[None, None, None, None, :]
  sc = jnp.where(kpos <= qpos, sc, -jnp.inf)
  return jnp.einsum("shgqk,shkd->shgqd", jax.nn.softmax(sc, axis=-1), v)


def bench(num_seqs, q_len, kv_len, block_size=16, hq=8, hkv=2, d=64, seed=0):
  """`num_seqs` sequences, each with `q_len` new tokens and `kv_len` in all."""
  rng = np.random.default_rng(seed)
  g = hq // hkv
  nb = -(-kv_len // block_size)
  k = rng.standard_normal((num_seqs, hkv, nb * block_size, d), np.float32)
  v = rng.standard_normal((num_seqs, hkv, nb * block_size, d), np.float32)
  q = rng.standard_normal((num_seqs, q_len, hq, d), np.float32)
  perm = rng.permutation(num_seqs * nb).reshape(num_seqs, nb)
  inv = np.argsort(perm.reshape(-1))

  def to_pages(x):  # [s, hkv, nb*bs, d] -> [hkv, s*nb, bs, d], permuted
    x = x.reshape(num_seqs, hkv, nb, block_size, d).transpose(1, 0, 2, 3, 4)
    return jnp.asarray(x.reshape(hkv, num_seqs * nb, block_size, d)[:, inv])

  k_pages, v_pages = to_pages(k), to_pages(v)
  tables = jnp.asarray(perm, jnp.int32)
  lens = jnp.full((num_seqs,), kv_len, jnp.int32)
  cu = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len
  qf = jnp.asarray(q.reshape(num_seqs * q_len, hq, d))
  paged = jax.jit(functools.partial(attention.ragged_paged_attention,
                                    implementation="xla"))
  args = (qf, k_pages, v_pages, tables, lens, cu, jnp.array([num_seqs]))
  qd = jnp.asarray(q.reshape(num_seqs, q_len, hkv, g, d).transpose(0, 2, 3, 1, 4))
  kd = jnp.asarray(k[:, :, :kv_len])
  vd = jnp.asarray(v[:, :, :kv_len])
  ref = dense_causal(qd, kd, vd, lens)  # [s, hkv, g, q, d]
  ref = ref.transpose(0, 3, 1, 2, 4).reshape(qf.shape)
  err = float(jnp.max(jnp.abs(paged(*args) - ref)))
  assert err < 1e-4, err
  t_paged = median_time(paged, *args)
  t_dense = median_time(dense_causal, qd, kd, vd, lens)
  flops = 4 * num_seqs * hq * d * q_len * (kv_len - q_len / 2)  # causal
  return dict(num_seqs=num_seqs, q_len=q_len, kv_len=kv_len,
              paged_ms=t_paged * 1e3, dense_ms=t_dense * 1e3,
              ratio=t_paged / t_dense, paged_gflops=flops / t_paged / 1e9,
              max_abs_err=err)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  grid = ([(2, 64, 64), (1, 16, 80)] if args.quick else
          [(1, 512, 512), (4, 512, 512), (2, 1024, 1024), (1, 2048, 2048),
           (4, 256, 1024), (8, 64, 512)])
  rows = []
  print(f"{'seqs':>4} {'q_len':>5} {'kv_len':>6} {'paged ms':>9} {'dense ms':>9}"
        f" {'ratio':>6} {'GFLOP/s':>8}")
  for s, ql, kl in grid:
    r = bench(s, ql, kl)
    rows.append(r)
    print(f"{s:4d} {ql:5d} {kl:6d} {r['paged_ms']:9.2f} {r['dense_ms']:9.2f} "
          f"{r['ratio']:6.2f} {r['paged_gflops']:8.2f}", flush=True)
  out = dict(machine=platform.platform(), cpus=os.cpu_count(),
             jax=jax.__version__, backend=jax.default_backend(),
             date=time.strftime("%Y-%m-%d"), prefill=rows)
  os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
  with open(os.path.join(HERE, "results", "xla_prefill.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
