"""The Llama decoder and the engine on 8 simulated CPU devices.

Every `(data, model)` mesh that divides 8: the tensor-parallel model with
per-data-shard pools gives the single-device logits, the compiled step moves
no K/V pages between devices, and the engine serves the same tokens as on one
device with each step compiled once.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from paged_jax.models.llama import model as model_lib
from paged_jax.models.llama import tensor_parallel
from paged_jax.serving.engine import Engine, EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams
from paged_jax import block_manager as bm
from paged_jax import flax_attention
from paged_jax import sharding as ps
from tests.examples.conftest import (assert_mirror_is_the_device_state,
                                     random_requests, serve)

# Every mesh that divides 8 devices; by default one of each kind (tensor
# parallel alone, data parallel alone, both), the rest under `-m slow`
# (each compiles its own sharded step: ~10 s).
DEFAULT_MESHES = {(1, 8), (8, 1), (2, 4)}
MESHES = [(d, m) if (d, m) in DEFAULT_MESHES else pytest.param(d, m, marks=pytest.mark.slow)
          for d in (1, 2, 4, 8) for m in (1, 2, 4, 8) if d * m <= 8]
BS, BLOCKS, SEQS, T = 4, 16, 2, 16

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices: run with "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py)")


@pytest.fixture(scope="module")
def model8():
  """8 query heads (so the model axis can be 8), 2 KV heads (replicated for
  model > 2)."""
  return model_lib.init_model(
      model_lib.LlamaConfig.tiny(num_heads=8, num_kv_heads=2), seed=1)


def collectives(hlo: str) -> list[tuple[str, str]]:
  """`(result shape, op)` of every cross-device collective in compiled HLO."""
  ops = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
  return re.findall(rf"= (\S+) ({ops})(?:-start)?\(", hlo)


def _rank(shape: str) -> int:
  dims = re.search(r"\[([^\]]*)\]", shape).group(1)
  return len([d for d in dims.split(",") if d])


def _prefill_then_decode(mesh, model, prompts):
  """One mixed step with every shard's prompts, then one decode step.

  Returns:
    `(prefill logits [data, T, vocab], decode logits [data, SEQS, vocab],
    cache, states, compiled prefill HLO)`.
  """
  data = mesh.shape[ps.DATA]
  sharded = tensor_parallel.shard_model(model, mesh)
  c = sharded.config
  cache = ps.create_cache(mesh, num_layers=c.num_layers,
                          num_kv_heads=c.num_kv_heads,
                          num_blocks_per_shard=BLOCKS, block_size=BS,
                          head_dim=c.head_dim, dtype=jnp.float32)
  states = ps.init_block_states(mesh, num_blocks_per_shard=BLOCKS,
                                block_size=BS, max_seqs_per_shard=SEQS,
                                max_blocks_per_seq=BLOCKS)
  graphdef, params = nnx.split(sharded)

  def step(params, cache, states, tokens, q_lens, decode_only):
    mdl = nnx.merge(graphdef, params)
    seq_ids = jnp.broadcast_to(jnp.arange(SEQS, dtype=jnp.int32), q_lens.shape)
    states, res = jax.vmap(bm.reserve)(states, seq_ids, q_lens)
    meta = flax_attention.sharded_step_metadata(
        mesh, states, seq_ids, q_lens, num_tokens=tokens.shape[1],
        active=res.ok, decode_only=decode_only)
    hidden, cache = mdl.paged_forward(tokens.reshape(-1), meta, cache)
    return mdl.logits(hidden).reshape(data, tokens.shape[1], -1), cache, states

  step = jax.jit(step, static_argnums=5, donate_argnums=(1, 2))
  tokens = np.zeros((data, T), np.int32)
  q_lens = np.zeros((data, SEQS), np.int32)
  for i, shard in enumerate(prompts):
    flat = [t for p in shard for t in p]
    tokens[i, :len(flat)] = flat
    q_lens[i] = [len(p) for p in shard]
  hlo = step.lower(params, cache, states, tokens, q_lens, False).compile().as_text()
  pre, cache, states = step(params, cache, states, tokens, q_lens, False)
  nxt = np.asarray(jnp.argmax(pre, -1))
  last = np.cumsum(q_lens, axis=1) - 1
  dec_tokens = np.take_along_axis(nxt, last, axis=1).astype(np.int32)
  dec, cache, states = step(params, cache, states, dec_tokens,
                            np.ones((data, SEQS), np.int32), True)
  return pre, dec, dec_tokens, cache, states, hlo, sharded


@pytest.mark.parametrize("data, model", MESHES)
def test_sharded_model_equals_single_device(model8, data, model):
  mesh = ps.make_mesh(data, model)
  rng = np.random.default_rng(data * 10 + model)
  prompts = [[rng.integers(3, 512, int(n)).tolist() for n in rng.integers(1, 9, SEQS)]
             for _ in range(data)]
  pre, dec, dec_tokens, cache, states, hlo, sharded = _prefill_then_decode(
      mesh, model8, prompts)

  # Same logits as the unsharded model's dense forward (one padded batch;
  # causal attention keeps the padding out of the real positions).
  seqs = [p + [int(dec_tokens[i, j])] for i, shard in enumerate(prompts)
          for j, p in enumerate(shard)]
  padded = np.zeros((len(seqs), 10), np.int32)
  for k, sq in enumerate(seqs):
    padded[k, :len(sq)] = sq
  want = np.asarray(jax.jit(model_lib.Llama.dense_logits)(model8, padded))
  k = 0
  for i, shard in enumerate(prompts):
    row = 0
    for j, p in enumerate(shard):
      np.testing.assert_allclose(pre[i, row:row + len(p)], want[k, :len(p)],
                                 rtol=2e-5, atol=2e-5)
      np.testing.assert_allclose(dec[i, j], want[k, len(p)], rtol=2e-5, atol=2e-5)
      row += len(p)
      k += 1

  # The layout: cache over (model, data), one block state per data shard,
  # tensor-parallel weights.
  heads = ps.cache_kv_heads(2, model)
  assert cache.k_pages.shape == (2, heads, data * BLOCKS, BS, 16)
  assert cache.k_pages.sharding.is_equivalent_to(
      NamedSharding(mesh, ps.cache_spec()), 5)
  per_device = ps.per_device_cache_bytes(cache)
  assert len(per_device) == data * model
  assert set(per_device.values()) == {cache.nbytes // (data * model)}
  if data > 1:
    assert states.refcounts.sharding.is_equivalent_to(
        NamedSharding(mesh, P(ps.DATA)), 2)
  q_kernel = sharded.layers.self_attn.q_proj.kernel.get_value()  # [layers, in, out]
  assert q_kernel.sharding.is_equivalent_to(
      NamedSharding(mesh, P(None, None, ps.MODEL)), 3)
  assert sharded.config.num_kv_heads == heads

  # No K/V pages cross devices: without tensor parallelism nothing does; with
  # it only the per-layer activations' reductions (2-D) do.
  found = collectives(hlo)
  if model == 1:
    assert not found, found
  else:
    assert found and all(_rank(shape) <= 3 for shape, _ in found), found


ENGINE_SIZES = dict(num_blocks=24, block_size=BS, max_batch=4,
                    max_tokens_per_step=16, max_model_len=64,
                    min_bucket=16)  # 2 step shapes: decode 4, mixed 16


def _engine_requests():
  requests = random_requests(5, 10, prompt=(3, 20), new=(2, 12))
  # Repeats of earlier prompts: prefix-cache hits when caching is on.
  requests += [Request(f"again{r.request_id}", list(r.prompt), r.params)
               for r in requests[:3]]  # (request i goes to data shard i % 2)
  requests.append(Request("n2", list(range(40, 50)), SamplingParams(
      n=2, temperature=0.8, top_k=20, seed=3, max_new_tokens=8)))
  return requests


@pytest.fixture(scope="module")
def one_device_outputs(model8):
  return serve(Engine(model8, EngineConfig(**ENGINE_SIZES)), _engine_requests())


@pytest.mark.parametrize("data, model, caching", [
    (2, 4, True)] + [pytest.param(*p, marks=pytest.mark.slow) for p in [
        (2, 4, False), (2, 1, True), (8, 1, False), (1, 8, False)]])
def test_sharded_engine_serves_what_one_device_serves(model8, one_device_outputs,
                                                     data, model, caching):
  requests, sizes, want = _engine_requests(), ENGINE_SIZES, one_device_outputs
  mesh = ps.make_mesh(data, model)
  engine = Engine(model8, EngineConfig(check_traces=True, **sizes,
                                       enable_prefix_caching=caching), mesh=mesh)
  got = serve(engine, requests)
  if caching:  # each data shard caches in its own pool
    assert engine.stats.prefix_hit_tokens > 0
    for pool in engine._pools:  # pylint: disable=protected-access
      pool.check_prefix_index()
  assert {k: o.completions for k, o in got.items()} == {
      k: o.completions for k, o in want.items()}
  assert engine.data_shards == data
  assert engine.stats.decode_steps > 1 and engine.stats.mixed_steps > 1
  # Every data shard's pool is back to empty and consistent.
  for i in range(data):
    state = jax.tree.map(lambda x, i=i: x[i], engine.block_state)
    bm.check_invariants(state)
    assert int(state.num_free) + int(state.num_cached or 0) == sizes["num_blocks"]
    assert int(state.num_used) == 0
  assert_mirror_is_the_device_state(engine)
  assert engine.cache.k_pages.sharding.is_equivalent_to(
      NamedSharding(mesh, ps.cache_spec()), 5)
  # The whole step (bookkeeping, copy-on-write, writes, attention, sampling)
  # moves no K/V pages between devices: data shards never talk to each other,
  # and tensor parallelism only reduces activations and gathers the logits.
  # The largest step of each kind: the decode step is read from the
  # executable the engine compiled and ran (`lower_step(True).compile()`
  # lacks the engine's decode compile options, `compiler.compiler_options`:
  # another program, compiled again for ~3 s); the mixed step through
  # `lower_step` (the same program: a persistent-cache hit).
  for decode_only in (True, False):
    if decode_only:
      step = engine._runner._steps[engine._largest(True)]  # pylint: disable=protected-access
    else:
      step = engine.lower_step(False).compile()
    found = collectives(step.as_text())
    if caching:
      # The eviction loop (`block_manager._evict`, a while loop) is vmapped
      # over the data shards: its scalar condition is or-ed across them, the
      # one collective caching adds (no K/V, no block state moves).
      found = [f for f in found if f != ("pred[]", "all-reduce")]
    if model == 1:
      assert not found, found
    else:
      assert found and all(_rank(shape) <= 3 for shape, _ in found), found


def test_mesh_errors(model8):
  tiny = model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)  # 4 heads
  with pytest.raises(ValueError, match=r"num_heads=4 must be a multiple of "
                     r"the model axis \(8\)"):
    tensor_parallel.shard_model(tiny, ps.make_mesh(1, 8))
  three = model_lib.LlamaConfig.tiny(num_heads=6, num_kv_heads=3)
  with pytest.raises(ValueError, match=r"num_kv_heads=3 and the model axis "
                     r"\(2\) must divide one another"):
    tensor_parallel.check_model_axis(three, 2)
  with pytest.raises(ValueError, match="seq_ids must be"):
    mesh = ps.make_mesh(2, 1)
    states = ps.init_block_states(mesh, num_blocks_per_shard=4, block_size=4,
                                  max_seqs_per_shard=2, max_blocks_per_seq=2)
    flax_attention.sharded_step_metadata(mesh, states, jnp.zeros((3, 2)),
                                         jnp.zeros((3, 2)), num_tokens=2)


def test_param_specs():
  spec = tensor_parallel.param_spec
  assert spec(("layers", 0, "self_attn", "q_proj", "kernel"), (64, 128), 4) == P(None, "model")
  assert spec(("layers", 0, "self_attn", "q_proj", "bias"), (128,), 4) == P("model")
  assert spec(("layers", 0, "self_attn", "o_proj", "kernel"), (128, 64), 4) == P("model", None)
  assert spec(("layers", 0, "self_attn", "o_proj", "bias"), (64,), 4) == P()
  assert spec(("layers", 0, "mlp", "down_proj", "kernel"), (192, 64), 4) == P("model", None)
  assert spec(("layers", 0, "mlp", "gate_proj", "kernel"), (64, 190), 4) == P()  # uneven
  assert spec(("embed_tokens", "embedding"), (512, 64), 4) == P("model", None)
  assert spec(("lm_head", "kernel"), (64, 512), 4) == P(None, "model")
  assert spec(("norm", "weight"), (64,), 4) == P()
  assert spec(("layers", 0, "input_layernorm", "weight"), (64,), 4) == P()
  # Stacked layers (the model's own paths): the leading layer axis is never split.
  assert spec(("layers", "self_attn", "q_proj", "kernel"), (2, 64, 128), 4) == P(None, None, "model")
  assert spec(("layers", "self_attn", "o_proj", "kernel"), (2, 128, 64), 4) == P(None, "model", None)
  assert spec(("layers", "self_attn", "k_proj", "bias"), (2, 128), 4) == P(None, "model")
  assert spec(("layers", "mlp", "down_proj", "kernel"), (2, 192, 64), 4) == P(None, "model", None)
