"""Lowering Pallas/Triton kernels for CUDA from a machine without a GPU."""

from __future__ import annotations

import contextlib

import jax


def abstract_gpu():
  """A context in which Pallas/Triton lowers for an H200 without one attached.

  JAX >= 0.11 asks the (abstract) device for its compute capability while
  lowering a Triton kernel; older versions fall back to sm_90 by themselves.
  """
  device_cls = getattr(jax.sharding, "AbstractDevice", None)
  if device_cls is None:
    return contextlib.nullcontext()
  device = device_cls(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh(
      (1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def abstract_gpu_mesh(mesh: jax.sharding.Mesh):
  """`mesh`'s shape on abstract H200s, for lowering kernels inside
  `shard_map` for CUDA (JAX >= 0.11 reads the compute capability from the
  mesh's device); `mesh` itself on older JAX, which assumes sm_90."""
  device_cls = getattr(jax.sharding, "AbstractDevice", None)
  if device_cls is None:
    return mesh, contextlib.nullcontext()
  device = device_cls(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  abstract = jax.sharding.AbstractMesh(
      tuple(mesh.shape.values()), tuple(mesh.axis_names),
      (jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
      abstract_device=device)
  return abstract, jax.sharding.use_abstract_mesh(abstract)


def lower_for_cuda(f, *args):
  """`jax.jit(f)` traced and lowered for CUDA; returns the StableHLO text."""
  with abstract_gpu():
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, (
      "no Triton kernel in the lowered module")
  return text


def shape_structs(*arrays):
  """`jax.ShapeDtypeStruct`s for arrays (None passes through)."""
  return tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
               for a in arrays)


def triton_ir(f, *args) -> list[str]:
  """The Triton IR (text) of every Pallas kernel in `f(*args)`, lowered for
  CUDA as `lower_for_cuda` does (for checks of the kernel's structure)."""
  from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top
  captured = []
  original = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    result = original(*a, **k)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    lower_for_cuda(f, *args)
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = original
  return captured
