"""The shared attention contract (tests/contract.py) on the TPU kernels,
called directly, in TPU interpret mode with race detection on and
uninitialised memory NaN. A table entry of 2**30 would make the interpreter
raise on the copy, so passing proves such entries are never dereferenced."""

from __future__ import annotations

import functools

from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import pytest

from pallas_kernels.tpu import paged_decode as pd
from pallas_kernels.tpu import ragged_attention as ra
from tests import contract
from tests import window_contract
from tests.pallas_kernels.tpu_testing import races_found


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  # A kernel that raised leaves the interpreter's shared state behind.
  pltpu.reset_tpu_interpret_mode_state()
  yield


class TestTpuContract(contract.MalformedInputContract,
                      contract.StaticErrorContract, contract.QuantizedContract):
  # 8-bit pages fill (32, 128) VMEM tiles: the rows at 32-token pages (the
  # refusal of 8-token ones is tested in test_tpu_paged_decode.py). The
  # shared tolerances hold as they are: with float32 queries every matmul is
  # float32 at HIGHEST and the scales' lane layout is exact, so against the
  # dequantised pages only the summation order differs (measured <= 6e-7 vs
  # 2e-5), and against the float pages the quantisation error is the
  # reference's own (`cases.QUANTIZED_TOLERANCES`).
  quantized_block_size = 32

  # Interpret mode takes ~12-17 s a call: by default decode runs fp8 and
  # ragged int8 (the shared base's choice), the other dtypes with -m slow.
  @pytest.mark.parametrize("dtype", [
      pytest.param(jnp.int8, marks=pytest.mark.slow), jnp.float8_e4m3fn],
                           ids=["int8", "fp8"])
  def test_quantized_decode_rows(self, dtype):
    super().test_quantized_decode_rows(dtype)
  decode = staticmethod(functools.partial(pd.paged_decode, interpret=True))
  ragged = staticmethod(functools.partial(ra.ragged_paged_attention,
                                          interpret=True))

  def check_after_call(self):
    assert races_found() in (False, None), "race detected in interpret mode"


class TestTpuWindowContract(window_contract.WindowContract,
                            window_contract.CountedCopiesContract):
  """Blocks outside the window are neither copied nor read: the shared
  NaN / NULL_BLOCK cases, and the DMAs counted in the interpreter."""
  decode = staticmethod(functools.partial(
      pd.paged_decode, interpret=True,
      config=pd.PagedDecodeConfig(pages_per_compute_block=2)))
  ragged = staticmethod(functools.partial(ra.ragged_paged_attention,
                                          interpret=True))

  def check_after_call(self):
    assert races_found() in (False, None), "race detected in interpret mode"
