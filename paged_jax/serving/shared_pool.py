"""One KV pool shared by a hybrid model's layer groups (vLLM's layout).

A hybrid model (Gemma 2, Gemma 3) has global layers, which keep every block
of a sequence, and local layers of window `w`, which after reclamation keep
at most `ceil(w / bs) + 1`. `window_pool` gives each window its own pool,
its memory fixed at init; here every layer group draws from one pool, so
memory the local layers give back serves the global ones and the reverse.

Layout (vLLM's hybrid KV cache manager): every window group is split into
*sub-groups* of `G` layers (`G` = the gcd of the groups' layer counts;
Gemma 3's 5 local : 1 global gives `G = 1` and six sub-groups). A block
holds the K/V of the `G` layers of one sub-group, so the KV cache is one
`KVCache` of `G` layers and `N` blocks (`N * G` = the engine's layer-blocks),
and each sub-group has its own block table; a layer reads and writes its
sub-group's table at its index in that sub-group (`layer_table`).

The block state is one `BlockState` (`SharedState.state`) of `K * max_seqs`
slots for `K` sub-groups: sequence slot `s` of sub-group `k` is slot `k *
max_seqs + s` (`expand`). One free stack and one refcount array serve every
sub-group; `state.window` is the local window (one distinct window is the
rule for this layout: `window_pool.layout`), and the local sub-groups'
slots reclaim after each step (`window_reclaim.reclaim`) as a pool with a
window does. The host model is `host_pool.HostPool` of the same state
(`SharedHost`): exact, journaled, fingerprinted as one pool.

Atomicity: a step's entry grows by the same tokens in every sub-group, and
is granted its blocks in every sub-group or in none (`joint_ok`, then
`block_manager.reserve` with the refused entries asking 0 tokens: the same
in-order counts, so every entry judged ok is served). Without prefix
caching (with it the engine keeps a pool per window: `window_pool.layout`).
"""

from __future__ import annotations

import dataclasses

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
from paged_jax.serving.host_pool import _NO_CACHE_OK, HostPool, _any_real, _leads  # pylint: disable=protected-access
from paged_jax.serving.host_reserve import HostReservation

NULL_BLOCK = bm.NULL_BLOCK


@flax.struct.dataclass
class SharedState:
  """The shared pool's block state (a pytree).

  Attributes:
    state: one `BlockState` of `len(windows) * max_seqs` slots (sub-group
      `k`'s slot `s` is `k * max_seqs + s`), `window` the local window.
    windows: static; per sub-group None (global) or its window.
  """

  state: bm.BlockState
  windows: tuple = flax.struct.field(pytree_node=False)

  @property
  def num_sub_groups(self) -> int:
    return len(self.windows)

  prefix_caching = False  # (`window_pool.layout`: not with the shared pool)

  @property
  def max_seqs(self) -> int:
    return self.state.max_seqs // self.num_sub_groups

  @property
  def block_size(self) -> int:
    return self.state.block_size

  @property
  def num_blocks(self) -> int:
    return self.state.num_blocks

  @property
  def seq_lens(self):
    return self.state.seq_lens[:self.max_seqs]

  def view(self, k: int) -> bm.BlockState:
    """Sub-group `k` as a `BlockState` of `max_seqs` slots (its table rows
    and lengths; the pool's refcounts and free stack)."""
    ms = self.max_seqs
    rows = slice(k * ms, (k + 1) * ms)
    return self.state.replace(block_tables=self.state.block_tables[rows],
                              seq_lens=self.state.seq_lens[rows],
                              window=self.windows[k])


def init(num_blocks: int, windows, *, block_size: int, max_seqs: int,
         max_blocks_per_seq: int) -> SharedState:
  """An empty shared pool of `num_blocks` blocks for sub-groups `windows`
  (`pooled.sub_groups`'; at most one distinct window besides None)."""
  local = {w for w in windows if w is not None}
  if len(local) != 1:
    raise ValueError(f"a shared pool reclaims for one local window, got "
                     f"windows={tuple(windows)}")
  state = bm.init(num_blocks=num_blocks, block_size=block_size,
                  max_seqs=len(windows) * max_seqs,
                  max_blocks_per_seq=max_blocks_per_seq, window=local.pop())
  return SharedState(state, tuple(windows))


def make_cache(model_config, num_blocks: int, *, block_size: int, dtype):
  """The zeroed `KVCache` of `G` layers (`pooled.sub_groups`) and `num_blocks`."""
  c = model_config
  g = pooled_model.sub_groups([s.sliding_window for s in c.layer_specs])[0]
  return kv_cache_lib.KVCache.create(
      num_layers=g, num_kv_heads=c.num_kv_heads, num_blocks=num_blocks,
      block_size=block_size, head_dim=c.head_dim,
      dtype=kv_cache_lib.cache_dtype(dtype, c.jnp_dtype))


def expand(ids, num_sub: int, max_seqs: int):
  """`i32[n] -> i32[n * num_sub]`: each id's slot in every sub-group, entry
  by entry (`[s, ms + s, 2 ms + s, ...]`); ids outside `[0, max_seqs)` give
  -1 (padding)."""
  xp = jnp if isinstance(ids, jax.Array) else np
  ids = xp.asarray(ids)
  ok = (ids >= 0) & (ids < max_seqs)
  slots = ids[:, None] + max_seqs * xp.arange(num_sub, dtype=ids.dtype)[None, :]
  return xp.where(ok[:, None], slots, -1).reshape(-1).astype(np.int32)


def _entries(xp, tables, lens, refs, seq_ids, num_new, max_seqs: int, bs: int):
  """`block_manager.reserve`'s per-entry inputs of its decision, for the
  expanded entries: `(valid, partial, last, last_refs, grow)`."""
  width = tables.shape[1]
  ids = xp.asarray(seq_ids)
  valid = (ids >= 0) & (ids < max_seqs) & (num_new >= 0) & _first(xp, ids)
  sid = xp.clip(ids, 0, max_seqs - 1)
  old = lens[sid]
  valid &= num_new <= width * bs - old
  new = old + xp.where(valid, num_new, 0)
  cur = -(-old // bs)
  last = xp.take_along_axis(tables[sid], xp.maximum(cur - 1, 0)[:, None], axis=1)[:, 0]
  partial = valid & (num_new > 0) & (old % bs != 0)
  last_refs = refs[xp.clip(last, 0, refs.shape[0] - 1)]
  return valid, partial, last, last_refs, -(-new // bs) - cur


def joint_ok(state: bm.BlockState, seq_ids, num_new, num_sub: int):
  """`bool[n]`: which of `n` entries (expanded, `n * num_sub`, `expand`)
  get their blocks in every sub-group, served in order as
  `block_manager.reserve` serves (an entry needs its new columns plus a
  copy-on-write block per sub-group whose partial last block is still
  shared), all sub-groups of an entry counted together: on the device
  `block_manager._serve` with `num_sub` (the one rule), on the host its
  NumPy model (`_scan_host`, checked equal by the tests). Padding and
  invalid entries: False."""
  host = not isinstance(state.block_tables, jax.Array)
  xp = np if host else jnp
  valid, partial, last, last_refs, grow = _entries(
      xp, state.block_tables, state.seq_lens, state.refcounts, seq_ids,
      num_new, state.max_seqs, state.block_size)
  if not host:
    ok = bm._serve(valid, partial, last, last_refs, grow, state.num_free,  # pylint: disable=protected-access
                   num_sub=num_sub)[1]
    return ok.reshape(-1, num_sub)[:, 0]
  n = seq_ids.shape[0] // num_sub
  shape = (n, num_sub)
  valid_r = valid.reshape(shape).all(axis=1)
  cow_all = partial & (last_refs > 1)
  total = np.sum(np.where(np.repeat(valid_r, num_sub), grow + cow_all, 0))
  shared = np.sort(np.where(cow_all, last, NULL_BLOCK))
  siblings = np.any((shared[1:] == shared[:-1]) & (shared[1:] >= 0))
  if not siblings and total <= state.num_free:
    return valid_r
  return _scan_host(valid_r, partial.reshape(shape), last.reshape(shape),
                    last_refs.reshape(shape), grow.reshape(shape), int(state.num_free))


def _first(xp, ids):
  if xp is np:
    out = np.zeros(ids.shape, bool)
    if ids.size:
      out[np.unique(ids, return_index=True)[1]] = True
    return out
  return bm._first_occurrence(ids)  # pylint: disable=protected-access


def _scan_host(valid, partial, last, last_refs, grow, free) -> np.ndarray:
  """`joint_ok`'s in-order decision on the host (the rare case: the pool
  cannot serve every entry, or two grow into one shared block)."""
  ok = np.zeros(valid.shape[0], bool)
  copied: list[int] = []
  for i in range(valid.shape[0]):
    if not valid[i]:
      continue
    drops = np.array([copied.count(int(b)) for b in last[i]])
    cow = partial[i] & (last_refs[i] - np.where(partial[i], drops, 0) > 1)
    need = int(np.sum(grow[i] + cow))
    if need <= free:
      ok[i] = True
      free -= need
      copied.extend(int(b) for b in last[i][cow])
  return ok


def _local(windows) -> np.ndarray:
  return np.array([w is not None for w in windows])


def _bookkeeping(shared: SharedState, x: step_lib.StepInputs):
  """`step.bookkeeping` on the shared pool (no prefix caching): release ->
  fork -> release -> reserve, each on every sub-group's slots; the reserve
  jointly (`joint_ok`).

  Returns:
    `(shared, fork_ok bool[B], ok bool[S], Reservation (expanded))`.
  """
  K, ms = shared.num_sub_groups, shared.max_seqs
  ex = lambda ids: expand(ids, K, ms)  # noqa: E731
  unless = step_lib._unless_empty  # pylint: disable=protected-access
  state = shared.state
  state, _ = unless(bm.release, state, ex(x.release_early))
  state, fork_ok = unless(bm.fork, state, ex(x.fork_parents), ex(x.fork_children))
  fork_ok = fork_ok.reshape(-1, K).all(axis=1)
  state, _ = unless(bm.release, state, ex(x.release_late))
  ids, q = ex(x.seq_ids), jnp.repeat(x.q_lens, K)
  ok = joint_ok(state, ids, q, K)
  state, res = bm.reserve(state, ids, jnp.where(jnp.repeat(ok, K), q, 0))
  return shared.replace(state=state), fork_ok, ok, res


def _reclaim_args(shared, seq_ids, q_lens, ok):
  """The local sub-groups' entries: `(ids, q, ok)`, expanded."""
  K, ms = shared.num_sub_groups, shared.max_seqs
  local = _local(shared.windows)
  xp = jnp if isinstance(seq_ids, jax.Array) else np
  pick = lambda a: a.reshape(-1, K)[:, local].reshape(-1)  # noqa: E731
  return (pick(expand(seq_ids, K, ms)), pick(xp.repeat(q_lens, K)),
          pick(xp.repeat(ok, K)))


def device_step(model_def, params, cache, shared: SharedState,
                last_tokens: jax.Array, slots, x: step_lib.StepInputs, *,
                decode_only: bool, num_logprobs: int):
  """`step.device_step` on the shared pool: bookkeeping -> copy-on-write ->
  one `StepMetadata` per sub-group -> the model
  (`models.llama.pooled.paged_forward_shared`) -> reclamation in the local
  sub-groups -> sampling -> the pool's fingerprint `u32[5]`.

  Returns:
    `(cache, shared, last_tokens, StepOutputs)`.
  """
  model = model_def.merge(params)
  shared, fork_ok, ok, res = _bookkeeping(shared, x)
  cache = kv_cache_lib.copy_blocks(cache, res.copy_src, res.copy_dst)
  metas = [step_metadata_lib.step_metadata(
      shared.view(k), x.seq_ids, x.q_lens, num_tokens=x.tokens.shape[0],
      active=ok, decode_only=decode_only) for k in range(shared.num_sub_groups)]
  hidden, cache = pooled_model.paged_forward_shared(
      model, step_lib.input_tokens(last_tokens, x), metas, cache)
  ids, q, live = _reclaim_args(shared, x.seq_ids, x.q_lens, ok)
  shared = shared.replace(state=window_reclaim.reclaim(
      shared.state, ids, q, live, max_new_tokens=x.tokens.shape[0]))
  tokens, top_lp, top_ids, token_lp = step_lib._sample(  # pylint: disable=protected-access
      model.logits(hidden[x.sample_rows]),
      step_lib.sample_rows(slots, shared.view(0), x), num_logprobs)
  last_tokens = step_lib.store_tokens(last_tokens, x.sample_slots, tokens)
  return cache, shared, last_tokens, step_lib.StepOutputs(
      tokens, top_lp, top_ids, ok, fork_ok, token_lp,
      step_lib.state_fingerprint(shared.state))


def bookkeeping_step(shared: SharedState, x: step_lib.StepInputs, *,
                     num_logprobs: int):
  """`step.bookkeeping_step` on the shared pool."""
  shared, fork_ok, ok, _ = _bookkeeping(shared, x)
  return shared, step_lib.bookkeeping_outputs(ok, fork_ok, step_lib.state_fingerprint(shared.state),
                                           num_logprobs=num_logprobs)


class SharedHost:
  """The scheduler's exact model of a `SharedState`: one `HostPool` of its
  `BlockState` (so begin / commit / rollback and the fingerprint are the
  pool's), read by the scheduler as a pool of `max_seqs` slots;
  `bookkeeping` runs `_bookkeeping`'s transitions and the step's
  reclamation on it."""

  window = None
  caching = False
  num_cached = 0

  def __init__(self, shared: SharedState):
    self.pool = HostPool(shared.state)
    self.windows = shared.windows
    self.num_sub = len(shared.windows)
    self.max_seqs = shared.max_seqs
    self.block_size, self.width = shared.block_size, self.pool.width
    self.num_blocks = self.pool.num_blocks
    self._local = _local(self.windows)
    self._num_local = int(self._local.sum())
    self._last = None  # (seq_ids, q_lens, `_expanded`'s) of read-only inputs

  def begin(self):
    self.pool.begin()

  def commit(self):
    self.pool.commit()

  def rollback(self):
    self.pool.rollback()

  @property
  def num_free(self) -> int:
    return self.pool.num_free

  @property
  def num_available(self) -> int:
    return self.pool.num_available

  @property
  def lens(self) -> np.ndarray:
    return self.pool.lens[:self.max_seqs]

  @property
  def tables(self) -> np.ndarray:
    return self.pool.tables[:self.max_seqs]

  def fingerprint(self) -> np.ndarray:
    return self.pool.fingerprint()

  def to_state(self) -> SharedState:
    return SharedState(self.pool.to_state(), self.windows)

  def _ex(self, ids):
    return expand(np.asarray(ids), self.num_sub, self.max_seqs)

  def _expanded(self, seq_ids, q_lens):
    """`(ids, q, local_ids, local_q)`: the entries expanded to every
    sub-group (`expand`) and the local sub-groups' of them
    (`_reclaim_args`). Read-only inputs (a steady decode step's, sent again
    while its rows stay the same: `packing.SteadyInputs`) give the same
    read-only arrays as the last call, so `HostPool.reserve` knows its steady
    rows by identity and nothing is expanded again."""
    last = self._last
    if last is not None and seq_ids is last[0] and q_lens is last[1]:
      return last[2]
    seq_ids, q_lens = np.asarray(seq_ids), np.asarray(q_lens)
    K, local = self.num_sub, self._local
    ids, q = self._ex(seq_ids), np.repeat(q_lens, K)
    out = (ids, q, ids.reshape(-1, K)[:, local].reshape(-1),
           q.reshape(-1, K)[:, local].reshape(-1))
    if not (seq_ids.flags.writeable or q_lens.flags.writeable):
      for a in out:
        a.flags.writeable = False
      self._last = (seq_ids, q_lens, out)
    return out

  def _joint_ok(self, seq_ids, q_lens, ids, q, packed: int | None) -> np.ndarray:
    """`joint_ok` on the model. With the scheduler's layout (`packed`
    distinct valid entries first, then padding), when no entry's partial
    last block is shared (so nothing copies; checked on those blocks only,
    not over the pool) and the pool holds every entry's new blocks in
    every sub-group at once, every entry is granted without building
    `joint_ok`'s per-entry inputs: O(entries) vector operations instead of
    a gather of their table rows. Otherwise `joint_ok` itself."""
    p, K = self.pool, self.num_sub
    if packed is not None and packed:
      n, bs = packed * K, self.block_size
      rows = ids[:n]
      old = p.lens[rows]
      new = old + q[:n]
      part = old % bs != 0  # rows growing into a partial last block
      last = p.tables[rows[part], (old[part] - 1) // bs]
      if (not np.any(p.refs[last[last >= 0]] > 1)  # none shared: no copy
          and int(new.max()) <= p.max_seq_len and (
          int(np.sum((new + bs - 1) // bs - (old + bs - 1) // bs)) <= p.num_free)):
        return p._granted(np.shape(seq_ids)[0], packed)  # pylint: disable=protected-access
    return joint_ok(_HostView(p), ids, q, K)

  def bookkeeping(self, register_seqs, register_cols, release_early,
                  fork_parents, fork_children, release_late, share_seqs,
                  share_blocks, share_counts, seq_ids, q_lens, *,
                  packed: int | None = None, decode: int = 0):
    """`_bookkeeping` and the step's reclamation on the model, in place.

    `packed`, `decode`: the scheduler's layout promise, as
    `HostPool.bookkeeping`'s (`seq_ids[:packed]` distinct valid slots, the
    rest padding; `q_lens[:decode]` are 1). Expanded, it is the same promise
    of `packed * K` and `decode * K` entries (each entry's K sub-group rows
    side by side, `expand`), which the pool's `reserve` takes when every
    entry is granted: the steady decode rows are then reserved without a
    scan (`host_reserve.SteadyDecode`), sub-group rows as any rows.

    Returns:
      `(fork_ok bool[B], HostReservation (ok bool[S]; copies expanded),
      cache_ok bool[0])`.
    """
    del register_seqs, register_cols, share_seqs, share_blocks, share_counts
    p, K = self.pool, self.num_sub
    real = _any_real if packed is None else _leads
    if real(release_early):
      p.release(self._ex(release_early))
    if real(fork_parents) or real(fork_children):
      fork_ok = p.fork(self._ex(fork_parents), self._ex(fork_children)).reshape(-1, K).all(1)
    else:
      fork_ok = p._no_forks(np.shape(fork_parents)[0])  # pylint: disable=protected-access
    if real(release_late):
      p.release(self._ex(release_late))
    ids, q, local_ids, local_q = self._expanded(seq_ids, q_lens)
    ok = self._joint_ok(seq_ids, q_lens, ids, q, packed)
    if packed is not None and ok[:packed].all():  # every entry granted
      res = p.reserve(ids, q, packed * K, decode * K)
      local_ok = p._granted(local_ids.shape[0], packed * self._num_local)  # pylint: disable=protected-access
    else:
      res = p.reserve(ids, np.where(np.repeat(ok, K), q, 0))
      local_ok = np.repeat(ok, self._num_local)
    window_reclaim.reclaim_host(p, local_ids, local_q, local_ok)
    return fork_ok, HostReservation(ok, res.copy_src, res.copy_dst, None), _NO_CACHE_OK

  def held(self, length: int) -> int:
    """Blocks a sequence of `length` tokens holds between steps, over every
    sub-group (`window_pool.held_blocks` summed): a waiting prompt's cost in
    block-aware admission."""
    bs = self.block_size  # (one local window: `init`)
    return (self.num_sub * -(-length // bs)
            - self._num_local * bm.reclaimable_columns(self.pool.window, length, bs))

  def admission_room(self, running, *, rows: int, max_tokens_per_step: int,
                     headroom_steps: int) -> int:
    """Block-aware admission's room in the shared pool
    (`Scheduler._schedule`; `window_pool.local_admission_room` per window):

      room = available - sum_s (held(len(s.tokens)) - held(s.num_cached))
             - local * (ceil(rows / bs) + ceil(max_tokens_per_step / bs) + 1)
             - global * ceil(rows * headroom_steps / bs)

    what is left once every running sequence holds its whole prompt, with
    room in each local sub-group for one step's boundary crossings and
    prompt chunk before reclamation, and in each global one for
    `headroom_steps` steps of decode growth. A prompt of `P` tokens then
    costs `held(P)`.

    Args:
      running: the running `Seq`s (`tokens`, `num_cached`).
      rows: this step's planned entries.
      max_tokens_per_step, headroom_steps: the engine's.

    Returns:
      The room in blocks (may be negative: none)."""
    bs = self.block_size
    local = sum(w is not None for w in self.windows)
    reserve = (local * (-(-rows // bs) + -(-max_tokens_per_step // bs) + 1)
               + (self.num_sub - local) * -(-rows * headroom_steps // bs))
    return self.num_available - reserve - sum(
        self.held(len(s.tokens)) - self.held(s.num_cached) for s in running)

  # `_reclaim_args` reads these as on a `SharedState`.
  @property
  def num_sub_groups(self) -> int:
    return self.num_sub


@dataclasses.dataclass
class _HostView:
  """A `HostPool` read as `joint_ok` reads a `BlockState`."""
  pool: HostPool

  @property
  def block_tables(self):
    return self.pool.tables

  @property
  def seq_lens(self):
    return self.pool.lens

  @property
  def refcounts(self):
    return self.pool.refs

  @property
  def num_free(self):
    return self.pool.num_free

  @property
  def max_seqs(self):
    return self.pool.max_seqs

  @property
  def block_size(self):
    return self.pool.block_size
