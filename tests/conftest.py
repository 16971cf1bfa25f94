import os

# Tests run on CPU; kernels run in Pallas interpret mode. Eight simulated
# devices let the sharding tests build every mesh that divides 8; the other
# tests use the first device only.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
