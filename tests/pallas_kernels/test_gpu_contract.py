"""The shared attention contract (tests/contract.py) on the GPU kernels,
called directly, in Pallas interpret mode."""

from __future__ import annotations

import functools

import pytest

from pallas_kernels.gpu import paged_decode as pd
from pallas_kernels.gpu import ragged_attention as ra
from tests import contract
from tests import window_contract


class TestGpuContract(contract.MalformedInputContract,
                      contract.StaticErrorContract, contract.QuantizedContract):
  decode = staticmethod(functools.partial(pd.paged_decode, interpret=True))
  ragged = staticmethod(functools.partial(ra.ragged_paged_attention,
                                          interpret=True))


@pytest.mark.slow
class TestGpuSplitDecodeContract(contract.MalformedDecodeContract):
  """Decode with k-splits (partial results merged outside the kernel)."""
  decode = staticmethod(functools.partial(
      pd.paged_decode, interpret=True,
      config=pd.PagedDecodeConfig(k_splits=2, pages_per_compute_block=2)))


class TestGpuWindowContract(window_contract.WindowContract,
                            window_contract.CountedCopiesContract):
  """Blocks outside the window: never read (NULL_BLOCK / NaN there), the
  loops start at the window's first compute block, and the pages the masked
  K/V loads touch counted (`window_contract.page_copies`)."""
  decode = staticmethod(functools.partial(
      pd.paged_decode, interpret=True,
      config=pd.PagedDecodeConfig(pages_per_compute_block=2)))
  ragged = staticmethod(functools.partial(ra.ragged_paged_attention,
                                          interpret=True))
