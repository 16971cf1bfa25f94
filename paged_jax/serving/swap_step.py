"""The device side of preemption by swap: the step's block bookkeeping with
the host tier's two operations in it, and the tier's fingerprint.

`bookkeeping` is `step.bookkeeping` with `host_tier.drop` and
`host_tier.swap_out` after the early release and `host_tier.swap_in` just
before the reservations:

  register -> release -> drop -> swap_out -> fork -> release (late) ->
  share -> swap_in -> reserve

`drop` forgets swapped-out sequences whose request finished or was aborted
while out (it touches only the tier; first, so that this step's swap-outs
can use the host blocks it frees).

Swapping out before the forks and reservations frees its device blocks for
them in the same step (so the copies to the host must be dispatched before
this step's writes to those blocks). Swapping in after `share` (not before,
as first proposed in #24): `swap_in` reserves with `block_manager.reserve`,
which may evict cached blocks, and the scheduler picks this step's
prefix-cache hits before it knows what a swap-in evicts; after `share` the
hits hold their blocks (refcount > 0, out of the ring), so a swap-in can
never evict a block a hit names, exactly as `reserve` never evicts them.
Before `reserve`, so returning sequences get their blocks first and their
own next tokens reserve on top. All three take padded `i32[max_swaps]` slot
arrays (-1 = none) and are skipped by a `lax.cond` when all padding, so a
step that swaps nothing pays two scalar tests. `host_tier_pool.HostTierPool.bookkeeping` is the
host's exact model of the same order.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import host_tier
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import kv_offload
from paged_jax import step_metadata as step_metadata_lib
from paged_jax.kv_cache import KVCache
from paged_jax.serving import step as step_lib

_unless_empty = step_lib._unless_empty  # pylint: disable=protected-access


def _swap_unless_empty(op, state, tier, ids):
  """`op(state, tier, ids)` (a `host_tier` swap), skipped when every id is
  -1: `(state, tier, Swap)` with all-False `ok`, all-`NULL_BLOCK` pairs."""
  n, width = ids.shape[0], state.max_blocks_per_seq
  if n == 0:
    return op(state, tier, ids)
  shape = jax.eval_shape(op, state, tier, ids)[2]

  def skip(st, tr):
    none = host_tier.Swap(
        ok=jnp.zeros((n,), bool),
        src=jnp.full((n, width), bm.NULL_BLOCK, jnp.int32),
        dst=jnp.full((n, width), bm.NULL_BLOCK, jnp.int32),
        evicted=(None if shape.evicted is None else
                 jnp.full((n, width), bm.NULL_BLOCK, jnp.int32)))
    return st, tr, none

  return jax.lax.cond(jnp.any(ids >= 0), lambda st, tr: op(st, tr, ids),
                      skip, state, tier)


def bookkeeping(state: bm.BlockState, tier: host_tier.HostTier, register_seqs,
                register_cols, release_early, fork_parents, fork_children,
                release_late, share_seqs, share_blocks, share_counts, seq_ids,
                q_lens, swap_out_ids, swap_in_ids, drop_ids=None):
  """A step's bookkeeping with swaps (module docstring), on one pool.

  Args:
    state: the device pool's `BlockState`.
    tier: its `host_tier.HostTier`.
    register_seqs ... q_lens: as `step.bookkeeping` (`step.StepInputs`).
    swap_out_ids: `i32[S]` live slots to move to the host, -1 padding.
    swap_in_ids: `i32[S]` swapped-out slots to move back, -1 padding.
    drop_ids: `i32[S]` swapped-out slots to forget, -1 padding (None: none).

  Returns:
    `(state, tier, fork_ok bool[max_batch], Reservation, cache_ok bool[R+H],
    out Swap, back Swap)`: copy `out.src -> out.dst` (device to host) before
    this step's K/V writes, `back.src -> back.dst` (host to device) before
    its attention (`dispatch_copies` does both); `back.evicted` joins the prefix index's evictions.
  """
  cache_ok = jnp.ones((0,), bool)
  if state.prefix_caching:
    state, reg_ok = _unless_empty(bm.register, state, register_seqs, register_cols)
    cache_ok = reg_ok | (register_seqs < 0)
  state, _ = _unless_empty(bm.release, state, release_early)
  if drop_ids is not None and drop_ids.shape[0]:
    tier = jax.lax.cond(jnp.any(drop_ids >= 0),
                        lambda t: host_tier.drop(t, drop_ids)[0], lambda t: t, tier)
  state, tier, out = _swap_unless_empty(host_tier.swap_out, state, tier,
                                        swap_out_ids)
  state, fork_ok = _unless_empty(bm.fork, state, fork_parents, fork_children)
  state, _ = _unless_empty(bm.release, state, release_late)
  if state.prefix_caching:
    state, share_ok = _unless_empty(bm.share, state, share_seqs, share_blocks,
                                    jnp.maximum(share_counts, 1))
    cache_ok = jnp.concatenate([cache_ok, share_ok | (share_seqs < 0)])
  state, tier, back = _swap_unless_empty(host_tier.swap_in, state, tier,
                                         swap_in_ids)
  state, res = bm.reserve(state, seq_ids, q_lens)
  return state, tier, fork_ok, res, cache_ok, out, back


@flax.struct.dataclass
class SwapInputs:
  """A step's swaps (`S`: the engine's `max_swaps`)."""

  swap_out: jax.Array  # i32[S]  live slots to move to the host; -1 = none
  swap_in: jax.Array  # i32[S]  swapped-out slots to move back; -1 = none
  drop: jax.Array  # i32[S]  swapped-out slots to forget (finished); -1 = none


@flax.struct.dataclass
class SwapOutputs:
  out_ok: jax.Array  # bool[S]  (the host knew it)
  in_ok: jax.Array  # bool[S]  (the host knew it)


def device_step(model_def: step_lib.ModelDef, params, cache: KVCache,
                state: bm.BlockState, tier: host_tier.HostTier,
                last_tokens: jax.Array, slots, x: step_lib.StepInputs,
                s: SwapInputs, *, decode_only: bool, num_logprobs: int):
  """`step.device_step` with the swaps of `s` in its bookkeeping (one pool,
  one device; jit it with the cache, state, tier and last tokens donated;
  `slots`, the `slot_state.SlotState`, is read only).

  The K/V copies are not in this program: `dispatch_copies` dispatches them,
  with the host model's pairs, before this step (see there). Only the
  bookkeeping differs from `step.device_step`: with `s` all padding the
  result is the same, and the tier comes back unchanged.

  Returns:
    `(cache, state, tier, last_tokens, step.StepOutputs, SwapOutputs)`; the
    outputs' `fingerprint` is u32[8], `step.state_fingerprint` then
    `tier_fingerprint` (`swap.SwapPool.fingerprint` on the host).
  """
  model = model_def.merge(params)
  state, tier, fork_ok, res, _, out, back = bookkeeping(
      state, tier, *step_lib.bookkeeping_args(x), s.swap_out, s.swap_in, s.drop)
  cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
  meta = step_metadata_lib.step_metadata(
      state, x.seq_ids, x.q_lens, num_tokens=x.tokens.shape[0], active=res.ok,
      decode_only=decode_only)
  hidden, cache = model.paged_forward(step_lib.input_tokens(last_tokens, x),
                                      meta, cache)
  tokens, top_lp, top_ids, token_lp = step_lib._sample(  # pylint: disable=protected-access
      model.logits(hidden[x.sample_rows]), step_lib.sample_rows(slots, state, x),
      num_logprobs)
  last_tokens = step_lib.store_tokens(last_tokens, x.sample_slots, tokens)
  fingerprint = jnp.concatenate([step_lib.state_fingerprint(state),
                                 tier_fingerprint(tier)])
  outputs = step_lib.StepOutputs(tokens, top_lp, top_ids, res.ok, fork_ok,
                                 token_lp, fingerprint)
  return cache, state, tier, last_tokens, outputs, SwapOutputs(out.ok, back.ok)


def tier_fingerprint(tier: host_tier.HostTier) -> jax.Array:
  """u32[3], a cheap checksum of the tier: `(num_free, sum w*seq_lens,
  sum w*(tables + 1))` mod 2**32, odd weights `w = 2 * index + 1`
  (`HostTierPool.fingerprint` computes the same on the host)."""
  u32 = jnp.uint32

  def weighted(a):
    a = a.reshape(-1).astype(u32)
    return jnp.sum(a * (2 * jnp.arange(a.shape[0], dtype=u32) + 1), dtype=u32)

  return jnp.stack([tier.num_free.astype(u32), weighted(tier.seq_lens),
                    weighted(tier.tables + 1)])


def copy_pairs(src, dst) -> tuple[np.ndarray, np.ndarray, int]:
  """The real `(src, dst)` block pairs of a swap (`HostSwap` / `Swap`
  `src`, `dst`, any shape), first in row-major order, padded with
  `NULL_BLOCK` to a power of two (so the copy programs compile once per
  size class). Returns `(src i32[m], dst i32[m], count)`, `m = 0` if none."""
  src = np.asarray(src, np.int32).reshape(-1)
  dst = np.asarray(dst, np.int32).reshape(-1)
  real = (src >= 0) & (dst >= 0)
  count = int(np.count_nonzero(real))
  m = 0 if count == 0 else 1 << (count - 1).bit_length()
  out_src = np.full(m, bm.NULL_BLOCK, np.int32)
  out_dst = np.full(m, bm.NULL_BLOCK, np.int32)
  out_src[:count], out_dst[:count] = src[real], dst[real]
  return out_src, out_dst, count


def dispatch_copies(cache: KVCache, host: KVCache, out, back
                    ) -> tuple[KVCache, KVCache, tuple[int, int]]:
  """Dispatches (does not await) a step's swap copies, with the pairs the
  host model computed (`HostTierPool.bookkeeping`'s `out`, `back`): device
  to host first, then host to device. Call it before dispatching the step
  whose bookkeeping runs these swaps: the swapped-out blocks still hold
  their K/V then (the step may reuse them), and the swapped-in blocks are
  free then (the step attends to them). A block freed by a swap-out and
  taken by a swap-in of the same step is read by the first copy before the
  second writes it (JAX orders them by data dependence).

  Args:
    cache: the device cache (donated when a swap-in copies).
    host: the host cache (`kv_offload.host_cache`; donated when a swap-out
      copies).
    out: the swap-out's `src` (device) / `dst` (host) blocks, any object
      with those attributes.
    back: the swap-in's `src` (host) / `dst` (device) blocks.

  Returns:
    `(cache, host, (blocks_out, blocks_in))`: the updated caches (the
    inputs when nothing moves) and the real blocks each copy moved (its
    padding excluded), for the stats.
  """
  src, dst, n_out = copy_pairs(out.src, out.dst)
  if n_out:
    host = kv_offload.copy_to_host(cache, host, src, dst)
  src, dst, n_in = copy_pairs(back.src, back.dst)
  if n_in:
    cache = kv_offload.copy_to_device(cache, host, src, dst)
  return cache, host, (n_out, n_in)
