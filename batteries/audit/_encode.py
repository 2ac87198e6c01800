"""Turning payloads and outputs into capped JSON / text on the hot path.

Everything here runs on the trio thread inside recorder calls, so the common
case must be cheap: one orjson encode and a length check. The slow paths
(values orjson refuses, oversize strings) only run when needed.

Caps keep the *tail* of a long value (the end of a command's output is where
the error is) and mark the payload `"truncated": true`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from kernel import ConfigError

if TYPE_CHECKING:
    from batteries.redact import Redactor

#: Env var: the largest string value (an output, a snapshot) stored, in bytes.
MAX_OUTPUT_ENV = "KERNEL_AUDIT_MAX_OUTPUT_BYTES"
#: Env var: the largest whole payload stored, in bytes.
MAX_PAYLOAD_ENV = "KERNEL_AUDIT_MAX_PAYLOAD_BYTES"

DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
_MIN_CAP = 64

# orjson is the hot path: ~0.5 us for a typical payload where the standard
# library takes ~3 us, and payload encoding is most of a recorder call's cost.
# Datetimes and dataclasses are passed to `default` (str), so a payload reads
# the same as it would through `json.dumps(..., default=str)`.
_ORJSON_OPTIONS = (orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
                   | orjson.OPT_PASSTHROUGH_DATACLASS)
_orjson_dumps = orjson.dumps
# The fallback for what orjson refuses (lone surrogates, ints beyond 64 bits,
# keys that are tuples, nesting deeper than 254). ensure_ascii=False keeps
# text readable; a lone surrogate that gets through is replaced by the writer
# (see _store._strings).
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str).encode

EMPTY = "{}"


def env_cap(name: str, default: int) -> int:
    """A byte cap from the environment (`default` if unset).

    Raises:
        ConfigError: The variable is set to something that is not a whole number >= 64.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number of bytes, got {raw!r}") from None
    if value < _MIN_CAP:
        raise ConfigError(f"{name} must be at least {_MIN_CAP} bytes, got {value}")
    return value


def tail(text: str, cap: int) -> tuple[str, bool]:
    """The last `cap` UTF-8 bytes of `text` (whole characters only), and whether it was cut."""
    if len(text) * 4 <= cap:  # fast path: cannot exceed the cap even if all 4-byte chars
        return text, False
    raw = text.encode("utf-8", "replace")
    if len(raw) <= cap:
        return text, False
    return raw[-cap:].decode("utf-8", "ignore"), True


def to_text(value: Any) -> str:
    """A run's output as stored in `runs.output`.

    Strings as-is; JSON values (dicts, lists, numbers, booleans) as JSON;
    anything else as `str(value)`.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple, int, float, bool)):
        return dumps(value)
    return str(value)


def dumps(value: Any) -> str:
    """Compact JSON; values json cannot encode become `str(value)`, bad keys become strings."""
    try:
        return _orjson_dumps(value, default=str, option=_ORJSON_OPTIONS).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        pass
    try:
        return _encode(value)
    except (TypeError, ValueError, RecursionError):
        return _encode(_plain(value, 0))


def encode_payload(payload: Mapping[str, Any] | None, max_value: int, max_total: int,
                   redactor: Redactor | None = None) -> str:
    """The JSON stored in `events.payload`, secrets redacted, with the size caps applied.

    Secrets are replaced first (`batteries.redact`), so a cut can never keep
    the end of a secret whose start it dropped. String values longer than
    `max_value` bytes keep their tail; if the whole payload is still over
    `max_total`, it is replaced by
    `{"truncated": true, "bytes": N, "tail": "<end of the JSON text>"}`.
    Either way a capped payload carries `"truncated": true`.
    """
    if not payload:
        return EMPTY
    try:  # dumps(), inlined: this is the hot path
        text = _orjson_dumps(payload, default=str, option=_ORJSON_OPTIONS).decode()
    except TypeError:
        text = dumps(payload)
    if redactor is not None:
        text = redactor.json_text(text)
    if len(text) <= max_value // 4:  # cheap: no value can be over the cap
        return text
    size = len(text.encode("utf-8", "replace"))
    if size <= max_value:
        return text
    cut = [False]
    plain = _plain(payload, 0)
    capped = _cap_strings(plain if redactor is None else redactor.value(plain), max_value, cut)
    if cut[0] and isinstance(capped, dict):
        capped["truncated"] = True
        text = dumps(capped)
        size = len(text.encode("utf-8", "replace"))
    if size <= max_total:
        return text
    end, _ = tail(text, max(max_total - 100, _MIN_CAP))
    return dumps({"truncated": True, "bytes": size, "tail": end})


def _cap_strings(value: Any, cap: int, cut: list[bool]) -> Any:
    if isinstance(value, str):
        kept, was_cut = tail(value, cap)
        if was_cut:
            cut[0] = True
        return kept
    if isinstance(value, dict):
        return {k: _cap_strings(v, cap, cut) for k, v in value.items()}
    if isinstance(value, list):
        return [_cap_strings(v, cap, cut) for v in value]
    return value


def _plain(value: Any, depth: int) -> Any:
    """A JSON-safe copy: string keys, no NaN/inf, no cycles (cut at depth 64)."""
    if depth > 64:
        return "<too deep>"
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return str(value)
