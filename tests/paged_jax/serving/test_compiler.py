"""`serving.compiler`'s table: use counts, a clear that keeps some keys,
and the rule of trace-checked engines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from paged_jax.serving import compiler


def _jobs(*names):
  spec = jax.ShapeDtypeStruct((3,), jnp.float32)
  fns = {"add": lambda x: x + 1, "mul": lambda x: x * 2}
  return {("test_compiler", n): (lambda n=n: jax.jit(fns[n]).lower(spec)) for n in names}


def test_use_counts_and_a_clear_that_keeps_what_is_asked():
  compiler.clear(keep=lambda k: k[0] != "test_compiler")
  count = compiler.compiled_count()
  done, _ = compiler.compile_all(_jobs("add", "mul"))
  compiler.compile_all(_jobs("add"))  # found: not compiled again
  assert compiler.compiled_count() == count + 2
  uses = compiler.use_counts()
  assert uses[("test_compiler", "add")] == 2 and uses[("test_compiler", "mul")] == 1
  assert float(done[("test_compiler", "add")](jnp.ones(3))[0]) == 2.0
  assert compiler.clear(keep=lambda k: k != ("test_compiler", "mul")) == 1
  assert ("test_compiler", "mul") not in compiler.use_counts()
  assert compiler.use_counts()[("test_compiler", "add")] == 2
  compiler.compile_all(_jobs("add", "mul"))  # only the dropped one compiles
  assert compiler.compiled_count() == count + 3
  assert compiler.use_counts()[("test_compiler", "mul")] == 1
  compiler.clear(keep=lambda k: k[0] != "test_compiler")
  assert not [k for k in compiler.use_counts() if k[0] == "test_compiler"]


def test_a_trace_checked_engine_has_the_programs_of_an_ordinary_one():
  """`check_traces` changes no program and keeps none of its own: a
  trace-checked engine's runner key is an ordinary engine's of equal sizes
  (the process table serves both), and its decode step lowers to the same
  module (so the persistent compilation cache serves either), named after
  the bucket."""
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(num_layers=1), seed=0)
  texts, keys = [], []
  for check in (False, True):
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=4, max_batch=2,
                                        max_tokens_per_step=8, max_model_len=16,
                                        check_traces=check))
    bucket = next(b for b in engine.buckets if b.decode_only)
    xs = [p._build([], bucket)[0] for p in engine._pools]  # pylint: disable=protected-access
    texts.append(engine._runner._lowerer(bucket, xs)().as_text())  # pylint: disable=protected-access
    keys.append(engine._runner._key)  # pylint: disable=protected-access
  assert keys[0] == keys[1]
  assert texts[0] == texts[1]
  assert f"@jit_decode_step_{bucket.num_tokens}x{bucket.num_seqs}" in texts[0]


def test_check_traced_once_refuses_a_program_asked_under_another_key():
  """The rule `check_traces` applies to a runner's jobs: a program (the key
  after its first item) asked again under the same engine part is found in
  the table; under another part it would be traced a second time, refused
  before anything lowers, saying which items of the part differ."""
  seen = {}
  part = ("model", "mesh", ("sig", 1))
  compiler.check_traced_once(seen, {(part, "b4"): None, (part, "spec", "b4", 2): None})
  compiler.check_traced_once(seen, {(part, "b4"): None})  # the same program, found
  drifted = part[:2] + (("sig", 2),)
  with pytest.raises(AssertionError,
                     match=r"program \('b4',\) would be traced a second time: .*"
                           r"items \[2\] of its part differ"):
    compiler.check_traced_once(seen, {(drifted, "b4"): None})
  compiler.check_traced_once(seen, {(drifted, "b8"): None})  # another program
  assert seen == {("b4",): part, ("spec", "b4", 2): part, ("b8",): drifted}


def test_a_step_first_used_after_other_steps_is_the_warm_up_program():
  """The arrays a step returns may carry their shardings spelled otherwise
  (on one device, a 1x1 mesh, an empty spec); programs still lower with
  the shardings the runner made its arrays with, so a step compiled on
  first use after other steps ran is the module `Engine.warmup` compiles
  (the persistent compilation cache serves either): the decode step, the
  bookkeeping-only step and a verification step, lowered before and after
  a request was served (a prefill step and a step of releases only)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  from paged_jax.serving import spec_host, spec_step  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.engine import Engine, EngineConfig  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.requests import Request  # pylint: disable=import-outside-toplevel
  from paged_jax.serving.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  from paged_jax.speculative import SpeculativeConfig  # pylint: disable=import-outside-toplevel
  model = model_lib.init_model(model_lib.LlamaConfig.tiny(num_layers=1), seed=0)
  spec = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
  engine = Engine(model, EngineConfig(num_blocks=8, block_size=4, max_batch=2,
                                      max_tokens_per_step=8, max_model_len=16,
                                      speculative_config=spec))
  runner = engine._runner  # pylint: disable=protected-access
  decode = next(b for b in engine.buckets if b.decode_only)
  xs = [p._build([], decode)[0] for p in engine._pools]  # pylint: disable=protected-access
  S = xs[0].seq_ids.shape[0]
  budget = spec_step.draft_budgets(S, 2)[0]
  verify = spec_host._inputs(xs[0], [], np.zeros(S, np.int32), 2, budget)  # pylint: disable=protected-access

  def programs():
    return (runner.lower(decode, xs).as_text(),
            runner._bookkeeping_lowerer(xs)().as_text(),  # pylint: disable=protected-access
            spec_step._lowerer(runner, decode, xs[0], verify)().as_text())  # pylint: disable=protected-access

  before = programs()
  engine.add_request(Request(0, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=1)))
  engine.run_until_done()
  st = engine.stats
  assert st.mixed_steps == 1 and st.decode_steps == 0 and st.bookkeeping_steps == 1
  for name, a, b in zip(("decode", "bookkeeping", "verification"), before, programs()):
    assert a == b, name
