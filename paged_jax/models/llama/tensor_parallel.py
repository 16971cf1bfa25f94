"""Tensor-parallel layout of the Llama weights on a `(data, model)` mesh.

Megatron-style, expressed as `NamedSharding`s and left to XLA's SPMD
partitioner (no hand-written collectives):

| weight | spec | why |
|---|---|---|
| `q_proj`, `k_proj`, `v_proj` kernels `[hidden, heads * head_dim]` | `P(None, "model")` | each device computes its own heads |
| `o_proj` kernel `[heads * head_dim, hidden]` | `P("model", None)` | partial sums, one all-reduce per layer |
| `gate_proj`, `up_proj` kernels `[hidden, intermediate]` | `P(None, "model")` | column parallel |
| `down_proj` kernel `[intermediate, hidden]` | `P("model", None)` | row parallel, one all-reduce |
| `embed_tokens` `[vocab, hidden]`, `lm_head` kernel `[hidden, vocab]` | vocab over `"model"` | vocab-parallel embedding and logits |
| norms, row-parallel biases | replicated | small |

The layers' parameters are stacked (`[num_layers, ...]`, see `model.py`); the
layer axis is never split, the specs above apply to the trailing axes.

A dimension that does not divide evenly over the model axis is replicated
instead (the MLP of a model whose intermediate size is not a multiple of it,
say); the heads must divide evenly.

KV heads: the cache shards over KV heads along `"model"` (see
`paged_jax.sharding`). When the model has fewer KV heads than the model axis,
`shard_model` repeats each KV head's `k_proj` / `v_proj` columns
`model // num_kv_heads` times, so the sharded model is the same function with
`num_kv_heads = model` (GQA is unchanged: query head `h` still reads a copy of
its original KV head) and every device computes and stores exactly the KV
heads its query heads read. That is what GQA serving systems do when the
tensor-parallel degree exceeds the KV heads; it costs `model / num_kv_heads`
times the KV memory of those heads per token, which `config.num_kv_heads` of
the returned model (and so `kv_bytes_per_token`, `make_cache`) reports.

The data axis is not used by the weights: they are replicated over it, and each
data shard serves its own sequences with its own block pool.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax.models.llama import model as model_lib
from paged_jax import sharding

MODEL = sharding.MODEL

# (module name, parameter) -> which axis is split over "model" (None: none).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def param_spec(path: tuple, shape: tuple[int, ...], model: int) -> P:
  """The `PartitionSpec` of one parameter, by its path in the model.

  Args:
    path: the parameter's path, e.g. `("layers", "self_attn", "q_proj",
      "kernel")`.
    shape: its shape; stacked layers' parameters have a leading
      `[num_layers]` axis, which is never split.
    model: size of the model axis.

  Returns:
    A spec over `("data", "model")` axes; replicated over `data`.
  """
  names = [p for p in path if isinstance(p, str)]
  module, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
  axis = None
  if module in _COLUMN or module == "lm_head":
    axis = len(shape) - 1  # output features (the bias' only axis)
  elif module in _ROW and leaf == "kernel":
    axis = len(shape) - 2  # input features (after a stacked layers axis)
  elif module == "embed_tokens":
    axis = 0  # vocab
  if axis is None or shape[axis] % model:
    return P()
  spec = [None] * len(shape)
  spec[axis] = MODEL
  return P(*spec)


def check_model_axis(config: model_lib.LlamaConfig, model: int) -> int:
  """Checks that `config` splits over a model axis of size `model`.

  Returns:
    The KV heads the sharded model and its cache hold
    (`paged_jax.sharding.cache_kv_heads`).

  Raises:
    ValueError: if `num_heads` is not a multiple of `model`, or the KV heads
      and `model` do not divide one another.
  """
  if config.num_heads % model:
    raise ValueError(f"num_heads={config.num_heads} must be a multiple of the "
                     f"model axis ({model}) to split the heads over it")
  return sharding.cache_kv_heads(config.num_kv_heads, model)


def _replicate_kv_columns(x: jax.Array, num_kv_heads: int, model: int):
  """A K/V projection kernel `[hidden, kv_heads * head_dim]` (or its bias)
  with each head's columns repeated as `sharding.replicate_kv_heads` repeats
  the cache's heads."""
  lead = x.shape[:-1]
  x = x.reshape(lead + (num_kv_heads, x.shape[-1] // num_kv_heads))
  x = sharding.replicate_kv_heads(x, num_kv_heads, model, axis=-2)
  return x.reshape(lead + (-1,))


def shard_model(model: model_lib.Llama, mesh: Mesh) -> model_lib.Llama:
  """The model laid out for tensor parallelism on `mesh`.

  Args:
    model: a `Llama` (on any device); it is not modified.
    mesh: a `(data, model)` mesh from `paged_jax.sharding.make_mesh`.

  Returns:
    A new `Llama` computing the same function, its parameters placed with
    `NamedSharding`s (see the module docstring). Its `config.num_kv_heads` is
    `paged_jax.sharding.cache_kv_heads(num_kv_heads, model)`.

  Raises:
    ValueError: if `num_heads` is not a multiple of the model axis, or the KV
      heads and the model axis do not divide one another.
  """
  config = model.config
  tp = mesh.shape[MODEL]
  kv_heads = check_model_axis(config, tp)
  reps = kv_heads // config.num_kv_heads
  new_config = dataclasses.replace(config, num_kv_heads=kv_heads)
  implementation = model.implementation
  new = model_lib.Llama.abstract(new_config, implementation=implementation)
  _, state = nnx.split(model, nnx.Param)
  updates = {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    if reps > 1 and path[-2] in ("k_proj", "v_proj"):
      value = _replicate_kv_columns(value, config.num_kv_heads, tp)
    spec = param_spec(path, value.shape, tp)
    node = updates
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = jax.device_put(value, NamedSharding(mesh, spec))
  nnx.update(new, updates)
  return new
