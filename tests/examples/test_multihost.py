"""Two processes on one machine as two hosts: `generate.py --coordinator`.

Each process holds 2 of the 4 CPU devices of a data=2 x model=2 mesh (so each
host holds one data shard, with its pool and its sequences, and its half of
the tensor-parallel weights); they run the same schedule through
`jax.distributed` with Gloo collectives. Process 0's outputs must equal the
single-device run's.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from paged_jax.entrypoints import generate
from tests.conftest import TEST_XLA_FLAGS
from tests.examples import test_generate
from tests.examples.test_generate import SMALL

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = SMALL + ["--num-requests", "5", "--no-baseline"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_serve_what_one_device_serves(tmp_path, capsys):
  one = tmp_path / "one.json"
  assert generate.main(ARGS + ["--output", str(one)]) == 0
  capsys.readouterr()
  port = _free_port()
  # Not the session's 8 simulated devices (each process has its own 2), but
  # the session's compile flags (tests/conftest.py).
  env = dict(os.environ, XLA_FLAGS=" ".join(TEST_XLA_FLAGS))
  env["PYTHONPATH"] = str(ROOT)
  procs = []
  for pid in (0, 1):
    cmd = [sys.executable, str(ROOT / "examples" / "generate.py"), *ARGS,
           "--mesh", "data=2,model=2", "--coordinator", f"localhost:{port}",
           "--num-processes", "2", "--process-id", str(pid),
           "--output", str(tmp_path / f"p{pid}.json")]
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], logs
  assert "mesh: data=2 x model=2 on 4 cpu devices" in logs[0]
  assert not (tmp_path / "p1.json").exists()  # process 0 reports
  got = json.loads((tmp_path / "p0.json").read_text())
  want = json.loads(one.read_text())
  test_generate.same_requests(got["requests"], want["requests"])
  stats = got["stats"]["paged"]
  assert stats["devices"] == 4 and stats["served"] == 5
