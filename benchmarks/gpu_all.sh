#!/usr/bin/env bash
# Every GPU benchmark in one command, for one device call on an H200:
#
#   PYTHONPATH=. bash benchmarks/gpu_all.sh             # at most 8 minutes
#   PYTHONPATH=. bash benchmarks/gpu_all.sh --dry-run   # CPU check of the script
#
# Runs benchmarks/gpu_all.py (sections, budgets, the correctness stop: see its
# docstring) and keeps the whole log in $OUT/gpu_all.log (or
# benchmarks/results/gpu_all.log). PYTHON picks the interpreter (default
# python3). Exit status: 0 if every section passed, 1 otherwise.

set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGDIR=${OUT:-benchmarks/results}
LOG=gpu_all.log
[[ " $* " == *" --dry-run "* ]] && LOG=gpu_all_dry_run.log
mkdir -p "$LOGDIR"
"$PY" benchmarks/gpu_all.py --python "$PY" "$@" 2>&1 | tee "$LOGDIR/$LOG"
