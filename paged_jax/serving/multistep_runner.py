"""The multi-step decode programs of a `runner.Runner` (`multistep.py`: K
decode steps in one dispatch, one device only): compiled per (bucket, K),
dispatched with the runner's donated arrays."""

from __future__ import annotations

import functools

import jax

from paged_jax.serving import compiler
from paged_jax.serving import out_pack
from paged_jax.serving import step as step_lib
from paged_jax.serving.buckets import Bucket
from paged_jax.serving.multistep import MultiStepInputs, multistep_device_step
from paged_jax.serving.step import StepInputs

DONATE = (2, 3, 4)  # a step's donated arguments: cache, block state, last tokens
_STATIC = ("num_steps", "num_logprobs")
_multistep = step_lib.on_one_pool(multistep_device_step, args=(3, 4, 5),
                                  outs=(1, 2, 3))


class MultiStepPrograms:
  """`Runner`'s K-step decode programs (a mixin: it uses the runner's
  `config`, `mesh`, `_key`, `_model_def`, `_params`, `cache`, `state`,
  `last_tokens`, `slots`, `num_logprobs`, `compile_seconds`,
  `compile_jobs`, `_xla_dots` and its `_multi` table `{(bucket, K): Compiled}`)."""

  def _decode_rows(self, buckets: dict) -> dict | None:
    """`compiler.compile_all`'s `rows` for decode programs (`{key: bucket}`):
    their token rows, or None (XLA's defaults) for a model whose dots do not
    suit XLA's own kernels (`compiler.xla_dots_suit`)."""
    return {k: b.num_tokens for k, b in buckets.items()} if self._xla_dots else None

  def _multistep_jit_for(self, bucket: Bucket, num_steps: int):
    """The jitted `num_steps`-step decode program of `bucket`, named after
    them (`decode_4_steps_4`)."""
    @functools.partial(out_pack.packs, per_pool=True)
    def multistep(model_def, params, cache, state, last_tokens, slots, x, m, *,
                  num_steps, num_logprobs):
      return _multistep(model_def, params, cache, state, last_tokens, slots, x,
                        m, mesh=self.mesh, num_steps=num_steps,
                        num_logprobs=num_logprobs)
    multistep.__name__ = f"decode_{num_steps}_steps_{bucket.num_tokens}"
    return jax.jit(multistep, static_argnums=(0,), donate_argnums=DONATE,
                   static_argnames=_STATIC)

  def compile_multistep(self, inputs: dict[Bucket, tuple[StepInputs, MultiStepInputs]],
                        num_steps: int) -> float:
    """Compiles the `num_steps`-step decode program of every (decode) bucket
    in `inputs` (`{bucket: (step inputs, loop inputs)}`, e.g. padding) not
    compiled yet, in parallel; runs nothing. Returns the seconds spent."""
    if self.mesh.size > 1:
      raise ValueError("multi-step decode runs on one device, not on a mesh")

    def lowerer(b, x, m):
      specs = jax.tree.map(compiler.spec, (x, m))
      held = [self.arg_spec(n) for n in ("cache", "state", "last_tokens", "slots")]
      return lambda: self._multistep_jit_for(b, num_steps).lower(
          self._model_def, self._params, *held, *specs, num_steps=num_steps,
          num_logprobs=self.num_logprobs)
    jobs = {(self._key, "multistep", num_steps, b): lowerer(b, x, m)
            for b, (x, m) in inputs.items() if (b, num_steps) not in self._multi}
    done, seconds = self.compile_jobs(jobs, rows=self._decode_rows({k: k[3] for k in jobs}))
    for (_, _, k, b), exe in done.items():
      self._multi[b, k] = exe
    self.compile_seconds += seconds
    return seconds

  def dispatch_multistep(self, bucket: Bucket, num_steps: int, x: StepInputs,
                         m: MultiStepInputs):
    """Launches up to `num_steps` decode steps in one program (compiling it
    first if needed); returns its `MultiStepOutputs`, still on the device."""
    exe = self._multi.get((bucket, num_steps))
    if exe is None:
      self.compile_multistep({bucket: (x, m)}, num_steps)
      exe = self._multi[bucket, num_steps]
    self.cache, self.state, self.last_tokens, out = exe(
        self._params, self.cache, self.state, self.last_tokens, self.slots, x, m)
    return out
