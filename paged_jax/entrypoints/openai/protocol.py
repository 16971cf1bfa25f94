"""The OpenAI request schema as pydantic models (vLLM's `protocol.py` idea).

One model per endpoint: `CompletionRequest` (`POST /v1/completions`) and
`ChatCompletionRequest` (`POST /v1/chat/completions`), with the OpenAI fields
and vLLM's extensions (`top_k`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`cache_salt`, `add_generation_prompt`). `parse_request` turns a raw body
into one of them or raises `RequestError`, which carries OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`) and names the public field.

The rules, so that no value can harm the engine:
- The body is strict JSON: `NaN`, `Infinity` and nesting too deep for the
  parser are refused before any field is read.
- Types are strict: an integer field takes a JSON integer only (not 2.9, not
  2.0, not `true`, not "2"); a number field takes an integer or a finite float.
- Integers are bounded to what the engine holds (int32: token ids, `top_k`,
  `n`, `best_of`, `logprobs`); `n` and `best_of` are >= 1. The ranges of the
  fields that `SamplingParams` takes as they are (`max_tokens`, `temperature`,
  `top_p`, `seed`, `min_tokens`, and `seed + n - 1`) are its own rules, its
  ValueError worded in the request's field names (`sampling_error`).
- `logit_bias` is OpenAI's: an object from token ids (strings of decimal
  digits) to biases in [-100, 100], at most `MAX_LOGIT_BIAS` entries (and at
  most the server's `--max-logit-bias`, ids inside its vocabulary:
  `check_limits`).
- A field the server knows but cannot honour (penalties,
  `suffix`, tools, ...) is refused by name when given a value other than its
  neutral one; a field it does not know is refused as unrecognized. Nothing
  is ignored silently (`user` is metadata and is accepted).

Limits that depend on the server (its model's name, context length and batch)
are checked by `check_limits`, the context and batch by asking the engine's
own rule (`admission.size_rejection`). Rules across `SamplingParams` fields
(the seed with `n`, `min_tokens` within the budget) are `SamplingParams`'
alone; `sampling_error` words its ValueError in the request's field names.
"""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged_jax import _cli
from paged_jax._int32 import INT32_MAX
from paged_jax.serving.sampling import SamplingParams

MAX_STOP_STRINGS = 16  # stop strings per request (each one is searched per delta)
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's bound)
MAX_SALT_CHARS = 1024  # the salt is hashed into every block's prefix hash


class RequestError(Exception):
  """A request the server refuses, in OpenAI's error shape.

  Args:
    message: what was expected and what was given, in the public field names.
    param: the field (`"stop_token_ids[0]"`), or None.
    status: the HTTP status (400, 404, ...).
    code: a short machine-readable code (`"invalid_type"`, ...).
  """

  def __init__(self, message: str, param: str | None = None, *, status: int = 400,
               code: str = "invalid_value"):
    super().__init__(message)
    self.message, self.param, self.status, self.code = message, param, status, code

  def body(self) -> dict:
    return error_body(self.message, self.status, param=self.param, code=self.code)


def error_body(message: str, status: int, *, param: str | None = None,
               code: str | None = None) -> dict:
  """OpenAI's error object."""
  kind = "invalid_request_error" if status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 1, 40, 40, 40


def shown(value) -> str:
  """A value given by a client, shown in a message: short and in JSON's words."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, dict):
    return "an object"
  if isinstance(value, list):
    return "an array"
  if isinstance(value, str):
    return json.dumps(value if len(value) <= 40 else value[:37] + "...")
  return _REPR.repr(value)


# ----------------------------------------------------------------- the models

class _Strict(BaseModel):
  model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(_Strict):
  include_usage: bool | None = False


def _text_content(value):
  """A message's content: a string, or a list of text parts (joined by "\\n")."""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and value:
    texts = []
    for part in value:
      if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else None
        raise ValueError("must hold text parts only" + (
            f", got type {shown(kind)}" if isinstance(kind, str) else
            f", got {shown(part)}"))
      if set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise ValueError('must hold parts {"type": "text", "text": string}')
      texts.append(part["text"])
    return "\n".join(texts)
  raise ValueError(f"must be a string or a non-empty array of text parts, got {shown(value)}")


class ChatMessage(_Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: Any
  name: str | None = None

  @field_validator("content", mode="before")
  @classmethod
  def _check_content(cls, value):
    return _text_content(value)


def _prompt(value, outer: bool = True):
  """A completion prompt: a string or token ids, alone or as a list of one."""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and not value:
    raise ValueError("must not be empty")
  if isinstance(value, list):
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
      bad = [t for t in value if not 0 <= t <= INT32_MAX]
      if bad:
        raise ValueError(f"must hold token ids in [0, 2**31), got {shown(bad[0])}")
      return list(value)
    if outer and all(isinstance(p, (str, list)) for p in value):
      if len(value) > 1:
        raise ValueError(f"holds {len(value)} prompts; one request serves one "
                         "prompt, send one request per prompt")
      return _prompt(value[0], outer=False)
  raise ValueError("must be a string, an array of token ids, or an array holding "
                   f"one of these, got {shown(value)}")


def _stop(value):
  if value is None:
    return ()
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
    raise ValueError(f"must be a string or an array of strings, got {shown(value)}")
  if any(not s for s in stops):
    raise ValueError("must not hold empty strings")
  if len(stops) > MAX_STOP_STRINGS:
    raise ValueError(f"must hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
  return tuple(stops)


_DIGITS = re.compile(r"[0-9]{1,10}")


def _logit_bias(value) -> dict[int, float] | None:
  """OpenAI's `logit_bias` as `{token id: bias}` (raises ValueError, worded
  after the field's name)."""
  if value is None:
    return None
  if not isinstance(value, dict):
    raise ValueError(f"must be an object from token ids to biases, got {shown(value)}")
  if len(value) > MAX_LOGIT_BIAS:
    raise ValueError(f"must hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
  out = {}
  for key, bias in value.items():
    if not _DIGITS.fullmatch(key) or int(key) > INT32_MAX:
      raise ValueError(f"keys must be token ids (strings of decimal digits, < 2**31), "
                       f"got {shown(key)}")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
        or not -100 <= bias <= 100:
      raise ValueError(f"values must be numbers in [-100, 100], got {shown(bias)} "
                       f"for token {key}")
    if int(key) in out:  # "7" and "07"
      raise ValueError(f"names token {int(key)} twice")
    out[int(key)] = float(bias)
  return out


Int32 = Field(None, ge=0, le=INT32_MAX)
TokenId = pydantic.conint(strict=True, ge=0, le=INT32_MAX)


# Fields known and refused unless neutral: name -> (is it neutral?, why).
_NEUTRAL = {
    "presence_penalty": (lambda v: not v, "presence_penalty is not supported; give 0"),
    "frequency_penalty": (lambda v: not v, "frequency_penalty is not supported; give 0"),
    "repetition_penalty": (lambda v: v is None or v == 1,
                           "repetition_penalty is not supported; give 1"),
    "min_p": (lambda v: not v, "min_p is not supported; give 0"),
    "suffix": (lambda v: v is None, "suffix (insertion) is not supported"),
    "tools": (lambda v: not v, "tools are not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool_choice is not supported"),
    "functions": (lambda v: not v, "functions are not supported"),
    "function_call": (lambda v: v in (None, "none"), "function_call is not supported"),
    "parallel_tool_calls": (lambda v: v is None, "parallel_tool_calls is not supported"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "response_format other than text is not supported"),
}


class _SamplingRequest(_Strict):
  """The fields both endpoints share."""

  model: str | None = None
  # The ranges of max_tokens, temperature, top_p, seed and min_tokens are
  # SamplingParams' rules (`sampling_error` words them); n and top_k are
  # bounded here, n before it sizes the random seed, top_k for vLLM's -1.
  max_tokens: int | None = None
  temperature: float | None = Field(None, allow_inf_nan=False)
  top_p: float | None = Field(None, allow_inf_nan=False)
  top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # vLLM: -1 or 0 keeps all
  n: int | None = Field(None, ge=1, le=INT32_MAX)
  seed: int | None = None
  stop: Any = None
  stop_token_ids: list[TokenId] | None = None
  min_tokens: int | None = None
  ignore_eos: bool | None = False
  cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
  stream: bool | None = False
  stream_options: StreamOptions | None = None
  user: str | None = None  # metadata: accepted, unused
  logit_bias: Any = None  # {token id: bias}, `_logit_bias`
  # Known, refused unless neutral (`_NEUTRAL`).
  presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
  frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
  repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
  min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)

  @field_validator("stop", mode="before")
  @classmethod
  def _check_stop(cls, value):
    return _stop(value)

  @field_validator("logit_bias", mode="before")
  @classmethod
  def _check_logit_bias(cls, value):
    return _logit_bias(value)

  @property
  def num_seqs(self) -> int:
    """Sequences the engine runs for this request."""
    return self.n or 1

  @property
  def requested_max_tokens(self) -> int | None:
    return self.max_tokens

  @property
  def num_logprobs(self) -> int | None:
    """Top alternatives per token asked for (`SamplingParams.logprobs`)."""
    return None

  def check(self) -> None:
    """Checks across fields and refusals by name (raises `RequestError`)."""
    for name, (neutral, why) in _NEUTRAL.items():
      if name in type(self).model_fields and not neutral(getattr(self, name)):
        raise RequestError(why, name, code="unsupported_parameter")
    if self.stream_options is not None and not self.stream:
      raise RequestError("stream_options needs stream: true", "stream_options")

  def sampling_params(self, max_tokens: int, seed: int) -> SamplingParams:
    """`SamplingParams` for the engine (the server picks `max_tokens` when
    the request gives none, and a random `seed`)."""
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if self.temperature is None else self.temperature,
        top_p=1.0 if self.top_p is None else self.top_p,
        top_k=max(self.top_k or 0, 0), n=self.num_seqs, seed=seed,
        stop=self.stop or (), stop_token_ids=tuple(self.stop_token_ids or ()),
        min_tokens=self.min_tokens or 0, ignore_eos=bool(self.ignore_eos),
        logprobs=self.num_logprobs, logit_bias=self.logit_bias or ())


class CompletionRequest(_SamplingRequest):
  """`POST /v1/completions`."""

  prompt: Any
  echo: bool | None = False
  logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
  best_of: int | None = Field(None, ge=1, le=INT32_MAX)
  suffix: str | None = None

  @field_validator("prompt", mode="before")
  @classmethod
  def _check_prompt(cls, value):
    return _prompt(value)

  @property
  def num_seqs(self) -> int:
    return max(self.n or 1, self.best_of or 1)

  @property
  def num_logprobs(self) -> int | None:
    return self.logprobs

  def check(self) -> None:
    super().check()
    if self.echo and self.logprobs is not None:
      raise RequestError("echo with logprobs needs the prompt's log-probabilities, "
                         "which are not served", "echo", code="unsupported_parameter")
    if self.best_of is not None and self.best_of < (self.n or 1):
      raise RequestError(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
    if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
      raise RequestError("best_of > n cannot be streamed", "best_of")


class ChatCompletionRequest(_SamplingRequest):
  """`POST /v1/chat/completions`."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = None  # SamplingParams' range, as max_tokens
  logprobs: bool | None = False
  top_logprobs: int | None = Int32  # at most the server's --max-logprobs
  add_generation_prompt: bool | None = True  # vLLM
  tools: list | None = None
  tool_choice: Any = None
  functions: list | None = None
  function_call: Any = None
  parallel_tool_calls: bool | None = None
  response_format: dict | None = None

  @property
  def requested_max_tokens(self) -> int | None:
    return (self.max_completion_tokens if self.max_completion_tokens is not None
            else self.max_tokens)

  @property
  def num_logprobs(self) -> int | None:
    return (self.top_logprobs or 0) if self.logprobs else None

  def check(self) -> None:
    super().check()
    if self.top_logprobs is not None and not self.logprobs:
      raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    if (self.max_tokens is not None and self.max_completion_tokens is not None
        and self.max_tokens != self.max_completion_tokens):
      raise RequestError("max_tokens and max_completion_tokens disagree; give one",
                         "max_completion_tokens")

  def message_dicts(self) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in self.messages]


# -------------------------------------------------------------------- parsing

class _NotJSON(ValueError):
  pass


def _constant(name):
  raise _NotJSON(f"{name} is not a JSON number")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(body: bytes):
  """The JSON value of a request body (strict: no NaN or Infinity, no string
  that is not Unicode text, i.e. a lone surrogate escape like "\\ud800")."""
  try:
    value = json.loads(body.decode("utf-8"), parse_constant=_constant)
    if _SURROGATE_ESCAPE.search(body):  # a pair is fine; a lone one is no text
      json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value
  except UnicodeEncodeError:
    raise RequestError("the body holds a string that is not Unicode text (a lone "
                       "surrogate escape)", code="invalid_json") from None
  except UnicodeDecodeError:
    raise RequestError("the body is not UTF-8", code="invalid_json") from None
  except RecursionError:
    raise RequestError("the body is nested too deeply", code="invalid_json") from None
  except _NotJSON as e:
    raise RequestError(f"the body is not valid JSON: {e}", code="invalid_json") from None
  except json.JSONDecodeError as e:
    raise RequestError(f"the body is not valid JSON: {e.msg} at position {e.pos}",
                       code="invalid_json") from None
  except ValueError:  # an integer of more than 4300 digits (Python's limit)
    raise RequestError("the body is not valid JSON here: a number has too many digits",
                       code="invalid_json") from None


def parse_request(body: bytes, kind: type[_SamplingRequest]) -> _SamplingRequest:
  """`kind` (`CompletionRequest` or `ChatCompletionRequest`) from a raw body.

  Raises:
    RequestError: the body is not a JSON object, a field is missing, unknown,
      of the wrong type or out of range, or a combination is refused.
  """
  value = parse_json(body)
  if not isinstance(value, dict):
    raise RequestError(f"the body must be a JSON object, got {shown(value)}",
                       code="invalid_type")
  try:
    req = kind.model_validate(value)
  except pydantic.ValidationError as e:
    raise _error(e.errors(include_url=False)[0]) from None
  except RecursionError:
    raise RequestError("the body is nested too deeply", code="invalid_json") from None
  req.check()
  return req


def _param(loc) -> str:
  out = ""
  for part in loc:
    out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
  return out


_TYPES = {"int": "an integer", "float": "a number", "string": "a string",
          "bool": "a boolean", "list": "an array", "dict": "an object",
          "model": "an object", "model_attributes": "an object"}


def _error(err: dict) -> RequestError:
  """One pydantic error in the public words: the field, what was expected,
  what was given (never the models' or Python's names)."""
  param, kind, ctx = _param(err["loc"]), err["type"], err.get("ctx") or {}
  given = f", got {shown(err.get('input'))}" if "input" in err else ""
  base = kind.split("_")[0] if kind.endswith(("_type", "_parsing", "_from_float")) else None
  if kind == "extra_forbidden":
    return RequestError(f"unrecognized request argument: {param}", param,
                        code="unknown_parameter")
  if kind == "missing":
    return RequestError(f"{param} is required", param, code="missing_required_parameter")
  if kind in ("model_type", "model_attributes_type", "dict_type"):
    return RequestError(f"{param} must be an object{given}", param, code="invalid_type")
  if base in _TYPES:
    return RequestError(f"{param} must be {_TYPES[base]}{given}", param,
                        code="invalid_type")
  bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
            "less_than": "<"}
  if kind in bounds:
    limit = next(iter(ctx.values()))
    limit = ("2**31 - 1" if limit == INT32_MAX else
             int(limit) if isinstance(limit, float) and limit.is_integer()
             and abs(limit) < 1e15 else limit)
    return RequestError(f"{param} must be {bounds[kind]} {limit}{given}", param)
  if kind == "finite_number":
    return RequestError(f"{param} must be a finite number{given}", param)
  if kind in ("too_short", "string_too_short"):
    return RequestError(f"{param} must not be empty", param)
  if kind in ("too_long", "string_too_long"):
    limit = ctx.get("max_length")
    unit = "characters" if kind == "string_too_long" else "items"
    return RequestError(f"{param} must hold at most {limit} {unit}", param)
  if kind == "literal_error":
    return RequestError(f"{param} must be one of {ctx.get('expected')}{given}", param)
  if kind == "value_error":
    return RequestError(f"{param} {ctx.get('error')}" if param else str(ctx.get("error")),
                        param)
  return RequestError(f"{param}: {err.get('msg', 'invalid value')}", param)


def check_model(req: _SamplingRequest, model_name: str) -> None:
  """Raises `RequestError` (404) if `req` names a model other than `model_name`."""
  if req.model is not None and req.model != model_name:
    raise RequestError(f"The model {shown(req.model)} does not exist; this server "
                       f"serves {shown(model_name)}", "model", status=404,
                       code="model_not_found")


def default_max_tokens(req: _SamplingRequest, *, prompt_len: int, max_model_len: int,
                       default_max_tokens: int) -> int:
  """`max_tokens` of the request, else the server's default cut to what the
  context leaves (at least 1: a prompt that fills the context is then
  refused by `check_limits`, naming the prompt)."""
  if req.requested_max_tokens is not None:
    return req.requested_max_tokens
  return max(1, min(default_max_tokens, max_model_len - prompt_len))


# SamplingParams' field names -> the request's (the ones that differ).
_PUBLIC = {"max_new_tokens": "max_tokens"}


def sampling_error(error: ValueError, req: _SamplingRequest) -> RequestError:
  """A `SamplingParams` ValueError (the one place its rules live: the seed's
  range with `n`, `min_tokens` within the budget, ...) as a 400 in the
  request's field names, `param` the first field it names."""
  names = dict(_PUBLIC)
  if getattr(req, "max_completion_tokens", None) is not None:
    names["max_new_tokens"] = "max_completion_tokens"
  if isinstance(req, ChatCompletionRequest):
    names["logprobs"] = "top_logprobs"
  text = _cli.one_line(error)
  word = lambda f: rf"(?<![\w.-]){f}(?![\w(])"  # noqa: E731
  fields = sorted(SamplingParams.__dataclass_fields__, key=len, reverse=True)
  named = [(m.start(), f) for f in fields for m in [re.search(word(f), text)] if m]
  for field in fields:
    text = re.sub(word(field), names.get(field, field), text)
  first = min(named)[1] if named else None
  return RequestError(text, names.get(first, first))


def check_limits(req: _SamplingRequest, params: SamplingParams, *, prompt_len: int,
                 max_model_len: int, max_seqs: int,
                 max_logprobs: int | None = None, max_logit_bias: int | None = None,
                 vocab_size: int | None = None) -> None:
  """The server's limits on a request whose `SamplingParams` are `params`.

  Top log-probs and `logit_bias` are the engine's rule
  (`admission.limits_rejection`, in the request's field names); the context
  and the batch are too (`admission.size_rejection`, asked here before the
  request is queued, so that the answer can be OpenAI's
  `context_length_exceeded` naming the field, in the server's words).

  Raises:
    RequestError: 400 past the context, the batch, `max_logprobs` (the
      engine's `EngineConfig.max_logprobs`, the server's `--max-logprobs`),
      `max_logit_bias` (likewise) or the vocabulary (`logit_bias` ids).
  """
  from paged_jax.serving.admission import limits_rejection, size_rejection  # pylint: disable=import-outside-toplevel
  unbounded = 2**31  # a limit not given is not checked
  why = limits_rejection(
      params, max_logprobs=unbounded if max_logprobs is None else max_logprobs,
      max_logit_bias=unbounded if max_logit_bias is None else max_logit_bias,
      vocab_size=unbounded if vocab_size is None else vocab_size)
  if why:  # the engine's rule, in the request's field names
    raise sampling_error(ValueError(why), req)
  # The engine's length rule alone (any batch), then its batch rule alone.
  if size_rejection(params, prompt_len, max_batch=params.num_seqs,
                    max_model_len=max_model_len):
    where = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if req.requested_max_tokens is None or prompt_len >= max_model_len:
      raise RequestError(f"This model's maximum context length is {max_model_len} "
                         f"tokens; the prompt has {prompt_len}", where,
                         code="context_length_exceeded")
    name = ("max_completion_tokens" if getattr(req, "max_completion_tokens", None)
            is not None else "max_tokens")
    raise RequestError(f"This model's maximum context length is {max_model_len} "
                       f"tokens; the prompt has {prompt_len} and {name} asks for "
                       f"{params.max_new_tokens} more ({prompt_len + params.max_new_tokens})",
                       name, code="context_length_exceeded")
  if size_rejection(params, prompt_len, max_batch=max_seqs, max_model_len=None):
    name = "best_of" if getattr(req, "best_of", None) and req.best_of > (req.n or 1) else "n"
    raise RequestError(f"{name} ({req.num_seqs}) exceeds the {max_seqs} sequences "
                       "this server runs at once", name)
