#!/usr/bin/env bash
# Every GPU benchmark in one command, for one device call on an H200.
#
#   PYTHONPATH=. bash benchmarks/gpu_all.sh          # about 5 min, at most 7.5
#
# Prints nvidia-smi and the versions, then runs, one after another:
#   gpu_prefill.py           on-GPU correctness of ragged attention, ceilings,
#                            prefill 8 x 2048 and a 50/50 mixed batch   ~1.5 min
#   gpu_decode.py --quick-gpu  on-GPU correctness of decode, copy bandwidth,
#                            5 decode shapes x 4 implementations, config sweep
#                            on 2 shapes, a few ragged mixes           ~2.5 min
#   block_size --gpu         decode time at block sizes 8-128 (xla, pallas_gpu)
#                                                                      ~1 min
#   gpu_mesh.py              the engine on a mesh of the local GPUs (shard_map
#                            with the real Triton kernels) vs one device ~1 min
#   kv_quant.py --gpu        decode over int8 / fp8 pages vs bf16 (pallas_gpu,
#                            xla), 2 shapes                            ~1 min
# Each section runs under its own limit and a global deadline
# (GPU_ALL_BUDGET_S, default 450 s); one that fails or runs out of time does not
# stop the others, and the Python scripts rewrite their JSON after every part,
# so a cut-short section keeps what it measured. The JSON, the block-size plot
# and the whole log (gpu_all.log) are copied to $OUT when it is set. A compact
# summary with each goal's verdict (benchmarks/gpu_summary.py) comes last.
#
# PYTHON picks the interpreter (default python3).

set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${GPU_ALL_BUDGET_S:-450}
START=$(date +%s)
RESULTS=benchmarks/results
LOGDIR=${OUT:-$RESULTS}
STATUS=$(mktemp)

# part NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, time left).
part() {
  local name=$1 limit=$2
  shift 2
  local left=$((START + BUDGET - 15 - $(date +%s)))  # 15 s kept for the end
  ((limit > left)) && limit=$left
  echo
  if ((limit < 30)); then
    echo "==== $name: skipped, ${left}s left of the ${BUDGET}s budget"
    printf '%s\tskipped\t0\n' "$name" >>"$STATUS"
    return
  fi
  echo "==== $name (limit ${limit}s, $(($(date +%s) - START))s elapsed): $*"
  local t0 rc
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@"
  rc=$?
  ((rc == 124 || rc == 137)) && echo "==== $name: stopped at its ${limit}s limit"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$STATUS"
}

environment() {
  echo "==== environment ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
  timeout 20 nvidia-smi
  timeout 20 nvidia-smi --format=csv --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,persistence_mode
  timeout 60 "$PY" - <<'EOF'
import importlib.metadata as md, platform
names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin",
         "jax-cuda13-pjrt", "jax-cuda12-pjrt", "nvidia-cudnn-cu13",
         "nvidia-cudnn-cu12", "numpy", "flax", "chex", "triton")
found = []
for n in names:
  try:
    found.append(f"{n} {md.version(n)}")
  except md.PackageNotFoundError:
    pass
print(f"python {platform.python_version()}; " + ", ".join(found))
EOF
}

main() {
  environment
  part gpu_prefill 150 "$PY" benchmarks/gpu_prefill.py
  part gpu_decode 210 "$PY" benchmarks/gpu_decode.py --quick-gpu
  part block_size 120 "$PY" -m benchmarks.block_size --gpu
  part gpu_mesh 90 "$PY" benchmarks/gpu_mesh.py
  part kv_quant 90 "$PY" benchmarks/kv_quant.py --gpu --repeats 20
  echo
  echo "==== after ($(($(date +%s) - START))s)"
  timeout 20 nvidia-smi --format=csv --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used
  if [[ -n "${OUT:-}" ]]; then
    for f in gpu_prefill.json gpu_decode.json block_size_gpu.json block_size_gpu.png \
        kv_quant_gpu.json; do
      [[ -f $RESULTS/$f ]] && cp "$RESULTS/$f" "$OUT/"
    done
    cp "$STATUS" "$OUT/gpu_all_sections.tsv"
  fi
  timeout 60 "$PY" benchmarks/gpu_summary.py --since "$START" --status "$STATUS"
  echo "total $(($(date +%s) - START))s"
}

mkdir -p "$LOGDIR"
main 2>&1 | tee "$LOGDIR/gpu_all.log"
rm -f "$STATUS"
