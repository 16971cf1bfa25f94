"""Per-slot sampling state, kept on the device.

Everything a step needs to sample a sequence's next token that does not
change from one step to the next -- its temperature, top-k, top-p, seed, the
`min_tokens` bans and its `logit_bias` -- lives in a `SlotState` on the
device, one row per sequence slot (`max_seqs` rows), next to the block
state. A row is written when a sequence takes a slot (admission, a fork of
a prompt's sample or of a beam) and at no other time: the host keeps an
exact NumPy copy (`HostSlots`), marks the rows it changes, and before the
next dispatch sends only those (`HostSlots.take_updates`, applied by one
small jitted scatter, `write`, with the state donated; the rows travel as
two packed matrices, `pack`). A steady decode
step sends none. A finished sequence's row is simply left behind: nothing
reads a slot that no live sequence holds, and the next sequence to take it
overwrites all of it.

The step reads the rows of its sample rows (`gather`): `StepInputs.
sample_seqs` names each sample row's slot, `StepInputs.seed_offsets` what
to add to its seed (the other samples of a prompt sampled in one row), and
the position of the token being sampled is the slot's `seq_lens` after the
step's bookkeeping (the prompt or chunk plus every token before it), so the
host sends no per-row sampling arrays at all.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.serving import sampling as sampling_lib

@flax.struct.dataclass
class SlotState:
  """Sampling parameters per sequence slot (`N`: rows; `max_seqs` on the
  device, or the rows of one update; `B`: `EngineConfig.max_logit_bias`).
  On a mesh every array has a leading `[data]` axis."""

  temperature: jax.Array  # f32[N]  0: greedy (beam search too)
  top_k: jax.Array  # i32[N]  0: all
  top_p: jax.Array  # f32[N]  1: all
  seeds: jax.Array  # i32[N]  the request's seed + the sample index
  ban_until: jax.Array  # i32[N]  `banned` masked while position < this
  banned: jax.Array  # i32[N, sampling.MAX_BANNED]  (min_tokens) -1 = none
  bias_ids: jax.Array  # i32[N, B]  logit_bias ids, -1 = none
  bias_values: jax.Array  # f32[N, B]  their biases
  wants_top: jax.Array  # i32[N]  1: top log-probs (asked for, or beam search)


def empty(rows: int, max_logit_bias: int) -> SlotState:
  """A `SlotState` of `rows` rows of NumPy arrays, every row neutral (greedy,
  no filter, no ban, no bias)."""
  return SlotState(
      temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
      top_p=np.ones(rows, np.float32), seeds=np.zeros(rows, np.int32),
      ban_until=np.zeros(rows, np.int32),
      banned=np.full((rows, sampling_lib.MAX_BANNED), -1, np.int32),
      bias_ids=np.full((rows, max_logit_bias), -1, np.int32),
      bias_values=np.zeros((rows, max_logit_bias), np.float32),
      wants_top=np.zeros(rows, np.int32))


def packed_widths(max_logit_bias: int) -> tuple[int, int]:
  """The column counts of `pack`'s two matrices: `(4 + MAX_BANNED + B, 2 + B)`."""
  return 4 + sampling_lib.MAX_BANNED + max_logit_bias, 2 + max_logit_bias


def pack(rows: SlotState) -> tuple[np.ndarray, np.ndarray]:
  """`rows` (NumPy, U rows) as two matrices, so that an update is two
  arrays to transfer: `(i32[U, 4 + MAX_BANNED + B], f32[U, 2 + B])` --
  `top_k, seeds, ban_until, banned..., bias_ids..., wants_top` and
  `temperature, top_p, bias_values...`."""
  ints = np.concatenate([rows.top_k[:, None], rows.seeds[:, None],
                         rows.ban_until[:, None], rows.banned, rows.bias_ids,
                         rows.wants_top[:, None]], 1)
  floats = np.concatenate([rows.temperature[:, None], rows.top_p[:, None],
                           rows.bias_values], 1)
  return ints.astype(np.int32), floats.astype(np.float32)


def unpack(ints: jax.Array, floats: jax.Array) -> SlotState:
  """The `SlotState` rows that `pack` packed."""
  nban = sampling_lib.MAX_BANNED
  return SlotState(temperature=floats[:, 0], top_k=ints[:, 0], top_p=floats[:, 1],
                   seeds=ints[:, 1], ban_until=ints[:, 2],
                   banned=ints[:, 3:3 + nban], bias_ids=ints[:, 3 + nban:-1],
                   bias_values=floats[:, 2:], wants_top=ints[:, -1])


def write(state: SlotState, slots: jax.Array, ints: jax.Array,
          floats: jax.Array) -> SlotState:
  """`state` with row `slots[i]` set to row `i` of the packed rows (`pack`;
  `slots`: i32[U], -1 = padding, dropped). Jitted in `Runner` with `state`
  donated."""
  idx = jnp.where(slots >= 0, slots, state.temperature.shape[0])  # -1: dropped
  return jax.tree.map(lambda a, r: a.at[idx].set(r, mode="drop"), state,
                      unpack(ints, floats))


@flax.struct.dataclass
class SampleRows:
  """The sampling parameters of a step's sample rows (`S`: the bucket's
  `num_seqs`), gathered from the `SlotState` on the device (`gather`)."""

  temperature: jax.Array  # f32[S]
  top_k: jax.Array  # i32[S]
  top_p: jax.Array  # f32[S]
  seeds: jax.Array  # i32[S]
  positions: jax.Array  # i32[S]  position of the token being sampled
  ban_until: jax.Array  # i32[S]
  banned: jax.Array  # i32[S, MAX_BANNED]  the slot's ids, unmasked (`bans`)
  bias_ids: jax.Array  # i32[S, B]
  bias_values: jax.Array  # f32[S, B]
  # i32[S]: 1 where the row's top log-probs are read; None: every row's are
  # (the step computes them only when some row's are, `step._sample`).
  wants_top: jax.Array | None = None

  def bans(self) -> jax.Array:
    """i32[S, MAX_BANNED]: the ids masked at `positions` (-1 = none)."""
    return jnp.where((self.positions < self.ban_until)[:, None], self.banned, -1)


def gather(state: SlotState, seq_lens: jax.Array, sample_seqs: jax.Array,
           seed_offsets: jax.Array) -> SampleRows:
  """The sample rows' parameters (pure; NumPy or jax arrays).

  Args:
    state: the `SlotState` (`max_seqs` rows).
    seq_lens: i32[max_seqs], the block state's `seq_lens` after the step's
      bookkeeping: the position of a slot's token being sampled.
    sample_seqs: i32[S], the slot each sample row reads, -1 = padding (a
      neutral row: greedy, no ban, no bias).
    seed_offsets: i32[S], added to the slot's seed.
  """
  xp = jnp if isinstance(sample_seqs, jax.Array) else np
  real = sample_seqs >= 0
  sl = xp.maximum(sample_seqs, 0)
  col = real[:, None]
  return SampleRows(
      temperature=xp.where(real, state.temperature[sl], 0.0).astype(np.float32),
      top_k=xp.where(real, state.top_k[sl], 0).astype(np.int32),
      top_p=xp.where(real, state.top_p[sl], 1.0).astype(np.float32),
      seeds=xp.where(real, state.seeds[sl] + seed_offsets, 0).astype(np.int32),
      positions=xp.where(real, seq_lens[sl], 0).astype(np.int32),
      ban_until=xp.where(real, state.ban_until[sl], 0).astype(np.int32),
      banned=xp.where(col, state.banned[sl], -1).astype(np.int32),
      bias_ids=xp.where(col, state.bias_ids[sl], -1).astype(np.int32),
      bias_values=xp.where(col, state.bias_values[sl], 0.0).astype(np.float32),
      wants_top=xp.where(real, state.wants_top[sl], 0).astype(np.int32))


def update_rows(n: int) -> int:
  """The row count an update of `n` changed rows is padded to: the next
  power of two, so the scatter compiles once per size class (what
  `Runner.compile_slot_writes` compiles ahead)."""
  return 1 << max(0, n - 1).bit_length()


class HostSlots:
  """The host's exact copy of one pool's `SlotState` (NumPy), and the rows
  changed since the last `take_updates`.

  Args:
    max_seqs: sequence slots.
    max_logit_bias: `logit_bias` entries per slot.
  """

  def __init__(self, max_seqs: int, max_logit_bias: int):
    # The rows as `pack` sends them, and `state` their column views: an
    # update is two row gathers (`take_updates`), nothing packed per call.
    self._ints, self._floats = pack(empty(max_seqs, max_logit_bias))
    self.state = unpack(self._ints, self._floats)
    self._dirty: set[int] = set()
    self.rows_written = 0  # rows sent to the device so far (tests, stats)

  def bind(self, slot: int, params: sampling_lib.SamplingParams, index: int,
           prompt_len: int, stop_ids: frozenset[int]):
    """Writes the row of a sequence (sample `index` of a request with
    `params`, `prompt_len` prompt tokens, `stop_ids` banned by `min_tokens`)
    taking `slot`; it goes to the device with the next update."""
    s = self.state
    s.temperature[slot] = 0.0 if params.beam_width > 1 else params.temperature
    s.top_k[slot] = params.top_k
    s.top_p[slot] = params.top_p
    s.seeds[slot] = params.seed + index
    s.ban_until[slot] = prompt_len + params.min_tokens if params.min_tokens else 0
    s.banned[slot] = -1
    if params.min_tokens:
      ban = sorted(stop_ids)
      s.banned[slot, :len(ban)] = ban
    if s.bias_ids.shape[1]:
      s.bias_ids[slot] = -1
      s.bias_values[slot] = 0.0
      if params.logit_bias:
        nb = len(params.logit_bias)
        s.bias_ids[slot, :nb] = [t for t, _ in params.logit_bias]
        s.bias_values[slot, :nb] = [b for _, b in params.logit_bias]
    s.wants_top[slot] = int(bool(params.logprobs) or params.beam_width > 1)
    self._dirty.add(slot)

  @property
  def num_pending(self) -> int:
    """Rows written since the last `take_updates`."""
    return len(self._dirty)

  def take_updates(self, rows: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`(slots i32[U], ints, floats)`: the rows changed since the last call
    (None if none), packed (`pack`), padded with slot -1 to `rows` (default:
    the next power of two, so the scatter compiles once per size class)."""
    if not self._dirty and rows is None:
      return None
    slots = sorted(self._dirty)
    n = len(slots)
    self._dirty.clear()
    self.rows_written += n
    u = update_rows(n) if rows is None else rows
    sl = np.array(slots + [0] * (u - n), np.intp)  # padding reads row 0
    return (np.array(slots + [-1] * (u - n), np.int32), self._ints[sl],
            self._floats[sl])
