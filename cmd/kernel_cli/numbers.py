"""Every number and duration the CLI takes, parsed and checked in this one place.

One duration grammar everywhere: a bare number of seconds or a number with
a unit, `90`, `90s`, `1.5m`, `2h`, `7d`, `2w`. Counts are whole numbers.
Nothing non-finite gets through (`inf`, `nan`, `1e400`), nor a negative
value, nor a zero where zero means nothing; every duration is at most
`MAX_SECONDS` (100 years), so deadlines and date arithmetic cannot overflow.

The `parse_*` functions raise `ValueError` with a message that completes
"--flag ..."; the option parsers (`duration()`, `age()`, `count()`, `amount()`,
`percent()`, `days()`, given to `typer.Option(parser=...)`) turn it into typer's usage error, which
`kernel` prints as one line with exit 2. `from_env` does the same for an
environment variable, as a `kernel.ConfigError`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import typer

T = TypeVar("T")

#: Seconds per duration unit; a bare number is seconds.
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: The grammar, as help texts say it.
DURATION_FORMS = "90, 90s, 5m, 2h, 7d or 2w"
#: The longest duration accepted anywhere (100 years).
MAX_SECONDS = 100 * 365 * 86400
#: The largest count accepted anywhere (what a 64-bit integer column holds).
MAX_COUNT = 2**63 - 1

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*$")
_COUNT = re.compile(r"^\s*\+?(\d+)\s*$")
_AMOUNT = re.compile(r"^\s*\+?(\d+(?:\.\d*)?|\.\d+)\s*$")


def parse_duration(text: str, *, zero: bool = True) -> float:
    """`90`, `90s`, `5m`, `2h`, `7d`, `2w` (with decimals: `1.5h`) as seconds.

    Args:
        text: What the user typed.
        zero: Whether 0 is accepted (where it means "none" or "off").

    Raises:
        ValueError: Anything else, a non-finite or too large value, or 0 when
            `zero` is false.
    """
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"expects a duration like {DURATION_FORMS}, got {text!r}")
    seconds = float(m.group(1)) * UNITS[m.group(2) or "s"]
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise ValueError(f"must be at most 100 years, got {text!r}")
    if seconds == 0 and not zero:
        raise ValueError(f"must be more than 0, got {text!r}")
    return seconds


def parse_age(text: str) -> timedelta:
    """A `--since` value: a duration (0 allowed) as a timedelta."""
    return timedelta(seconds=parse_duration(text))


def parse_count(text: str, *, minimum: int = 0) -> int:
    """A whole number >= `minimum` (and at most `MAX_COUNT`).

    Raises:
        ValueError: Not a whole number, or out of range.
    """
    m = _COUNT.match(text)
    if m is None:
        raise ValueError(f"expects a whole number, got {text!r}")
    value = int(m.group(1))
    if value < minimum:
        raise ValueError(f"must be at least {minimum}, got {text!r}")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}, got {text!r}")
    return value


def parse_days(text: str) -> int:
    """A whole number of days >= 0, at most 100 years of them.

    Raises:
        ValueError: Not a whole number, or out of range.
    """
    days = parse_count(text)
    if days > MAX_SECONDS // 86400:
        raise ValueError(f"must be at most {MAX_SECONDS // 86400} days, got {text!r}")
    return days


def parse_amount(text: str, *, maximum: float | None = None) -> float:
    """A finite decimal number >= 0 (`0.5`, `12`), at most `maximum` if given.

    Raises:
        ValueError: Not a plain decimal number (`inf`, `nan`, `-1`, `1e400`), or too large.
    """
    m = _AMOUNT.match(text)
    value = float(m.group(1)) if m is not None else math.nan
    if not math.isfinite(value):
        raise ValueError(f"expects a number >= 0 like 0.5 or 12, got {text!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"must be at most {maximum:g}, got {text!r}")
    return value


def parse_price(text: str) -> tuple[float, float]:
    """`IN,OUT`: US dollars per million input and output tokens (`0.15,0.60`).

    Raises:
        ValueError: Not two amounts >= 0 separated by a comma.
    """
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"expects IN,OUT: US dollars per million input and output tokens "
                         f"(like 0.15,0.60), got {text!r}")
    try:
        return (parse_amount(parts[0].strip(), maximum=1e6),
                parse_amount(parts[1].strip(), maximum=1e6))
    except ValueError:
        raise ValueError(f"expects IN,OUT: two amounts >= 0 in US dollars per million "
                         f"tokens (like 0.15,0.60), got {text!r}") from None


def from_env(name: str, parse: Callable[[str], T], default: T) -> T:
    """The environment variable `name` through `parse`; `default` when unset or empty.

    Raises:
        kernel.ConfigError: The value does not parse (the message names the variable).
    """
    from kernel import ConfigError

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} {exc}") from None


# ----------------------------------------------------- typer option parsers


def _option(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as a `typer.Option(parser=...)`: a ValueError becomes typer's usage error.

    typer also passes an option's default through it (`1.0`, `20`): that is
    parsed from its text like anything typed.
    """
    def parser(text: str) -> T:
        try:
            return parse(str(text))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None

    return parser


def duration(*, zero: bool = True) -> Callable[[str], float]:
    """Option parser: seconds from `90`, `90s`, `5m`, `2h`, `7d`, `2w` (0 only if `zero`)."""
    return _option(lambda text: parse_duration(text, zero=zero))


def age() -> Callable[[str], timedelta]:
    """Option parser: a `--since` duration as a timedelta."""
    return _option(parse_age)


def count(*, minimum: int = 0) -> Callable[[str], int]:
    """Option parser: a whole number >= `minimum`."""
    return _option(lambda text: parse_count(text, minimum=minimum))


def days() -> Callable[[str], int]:
    """Option parser: a whole number of days >= 0."""
    return _option(parse_days)


def amount() -> Callable[[str], float]:
    """Option parser: a finite decimal number >= 0 (dollars, ...)."""
    return _option(parse_amount)


def percent() -> Callable[[str], float]:
    """Option parser: a finite number of percentage points, 0 to 100."""
    return _option(lambda text: parse_amount(text, maximum=100))
