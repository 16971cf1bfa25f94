"""A step's small outputs as one int32 buffer, fetched in one transfer.

A serving step returns a handful of small arrays (sampled tokens, their
log-probs, the reservation masks, the block-state fingerprint). Fetching each
costs a transfer of its own: on the CPU backend about 10 us per array, so the
five of a decode step cost about 60 us against 21 us for one buffer holding
them all (measured 2026-12-03, JAX 0.10.2, 2-core CPU; issue #21 wants the
host's whole step under 200 us). So the compiled step packs them on the
device, and `fetch` unpacks one buffer with NumPy views.

`packs(step_fn)` wraps a step function: every output that is a
`flax.struct` outputs record (`StepOutputs`, `MultiStepOutputs`, ...) becomes
a `Packed` -- its 4-byte and bool leaves bitcast or cast to int32 and
concatenated into `buf`, the leaves named in `APART` (the top log-probs and
their ids: large, and fetched only when a row asked for them) and any leaf of
another width kept as they are. The layout is static pytree data of `Packed`,
so a compiled executable's outputs carry it. `fetch(out, top=...)` returns the
original record, on the host, with `None` for the `APART` leaves unless
`top`. A record that is not `Packed` is fetched leaf by leaf (`device_get`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Leaves fetched only on request (`fetch(top=True)`), never packed.
APART = frozenset({"top_logprobs", "top_ids"})


class _Entry(NamedTuple):
  apart: int  # index into `Packed.apart`, or -1 when the leaf is in `buf`
  shape: tuple[int, ...]
  dtype: str  # numpy dtype name of the leaf
  on_request: bool  # named in `APART`: fetched only with `top=True`


class Layout(NamedTuple):
  treedef: Any  # the record's `jax.tree_util.PyTreeDef`
  entries: tuple[_Entry, ...]  # one per leaf, in flattening order


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
  """A step's outputs record, packed (module docstring).

  Attributes:
    buf: i32[n]  every packed leaf, flattened, in leaf order.
    apart: the leaves kept out of `buf`, in leaf order.
    layout: static: the record's tree structure and each leaf's place.
  """
  buf: jax.Array
  apart: tuple
  layout: Layout

  def tree_flatten(self):
    return (self.buf, self.apart), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], children[1], layout)

  def is_ready(self) -> bool:
    """Whether the step that made it has finished (`jax.Array.is_ready`)."""
    return self.buf.is_ready()


def _name(path) -> str | None:
  last = path[-1] if path else None
  return getattr(last, "name", None)


def _packable(leaf) -> bool:
  dt = jnp.dtype(leaf.dtype)
  return dt == jnp.bool_ or dt.itemsize == 4


def pack(record, per_pool: bool = False) -> Packed:
  """`record` (a pytree of arrays, traced) as a `Packed` (module docstring).
  With `per_pool`, every leaf has a leading `[data]` axis and `buf` is
  `i32[data, n]`, row `i` packing pool `i`'s leaves: on a mesh each data
  shard's row stays on its devices (no gather on the device)."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(record)
  parts, apart, entries = [], [], []
  lead = 1 if per_pool else 0
  for path, leaf in with_paths:
    shape, dtype = tuple(leaf.shape[lead:]), jnp.dtype(leaf.dtype)
    named = _name(path) in APART
    if named or not _packable(leaf):
      entries.append(_Entry(len(apart), shape, dtype.name, named))
      apart.append(leaf)
      continue
    flat = jnp.reshape(leaf, tuple(leaf.shape[:lead]) + (-1,))
    if dtype == jnp.bool_:
      flat = flat.astype(jnp.int32)
    elif dtype != jnp.int32:
      flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
    parts.append(flat)
    entries.append(_Entry(-1, shape, dtype.name, False))
  buf = (jnp.concatenate(parts, axis=lead) if parts
         else jnp.zeros(tuple(with_paths[0][1].shape[:lead]) + (0,), jnp.int32))
  return Packed(buf, tuple(apart), Layout(treedef, tuple(entries)))


def unpack(buf: np.ndarray, apart, layout: Layout, pool: int | None = None):
  """The record of `layout` from a fetched `buf` (NumPy int32) and its
  `apart` leaves (host arrays, or `None` each); with `pool`, row `pool` of
  every leaf and of `buf` (`pack(..., per_pool=True)`)."""
  leaves, offset = [], 0
  for e in layout.entries:
    if e.apart >= 0:
      a = apart[e.apart]
      leaves.append(a if pool is None or a is None else a[pool])
      continue
    n = math.prod(e.shape)
    seg = buf[offset:offset + n] if pool is None else buf[pool, offset:offset + n]
    offset += n
    seg = (seg != 0) if e.dtype == "bool" else seg.view(np.dtype(e.dtype))
    leaves.append(seg.reshape(e.shape))
  return layout.treedef.unflatten(leaves)


def fetch(out, *, top: bool = True, pools: int | None = None):
  """Waits for `out` (a `Packed`, or any pytree of arrays) and returns its
  record on the host; with `top=False` the `APART` leaves are `None` (and not
  transferred). With `pools`, the leaves have a leading `[data]` axis and
  the result is a list of each pool's record (its row of every leaf; a
  `Packed` made with `pack(..., per_pool=True)`)."""
  if not isinstance(out, Packed):
    if not top:
      out = out.replace(**{k: None for k in APART if hasattr(out, k)})
    out = jax.device_get(out)
    if pools is None:
      return out
    return [jax.tree.map(lambda a, i=i: a[i], out) for i in range(pools)]
  wanted = [top or not e.on_request for e in out.layout.entries if e.apart >= 0]
  buf, got = jax.device_get(
      (out.buf, [a for a, w in zip(out.apart, wanted) if w]))
  got = iter(got)
  apart = [next(got) if w else None for w in wanted]
  if pools is None:
    return unpack(buf, apart, out.layout)
  return [unpack(buf, apart, out.layout, i) for i in range(pools)]


def is_ready(out) -> bool:
  """Whether the step that made `out` has finished."""
  if isinstance(out, Packed):
    return out.is_ready()
  return jax.tree.leaves(out)[0].is_ready()


def _is_record(x) -> bool:
  return dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(
      x, "fingerprint")


def packs(step_fn, per_pool: bool = False):
  """`step_fn` with each outputs record it returns packed (module
  docstring): a record is an output that has a `fingerprint` field
  (`StepOutputs`, `MultiStepOutputs`); the rest is returned as it is."""
  @functools.wraps(step_fn)
  def wrapped(*args, **kwargs):
    result = step_fn(*args, **kwargs)
    if _is_record(result):
      return pack(result, per_pool)
    if isinstance(result, tuple):
      return tuple(pack(r, per_pool) if _is_record(r) else r for r in result)
    return result
  return wrapped
