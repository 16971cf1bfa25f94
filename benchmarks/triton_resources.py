"""Resource use of the GPU decode kernel, compiled for an H200 on a CPU.

No GPU needed: the kernel is lowered for CUDA from the CPU (as the lowering
tests do), its Triton IR is captured and compiled for sm_90a by the `triton`
package (not a dependency of paged-jax: install it anywhere, e.g.
`pip install --target /tmp/triton-site triton`, and point `--triton` there).
For each config it prints registers per thread, shared memory per program,
spills, the `cp.async.wait_group` depths in the PTX (a depth above 0 inside the
loop means the next block's K/V copies overlap the current block's compute),
programs per multiprocessor (registers, shared memory and warps) and the
waves the shape needs on 132 multiprocessors.

    PYTHONPATH=. python benchmarks/triton_resources.py --triton /tmp/triton-site

This is how `pallas_kernels.gpu.paged_decode.default_config` was chosen (its
comment has the numbers); timings on a GPU are still owed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels.gpu import paged_decode as pd
from tests.pallas_kernels.gpu_lowering import triton_ir

# Hopper (sm_90) per multiprocessor.
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024  # 227 KiB usable by one block, 1 KiB reserved each
SMEM_RESERVED_PER_BLOCK = 1024
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
NUM_SMS = 132


def kernel_ir(config, args) -> str:
  """The Triton IR (text) of `paged_decode(*args, config=config)`."""
  return triton_ir(lambda *a: pd.paged_decode(*a, config=config), *args)[0]


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
  """Resident programs per multiprocessor (registers allocated per warp in
  units of 256, shared memory plus its reserved KiB per program)."""
  regs_per_warp = -(-regs * 32 // 256) * 256
  by_regs = REGS_PER_SM // (regs_per_warp * warps)
  by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED_PER_BLOCK)
  return min(by_regs, by_smem, MAX_WARPS_PER_SM // warps, MAX_BLOCKS_PER_SM)


def compile_sm90(ir_text: str, config, triton_dir: str) -> dict:
  """Compiles Triton IR for sm_90a; registers, shared memory, PTX facts."""
  sys.path.insert(0, triton_dir)
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ir_text)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=config.num_warps, num_stages=config.num_stages))
    cubin = os.path.join(d, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(kernel.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends",
                             "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin],
                           capture_output=True, text=True, check=True).stdout
  regs = int(re.search(r"REG:(\d+)", usage).group(1))
  spill = int(re.search(r"LOCAL:(\d+)", usage).group(1))
  ptx = kernel.asm["ptx"]
  waits = sorted({int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+)",
                                             ptx)})
  shared = int(kernel.metadata.shared)
  return dict(regs=regs, local_bytes=spill, shared=shared, wait_groups=waits,
              per_sm=programs_per_sm(regs, shared, config.num_warps))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--triton", default="/tmp/triton-site",
                 help="folder holding the triton package")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--context", type=int, default=4096)
  args = p.parse_args(argv)
  s = jax.ShapeDtypeStruct
  blocks = args.context // 16
  shape = (s((args.batch, 32, 128), jnp.bfloat16),
           s((8, args.batch * blocks, 16, 128), jnp.bfloat16),
           s((8, args.batch * blocks, 16, 128), jnp.bfloat16),
           s((args.batch, blocks), jnp.int32), s((args.batch,), jnp.int32))
  default = pd.default_config(shape[0], shape[1], shape[3],
                              num_sms=NUM_SMS)
  print(f"batch {args.batch} x context {args.context}, 32/8 heads, d128, bf16,"
        f" block 16; default {default}")
  print(f"{'ppcb':>4} {'warps':>5} {'stages':>6} | {'regs':>4} {'smem KiB':>8}"
        f" {'spill':>5} {'wait_group':>10} {'per SM':>6} {'waves':>5}")
  for ppcb, warps, stages in itertools.product((1, 2, 4, 8), (2, 4, 8),
                                               (2, 3, 4)):
    config = dataclasses.replace(default, pages_per_compute_block=ppcb,
                                 num_warps=warps, num_stages=stages)
    try:
      r = compile_sm90(kernel_ir(config, shape), config, args.triton)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{ppcb:4d} {warps:5d} {stages:6d} | {type(e).__name__}: "
            f"{str(e)[:100]}")
      continue
    programs = args.batch * 8 * config.k_splits
    waves = programs / (NUM_SMS * max(r["per_sm"], 1))
    mark = " *" if config == default else ""
    print(f"{ppcb:4d} {warps:5d} {stages:6d} | {r['regs']:4d}"
          f" {r['shared'] / 1024:8.1f} {r['local_bytes']:5d}"
          f" {str(r['wait_groups']):>10} {r['per_sm']:6d} {waves:5.2f}{mark}",
          flush=True)


if __name__ == "__main__":
  main()
