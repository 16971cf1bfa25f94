"""The device step of a hybrid model with one KV pool per attention window.

`PooledState` holds one `BlockState` per pool (`window_pool.py` sizes
them; pool `g` serves the layers of window `windows[g]`, None = global). The
step is `step.device_step` with every block operation run once per pool on
the same inputs (every pool holds every sequence, at the same length):

  bookkeeping per pool -> copy-on-write per pool's cache -> `step_metadata`
  per pool -> the model over the pools' caches
  (`models.llama.pooled.paged_forward_pooled`) -> reclamation in the local
  pools (`window_reclaim.reclaim`) -> sampling (the lengths of pool 0,
  which every pool shares) -> fingerprints, `u32[num_pools, 5]`.

A sequence is served only where every pool granted it: the host's model
(`window_pool.PooledHost`) plans so that all pools grant every entry, and a
pool refusing one would show in `ok` and the fingerprints.

Prefix caching (`PooledState.links`). The prefix index names blocks of the
global pool (the *anchor*: it keeps every block, so a cached prefix is a
chain of its blocks from column 0). Every pool registers the step's blocks
at the same (slot, column) (`step.bookkeeping`'s register rows); a local
pool also records, per anchor block, its own block holding the same tokens
of the same layers' K/V (`links[anchor block]`, -1 where it had already
reclaimed that column before the registration). The choice for blocks that
slide out: a registered one is *cached* in its local pool (reclamation
drops the sequence's reference, as a release does, `block_manager._unref`),
not emptied. It still counts as available (an allocation may evict it, least
recently dropped first), so reclamation frees as much as before; until then
it can serve a hit. Emptying them instead would leave a local pool only the
last window of finished sequences, and a prompt sharing a system prefix
with them would then almost never hit.

A hit of `n` anchor blocks starts its sequence at `n * block_size` tokens in
every pool (one length for all). Its future queries in a local pool of
window `w` see only columns from `c = block_manager.reclaimable_columns(w, n
* block_size)` on, so that pool shares its linked blocks of columns `c ..
n - 1` and leaves `0 .. c - 1` as `NULL_BLOCK`, exactly the table
reclamation would have left (`window_reclaim.share_columns`). The host shortens each hit to
the longest `n` for which every local pool's links of those columns are
live (`window_pool.PooledHost.usable_hit`): so the hit length is the same
in every pool, and a local pool that lost part of the last window (evicted,
or reclaimed before its registration) shortens the hit instead of serving
wrong K/V.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import kv_cache as kv_cache_lib
from paged_jax import step_metadata as step_metadata_lib
from paged_jax import window_reclaim
from paged_jax.models.llama import pooled as pooled_model
from paged_jax.serving import step as step_lib

NULL_BLOCK = bm.NULL_BLOCK


@flax.struct.dataclass
class PooledState:
  """One `BlockState` per pool (a pytree). Reads like one state where the
  scheduler asks: pool 0's block size; with prefix caching, the global
  pool's (the anchor's) cacheable blocks, which the prefix index names.

  Attributes:
    states: one `BlockState` per pool.
    links: with prefix caching, per pool `i32[anchor num_blocks]` for a
      local pool (see "Prefix caching" in the module docstring) and None for
      the anchor; without it, `()`.
  """

  states: tuple
  links: tuple = ()

  @property
  def prefix_caching(self) -> bool:
    return bool(self.links)

  @property
  def anchor(self) -> int:
    """The global pool (`window` None): prefix-cache hits are its blocks."""
    return self.windows.index(None)

  @property
  def cacheable(self) -> jax.Array:
    return self.states[self.anchor].cacheable

  @property
  def block_size(self) -> int:
    return self.states[0].block_size

  @property
  def windows(self) -> tuple:
    return tuple(s.window for s in self.states)

  @property
  def seq_lens(self) -> jax.Array:
    return self.states[0].seq_lens


def _link_registrations(links, anchor_tables, local_tables, register_seqs,
                        register_cols):
  """`links` after this step's registrations: each registered anchor block
  -> this pool's block at the same (slot, column), or -1 where this pool
  already reclaimed it (a link from the block's earlier life cleared)."""
  xp = jnp if isinstance(links, jax.Array) else np
  s = xp.clip(register_seqs, 0, anchor_tables.shape[0] - 1)
  c = xp.clip(register_cols, 0, anchor_tables.shape[1] - 1)
  anchor = xp.where(register_seqs >= 0, anchor_tables[s, c], -1)
  return anchor, local_tables[s, c]


def _local_bookkeeping(state: bm.BlockState, links, anchor_tables,
                       register_seqs, register_cols, release_early,
                       fork_parents, fork_children, release_late, share_seqs,
                       share_blocks, share_counts, seq_ids, q_lens):
  """`step.bookkeeping` on a local pool with prefix caching: registrations
  of blocks this pool already reclaimed are skipped, and hits share the
  linked blocks of the last window (`window_reclaim.share`).

  Returns:
    `(state, links, fork_ok, Reservation, cache_ok)` as `step.bookkeeping`.
  """
  unless = step_lib._unless_empty  # pylint: disable=protected-access
  anchor, mine = _link_registrations(links, anchor_tables, state.block_tables,
                                     register_seqs, register_cols)
  links = links.at[jnp.where(anchor >= 0, anchor, links.shape[0])].set(
      mine, mode="drop")
  reg_seqs = jnp.where(mine >= 0, register_seqs, -1)
  state, reg_ok = unless(bm.register, state, reg_seqs, register_cols)
  cache_ok = reg_ok | (reg_seqs < 0)
  state, _ = unless(bm.release, state, release_early)
  state, fork_ok = unless(bm.fork, state, fork_parents, fork_children)
  state, _ = unless(bm.release, state, release_late)
  state, share_ok = unless(functools.partial(window_reclaim.share, links=links),
                           state, share_seqs, share_blocks, share_counts)
  cache_ok = jnp.concatenate([cache_ok, share_ok | (share_seqs < 0)])
  state, res = bm.reserve(state, seq_ids, q_lens)
  return state, links, fork_ok, res, cache_ok


def _bookkeeping(states: PooledState, x: step_lib.StepInputs):
  args = step_lib.bookkeeping_args(x)
  if states.prefix_caching:
    a = states.anchor
    anchor_tables = states.states[a].block_tables  # before the registrations
    out, links = [], []
    for s, link in zip(states.states, states.links):
      if link is None:
        out.append(step_lib.bookkeeping(s, *args))
        links.append(None)
      else:
        s, link, f, r, c = _local_bookkeeping(s, link, anchor_tables, *args)
        out.append((s, f, r, c))
        links.append(link)
    links = tuple(links)
  else:
    out = [step_lib.bookkeeping(s, *args) for s in states.states]
    links = ()
  ok = out[0][2].ok
  fork_ok = out[0][1]
  for _, f, r, _ in out[1:]:
    ok &= r.ok
    fork_ok &= f
  return (PooledState(tuple(o[0] for o in out), links), fork_ok, ok,
          [o[2] for o in out])


def fingerprint(states: PooledState) -> jax.Array:
  """`u32[num_pools, 5]`: `step.state_fingerprint` of each pool."""
  return jnp.stack([step_lib.state_fingerprint(s) for s in states.states])


def device_step(model_def, params, caches: tuple, states: PooledState,
                last_tokens: jax.Array, slots, x: step_lib.StepInputs, *,
                decode_only: bool, num_logprobs: int):
  """`step.device_step` over the pools (see the module docstring).

  Returns:
    `(caches, states, last_tokens, StepOutputs)`.
  """
  model = model_def.merge(params)
  states, fork_ok, ok, res = _bookkeeping(states, x)
  caches = tuple(kv_cache_lib.copy_blocks(c, r.copy_src, r.copy_dst)
                 for c, r in zip(caches, res))
  metas = [step_metadata_lib.step_metadata(
      s, x.seq_ids, x.q_lens, num_tokens=x.tokens.shape[0], active=ok,
      decode_only=decode_only) for s in states.states]
  hidden, caches = pooled_model.paged_forward_pooled(
      model, step_lib.input_tokens(last_tokens, x), metas, caches)
  states = states.replace(states=tuple(
      s if s.window is None else window_reclaim.reclaim(
          s, x.seq_ids, x.q_lens, r.ok, max_new_tokens=x.tokens.shape[0],
          # register rows >= max_tokens_per_step // block_size (`prefix.register_rows`)
          deferred_columns=x.register_seqs.shape[0] + 1)
      for s, r in zip(states.states, res)))
  tokens, top_lp, top_ids, token_lp = step_lib._sample(  # pylint: disable=protected-access
      model.logits(hidden[x.sample_rows]),
      step_lib.sample_rows(slots, states.states[0], x), num_logprobs)
  last_tokens = step_lib.store_tokens(last_tokens, x.sample_slots, tokens)
  return caches, states, last_tokens, step_lib.StepOutputs(
      tokens, top_lp, top_ids, ok, fork_ok, token_lp, fingerprint(states))


def bookkeeping_step(states: PooledState, x: step_lib.StepInputs, *,
                     num_logprobs: int):
  """`step.bookkeeping_step` over the pools."""
  states, fork_ok, ok, _ = _bookkeeping(states, x)
  return states, step_lib.bookkeeping_outputs(ok, fork_ok, fingerprint(states),
                                           num_logprobs=num_logprobs)


def init(pool_blocks, windows, *, block_size: int, max_seqs: int,
         max_blocks_per_seq: int, prefix_caching: bool = False) -> PooledState:
  """Empty pools: `pool_blocks[g]` blocks for window `windows[g]`.

  Raises:
    ValueError: with `prefix_caching` and no global pool (None in
      `windows`): hits are anchored on its blocks.
  """
  windows = tuple(windows)
  if prefix_caching and None not in windows:
    raise ValueError(f"prefix caching over pools needs a global pool (a window "
                     f"None) to anchor hits on, got windows={windows}")
  states = tuple(
      bm.init(num_blocks=n, block_size=block_size, max_seqs=max_seqs,
              max_blocks_per_seq=max_blocks_per_seq, window=w,
              prefix_caching=prefix_caching)
      for n, w in zip(pool_blocks, windows))
  links = ()
  if prefix_caching:
    anchor_blocks = pool_blocks[windows.index(None)]
    links = tuple(None if w is None else jnp.full((anchor_blocks,), NULL_BLOCK,
                                                  jnp.int32)
                  for w in windows)
  return PooledState(states, links)
