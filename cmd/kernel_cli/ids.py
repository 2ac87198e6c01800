"""Run ids a person can type: the short id, and the one resolver every command uses.

A run id is 32 hex digits in the UUIDv7 layout: the first 12 are the start
time in milliseconds, so runs started close together share them and a
prefix of the full id says little. The *short id* is taken from the random
end instead: digits 21-32 (48 random bits), shown as their first 8. Runs
started in the same millisecond still get unrelated short ids, and 8 digits
(32 bits) leave about one chance in 2,000 that any two of 2,000 runs
share one; the resolver then names both and asks for more digits.

`resolve` accepts, case-insensitively and with dashes ignored: a short id or
any prefix of the random end (at least 4 digits), a prefix of the full id
(how ids were abbreviated before), or `last` for the newest run. Several
matches are an error listing them, never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


#: Where the random end of a 32-digit run id starts (after time, version, rand_a, variant).
RANDOM_START = 20
#: Digits of the random end shown as the short id.
SHORT_LEN = 8
#: The fewest digits accepted as a prefix of the random end.
MIN_PREFIX = 4
#: The word that means the newest run.
LAST = "last"

_HEX = re.compile(r"[0-9a-f]+")


def short_id(run_id: str) -> str:
    """The run's short id: the first 8 of its 12 random final digits."""
    flat = run_id.replace("-", "").lower()
    if len(flat) != 32:
        return flat[:SHORT_LEN]
    return flat[RANDOM_START:RANDOM_START + SHORT_LEN]


def normalise(text: str) -> str:
    """`text` as the resolver compares it: lower case, no dashes or spaces.

    Raises:
        ConfigError: It is empty, not hex, or longer than a run id.
    """
    from kernel import ConfigError

    want = text.strip().lower().replace("-", "")
    if not want or len(want) > 32 or not _HEX.fullmatch(want):
        raise ConfigError(f"a run id is a short id (8 hex digits), a full id or 'last', "
                          f"got {text!r}")
    return want


def matches(run_id: str, want: str) -> bool:
    """Whether `run_id` is meant by the normalised `want` (short-id prefix or full prefix)."""
    flat = run_id.replace("-", "").lower()
    if flat.startswith(want):
        return True
    return len(want) >= MIN_PREFIX and flat[RANDOM_START:].startswith(want)


def pick(text: str, candidates: Iterable[str]) -> str:
    """The one id in `candidates` that `text` names (not `last`: callers order runs).

    Raises:
        ConfigError: `text` is malformed, names none of them, or names several.
    """
    want = normalise(text)
    found = sorted({c for c in candidates if matches(c, want)})
    return _one(text, found)


def resolve(cur: Any, text: str, *, table: str = "runs") -> str:
    """The full run id `text` names in the audit database's `table` (a DuckDB cursor).

    Raises:
        ConfigError: `text` is malformed, names no run, or names several.
    """
    from kernel import ConfigError

    if text.strip().lower() == LAST:
        rows = cur.execute(f"SELECT run_id FROM {table} ORDER BY started_at DESC NULLS LAST, "
                           f"run_id DESC LIMIT 1").fetchall()
        if not rows:
            raise ConfigError("no runs yet: 'last' names nothing")
        return str(rows[0][0])
    want = normalise(text)
    params: list[Any] = [want]
    where = "starts_with(lower(replace(run_id, '-', '')), ?)"
    if len(want) >= MIN_PREFIX:
        where += f" OR starts_with(substr(lower(replace(run_id, '-', '')), {RANDOM_START + 1}), ?)"
        params.append(want)
    found = [str(r[0]) for r in cur.execute(
        f"SELECT run_id FROM {table} WHERE {where} ORDER BY run_id LIMIT 6", params).fetchall()]
    return _one(text, found)


def _one(text: str, found: Sequence[str]) -> str:
    from kernel import ConfigError

    if not found:
        raise ConfigError(f"no run matches {text!r}")
    if len(found) > 1:
        shown = ", ".join(f"{short_id(f)} ({f})" for f in found[:5])
        raise ConfigError(f"run id {text!r} is ambiguous: it matches {shown}"
                          f"{', ...' if len(found) > 5 else ''}; give more digits")
    return found[0]
