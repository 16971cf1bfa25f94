"""Speculative decoding end to end below the engine: a toy one-layer model
decodes through the paged KV cache and ragged attention, with lookahead
(`reserve(1 + k)`), verification (`greedy_accept`) and rollback (`truncate`),
a fork sharing a partial block (copy-on-write), and every empty block
NaN-poisoned after every step. Its greedy output equals plain decoding's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention
from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax import speculative as spec

VOCAB, DIM, Q_HEADS, KV_HEADS, HEAD_DIM = 13, 16, 2, 1, 8
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, WIDTH = 4, 24, 4, 8
K, NEW_TOKENS = 3, 18
ROWS = MAX_SEQS * (K + 1) + 8  # padded query rows: one compiled shape

_rng = np.random.default_rng(0)
_PARAMS = {name: jnp.asarray(_rng.standard_normal(shape) * scale, jnp.float32)
           for name, shape, scale in (
               ("embed", (VOCAB, DIM), 1.0), ("pos", (64, DIM), 1.0),
               ("wq", (DIM, Q_HEADS * HEAD_DIM), 0.5),
               ("wk", (DIM, KV_HEADS * HEAD_DIM), 0.5),
               ("wv", (DIM, KV_HEADS * HEAD_DIM), 0.5),
               ("wo", (Q_HEADS * HEAD_DIM, VOCAB), 1.0))}


@jax.jit
def _forward(k_pages, v_pages, tables, kv_lens, cu_q_lens, tokens, positions,
             slots):
  p = _PARAMS
  x = p["embed"][tokens] + p["pos"][positions]
  q = (x @ p["wq"]).reshape(ROWS, Q_HEADS, HEAD_DIM)
  k = (x @ p["wk"]).reshape(ROWS, KV_HEADS, HEAD_DIM)
  v = (x @ p["wv"]).reshape(ROWS, KV_HEADS, HEAD_DIM)
  k_pages, v_pages = kv_cache.write_kv(k_pages, v_pages, k, v, slots)
  out = attention.ragged_paged_attention(
      q, k_pages, v_pages, tables, kv_lens, cu_q_lens,
      jnp.array([MAX_SEQS], jnp.int32))
  logits = out.reshape(ROWS, Q_HEADS * HEAD_DIM) @ p["wo"]
  return k_pages, v_pages, jnp.argmax(logits, axis=-1).astype(jnp.int32)


# The block manager's calls as one compiled program per input shape each (they
# are pure and jittable; called eagerly, each of their ops compiled per shape
# and each eager `lax.cond` per call: ~600 small compiles in all). The
# verification is the same `greedy_accept`, compiled.
(_reserve, _slot_mapping, _gather_tables, _fork, _truncate, _release,
 _greedy_accept) = (jax.jit(f) for f in (
     bm.reserve, bm.slot_mapping, bm.gather_tables, bm.fork, bm.truncate,
     bm.release, spec.greedy_accept))


@jax.jit
def _poisoned(pages, free):
  """`pages` with every block where `free` (`bool[NUM_BLOCKS]`) is set NaN."""
  return jnp.where(free[None, :, None, None], jnp.nan, pages)


class _Pool:
  """The pool, the pages and one forward step over any rows."""

  def __init__(self):
    self.state = bm.init(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         max_seqs=MAX_SEQS, max_blocks_per_seq=WIDTH)
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    self.k = jnp.zeros(shape, jnp.float32)
    self.v = jnp.zeros(shape, jnp.float32)

  def step(self, rows: dict[int, list[int]]) -> dict[int, list[int]]:
    """Reserves `len(rows[s])` slots for each sequence `s`, writes and attends
    its rows, returns the target's greedy token after each row."""
    ids = sorted(rows)
    old = np.asarray(self.state.seq_lens).copy()
    self.state, res = _reserve(self.state, jnp.array(ids),
                               jnp.array([len(rows[s]) for s in ids]))
    assert all(res.ok.tolist()), (res.ok, rows, self.state.seq_lens,
                                  self.state.num_free)
    for src, dst in zip(res.copy_src.tolist(), res.copy_dst.tolist()):
      if src >= 0:  # copy-on-write
        self.k = self.k.at[:, dst].set(self.k[:, src])
        self.v = self.v.at[:, dst].set(self.v[:, src])
    q_lens = np.zeros(MAX_SEQS, np.int32)
    tokens, positions, seq_of = [], [], []
    for s in ids:
      q_lens[s] = len(rows[s])
      tokens += rows[s]
      positions += list(range(old[s], old[s] + len(rows[s])))
      seq_of += [s] * len(rows[s])
    pad = ROWS - len(tokens)
    # Padded to ROWS rows (one shape): a -1 id maps to slot -1.
    slots = np.asarray(_slot_mapping(
        self.state, jnp.array(seq_of + [-1] * pad),
        jnp.array(positions + [0] * pad)))
    assert np.all(slots[:len(tokens)] >= 0)
    assert np.all(slots[len(tokens):] == -1)
    slots = slots[:len(tokens)]
    # Rows in slot order, as cu_q_lens says.
    tables, kv_lens = _gather_tables(self.state, jnp.arange(MAX_SEQS))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    self.k, self.v, argmax = _forward(
        self.k, self.v, tables, kv_lens, jnp.asarray(cu),
        jnp.asarray(tokens + [0] * pad, jnp.int32),
        jnp.asarray(positions + [0] * pad, jnp.int32),
        jnp.asarray(np.concatenate([slots, np.full(pad, -1)]), jnp.int32))
    argmax = np.asarray(argmax).tolist()
    out, at = {}, 0
    for s in ids:
      out[s] = argmax[at:at + len(rows[s])]
      at += len(rows[s])
    return out

  def poison_empty_blocks(self):
    free = np.zeros(NUM_BLOCKS, bool)
    free[np.asarray(self.state.free_stack)[:int(self.state.num_free)]] = True
    self.k = _poisoned(self.k, jnp.asarray(free))
    self.v = _poisoned(self.v, jnp.asarray(free))
    bm.check_invariants(self.state)


def _start(pool):
  """Prefills two prompts, forks the first after its prefill (the child
  shares its partial block), returns each sequence's first token."""
  prompts = {0: [1, 2, 3, 1, 2, 3], 2: [5, 4, 7, 9, 4, 7, 9]}
  out = pool.step(prompts)
  pool.state, ok = _fork(pool.state, jnp.array([0]), jnp.array([1]))
  assert ok.tolist() == [True]
  pool.poison_empty_blocks()
  return {0: out[0][-1], 1: out[0][-1], 2: out[2][-1]}


def _plain():
  pool = _Pool()
  last = _start(pool)
  gen = {s: [t] for s, t in last.items()}
  while min(len(g) for g in gen.values()) < NEW_TOKENS:
    out = pool.step({s: [g[-1]] for s, g in gen.items()
                     if len(g) < NEW_TOKENS})
    for s in out:
      gen[s].append(out[s][0])
    pool.poison_empty_blocks()
  return {s: g[:NEW_TOKENS] for s, g in gen.items()}


def _speculative(oracle, rng):
  """Drafts: the true continuation (from `oracle`) with a third of the tokens
  corrupted, 0..K per sequence and step."""
  pool = _Pool()
  last = _start(pool)
  gen = {s: [t] for s, t in last.items()}
  proposed = accepted_total = 0
  while min(len(g) for g in gen.values()) < NEW_TOKENS:
    drafts = {}
    for s, g in gen.items():
      if len(g) >= NEW_TOKENS:
        continue
      true = oracle[s][len(g):len(g) + K] + [0] * K
      d = int(rng.integers(0, K + 1))
      drafts[s] = [t if rng.random() < 2 / 3 else int(rng.integers(VOCAB))
                   for t in true[:d]]
    ids = sorted(drafts)
    old = np.asarray(pool.state.seq_lens)[ids]
    out = pool.step({s: [gen[s][-1]] + drafts[s] for s in ids})
    draft = np.full((len(ids), K), -1)
    target = np.zeros((len(ids), K + 1), np.int64)
    for i, s in enumerate(ids):
      draft[i, :len(drafts[s])] = drafts[s]
      target[i, :len(out[s])] = out[s]
    tokens, accepted = map(np.asarray, _greedy_accept(
        jnp.asarray(draft, jnp.int32), jnp.asarray(target, jnp.int32),
        jnp.array([len(drafts[s]) for s in ids])))
    pool.state, ok = _truncate(pool.state, jnp.array(ids),
                               jnp.asarray(old + 1 + accepted))
    assert all(ok.tolist())
    for i, s in enumerate(ids):
      gen[s] += tokens[i, :accepted[i] + 1].tolist()
    proposed += sum(len(d) for d in drafts.values())
    accepted_total += int(accepted.sum())
    pool.poison_empty_blocks()
  pool.state, ok = _release(pool.state, jnp.array(sorted(gen)))
  assert int(pool.state.num_free) == NUM_BLOCKS  # every block returns
  return {s: g[:NEW_TOKENS] for s, g in gen.items()}, proposed, accepted_total


def test_speculative_greedy_decoding_equals_plain_decoding():
  want = _plain()
  assert len(set(map(tuple, want.values()))) == 2  # 0 and its fork agree
  oracle = {s: g + [0] * (K + 1) for s, g in want.items()}
  got, proposed, accepted = _speculative(oracle, np.random.default_rng(1))
  assert got == want
  assert 0 < accepted < proposed  # accepted and rejected drafts both seen
