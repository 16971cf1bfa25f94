"""Each engine or request rule fires from the Python API (`EngineConfig`,
`SamplingParams`, the engine's admission) and from the command line, where
the CLI reports the library's own message with flag names, one line."""

from __future__ import annotations

import pytest

from paged_jax.entrypoints import generate
from paged_jax.entrypoints.openai import api_server
from paged_jax.serving.engine import EngineConfig
from paged_jax.serving.requests import Request
from paged_jax.serving.sampling import SamplingParams


def _cli(argv, capsys, parse=generate.parse_and_check) -> str:
  with pytest.raises(SystemExit) as e:
    parse(["--model", "tiny"] + argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  return err


# (rule, what the API raises on, its message, the flags, the CLI's line)
RULES = [
    ("every decode fits a step", lambda: EngineConfig(num_blocks=1, max_batch=8,
                                                     max_tokens_per_step=4),
     "max_tokens_per_step=4 must be >= max_batch=8 so every decode fits a step",
     ["--max-batch", "8", "--max-tokens-per-step", "4"],
     "error: --max-tokens-per-step 4 must be >= --max-batch 8 so every decode fits a step\n"),
    ("beams fit the batch", lambda: EngineConfig(num_blocks=1, max_batch=4,
                                                max_tokens_per_step=8, max_beam_width=8),
     "max_beam_width=8 must be <= max_batch=4",
     ["--beam-width", "8", "--max-num-seqs", "4", "--max-tokens-per-step", "8"],
     "error: --beam-width 8 must be <= --max-num-seqs 4\n"),
    ("the seed's range", lambda: SamplingParams(seed=2**31 - 1, n=2),
     r"seed \+ 1 \(sample i uses seed \+ i\) must be < 2\*\*31, got seed=2147483647",
     ["--n", "2", "--seed", "2147483647"],
     "error: --seed + 1 (sample i uses --seed + i) must be < 2**31, got --seed 2147483647\n"),
    ("n or beams", lambda: SamplingParams(n=2, beam_width=2),
     r"use n or beam_width, not both \(got n=2, beam_width=2\)",
     ["--n", "2", "--beam-width", "2"],
     "error: use --n or --beam-width, not both (got --n 2, --beam-width 2)\n"),
    ("min tokens within the budget", lambda: SamplingParams(max_new_tokens=5, min_tokens=9),
     r"min_tokens must be in \[0, max_new_tokens=5\], got 9",
     ["--max-new-tokens", "5", "--min-tokens", "9"],
     "error: --min-tokens must be in [0, --max-new-tokens 5], got 9\n"),
    ("window reclamation refuses prefix caching",
     lambda: EngineConfig(num_blocks=8, sliding_window_reclamation=True,
                          enable_prefix_caching=True),
     r"sliding_window_reclamation=True: enable_prefix_caching=True is not supported",
     ["--sliding-window-reclamation", "--enable-prefix-caching"],
     "error: --sliding-window-reclamation True: --enable-prefix-caching True is "
     "not supported with it\n"),
    ("stop strings are not empty", lambda: SamplingParams(stop=("",)),
     "stop strings must be non-empty str, got",
     ["--prompt", "hi", "--stop", ""],
     "error: --stop strings must be non-empty str, got ('',)\n"),
]


@pytest.mark.parametrize("rule,api,api_match,argv,line", RULES, ids=[r[0] for r in RULES])
def test_each_rule_fires_from_the_api_and_the_cli(rule, api, api_match, argv, line, capsys):
  with pytest.raises(ValueError, match=api_match):
    api()
  assert _cli(argv, capsys) == line, rule


def test_the_server_reports_engine_config_rules_too(capsys):
  err = _cli(["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], capsys,
             parse=api_server.parse_args)
  assert err.endswith("--max-num-batched-tokens 4 must be >= --max-num-seqs 8 so every "
                      "decode fits a step\n"), err


@pytest.fixture(scope="module")
def tiny():
  from paged_jax.models.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  return model_lib.init_model(model_lib.LlamaConfig.tiny(), seed=0)


@pytest.mark.parametrize("n,max_new,batch,max_len", [
    (2, 8, 2, 64), (3, 8, 2, 64), (1, 63, 4, 64), (1, 64, 4, 64), (4, 70, 4, 64)])
def test_the_cli_refuses_exactly_what_the_engine_rejects(tiny, n, max_new, batch, max_len,
                                                         capsys):
  """`check_fits_engine` asks the engine's own size rule
  (`scheduler.size_rejection`) early: the engine rejects a request of the
  flags (a one-token prompt) exactly when the CLI refuses the flags, with the
  same words (field names as flags)."""
  from paged_jax.serving.engine import Engine  # pylint: disable=import-outside-toplevel
  engine = Engine(tiny, EngineConfig(num_blocks=8, block_size=16, max_batch=batch,
                                     max_tokens_per_step=16, max_model_len=max_len))
  out = engine.add_request(Request(0, [1], SamplingParams(max_new_tokens=max_new, n=n)))
  argv = ["--n", str(n), "--max-new-tokens", str(max_new), "--max-batch", str(batch),
          "--max-tokens-per-step", "16", "--max-model-len", str(max_len)]
  if out is None:
    assert generate.parse_and_check(["--model", "tiny"] + argv).n == n
    return
  err = _cli(argv, capsys)
  if n > batch:
    assert f"max_batch is {batch}" in out.rejected
    assert err == (f"error: --n {n}: every request would be rejected: needs {n} "
                   f"sequences at once, --max-batch is {batch}\n")
  else:
    assert f"exceeds max_model_len={max_len}" in out.rejected
    assert err == (f"error: every request would be rejected: prompt (1) + "
                   f"--max-new-tokens ({max_new}) = {max_new + 1} exceeds "
                   f"--max-model-len {max_len}\n")
