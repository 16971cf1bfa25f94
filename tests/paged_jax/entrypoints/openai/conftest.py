"""The tiny model for the server tests (the jitted steps compile once per
process for the harness's engine sizes)."""

from __future__ import annotations

import pytest

from paged_jax.models.llama import model as model_lib


@pytest.fixture(scope="session")
def model():
  return model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)
