"""Command-line helpers shared by `paged_jax.capacity` and the example CLIs.

One contract for every command line: a bad value is one line on stderr that
starts with the program's `error:` form, exit status 2, before any work.
Standard library only (no JAX import), so a CLI reports bad flags at once.
"""

from __future__ import annotations

import argparse
import decimal
import fractions
import math


def one_line(text: str, limit: int = 400) -> str:
  """`text` with control characters escaped, cut to `limit` characters, so
  that a message built from user input (a path, a flag value) stays one line."""
  out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
  return out if len(out) <= limit else out[:limit - 3] + "..."


def shown(text: str) -> str:
  """A user's flag value quoted for a message (short, one line)."""
  return one_line(repr(text), limit=60)


class OneLineParser(argparse.ArgumentParser):
  """An `ArgumentParser` whose errors are one line on stderr, exit status 2.

  Flags must be typed in full (`allow_abbrev=False` unless asked): argparse's
  prefix matching read `--max-tokens 0` as `--max-tokens-per-step 0`.

  Args:
    error_prefix: what the line starts with, e.g. `"error: "` or
      `"python -m paged_jax.capacity: error: "`.
  """

  def __init__(self, *args, error_prefix: str = "error: ", **kwargs):
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(*args, **kwargs)
    self.error_prefix = error_prefix

  def error(self, message):  # noqa: D102
    self.exit(2, f"{self.error_prefix}{one_line(message)}\n")


class TypedFlag(argparse.Action):
  """Stores the value and remembers which of the option strings was typed
  (`--max-batch` or its alias `--max-num-seqs`), for `typed_flag`."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    typed = dict(getattr(namespace, "_typed_flags", {}))
    typed[self.dest] = option_string
    namespace._typed_flags = typed  # pylint: disable=protected-access


def typed_flag(args: argparse.Namespace, dest: str, default: str) -> str:
  """The option string the user typed for `dest`, else `default`."""
  return getattr(args, "_typed_flags", {}).get(dest) or default


def int_in(lo: int, hi: int):
  """An argparse type: an integer in `[lo, hi]`."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:  # also more than int's 4300-digit string limit
      raise argparse.ArgumentTypeError(
          f"expected an integer, got {shown(text)}") from None
    if not lo <= value <= hi:
      raise argparse.ArgumentTypeError(
          f"expected an integer in [{lo}, {hi}], got {one_line(text, 60)}")
    return value
  return parse


_MAX_PLACES = 30


def integer(text: str) -> int:
  """An argparse type: an integer of at most 30 digits, any sign. For a flag
  that sets a field of `EngineConfig` or `SamplingParams`: the range is that
  class's rule (one place), and the CLI reports its ValueError with the
  flag's name (`entrypoints.engine_args.as_flags`)."""
  digits = text.strip().lstrip("+-")
  if not (digits.isascii() and digits.isdigit()) or len(digits) > _MAX_PLACES:
    raise argparse.ArgumentTypeError(
        f"expected an integer (at most {_MAX_PLACES} digits), got {shown(text)}")
  return int(text)


def number(text: str) -> float:
  """An argparse type: a finite number (ASCII decimal, any sign, as a
  float); the range is the config's rule, as for `integer`."""
  t = text.strip()
  try:
    value = float(t) if t.isascii() and "_" not in t else None
  except ValueError:
    value = None
  if value is None or not math.isfinite(value):
    raise argparse.ArgumentTypeError(f"expected a finite number, got {shown(text)}")
  return value


def _exact_number(text: str, *, allow_ratio: bool) -> fractions.Fraction | None:
  """`text` as an exact finite number, or None. A decimal whose exponent is
  far outside what any flag takes is refused before it is expanded, so
  `1e99999999` or `1e-99999999` cost nothing."""
  try:
    value = decimal.Decimal(text.strip())
  except (decimal.InvalidOperation, ValueError, TypeError):
    value = None
  if value is not None:
    if not value.is_finite():
      return None
    if value != 0 and value.adjusted() > _MAX_PLACES:
      raise _OutOfRange("")
    if value != 0 and value.adjusted() < -_MAX_PLACES:
      raise _OutOfRange(f" with at most {_MAX_PLACES} decimal places")
    try:
      return fractions.Fraction(value)
    except ValueError:  # more digits than int() takes from a string
      return None
  num, slash, den = text.partition("/")
  if not (allow_ratio and slash):
    return None
  try:
    return fractions.Fraction(int(num), int(den))
  except (ValueError, ZeroDivisionError):
    return None


class _OutOfRange(Exception):
  pass


def number_in(lo, hi, *, lo_open: bool = False, exact: bool = False):
  """An argparse type: a finite number in `[lo, hi]` (`(lo, hi]` if `lo_open`),
  with at most 30 decimal places.

  Returns a `fractions.Fraction` (`exact`, which also accepts a ratio `n/d`)
  or a float.
  """
  lo_f, hi_f = fractions.Fraction(str(lo)), fractions.Fraction(str(hi))
  what = f"a number in {'(' if lo_open else '['}{lo}, {hi}]"

  def parse(text: str):
    try:
      value = _exact_number(text, allow_ratio=exact)
    except _OutOfRange as e:
      value, out, why = None, True, str(e)
    else:
      why = ""
      out = value is not None and (
          value < lo_f or value > hi_f or (lo_open and value == lo_f))
    if out:
      raise argparse.ArgumentTypeError(f"expected {what}{why}, got {one_line(text, 60)}")
    if value is None:
      raise argparse.ArgumentTypeError(
          f"expected a finite number, got {shown(text)}")
    return value if exact else float(value)
  return parse
