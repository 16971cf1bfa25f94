"""Shared helpers of the TPU-kernel tests (interpret mode on CPU).

* `FAR_BLOCK`: a block-table entry far outside any page pool. Tests put it in
  every entry a kernel must not read; the TPU interpreter raises on a copy of
  such a page, so a passing test proves the entry was never touched (-1
  itself would wrap around in the interpreter's NumPy-style indexing).
* `races_found()`: whether the interpreter's race detector fired.
"""

from __future__ import annotations

FAR_BLOCK = 2**30


def races_found() -> bool | None:
  """Whether the TPU interpreter's race detector fired (None: not exposed)."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  except ImportError:
    return None
  races = getattr(ipc, "races", None)
  return None if races is None else bool(races.races_found)
