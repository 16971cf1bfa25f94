"""`python -m benchmarks`: run every benchmark (see run_all.py)."""

from benchmarks import run_all

run_all.main()
