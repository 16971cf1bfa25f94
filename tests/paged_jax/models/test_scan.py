"""The layers under `lax.scan`: one compiled layer whatever the depth, the
donated cache updated in place, paged == dense for every family."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax.models as models
from paged_jax import block_manager as bm
from paged_jax import step_metadata
from tests.paged_jax.models.test_api import FAMILIES, hf_config, random_tensors

BS, BLOCKS = 4, 24


def _step(num_seqs=2, q_len=13):
  state = bm.init(num_blocks=BLOCKS, block_size=BS, max_seqs=num_seqs,
                  max_blocks_per_seq=8)
  seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
  q_lens = jnp.full(num_seqs, q_len, jnp.int32)
  state, _ = bm.reserve(state, seq_ids, q_lens)
  return step_metadata.step_metadata(state, seq_ids, q_lens,
                                     num_tokens=num_seqs * q_len)


def _jitted_forward(model):
  graphdef, params = nnx.split(model)

  def fwd(params, cache, tokens, meta):
    m = nnx.merge(graphdef, params)
    hidden, cache = m.paged_forward(tokens, meta, cache)
    return m.logits(hidden), cache

  return jax.jit(fwd, donate_argnums=1), params


def test_program_does_not_grow_with_depth_and_the_cache_is_aliased():
  meta = _step()
  texts = {}
  for layers in (1, 6):
    model = models.tiny(0, num_layers=layers)
    fwd, params = _jitted_forward(model)
    cache = model.make_cache(BLOCKS, BS)
    lowered = fwd.lower(params, cache, jnp.zeros(26, jnp.int32), meta)
    texts[layers] = lowered.as_text()
    compiled = lowered.compile().as_text()
    header = compiled.splitlines()[0]
    # Both page arrays (the donated cache) alias outputs: updated in place.
    assert header.count("may-alias") >= 2, header[:400]
  # One layer in the program at any depth (only the stacked shapes differ).
  assert len(texts[1].splitlines()) == len(texts[6].splitlines())


def test_hybrid_program_holds_one_period_whatever_the_depth():
  # Gemma 3-like 2 local : 1 global: the scan body holds one period (3
  # layers, each with its static window), so 3 and 9 layers give the same
  # program; a partial period (5 = 3 + 2) adds its 2 layers once, unrolled.
  meta = _step()
  lines = {}
  for layers in (3, 9, 5):
    cfg = hf_config("Gemma3ForCausalLM", num_hidden_layers=layers,
                    sliding_window_pattern=3)
    model = models.from_hf(cfg, random_tensors(cfg))
    assert model.config.layer_types[:3] == (
        "sliding_attention", "sliding_attention", "full_attention")
    fwd, params = _jitted_forward(model)
    lowered = fwd.lower(params, model.make_cache(BLOCKS, BS),
                        jnp.zeros(26, jnp.int32), meta)
    lines[layers] = len(lowered.as_text().splitlines())
    if layers == 5:  # a scanned period and an unrolled tail: still in place
      header = lowered.compile().as_text().splitlines()[0]
      assert header.count("may-alias") >= 2, header[:400]
  assert lines[3] == lines[9]
  assert lines[3] < lines[5] < 2 * lines[3]


def test_layers_run_with_their_own_spec_in_order():
  from paged_jax.models.llama import layers  # pylint: disable=import-outside-toplevel
  from paged_jax import rope  # pylint: disable=import-outside-toplevel
  r = rope.RopeConfig(4, 10.0)
  specs = [layers.LayerSpec(w, r) for w in (2, 2, None, 2, 2, None, 2)]
  assert layers.period(specs) == 3
  assert layers.period(specs[:2]) == 1 and layers.period(specs[:3]) == 3
  params = {"w": jnp.arange(7, dtype=jnp.float32) + 1}

  def body(carry, p, spec, i):
    # carry: (running value, log of (index, window or 0, weight)).
    acc, log = carry
    entry = jnp.stack([jnp.asarray(i, jnp.float32),
                       jnp.float32(spec.sliding_window or 0), p["w"]])
    return acc * 10 + p["w"], log.at[i].set(entry)

  acc, log = jax.jit(lambda p: layers.run_layers(
      body, p, specs, (jnp.float32(0), jnp.zeros((7, 3)))))(params)
  assert float(acc) == 1234567.0
  np.testing.assert_array_equal(np.asarray(log), [
      [i, s.sliding_window or 0, i + 1] for i, s in enumerate(specs)])


def _hlo_shape(x) -> str:
  """How compiled HLO spells an array's type: `f32[3,2,24,4,16]`."""
  name = {"float32": "f32", "int8": "s8", "bfloat16": "bf16",
          "float8_e4m3fn": "f8e4m3fn"}[str(x.dtype)]
  return f"{name}[{','.join(map(str, x.shape))}]"


@pytest.mark.parametrize("num_seqs, decode_only",
                         [(2, True), (2, False), (1, True)])
@pytest.mark.parametrize("cache_dtype,scan_layers", [
    (None, True), ("int8", True), (None, False)])
def test_the_step_writes_into_the_cache_without_copying_it(
    cache_dtype, scan_layers, num_seqs, decode_only):
  # The K/V are scattered into the carried 5-D cache at the traced layer
  # index: the compiled step has no copy and no dynamic-update-slice of a
  # whole cache array (writing a layer's pages back into the carry, as the
  # slice-write-put-back form did), and the donated arrays alias outputs.
  # One decode row (T = 1) is the case XLA turns a one-index scatter into a
  # dynamic-update-slice that copies the whole carried cache per layer
  # (`kv_cache.write_kv_layer`'s note).
  q_len = 1 if decode_only else 5
  state = bm.init(num_blocks=BLOCKS, block_size=BS, max_seqs=num_seqs,
                  max_blocks_per_seq=8)
  seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
  q_lens = jnp.full(num_seqs, q_len, jnp.int32)
  state, _ = bm.reserve(state, seq_ids, q_lens)
  meta = step_metadata.step_metadata(state, seq_ids, q_lens,
                                     num_tokens=num_seqs * q_len,
                                     decode_only=decode_only)
  model = models.tiny(0, num_layers=3, scan_layers=scan_layers)
  fwd, params = _jitted_forward(model)
  cache = model.make_cache(BLOCKS, BS, cache_dtype)
  compiled = fwd.lower(params, cache, jnp.zeros(num_seqs * q_len, jnp.int32),
                       meta).compile().as_text()
  header = compiled.splitlines()[0]
  assert header.count("may-alias") >= len(cache.arrays()), header[:400]
  for x in cache.arrays():
    # Nor a copy of the write's flat view [L, kvh, blocks * bs(, d)] (an
    # in-place dynamic-update-slice of it, XLA's form of a small scatter, is
    # fine).
    flat = jax.ShapeDtypeStruct(
        x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:], x.dtype)
    pattern = (re.escape(_hlo_shape(x)) +
               r"\{[^}]*\} (copy|dynamic-update-slice)\(|" +
               re.escape(_hlo_shape(flat)) + r"\{[^}]*\} copy\(")
    hits = [line.strip()[:200] for line in compiled.splitlines()
            if re.search(pattern, line)]
    assert not hits, hits


@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_paged_matches_dense_per_family(arch, cache_dtype):
  cfg = hf_config(arch, num_hidden_layers=3)
  model = models.from_hf(cfg, random_tensors(cfg, seed=5))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (2, 13)).astype(np.int32)  # > Mistral's window 5
  dense = np.asarray(model.dense_logits(jnp.asarray(tokens)))
  fwd, params = _jitted_forward(model)
  cache = model.make_cache(BLOCKS, BS, cache_dtype)
  paged, cache = fwd(params, cache, jnp.asarray(tokens.reshape(-1)), _step())
  paged = np.asarray(paged).reshape(dense.shape)
  tol = 1e-5 if cache_dtype is None else 5e-2
  scale = np.abs(dense).max(-1, keepdims=True)
  np.testing.assert_array_less(np.abs(paged - dense) / scale, tol)
  assert cache.k_pages.shape[0] == 3
  # Every layer wrote its own K (layers differ, so their pages differ).
  k = np.asarray(cache.k_pages, np.float32)
  assert all(np.abs(k[i]).sum() > 0 for i in range(3))
  assert not np.array_equal(k[0], k[1])


def test_cache_with_other_layer_count_is_refused():
  model = models.tiny(0, num_layers=2)
  cache = models.tiny(0, num_layers=3).make_cache(BLOCKS, BS)
  with pytest.raises(ValueError, match="the KV cache has 3 layers, the model num_layers=2"):
    model.paged_forward(jnp.zeros(26, jnp.int32), _step(), cache)


def test_a_seed_gives_the_weights_separate_layers_would():
  """Stacking kept the seeded weights: layer i of the stack is the i-th
  `DecoderLayer` drawn from the same `Rngs` after the embedding."""
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  config = model_lib.LlamaConfig.tiny(num_layers=3)
  stacked = model_lib.init_model(config, seed=7)
  rngs = nnx.Rngs(7)
  nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs,
            embedding_init=nnx.initializers.normal(1.0))
  for i in range(3):
    layer = model_lib.DecoderLayer(config, implementation=None, rngs=rngs)
    np.testing.assert_array_equal(stacked.layers.mlp.up_proj.kernel[...][i],
                                  layer.mlp.up_proj.kernel[...])
    np.testing.assert_array_equal(stacked.layers.self_attn.q_proj.kernel[...][i],
                                  layer.self_attn.q_proj.kernel[...])


def _weight_copies(model, num_seqs=2):
  """The compiled decode step's ops that produce an MLP kernel-sized array
  (`f32[64,192]`, `f32[192,64]`, or with a leading 1): slices or copies of
  a layer's weights, which the step should read in place."""
  state = bm.init(num_blocks=BLOCKS, block_size=BS, max_seqs=num_seqs,
                  max_blocks_per_seq=8)
  seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
  ones = jnp.ones(num_seqs, jnp.int32)
  state, _ = bm.reserve(state, seq_ids, ones)
  meta = step_metadata.step_metadata(state, seq_ids, ones, num_tokens=num_seqs,
                                     decode_only=True)
  fwd, params = _jitted_forward(model)
  compiled = fwd.lower(params, model.make_cache(BLOCKS, BS),
                       jnp.zeros(num_seqs, jnp.int32), meta).compile().as_text()
  pattern = (r"= f32\[(1,)?(64,192|192,64)\]\{[^}]*\} "
             r"(dynamic-slice|slice|copy|gather|fusion)\(")
  return [line.strip()[:160] for line in compiled.splitlines()
          if re.search(pattern, line)]


def test_separate_layers_read_their_weights_in_place():
  # scan_layers=False: each layer's weights are their own arrays and the
  # unrolled step reads them in place. The stacked form, on XLA CPU, slices
  # every layer's kernels out of the [num_layers, ...] stacks (a copy per
  # weight per layer per step, benchmarks/RESULTS.md section 12): the same
  # search finds those, so it is not vacuous.
  config = dict(num_layers=3, hidden_size=64, intermediate_size=192)
  separate = models.tiny(0, scan_layers=False, **config)
  assert len(separate.layers) == 3
  assert separate.layers[0].mlp.up_proj.kernel[...].shape == (64, 192)
  assert not _weight_copies(separate), _weight_copies(separate)
  if jax.default_backend() == "cpu":
    assert _weight_copies(models.tiny(0, scan_layers=True, **config))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_separate_layers_compute_what_stacked_ones_do(arch):
  # Same seed and checkpoint tensors, separate or stacked layers: the same
  # Hugging Face tensors out, the same logits (dense and paged) in float32.
  import dataclasses  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  cfg = hf_config(arch, num_hidden_layers=4, **(
      {"sliding_window_pattern": 3} if arch == "Gemma3ForCausalLM" else {}))
  stacked = models.from_hf(cfg, random_tensors(cfg, seed=3))
  config = dataclasses.replace(stacked.config, scan_layers=False)
  tensors = checkpoint.to_tensors(stacked)
  separate = checkpoint.from_tensors(config, tensors)
  assert len(separate.layers) == 4
  out = checkpoint.to_tensors(separate)
  assert sorted(out) == sorted(tensors)
  for name, t in tensors.items():
    np.testing.assert_array_equal(out[name], t, err_msg=name)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 13)).astype(np.int32)
  for model in (stacked, separate):
    dense = np.asarray(model.dense_logits(jnp.asarray(tokens)))
    fwd, params = _jitted_forward(model)
    paged, _ = fwd(params, model.make_cache(BLOCKS, BS),
                   jnp.asarray(tokens.reshape(-1)), _step())
    paged = np.asarray(paged).reshape(dense.shape)
    if model is stacked:
      want_dense, want_paged = dense, paged
    else:
      scale = np.abs(want_dense).max(-1, keepdims=True)
      np.testing.assert_array_less(np.abs(dense - want_dense) / scale, 1e-5)
      np.testing.assert_array_less(np.abs(paged - want_paged) / scale, 1e-5)


def test_with_scan_layers_converts_both_ways_and_the_loader_uses_it():
  from paged_jax.models import loader  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import checkpoint  # pylint: disable=import-outside-toplevel
  stacked = models.tiny(2)  # loader.load("tiny", seed=2)'s weights
  separate = stacked.with_scan_layers(False)
  back = separate.with_scan_layers(True)
  assert stacked.with_scan_layers(True) is stacked
  assert len(separate.layers) == 2 and not separate.config.scan_layers
  assert back.layers.mlp.up_proj.kernel[...].shape[0] == 2
  want = checkpoint.to_tensors(stacked)
  for model in (separate, back):
    got = checkpoint.to_tensors(model)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
      np.testing.assert_array_equal(got[name], t, err_msg=name)
  loaded = loader.load("tiny", seed=2, scan_layers=False)
  assert isinstance(loaded.model.layers, nnx.List)
  np.testing.assert_array_equal(loaded.model.layers[1].mlp.up_proj.kernel[...],
                                stacked.layers.mlp.up_proj.kernel[...][1])


def test_the_loader_separates_shallow_models_on_cpu_only_by_default():
  from paged_jax.models import loader  # pylint: disable=import-outside-toplevel
  deepest = loader.CPU_SEPARATE_MAX_LAYERS
  assert loader.default_scan_layers(deepest, "cpu") is False
  assert loader.default_scan_layers(deepest + 1, "cpu") is True
  assert loader.default_scan_layers(2, "tpu") is True
  assert loader.default_scan_layers(2, "gpu") is True
  assert loader.default_scan_layers(2) is (jax.default_backend() != "cpu")
  model = loader.load("tiny", seed=2).model
  assert model.config.scan_layers is loader.default_scan_layers(model.config.num_layers)
  assert isinstance(model.layers, nnx.List) is (not model.config.scan_layers)
  assert loader.load("tiny", seed=2, scan_layers=True).model.config.scan_layers
