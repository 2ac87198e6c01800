"""Run ids a person can type: the short id, and the one resolver every command uses.

A run id the kernel makes is 32 hex digits in the UUIDv7 layout: the first
12 are the start time in milliseconds, so runs started close together share
them and a prefix of the full id says little. The *short id* is taken from
the random end instead: digits 21-32 (48 random bits), shown as their first
8. Runs started in the same millisecond still get unrelated short ids, and
8 digits (32 bits) leave about one chance in 2,000 that any two of 2,000 runs
share one; the resolver then names both and asks for more digits.

A host may choose its own run id (`RunInfo(run_id="job-42")`: any printable
text without a slash, up to `MAX_RUN_ID` characters). Such an id has no
random end: its short id is the id itself, and it is taken as it is.

`resolve` accepts: the run id exactly as recorded; case-insensitively and
with dashes ignored, a short id or any prefix of the random end (at least 4
hex digits) of a 32-digit id, or a prefix of any full id (how ids were
abbreviated before); or `last` for the newest run that is not a child run (a
sub-loop's child is newer than the loop that started it). An exact id wins over
the runs it is a prefix of; otherwise several matches are an error listing
them, never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

#: Where the random end of a 32-digit run id starts (after time, version, rand_a, variant).
RANDOM_START = 20
#: Digits of the random end shown as the short id.
SHORT_LEN = 8
#: The fewest digits accepted as a prefix of the random end.
MIN_PREFIX = 4
#: The word that means the newest run.
LAST = "last"

_HEX = re.compile(r"[0-9a-f]+")
_UUID_LIKE = re.compile(r"[0-9a-f]{32}")


def _flat(run_id: str) -> str:
    """`run_id` as the resolver compares it: lower case, no dashes."""
    return run_id.replace("-", "").lower()


def short_id(run_id: str) -> str:
    """The run's short id: the first 8 of its 12 random final digits.

    An id a host chose (not 32 hex digits) has no random end: its short id
    is the whole id, which every command takes as it is.
    """
    flat = _flat(run_id)
    if _UUID_LIKE.fullmatch(flat) is None:
        return run_id
    return flat[RANDOM_START:RANDOM_START + SHORT_LEN]


def normalise(text: str) -> str:
    """`text` as the resolver compares it (`matches`): lower case, no dashes, no spaces
    around it. Any id `RunInfo` accepts is accepted.

    Raises:
        ConfigError: It is empty, longer than a run id, or holds what no run id
            holds (a slash, a backslash, a control character).
    """
    from kernel import ConfigError, RunInfo

    want = _flat(text.strip())
    try:
        RunInfo(run_id=text)  # what no run id can be (a slash, too long, ...) names none
    except ConfigError:
        want = ""
    if not want:
        raise ConfigError(f"a run id is a short id (8 hex digits), a full id or 'last', "
                          f"got {text!r}")
    return want


def matches(run_id: str, want: str) -> bool:
    """Whether `run_id` is meant by the normalised `want`: a prefix of the whole id, or
    (4+ hex digits) of a kernel-shaped id's random end."""
    flat = _flat(run_id)
    if flat.startswith(want):
        return True
    return (len(want) >= MIN_PREFIX and _HEX.fullmatch(want) is not None
            and _UUID_LIKE.fullmatch(flat) is not None
            and flat[RANDOM_START:].startswith(want))


def pick(text: str, candidates: Iterable[str]) -> str:
    """The one id in `candidates` that `text` names (not `last`: callers order runs).

    Raises:
        ConfigError: `text` is malformed, names none of them, or names several.
    """
    want = normalise(text)
    pool = set(candidates)
    for exact in (text, text.strip()):
        if exact in pool:  # the id as recorded: never ambiguous with ids it prefixes
            return exact
    found = sorted(c for c in pool if matches(c, want))
    same = [c for c in found if _flat(c) == want]
    return _one(text, same if len(same) == 1 else found)


def resolve(cur: Any, text: str, *, table: str = "runs") -> str:
    """The full run id `text` names in the audit database's `table` (a DuckDB cursor).

    Raises:
        ConfigError: `text` is malformed, names no run, or names several.
    """
    from kernel import ConfigError

    if text.strip().lower() == LAST:
        # The newest run someone started: a child run (a sub-loop's) starts after its
        # parent, and "the run I just ran" is the parent.
        top = " WHERE parent_run_id IS NULL" if table == "runs" else ""
        rows = cur.execute(f"SELECT run_id FROM {table}{top} ORDER BY started_at DESC NULLS "
                           f"LAST, run_id DESC LIMIT 1").fetchall()
        if not rows:
            raise ConfigError("no runs yet: 'last' names nothing")
        return str(rows[0][0])
    want = normalise(text)
    # The id exactly as recorded first (a host's own id, spaces and all): it is never
    # ambiguous with the ids it is a prefix of.
    exact = cur.execute(f"SELECT run_id FROM {table} WHERE run_id IN (?, ?) LIMIT 1",
                        [text, text.strip()]).fetchall()
    if exact:
        return str(exact[0][0])
    flat = "lower(replace(run_id, '-', ''))"
    params: list[Any] = [want]
    where = f"starts_with({flat}, ?)"
    if len(want) >= MIN_PREFIX and _HEX.fullmatch(want):
        where += (f" OR (regexp_full_match({flat}, '[0-9a-f]{{32}}') "
                  f"AND starts_with(substr({flat}, {RANDOM_START + 1}), ?))")
        params.append(want)
    found = [str(r[0]) for r in cur.execute(
        f"SELECT run_id FROM {table} WHERE {where} ORDER BY run_id LIMIT 6", params).fetchall()]
    same = [f for f in found if _flat(f) == want]
    return _one(text, same if len(same) == 1 else found)


def _one(text: str, found: Sequence[str]) -> str:
    from kernel import ConfigError

    if not found:
        raise ConfigError(f"no run matches {text!r}")
    if len(found) > 1:
        shown = ", ".join(f"{short_id(f)} ({f})" for f in found[:5])
        raise ConfigError(f"run id {text!r} is ambiguous: it matches {shown}"
                          f"{', ...' if len(found) > 5 else ''}; give more digits")
    return found[0]
