"""The sharded engine on the GPU(s) at hand, against the single-device engine.

  PYTHONPATH=. python benchmarks/gpu_mesh.py        # part of gpu_all.sh

Serves the same greedy workload with `pallas_gpu` attention on one device
(no mesh) and on a `data=1 x model=N` mesh over every local GPU (N = 1 on one
GPU: then it checks the `shard_map` path with the real Triton kernels), and
prints whether the completions are identical and both decode step times.
`--dry-run` builds everything (tiny model, the mesh, the workload) on CPU but
serves nothing: the engine's compilations take minutes on a CPU.
"""

from __future__ import annotations

import argparse
import time

import jax

from paged_jax.models.llama import model as model_lib
from paged_jax.entrypoints import workload
from paged_jax import sharding


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--implementation", default="pallas_gpu")
  p.add_argument("--smoke", action="store_true",
                 help="tiny sizes (checks the script itself, e.g. on CPU)")
  p.add_argument("--dry-run", action="store_true",
                 help="tiny sizes, build only: no request is served")
  args = p.parse_args(argv)
  devices = jax.devices()
  model_axis = 1
  for n in (8, 4, 2):
    if len(devices) >= n:
      model_axis = n
      break
  cfg = model_lib.LlamaConfig(
      vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=4,
      num_heads=8, num_kv_heads=8, head_dim=128, max_position_embeddings=2048,
      eos_token_ids=(2,), dtype="bfloat16")
  kw = dict(kv_tokens=16384, block_size=16, max_batch=32,
            max_tokens_per_step=512, max_model_len=512, progress=False)
  num_requests = 64
  if args.smoke or args.dry_run:
    cfg = model_lib.LlamaConfig.tiny(num_heads=8, num_kv_heads=8)
    kw.update(kv_tokens=1024, max_batch=8, max_tokens_per_step=64,
              max_model_len=128)
    num_requests = 8
  model = model_lib.init_model(cfg, seed=0, implementation=args.implementation)
  requests = workload.synthetic_requests(
      num_requests, vocab_size=cfg.vocab_size, max_model_len=kw["max_model_len"],
      seed=0, exclude_ids=cfg.eos_token_ids)
  mesh = sharding.make_mesh(1, model_axis)
  if args.dry_run:
    print(f"dry run: {len(requests)} requests, mesh {dict(mesh.shape)}, "
          f"{args.implementation}; nothing served")
    return 0
  t0 = time.perf_counter()
  one, one_out = workload.run_workload("paged", model, requests, **kw)
  sharded, sh_out = workload.run_workload("paged", model, requests, mesh=mesh, **kw)
  same = sum(a.completions == b.completions for a, b in zip(one_out, sh_out))
  print(f"devices: {len(devices)} x {devices[0].device_kind}; mesh data=1 x "
        f"model={model_axis}")
  print(f"completions identical: {same}/{len(requests)} (bf16: a few may "
        "differ where two logits tie within rounding)")
  for name, s in (("one device", one), (f"mesh 1x{model_axis}", sharded)):
    print(f"{name:>12}: decode {s['device_ms_per_decode_step']:.2f} ms/step, "
          f"{s['tokens_per_second']:.0f} tokens/s, compile "
          f"{s['compile_seconds']:.1f} s, KV {s['kv_bytes_per_device'] / 2**20:.1f} "
          "MiB per device")
  print(f"total {time.perf_counter() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
