"""Turning raw evidence into comparable keys: masked calls, result digests, output novelty.

Everything here is a pure function of text, so the rules that use it are
tested without a kernel. Three questions are answered:

- **Is this call the same as that one?** `masked_call_key` compares a call by
  its name and its arguments with the volatile values masked (timestamps,
  UUIDs, hex ids, nonces, the random part of temp paths, counters such as
  `"attempt": 3` or `"n": 3`, epoch-like numbers): `poll(job=1, at=12:00:01)`
  and `poll(job=1, at=12:00:07)` are the same call; `poll(job=101)` and
  `poll(job=102)` are not.
- **Did the result change?** `result_key` masks only what changes without
  meaning (timestamps, UUIDs, long hex ids, nonces, the random part of temp
  paths, sub-second timings, attempt counters) and keeps every other number,
  so a poll answering `1/8` then `2/8`, a byte count that grew or an ETA that
  shrank is progress, and one answering `pending (checked 12:00:07)` is not.
- **Is this output line new?** `line_key` strips ANSI escapes, carriage-
  return redraws, spinner frames and clock times; `Novelty` remembers recent
  lines, so the same line again is not progress and a line whose numbers
  changed is.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from kernel import ToolCall, ToolResult

_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                   r"[0-9a-fA-F]{12}\b")
_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2})?(?:[.,]\d+)?"
                       r"(?:Z|[+-]\d{2}:?\d{2})?)?")
_CLOCK = re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b")
# The random part of a temp path, not the whole path: `/tmp/tmpa8f3k2x/out.txt` and
# `/tmp/tmpzz01kk7/out.txt` are the same file of two runs, `/tmp/a.txt` and
# `/tmp/b.txt` are two files. tempfile's `tmpXXXXXXXX`, mktemp's `tmp.XXXXXXXXXX`,
# pytest's numbered base dirs, macOS's per-user folder under /var/folders.
_TEMP = re.compile(r"\btmp[._]?[A-Za-z0-9_]{6,}\b|\bpytest-\d+\b"
                   r"|(?<=/var/folders/)[^/\s\"']+/[^/\s\"']+")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])"
                  r"[0-9a-fA-F]{8,}\b")
_NONCE = re.compile(r"\b(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{20,}\b")
# A timing measured to a fraction of a second (`ok in 0.53s`, `12ms`): noise. Whole
# seconds, minutes and hours (an ETA going from 50 min to 40 min) are kept.
_TIMING = re.compile(r"\b\d+\.\d+\s?(?:ns|us|µs|ms|s|sec|secs|seconds?)\b"
                     r"|\b\d+\s?(?:ns|us|µs|ms)\b")
# A number that plainly counts attempts (`attempt 3`, `--retry=2`, `"attempt": 3`) or
# stamps a time (`"ts": 1732345678`, `"checked_at": "..."`): masked wherever it is.
_COUNTER_WORD = re.compile(
    r"(?i)\b(attempts?|retry|retries|tries|try|iteration|iter|round|seq|nonce|seed|"
    r"timestamp|ts|[a-z_]*_(?:at|ts|time))(\"?\s*[:=#]\s*\"?|\s+#?)(-?\d+(?:\.\d+)?)(?![\w.])")
# In arguments only: JSON values of keys that name a counter (`"n": 3`, `"count": 4`),
# and epoch-like numbers (9+ digits). In a result these are what changed (a growing
# byte count), so they stay there.
_COUNTER_KEY = re.compile(r"(\"(?:n|i|count|counter|time)\"\s*:\s*\"?)(-?\d+(?:\.\d+)?)"
                          r"(?![\w.])")
_LONG_NUMBER = re.compile(r"(?<![\w.])\d{9,}(?:\.\d+)?(?![\w.])")
_SPACE = re.compile(r"\s+")

# A move to the start of the line without a carriage return: CSI G to column 1 (what
# node's `readline.cursorTo(stream, 0)` writes). A redraw like `\r`, so read as one.
_TO_COLUMN_1 = re.compile(r"\x1b\[[01]?G")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]"          # CSI: colours, cursor moves
                   r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: titles, hyperlinks
                   r"|\x1b[@-Z\\-_]"                      # two-byte escapes
                   r"|[\x00-\x08\x0b-\x1f\x7f]")          # other control characters
# Spinner frames: braille dots, moons, arcs, blocks, stars, and the classic |/-\.
_SPINNER_CHARS = ("\u2800-\u28ff\u25d0-\u25d3\u25f4-\u25f7\u2596-\u259f\u25a0-\u25a1"
                  "\u25cb\u25cf\u25c9\u2022\u00b7\u2736\u2738\u2739\u273a\u273b\u273d"
                  "\u2722\u2733\u2217\u23fa\u2590\u258c")
_SPINNER = re.compile(f"[{_SPINNER_CHARS}]")
_EDGE_SPIN = re.compile(r"^[|/\\\-\s.]+|[|/\\\-\s.]+$")

_LABEL_LIMIT = 80
# How a line not ended yet is shown to the critic when characters were added to it
# (the shell adapter's `PartialLine`): its length, then what it shows.
_PARTIAL = re.compile(r"\d+ chars: ")


def mask_volatile(text: str) -> str:
    """`text` with values that change without meaning masked (results, errors).

    Timestamps and clock times, UUIDs, hex ids of 8+ digits, long random
    tokens, the random part of temp paths, timings to a fraction of a second
    and numbers that plainly count attempts or stamp a time (`attempt 3`,
    `"ts": 1732345678`) become placeholders. Every other number stays: `2/8`
    is not `1/8`, `4 failed` is not `5 failed`, a byte count that grew and an
    ETA that shrank are changes.
    """
    text = _UUID.sub("<uuid>", text)
    text = _DATETIME.sub("<time>", text)
    text = _CLOCK.sub("<time>", text)
    text = _TEMP.sub("<tmp>", text)
    text = _HEX.sub("<hex>", text)
    text = _NONCE.sub("<id>", text)
    text = _TIMING.sub("<dur>", text)
    return _COUNTER_WORD.sub(r"\1\2<n>", text)


def mask_call_text(text: str) -> str:
    """Arguments with volatile values masked: what `mask_volatile` masks, plus the
    values of counter keys (`"n": 3`, `"count": 4`) and epoch-like numbers.

    Other numbers stay: `poll(job=101)` and `poll(job=102)` are two jobs, and
    digits inside a name (`file_2.py`) name different things.
    """
    text = _COUNTER_KEY.sub(r"\1<n>", mask_volatile(text))
    return _LONG_NUMBER.sub("<n>", text)


def _args_json(args: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(args), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, default=repr)
    except (TypeError, ValueError):  # unsortable keys, circular values
        return repr(dict(args))


def call_key(call: ToolCall) -> str:
    """The exact identity of a tool call: `name(args as sorted, compact JSON)`.

    Two calls with the same name and equal arguments, in whatever order the
    arguments were given, have the same key: `search({"page":1,"q":"x"})`.
    """
    return f"{call.name}({_args_json(call.args)})"


def masked_call_key(call: ToolCall) -> str:
    """A call's identity with volatile argument values masked: near-duplicates compare equal."""
    return f"{call.name}({mask_call_text(_args_json(call.args))})"


def call_label(call: ToolCall) -> str:
    """A short human form of a call for sentences: `read_file(note.txt)`."""
    parts = []
    for value in call.args.values():
        text = value if isinstance(value, str) else _args_json({"v": value})[5:-1]
        parts.append(text)
    label = f"{call.name}({', '.join(parts)})"
    return label if len(label) <= _LABEL_LIMIT else label[: _LABEL_LIMIT - 4] + "...)"


def render_result(result: ToolResult) -> str:
    """A tool result as text: the error when it failed, else its output."""
    if result.error is not None:
        return f"error: {result.error}"
    out = result.output
    if out is None:
        return ""
    if isinstance(out, str):
        return out
    if isinstance(out, bytes):
        return out.decode("utf-8", "replace")
    return _args_json({"v": out})[5:-1]


def result_key(result: ToolResult) -> str:
    """What a result said, with meaningless changes masked; the same answer gives the same key."""
    return mask_volatile(render_result(result))


_FAILED = re.compile(r"^\s*exit (?:code|status) [1-9]|\b(?:error|exception|traceback|fatal|"
                     r"failed|failure|denied|not found|no such file)\b", re.IGNORECASE)


def failure_text(result: ToolResult) -> str | None:
    """What a failed tool call said: its error, or an output that reports a failure.

    Tools that return their failures as output (a shell tool's `exit code 1`
    and stderr, an API's error body) count too: the start of the output is
    checked for a non-zero exit or an error word.
    """
    if result.error is not None:
        return result.error
    out = result.output
    if isinstance(out, str) and _FAILED.search(out[:500]):
        return out
    return None


def error_key(error: str) -> str:
    """An error message with its volatile values masked (`mask_volatile`); numbers stay,
    so `5 failed` then `4 failed`, or errors at different lines, are different errors."""
    return _SPACE.sub(" ", mask_volatile(error)).strip()


def message_key(text: str) -> str:
    """An assistant message, whitespace collapsed: the same words give the same key."""
    return _SPACE.sub(" ", text).strip()


def line_key(text: str) -> str:
    """What an output line shows once redraws, escapes and spinner frames are gone.

    A line redrawn with carriage returns (or moves to its first column,
    `ESC[1G`) shows its last segment that shows something; ANSI escapes and
    control characters go; spinner glyphs go, and so do the `|/-\\` and dots
    at either end; timestamps, clock times and UUIDs are
    masked (`still waiting 12:00:07` again is the same line); whitespace is
    collapsed. Other numbers stay, so `1/8` and `2/8` differ. An empty key
    means the line showed nothing.
    """
    if "\x1b[" in text and "G" in text:
        text = _TO_COLUMN_1.sub("\r", text)
    if "\r" in text:
        segments = [s for s in text.split("\r") if _ANSI.sub("", s).strip()]
        text = segments[-1] if segments else ""
    if "\x1b" in text or not text.isprintable():
        text = _ANSI.sub("", text)
    if ":" in text or "-" in text:
        text = _CLOCK.sub("<time>", _DATETIME.sub("<time>", _UUID.sub("<uuid>", text)))
    text = _SPINNER.sub("", text)
    text = _EDGE_SPIN.sub("", text)
    return _SPACE.sub(" ", text).strip()


def preview(text: str, limit: int = _LABEL_LIMIT) -> str:
    """The first `limit` characters of `text` on one line."""
    one = _SPACE.sub(" ", text).strip()
    return one if len(one) <= limit else one[: limit - 3] + "..."


class Novelty:
    """Which output lines are new: the recent distinct lines, least recently seen dropped first.

    Args:
        memory: How many distinct recent lines are remembered.
    """

    __slots__ = ("_memory", "_seen", "lines", "novel")

    def __init__(self, memory: int = 256) -> None:
        self._memory = memory
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.lines = 0
        self.novel = 0

    def see(self, text: str) -> bool:
        """Count a line; True if it shows something not seen recently.

        A line not ended yet comes as `N chars: TEXT` (what it shows, with its
        length: dots added one by one are progress); one that shows a whole
        line seen recently, and does not end in a dot or a spinner stroke, is
        not new (a status line that reaches the reader in two pieces, its
        newline a moment after its text).
        """
        self.lines += 1
        key = line_key(text)
        if not key:
            return False
        seen = self._seen
        if key in seen:
            seen.move_to_end(key)
            return False
        if text[:1].isdigit():
            partial = _PARTIAL.match(text)
            if partial is not None and text.rstrip()[-1:] not in ".|/-\\":
                shown = line_key(text[partial.end():])
                if shown in seen:
                    seen.move_to_end(shown)
                    return False
        seen[key] = None
        if len(seen) > self._memory:
            seen.popitem(last=False)
        self.novel += 1
        return True
