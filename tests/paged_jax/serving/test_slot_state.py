"""The per-slot sampling state on the device (`slot_state.py`).

Randomised engine runs (the stub model; admissions, prompts with `n`
samples that fork, beams, aborts, finishes) check after every step that:

* the device's `SlotState` row of every live sequence is what the request
  asks for, built from scratch from its `SamplingParams` (the rows the old
  engine packed into every step);
* each sample row's parameters as the device step gathers them
  (`step.sample_rows`: its slot's row, the position from `seq_lens` after
  the step's bookkeeping) equal the per-row arrays the old engine built on
  the host from the plan (position = tokens cached + this step's, seed =
  seed + sample index, the `min_tokens` bans below the prompt + min_tokens).

And that a steady decode step writes no slot row, an admission or a fork
writes exactly its rows, and a step with nothing to compute runs no model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import stub_model
from paged_jax.serving import sampling as sampling_lib
from paged_jax.serving import slot_state
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.runner import Runner
from paged_jax.serving.sampling import SamplingParams
from paged_jax.serving.scheduler import Scheduler

NB = 3  # max_logit_bias
MODEL = stub_model.StubModel()
VOCAB = MODEL.config.vocab_size


def _engine(**kw) -> Engine:
  cfg = dict(num_blocks=48, block_size=4, max_batch=4, max_tokens_per_step=16,
             max_model_len=64, min_bucket=2, bucket_midpoints=False,
             max_logit_bias=NB, max_beam_width=2)
  return Engine(MODEL, EngineConfig(**{**cfg, **kw}))


def _params(rng) -> SamplingParams:
  kind = rng.integers(4)
  common = dict(max_new_tokens=int(rng.integers(1, 9)), seed=int(rng.integers(1000)))
  if kind == 0:
    return SamplingParams(beam_width=2, **common)
  stops = tuple(int(t) for t in rng.choice(VOCAB, size=rng.integers(1, 3), replace=False))
  bias = {int(t): float(rng.uniform(-3, 3))
          for t in rng.choice(VOCAB, size=rng.integers(0, NB + 1), replace=False)}
  return SamplingParams(
      temperature=float(rng.choice([0.0, 0.7, 1.3])), top_k=int(rng.choice([0, 5])),
      top_p=float(rng.choice([1.0, 0.9])), n=int(rng.choice([1, 1, 2])),
      stop_token_ids=stops,
      min_tokens=int(rng.integers(0, min(3, common["max_new_tokens"] + 1))) if kind == 1 else 0,
      logit_bias=bias, ignore_eos=True, logprobs=[None, 0, 2][int(rng.integers(3))],
      **common)


def _want_row(seq, lane: int) -> dict:
  """A sample row's parameters, from scratch (the old per-step packing)."""
  g, p = seq.group, seq.group.params
  return dict(temperature=0.0 if g.is_beam else np.float32(p.temperature),
              top_k=p.top_k, top_p=np.float32(p.top_p), seed=p.seed + lane,
              ban_until=g.prompt_len + p.min_tokens if p.min_tokens else 0,
              banned=sorted(g.eos) if p.min_tokens else [],
              bias=list(p.logit_bias), wants_top=int(g.is_beam or bool(p.logprobs)))


def _check_row(rows, i: int, want: dict, position: int | None):
  assert rows.temperature[i] == want["temperature"]
  assert rows.top_k[i] == want["top_k"] and rows.top_p[i] == want["top_p"]
  assert rows.seeds[i] == want["seed"]
  assert rows.ban_until[i] == want["ban_until"]
  nban = len(want["banned"])
  assert list(rows.banned[i, :nban]) == want["banned"]
  assert (rows.banned[i, nban:] == -1).all()
  nb = len(want["bias"])
  assert list(rows.bias_ids[i, :nb]) == [t for t, _ in want["bias"]]
  np.testing.assert_array_equal(rows.bias_values[i, :nb],
                                np.float32([b for _, b in want["bias"]]))
  assert (rows.bias_ids[i, nb:] == -1).all()
  assert rows.wants_top[i] == want["wants_top"]
  if position is not None:
    assert rows.positions[i] == position
    masked = rows.banned[i] if position < want["ban_until"] else np.full_like(rows.banned[i], -1)
    np.testing.assert_array_equal(np.asarray(rows.bans())[i], masked)


def _record_builds(monkeypatch):
  """Per `build_step` call: the plan's sample rows as the old packing saw
  them, the step's inputs and the host model's `seq_lens` after `_fit`."""
  built = []
  original = Scheduler.build_step

  def build_step(self, plan, bucket):
    rows = []  # (seq, lane, position) per sample row, in row order
    for s, n in plan:
      end = s.num_cached + n
      if end == len(s.tokens):
        g = s.group
        lanes = range(g.params.n) if g.unborn and not g.is_beam else [s.index]
        rows += [(s, lane, end) for lane in lanes]
    seq_lens = self.mirror_state().seq_lens.copy()
    x, pending = original(self, plan, bucket)
    built.append((rows, x, seq_lens))
    return x, pending

  monkeypatch.setattr(Scheduler, "build_step", build_step)
  return built


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_slot_state_matches_the_from_scratch_rows(monkeypatch, seed):
  rng = np.random.default_rng(seed)
  built = _record_builds(monkeypatch)
  engine = _engine()
  pool = engine._pools[0]  # pylint: disable=protected-access
  runner = engine._runner  # pylint: disable=protected-access
  ids = 0
  for _ in range(60):
    if rng.random() < 0.4 or not engine.has_unfinished():
      prompt = rng.integers(0, VOCAB, size=rng.integers(1, 12)).tolist()
      assert engine.add_request(Request(ids, prompt, _params(rng))) is None
      ids += 1
    if rng.random() < 0.05 and ids:
      engine.abort_request(int(rng.integers(ids)))
    before = len(built)
    engine.step()
    # Every live sequence's row, from scratch: on the device, or still to
    # be sent with the next step (a beam's children, bound at resolve).
    on_device = jax.tree.map(lambda a: a[0], runner.slots)  # the one data shard's
    device = jax.tree.map(np.asarray, on_device)
    unsent = pool._slots._dirty  # pylint: disable=protected-access
    for s in pool._running:  # pylint: disable=protected-access
      if s.slot >= 0:
        state = pool._slots.state if s.slot in unsent else device  # pylint: disable=protected-access
        got = jax.tree.map(lambda a, i=s.slot: a[i:i + 1], state)
        _check_row(got, 0, _want_row(s, s.index), None)
    # This step's sample rows, as the device step gathers them.
    for rows, x, seq_lens in built[before:]:
      got = slot_state.gather(on_device, jnp.asarray(seq_lens),
                              jnp.asarray(x.sample_seqs), jnp.asarray(x.seed_offsets))
      got = jax.tree.map(np.asarray, got)
      for i, (s, lane, position) in enumerate(rows):
        _check_row(got, i, _want_row(s, lane), position)
      pad = slice(len(rows), None)  # padding rows: neutral
      assert (got.temperature[pad] == 0).all() and (got.bias_ids[pad] == -1).all()
      assert (got.bans()[pad] == -1).all()
  assert sum(len(rows) for rows, _, _ in built) > 30  # sample rows checked
  engine.run_until_done()


def test_a_steady_decode_step_writes_no_slot_row():
  engine = _engine()
  runner = engine._runner  # pylint: disable=protected-access
  pool = engine._pools[0]  # pylint: disable=protected-access
  for i in range(2):
    engine.add_request(Request(i, [1, 2, 3 + i], SamplingParams(max_new_tokens=12)))
  engine.step()  # admits both: one write of their two rows
  assert runner.slot_writes == 1 and pool._slots.rows_written == 2  # pylint: disable=protected-access
  for _ in range(6):  # steady decode
    engine.step()
  assert runner.slot_writes == 1 and pool._slots.rows_written == 2  # pylint: disable=protected-access
  engine.add_request(Request("n", [4, 5], SamplingParams(n=2, max_new_tokens=3)))
  engine.step()  # its prompt (one row), and its second sample, forked at commit
  assert runner.slot_writes == 2 and pool._slots.rows_written == 4  # pylint: disable=protected-access
  engine.step()  # the fork runs; nothing new to write
  engine.step()
  assert runner.slot_writes == 2
  engine.run_until_done()


def test_a_step_with_nothing_to_compute_runs_no_model(monkeypatch):
  """The sequences that finish at their budget are released by the next
  step: with nothing else to run, that step is its bookkeeping alone (it was
  a model step of the smallest decode bucket, all padding)."""
  dispatched = []
  original = Runner.dispatch

  def dispatch(self, bucket, xs, swaps=None):
    dispatched.append(xs[0])
    return original(self, bucket, xs, swaps)

  monkeypatch.setattr(Runner, "dispatch", dispatch)
  engine = _engine()
  for i in range(2):
    engine.add_request(Request(i, [1, 2, 3 + i], SamplingParams(max_new_tokens=3)))
  outs = engine.run_until_done()
  assert [len(o.completions[0].token_ids) for o in outs] == [3, 3]
  assert all((x.seq_ids >= 0).any() for x in dispatched)  # every model step has an entry
  assert len(dispatched) == 3 and engine.stats.steps == 3
  assert engine.stats.bookkeeping_steps == 1
  assert engine.usage()["blocks_used"] == 0  # the releases ran
  np.testing.assert_array_equal(np.asarray(engine.block_state.seq_lens), 0)


def test_take_updates_pads_to_a_power_of_two_and_clears():
  host = slot_state.HostSlots(max_seqs=8, max_logit_bias=2)
  assert host.take_updates() is None
  p = SamplingParams(temperature=0.5, top_k=3, seed=7, logit_bias={4: 1.5}, min_tokens=1)
  for slot in (5, 1, 6):
    host.bind(slot, p, index=1, prompt_len=3, stop_ids=frozenset({2}))
  slots, ints, floats = host.take_updates()
  assert slots.tolist() == [1, 5, 6, -1] and host.num_pending == 0
  rows = slot_state.unpack(ints, floats)
  assert rows.seeds[:3].tolist() == [8, 8, 8] and rows.bias_ids[0].tolist() == [4, -1]
  assert rows.banned[0].tolist() == [2] + [-1] * (sampling_lib.MAX_BANNED - 1)
  np.testing.assert_array_equal(rows.bias_values[:3], np.float32([[1.5, 0]] * 3))
  assert rows.temperature[0] == np.float32(0.5) and rows.top_p[0] == 1
  assert rows.ban_until[:3].tolist() == [4, 4, 4]
  state = slot_state.write(jax.tree.map(jnp.asarray, slot_state.empty(8, 2)),
                           jnp.asarray(slots), ints, floats)
  np.testing.assert_array_equal(np.asarray(state.top_k), [0, 3, 0, 0, 0, 3, 3, 0])
  assert host.take_updates() is None and host.rows_written == 3
  assert sampling_lib.MAX_BANNED == state.banned.shape[1]


def test_top_logprobs_computed_only_when_a_row_reads_them():
  """`step._sample` runs the vocabulary top-k only when some row wants it
  (`wants_top`, a `lax.cond`); the tokens and their log-probs are the same
  either way, and a row that wants them gets `sampling.top_logprobs`."""
  from paged_jax.serving import step as step_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
  base = slot_state.gather(jax.tree.map(jnp.asarray, slot_state.empty(4, 0)),
                           jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32),
                           jnp.zeros(4, jnp.int32))
  want_lp, want_ids = sampling_lib.top_logprobs(logits, 3)
  sample = jax.jit(step_lib._sample, static_argnums=2)  # pylint: disable=protected-access
  outs = {}
  for wants in ([0, 0, 0, 0], [0, 1, 0, 0], None):
    rows = base.replace(wants_top=None if wants is None else jnp.int32(wants))
    outs[str(wants)] = tok, top_lp, top_ids, tok_lp = sample(logits, rows, 3)
    if wants == [0, 0, 0, 0]:
      assert not np.asarray(top_lp).any() and not np.asarray(top_ids).any()
    else:
      np.testing.assert_array_equal(top_lp, want_lp)
      np.testing.assert_array_equal(top_ids, want_ids)
  for tok, _, _, tok_lp in outs.values():
    np.testing.assert_array_equal(tok, outs["None"][0])
    np.testing.assert_array_equal(tok_lp, outs["None"][3])
  text = sample.lower(logits, base, 3).as_text()
  assert "conditional" in text or "case" in text  # the top-k sits in a branch
