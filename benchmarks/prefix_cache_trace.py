"""Prefix-cache hit rates on the real Mooncake conversation trace (no model).

The trace's `hash_ids` carry the real sharing structure of multi-turn chat:
one id per 512-token prompt block, equal ids at equal positions meaning equal
tokens. Scaled down, each hash id becomes a fixed seeded run of
`--tokens-per-hash` token ids (16 by default: lengths / 32), so shared ids give
shared tokens, and the prompts go through the real machinery: the host index
(`paged_jax.prefix_cache.PrefixIndex`: chained hashes, longest-prefix match
that leaves the last token to compute) and the jitted block-manager ops
(`share` on a hit, `reserve`, `register` of the full prompt blocks, `release`,
evictions reported by `reserve` and dropped from the index). No model runs.

Time follows the trace: a request arrives at its `timestamp`, is admitted
when a sequence slot and its blocks are free (FIFO), holds its prompt plus
its scaled output for `output_length * --ms-per-token` ms, then is released
(its registered blocks become cached, evictable least recently released
first). Figures per pool size:

* `ideal`: the unbounded-cache hit rate, computed from the ids alone (a
  block hits when its whole prefix was in an earlier prompt), with the last
  prompt token always computed; `trace ideal` counts every 512-token block as
  the trace's README does (36.6% over the full trace);
* `hit rate`: prompt tokens served from the cache / prompt tokens (vLLM's
  `prefix_cache_hit_rate`), and the same in blocks; evictions, waiting.

  PYTHONPATH=. python -m benchmarks.prefix_cache_trace [--quick]
"""

from __future__ import annotations

import collections
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from paged_jax import block_manager as bm
from paged_jax import prefix_cache

TRACE = pathlib.Path(__file__).parent / "data" / "mooncake_conversation_first2000.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the trace


def load(path=TRACE, limit=None):
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return rows[:limit] if limit else rows


class Scaled:
  """The trace scaled down: prompts as token ids, output lengths in tokens."""

  def __init__(self, rows, tokens_per_hash: int, seed: int = 0):
    self.scale = TRACE_BLOCK // tokens_per_hash
    self.rows = rows
    self.tph = tokens_per_hash
    self._runs = {}
    self._seed = seed

  def _run(self, hash_id):
    run = self._runs.get(hash_id)
    if run is None:
      rng = np.random.default_rng([self._seed, hash_id])
      run = self._runs[hash_id] = rng.integers(0, 32000, self.tph)
    return run

  def prompt(self, i):
    r = self.rows[i]
    n = max(1, math.ceil(r["input_length"] / self.scale))
    ids = np.concatenate([self._run(h) for h in r["hash_ids"]])[:n]
    return ids

  def output_len(self, i):
    return max(1, math.ceil(self.rows[i]["output_length"] / self.scale))


def ideal_hits(prompt, block_size: int, seen: set) -> int:
  """Blocks of `prompt` an unbounded cache serves (its longest prefix of full
  blocks seen in an earlier prompt, its last token always computed); adds
  its blocks to `seen`."""
  full = len(prompt) // block_size
  chains = [tuple(prompt[:(j + 1) * block_size]) for j in range(full)]
  limit = prefix_cache.max_hit_blocks(len(prompt), block_size)
  hits = 0
  while hits < limit and chains[hits] in seen:
    hits += 1
  seen.update(chains)
  return hits


def ideal(scaled: Scaled, block_size: int) -> dict:
  """Unbounded-cache hit rates from the ids alone."""
  seen_ids, seen_chains = set(), set()
  trace_hits = trace_blocks = hit_tok = prompt_tok = hit_blk = prompt_blk = 0
  for i, r in enumerate(scaled.rows):
    ids = r["hash_ids"]
    trace_blocks += len(ids)
    trace_hits += sum(h in seen_ids for h in ids)
    seen_ids.update(ids)
    prompt = scaled.prompt(i)
    full = len(prompt) // block_size
    hits = ideal_hits(prompt, block_size, seen_chains)
    hit_blk += hits
    prompt_blk += full
    hit_tok += hits * block_size
    prompt_tok += len(prompt)
  return {"trace_block_hit_rate": trace_hits / trace_blocks,
          "token_hit_rate": hit_tok / prompt_tok,
          "block_hit_rate": hit_blk / max(prompt_blk, 1),
          "prompt_tokens": prompt_tok}


def simulate(scaled: Scaled, *, num_blocks: int, block_size: int,
             max_seqs: int, ms_per_token: float, check_every: int = 500) -> dict:
  """The block manager and the index on the trace's arrivals."""
  n = len(scaled.rows)
  prompts = [scaled.prompt(i) for i in range(n)]
  width = max(-(-(len(p) + scaled.output_len(i)) // block_size)
              for i, p in enumerate(prompts))
  state = bm.init(num_blocks=num_blocks, block_size=block_size,
                  max_seqs=max_seqs, max_blocks_per_seq=width,
                  prefix_caching=True)
  index = prefix_cache.PrefixIndex(block_size)
  share = jax.jit(bm.share, donate_argnums=0)
  reserve = jax.jit(bm.reserve, donate_argnums=0)
  register = jax.jit(bm.register, donate_argnums=0)
  release = jax.jit(bm.release, donate_argnums=0)
  pad = np.full(width, -1, np.int32)
  free_slots = list(range(max_seqs))
  running = []  # (end time ms, slot)
  waiting = collections.deque()
  stats = collections.Counter()
  max_waiting = 0

  def admit(i, now):
    nonlocal state
    prompt = prompts[i]
    if -(-(len(prompt) + scaled.output_len(i)) // block_size) > num_blocks:
      raise ValueError(f"request {i} needs more than num_blocks={num_blocks}")
    hashes = index.block_hashes(prompt)
    hit = index.lookup(hashes[:prefix_cache.max_hit_blocks(len(prompt),
                                                           block_size)])
    slot = free_slots[-1]
    if hit:
      row = pad.copy()
      row[:len(hit)] = hit
      state, ok = share(state, jnp.array([slot], jnp.int32),
                        jnp.asarray(row[None]), jnp.array([len(hit)], jnp.int32))
      assert bool(ok[0])
    need = len(prompt) + scaled.output_len(i) - len(hit) * block_size
    state, res = reserve(state, jnp.array([slot], jnp.int32),
                         jnp.array([need], jnp.int32))
    if not bool(res.ok[0]):  # not enough blocks now: undo the hit, wait
      if hit:
        state, _ = release(state, jnp.array([slot], jnp.int32))
      return False
    free_slots.pop()
    evicted = np.asarray(res.evicted)
    stats["evicted_blocks"] += index.evict(evicted)
    # The prefill writes the prompt; then its full blocks register.
    row = np.asarray(state.block_tables[slot])
    cols = [c for c, h in enumerate(hashes) if index.insert(h, row[c])]
    stats["registered_blocks"] += len(cols)
    sids, ccols = pad.copy(), pad.copy()
    sids[:len(cols)], ccols[:len(cols)] = slot, cols
    state, _ = register(state, jnp.asarray(sids), jnp.asarray(ccols))
    stats["hit_tokens"] += len(hit) * block_size
    stats["hit_blocks"] += len(hit)
    stats["prompt_tokens"] += len(prompt)
    stats["prompt_blocks"] += len(prompt) // block_size
    stats["admitted"] += 1
    end = now + scaled.rows[i]["output_length"] * ms_per_token
    running.append((end, slot))
    return True

  def finish_until(t):
    nonlocal state
    running.sort()
    while running and running[0][0] <= t:
      end, slot = running.pop(0)
      state, _ = release(state, jnp.array([slot], jnp.int32))
      free_slots.append(slot)
      drain(end)

  def drain(now):
    nonlocal max_waiting
    while waiting and free_slots and admit(waiting[0], now):
      waiting.popleft()
    max_waiting = max(max_waiting, len(waiting))

  for i, r in enumerate(scaled.rows):
    finish_until(r["timestamp"])
    waiting.append(i)
    drain(r["timestamp"])
    if check_every and i % check_every == check_every - 1:
      bm.check_invariants(state)
      prefix_cache.check_consistent(index, state)
  while waiting or running:
    if not running:
      raise RuntimeError("a waiting request can never be admitted")
    finish_until(min(e for e, _ in running))
  bm.check_invariants(state)
  prefix_cache.check_consistent(index, state)
  assert stats["admitted"] == n
  return {
      "num_blocks": num_blocks,
      "token_hit_rate": stats["hit_tokens"] / stats["prompt_tokens"],
      "block_hit_rate": stats["hit_blocks"] / max(stats["prompt_blocks"], 1),
      "prefill_tokens_saved": stats["hit_tokens"],
      "evicted_blocks": stats["evicted_blocks"],
      "registered_blocks": stats["registered_blocks"],
      "cached_blocks_at_end": int(state.num_cached),
      "max_waiting": max_waiting,
  }


def main():
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument("--requests", type=int, default=2000)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--tokens-per-hash", type=int, default=16)
  p.add_argument("--max-seqs", type=int, default=64)
  p.add_argument("--ms-per-token", type=float, default=20.0)
  p.add_argument("--pools", type=int, nargs="*",
                 default=[1024, 2048, 4096, 8192, 32768, 131072])
  args = p.parse_args()
  if args.quick:
    args.requests, args.pools = 150, [512, 4096]
  scaled = Scaled(load(limit=args.requests), args.tokens_per_hash)
  best = ideal(scaled, args.block_size)
  print(f"{args.requests} requests, {args.tokens_per_hash} tokens per 512-token "
        f"hash block, block_size {args.block_size}: {best['prompt_tokens']} "
        f"prompt tokens")
  print(f"ideal (unbounded): trace blocks {best['trace_block_hit_rate']:.1%}, "
        f"tokens {best['token_hit_rate']:.1%}, blocks "
        f"{best['block_hit_rate']:.1%}")
  runs = []
  for num_blocks in args.pools:
    r = simulate(scaled, num_blocks=num_blocks, block_size=args.block_size,
                 max_seqs=args.max_seqs, ms_per_token=args.ms_per_token)
    r["fraction_of_ideal"] = r["token_hit_rate"] / best["token_hit_rate"]
    runs.append(r)
    print(f"pool {num_blocks:>6} blocks: hit rate {r['token_hit_rate']:.1%} "
          f"tokens ({r['fraction_of_ideal']:.1%} of ideal), "
          f"{r['block_hit_rate']:.1%} blocks; {r['prefill_tokens_saved']} "
          f"prefill tokens saved; {r['evicted_blocks']} evicted; "
          f"max waiting {r['max_waiting']}")
  path = common.write_json(args.out, "prefix_cache_trace", {
      "args": {k: v for k, v in vars(args).items() if k != "out"}
      | {"out": str(args.out)},
      "ideal": best, "runs": runs}, quick=args.quick)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
