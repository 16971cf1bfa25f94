import os

# Tests run on CPU; kernels run in Pallas interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
