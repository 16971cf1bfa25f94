"""The decode step of the random 30.7M Llama on CPU in four forms, in one
process, steps interleaved: layers stacked (`lax.scan`) or separate
(`--no-scan-layers`), and dots on YNNPACK's library fusions (XLA's default)
or on XLA's own kernels (`serving.compiler.CPU_COMPILER_OPTIONS`, the
engine's default on CPU since RESULTS 7f).

`benchmarks.vllm_compare`'s random model (hidden 512, 8 layers, 8/2 heads,
vocab 256, float32) as an HF checkpoint in a temporary directory; one engine
per form (block 16, batch `--batch`, 32-token prompts, greedy, EOS ignored);
each engine prefills and runs 4 decode steps, then the forms take turns, one
decode step each (waited for), `--steps` rounds. Prints each form's median ms
per decode step, the median per-round ratio to the first form, and whether
the greedy tokens of every form equal the first's.

  PYTHONPATH=. python -m benchmarks.cpu_step_forms [--steps 40] [--batch 32]
      [--model smollm2] [--forms scan-xla,noscan-xla]
"""

from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("PAGED_JAX_NO_FETCH", "1")

import jax  # noqa: E402  pylint: disable=wrong-import-position

from benchmarks import common  # noqa: E402
from benchmarks import vllm_compare  # noqa: E402
from paged_jax.models import loader  # noqa: E402
from paged_jax.serving import compiler  # noqa: E402
from paged_jax.serving.engine import Engine, EngineConfig  # noqa: E402
from paged_jax.serving.requests import Request  # noqa: E402
from paged_jax.serving.sampling import SamplingParams  # noqa: E402

PROMPT = 32
FORMS = ("scan-ynn", "scan-xla", "noscan-ynn", "noscan-xla")
XLA_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def run(args) -> dict:
  if args.model:
    base = loader.load(args.model, scan_layers=True).model
  else:
    ckpt = pathlib.Path(tempfile.mkdtemp(prefix="cpu_step_forms_")) / "ckpt"
    vllm_compare.write_checkpoint(ckpt)
    base = loader.load(str(ckpt), scan_layers=True).model
  forms = args.forms
  batch, steps = args.batch, args.steps
  max_len = PROMPT + 4 + steps + 16
  engines, warmup_s = [], {}
  saved = dict(compiler.CPU_COMPILER_OPTIONS), compiler.CPU_XLA_DOTS_MAX_ROWS
  try:
    for form in forms:
      compiler.clear()  # the table's keys do not hold the options
      compiler.CPU_COMPILER_OPTIONS = dict(XLA_DOTS) if form.endswith("xla") else {}
      compiler.CPU_XLA_DOTS_MAX_ROWS = batch
      cfg = EngineConfig(num_blocks=batch * (-(-max_len // 16) + 1) + 8, block_size=16,
                         max_batch=batch, max_tokens_per_step=PROMPT * batch,
                         max_model_len=max_len, min_bucket=batch, bucket_midpoints=False)
      e = Engine(base.with_scan_layers(form.startswith("scan")), cfg)
      t = time.perf_counter()
      e.warmup()
      warmup_s[form] = time.perf_counter() - t
      params = SamplingParams(max_new_tokens=steps + 12, ignore_eos=True, seed=1)
      vocab = base.config.vocab_size
      for i in range(batch):
        e.add_request(Request(i, [(97 * i + 13 * j + 5) % vocab for j in range(PROMPT)],
                              params))
      while e.stats.decode_steps < 4:
        e.step()
      engines.append(e)
  finally:
    compiler.CPU_COMPILER_OPTIONS, compiler.CPU_XLA_DOTS_MAX_ROWS = saved
    compiler.clear()
  walls = [[] for _ in forms]
  for _ in range(steps):
    for k, e in enumerate(engines):
      t = time.perf_counter()
      e.step()
      jax.block_until_ready(e.block_state.num_free)
      walls[k].append(time.perf_counter() - t)
  tokens = [{o.request_id: list(o.completions[0].token_ids) for o in e.run_until_done()}
            for e in engines]
  return {"model": args.model or "vllm_compare's random Llama", "batch": batch,
          "steps": steps, "forms": list(forms), "warmup_s": warmup_s,
          "ms_per_decode_step": {f: 1e3 * statistics.median(w) for f, w in zip(forms, walls)},
          "ratio_to_first": {f: statistics.median(b / a for a, b in zip(walls[0], w))
                             for f, w in zip(forms, walls)},
          "same_tokens_as_first": {f: t == tokens[0] for f, t in zip(forms, tokens)}}


def main(argv=None):
  p = common.parser(__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--model", default=None,
                 help="what loader.load takes (e.g. smollm2); default vllm_compare's "
                      "random checkpoint")
  p.add_argument("--forms", default=",".join(FORMS),
                 help=f"comma-separated subset of {','.join(FORMS)}, the first the baseline")
  args = p.parse_args(argv)
  args.forms = tuple(args.forms.split(","))
  if bad := set(args.forms) - set(FORMS):
    p.error(f"--forms: expected names from {FORMS}, got {sorted(bad)}")
  if args.quick:
    args.steps, args.batch = 3, 4
  r = run(args)
  for f in args.forms:
    print(f"{f:12s} {r['ms_per_decode_step'][f]:8.2f} ms/step  x{r['ratio_to_first'][f]:.3f}"
          f"  warm-up {r['warmup_s'][f]:.0f} s  same tokens {r['same_tokens_as_first'][f]}")
  path = common.write_json(args.out, "cpu_step_forms",
                           {"machine": common.machine(), "result": r}, quick=args.quick)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
