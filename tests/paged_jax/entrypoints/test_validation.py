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
    # (multi-step decode runs with it on one pool: refused per model, at
    # `reclamation.decide`, tests/examples/test_window_engine.py)
    ("window reclamation refuses preemption by swap",
     lambda: EngineConfig(num_blocks=8, sliding_window_reclamation=True,
                          preemption_mode="swap", swap_space_blocks=8),
     r"sliding_window_reclamation=True: preemption_mode='swap' is not supported",
     ["--sliding-window-reclamation", "--preemption-mode", "swap",
      "--swap-space-blocks", "8"],
     "error: --sliding-window-reclamation True: --preemption-mode 'swap' is not "
     "supported with it\n"),
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


E = lambda **kw: lambda: EngineConfig(**{"num_blocks": 1, **kw})  # noqa: E731
S = lambda **kw: lambda: SamplingParams(**kw)  # noqa: E731
G, SRV = generate.parse_and_check, api_server.parse_args

# Every flag that sets an `EngineConfig` or `SamplingParams` field parses any
# integer / number; its range is the class's rule: (flags, command, the
# API call that raises, the CLI's line = the API's message, fields as flags).
FLAG_RULES = [
    (["--num-blocks", "0"], G, E(num_blocks=0), "--num-blocks must be a positive int, got 0"),
    (["--num-blocks", str(2**31)], G, E(num_blocks=2**31),
     "--num-blocks must be <= 2147483647, got 2147483648"),
    (["--block-size", "0"], G, E(block_size=0), "--block-size must be a positive int, got 0"),
    (["--block-size", str(2**21)], SRV, E(block_size=2**21),
     "--block-size must be <= 1048576, got 2097152"),
    (["--max-batch", "0"], G, E(max_batch=0), "--max-batch must be a positive int, got 0"),
    (["--max-num-seqs", "70000"], SRV, E(max_batch=70000),
     "--max-num-seqs must be <= 65536, got 70000"),
    (["--max-tokens-per-step", "0"], G, E(max_tokens_per_step=0),
     "--max-tokens-per-step must be a positive int, got 0"),
    (["--max-num-batched-tokens", str(2**21)], G, E(max_tokens_per_step=2**21),
     "--max-num-batched-tokens must be <= 1048576, got 2097152"),
    (["--min-bucket", "0"], G, E(min_bucket=0), "--min-bucket must be a positive int, got 0"),
    (["--max-model-len", "1"], SRV, E(max_model_len=1), "--max-model-len must be >= 2, got 1"),
    (["--max-model-len", str(2**25)], G, E(max_model_len=2**25),
     "--max-model-len must be <= 16777216, got 33554432"),
    (["--admission-headroom-steps", "-1"], G, E(admission_headroom_steps=-1),
     "--admission-headroom-steps must be an int >= 0, got -1"),
    (["--num-scheduler-steps", "0"], G, E(num_scheduler_steps=0),
     "--num-scheduler-steps must be an int in [1, 64], got 0"),
    (["--swap-space-blocks", "-1"], SRV, E(swap_space_blocks=-1),
     "--swap-space-blocks must be an int >= 0, got -1"),
    (["--max-logprobs", "-1"], SRV, E(max_logprobs=-1),
     "--max-logprobs must be an int >= 0, got -1"),
    (["--max-logprobs", "70000"], SRV, E(max_logprobs=70000),
     "--max-logprobs must be <= 65536, got 70000"),
    (["--max-logit-bias", "-1"], SRV, E(max_logit_bias=-1),
     "--max-logit-bias must be an int >= 0, got -1"),
    (["--beam-width", "0"], G, E(max_beam_width=0), "--beam-width must be a positive int, got 0"),
    (["--max-new-tokens", "0"], G, S(max_new_tokens=0), "--max-new-tokens must be >= 1, got 0"),
    (["--max-tokens", "0"], SRV, S(max_new_tokens=0), "--max-tokens must be >= 1, got 0"),
    (["--n", "0"], G, S(n=0), "--n must be >= 1, got 0"),
    (["--n", str(2**31)], G, S(n=2**31), "--n must be >= 1 and < 2**31, got 2147483648"),
    (["--seed", "-1"], G, S(seed=-1), "--seed must be an int in [0, 2**31), got -1"),
    (["--seed", str(2**31)], G, S(seed=2**31),
     "--seed must be an int in [0, 2**31), got 2147483648"),
    (["--temperature", "-0.5"], G, S(temperature=-0.5),
     "--temperature must be >= 0 and finite, got -0.5"),
    (["--temperature", "1e39"], G, S(temperature=1e39),
     "--temperature must be <= 3.403e+38 (float32), got 1e+39"),
    (["--top-p", "0"], G, S(top_p=0.0), "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], G, S(top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-1"], G, S(top_k=-1), "--top-k must be >= 0, got -1"),
    (["--min-tokens", "-1"], G, S(min_tokens=-1), "--min-tokens must be >= 0, got -1"),
    (["--min-tokens", str(2**31)], G, S(min_tokens=2**31, max_new_tokens=2**31 - 1),
     "--min-tokens must be >= 0 and < 2**31, got 2147483648"),
    (["--stop-token-ids", "1," + str(2**40)], G, S(stop_token_ids=(1, 2**40)),
     "--stop-token-ids must hold int32 token ids, got 1099511627776"),
]


def _field_words(text: str) -> str:
  """A CLI line's flags back in field names, to compare with the API's."""
  import re  # pylint: disable=import-outside-toplevel
  names = {"num-blocks": "num_blocks", "max-num-seqs": "max_batch",
           "max-num-batched-tokens": "max_tokens_per_step", "beam-width": "max_beam_width",
           "max-tokens": "max_new_tokens"}
  return re.sub(r"--([a-z-]+)", lambda m: names.get(m[1], m[1].replace("-", "_")), text)


@pytest.mark.parametrize("argv,parse,api,line", FLAG_RULES,
                         ids=[" ".join(r[0]) for r in FLAG_RULES])
def test_each_flag_reports_its_fields_rule(argv, parse, api, line, capsys):
  """One `error:` line naming the flag, in the library's own words: the
  same message the API raises for that value."""
  with pytest.raises(ValueError) as e:
    api()
  assert str(e.value) == _field_words(line)
  assert _cli(argv, capsys, parse=parse).endswith(f"error: {line}\n")


def test_the_server_keeps_its_own_bound_on_logit_bias(capsys):
  """--max-logit-bias past what a request may give (OpenAI's 300 entries,
  the request schema's bound) is the server's rule, not EngineConfig's."""
  assert _cli(["--max-logit-bias", "301"], capsys, parse=SRV).endswith(
      "error: --max-logit-bias must be <= 300 (a request's logit_bias holds at most "
      "that many entries), got 301\n")


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
  (`admission.size_rejection`) early: the engine rejects a request of the
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
