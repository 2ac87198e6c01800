"""One machine-output vocabulary for every command.

- `--json` prints JSON and nothing else on stdout. A single result (`kernel
  run`, `show`, `resume`, `purge`, `sync`, `actions run`, `validate`, ...) is
  one JSON document on one line; a list (`runs`, `stats`, `query`, `export`,
  `recover`, `actions query|stats`, `budget show`) is JSON lines: one object a
  line, nothing at all for an empty list. So every `--json` output is JSON
  lines, read with `jq`, `jq -s` for a list, or a JSON-lines reader.
- `--format table|json|csv` wherever a table is printed: `json` is the same
  JSON lines as `--json`; `csv` is a header row, then one row a line, nested
  values as JSON text, times in ISO 8601.

Times are ISO 8601 strings, decimals are numbers; nothing else is converted.
JSON is strict (RFC 8259): a float that is not finite (NaN, +-Infinity) is
`null`, and an integer keeps every digit (a DuckDB HUGEINT arrives as a
whole Decimal and is printed as that integer); CSV keeps such values exact
too (`nan`, `inf`, every digit).

Human-readable output (tables, `kernel show`) prints recorded data, which
may hold terminal control sequences (a command's output, a run's name).
`visible` replaces every C0 and C1 control character with an escape a
person can read (`\x1b`, `\x9b`), so nothing recorded can clear the screen,
retitle the window or write the clipboard; `table` does it to every cell.
JSON and CSV keep the data exact (JSON escapes the C0 characters itself).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any, NoReturn

import typer

FORMATS = ("table", "json", "csv")
FORMAT_METAVAR = "table|json|csv"
FORMAT_HELP = ("Output format: table, json (JSON lines: one object a line, as --json) or "
               "csv (a header row first).")
JSON_LIST_HELP = "Print JSON lines (one object a line) instead of a table: --format json."
JSON_ONE_HELP = "Print the result as one JSON document (one line) on stdout."


def json_option(help: str = JSON_LIST_HELP) -> Any:
    """The `--json` flag."""
    return typer.Option(False, "--json", help=help)


def format_option() -> Any:
    """The `--format table|json|csv` option (None: table, unless --json)."""
    return typer.Option(None, "--format", metavar=FORMAT_METAVAR, show_default=False,
                        help=FORMAT_HELP + " [default: table]")


def pick(fmt: str | None, json_out: bool) -> str:
    """The format asked for by `--format` and `--json` (one line and exit 2 if they clash)."""
    if fmt is not None and fmt not in FORMATS:
        _usage(f"--format must be table, json or csv, got {fmt!r}")
    if json_out:
        if fmt not in (None, "json"):
            _usage(f"--json and --format {fmt} ask for two formats: give one")
        return "json"
    return fmt or "table"


def jsonable(value: Any) -> Any:
    """`json.dumps` default: ISO 8601 times, decimals as numbers (a whole one as an exact
    integer, a non-finite one as null), bytes as hex, else str."""
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return _decimal(value)
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    return str(value)


def _decimal(value: Decimal) -> int | float | None:
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return int(value)  # every digit: a HUGEINT is not rounded to a double
    return float(value)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return _decimal(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        from dataclasses import asdict

        return _finite(asdict(value))
    return value


def dumps(value: Any) -> str:
    """One JSON document on one line, strict JSON: NaN and +-Infinity are null."""
    try:
        return json.dumps(value, default=jsonable, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: the rare case pays for a walk
        return json.dumps(_finite(value), default=jsonable, ensure_ascii=False,
                          allow_nan=False)


def print_doc(value: Any) -> None:
    """A single result: one JSON document, one line."""
    sys.stdout.write(dumps(value) + "\n")


def print_lines(rows: Iterable[Any]) -> None:
    """A list: JSON lines, one value a line (nothing for an empty list)."""
    sys.stdout.write("".join(dumps(r) + "\n" for r in rows))


def print_csv(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A header row, then one row a line; nested values as JSON, times in ISO 8601."""
    csv_lines(headers)(rows)


def csv_lines(headers: Sequence[str]) -> Callable[[Iterable[Sequence[Any]]], None]:
    """`print_csv` in parts: writes the header row now, and returns a function that writes
    rows (as `print_csv` does) each time it is called."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")

    def write(rows: Iterable[Sequence[Any]]) -> None:
        w.writerows([tuple(csv_cell(v) for v in r) for r in rows])
        sys.stdout.write(buf.getvalue())
        buf.seek(0)
        buf.truncate()

    w.writerow(headers)
    write(())
    return write


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null: its reader is gone (`| head`), and what is still
    buffered, or written later, then goes nowhere instead of failing again."""
    import contextlib
    import os

    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def csv_cell(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (dict, list)):
        return dumps(value)
    if isinstance(value, Decimal):
        return str(int(value)) if value.is_finite() and value == value.to_integral_value() \
            else format(value, "f")
    return value


#: What a terminal acts on, C0 controls (but tab and newline), DEL and C1 controls, and
#: what moves or reorders what it shows: Unicode line and paragraph separators,
#: bidirectional marks, embeddings, overrides and isolates.
_REORDERING = "\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_REORDERING}]")
_CONTROL_ALL = re.compile(f"[\x00-\x1f\x7f-\x9f{_REORDERING}]")


def visible(text: str, *, layout: bool = True) -> str:
    """`text` with each control character as a visible escape (`\\x1b`, `\\u202e`).

    Names, reasons and errors come from whoever recorded them (a shared store
    holds other people's runs): raw, an escape sequence would clear the screen
    or retitle the window of whoever lists them, and a bidirectional override
    would show text in another order than it is. With `layout`, tab and newline
    are kept (the caller's own layout uses them); without, they are escaped too
    (a table cell is one line).
    """
    pattern = _CONTROL if layout else _CONTROL_ALL
    return pattern.sub(_escaped, text)


def _escaped(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def print_records(fmt: str, records: Sequence[Mapping[str, Any]],
                  headers: Sequence[str] | None = None) -> bool:
    """Print `records` as JSON lines or CSV when `fmt` asks; False for a table (caller's job).

    CSV columns are `headers`, else the first record's keys (an empty list
    with no `headers` prints nothing).
    """
    if fmt == "json":
        print_lines(records)
        return True
    if fmt == "csv":
        cols = list(headers) if headers is not None else (list(records[0]) if records else [])
        if cols:
            print_csv(cols, [[r.get(c) for c in cols] for r in records])
        return True
    return False


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
          right: Sequence[int] = ()) -> str:
    """Plain aligned columns (no box drawing), so the output pipes cleanly into grep/awk."""
    cells = [[visible(str(h), layout=False) for h in headers]] + [
        ["" if v is None else visible(str(v), layout=False) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    last = len(headers) - 1
    lines = []
    for r in cells:
        parts = []
        for i, v in enumerate(r):
            if i in right:
                parts.append(v.rjust(widths[i]))
            else:
                parts.append(v if i == last else v.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _usage(message: str) -> NoReturn:
    from .dberrors import error_prefix

    print(f"{error_prefix()} {message}", file=sys.stderr)
    raise typer.Exit(2)
