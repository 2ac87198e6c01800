"""Secrets out of everything the kernel stores: the one redactor the batteries share.

A `Redactor` replaces secrets in text with a marker such as
`[REDACTED:github_token]` (no part of the secret is kept). It knows three
kinds of secret:

- **Token shapes**: OpenAI (`sk-`, `sk-proj-`) and Anthropic (`sk-ant-`) keys,
  GitHub tokens (`ghp_ gho_ ghu_ ghs_ ghr_ github_pat_`), AWS access key ids
  (`AKIA`/`ASIA`), Slack tokens (`xox[abposr]-`), bearer tokens and
  `Authorization:` headers, the `user:password@` of a URL, private-key PEM
  blocks, and the value of an assignment whose name ends like a secret
  (`AWS_SECRET_ACCESS_KEY=...`, `"password": "..."`, `api_key: ...`).
- **Literal values**: the values of environment variables whose names look
  secret (`*TOKEN*`, `*SECRET*`, `*KEY*`, `*PASSWORD*`, `*PASSWD*`,
  `*PASSPHRASE*`, `*CREDENTIAL*`, `*PRIVATE*`, `*COOKIE*`) and of `--context`
  keys named the same way, replaced wherever they appear. Values shorter than
  `MIN_LITERAL` characters are not replaced as substrings (they would mangle
  unrelated text); in a context mapping they are still replaced by key.
- **User patterns**: `--redact REGEX` (repeatable) and `$KERNEL_REDACT`
  (one regex per line), for what has no known shape.

Cost on the hot path: the audit recorder redacts each encoded payload. A
precheck (`str.lower` and ~20 substring tests, ~1 us of CPU per payload)
decides which rules' regexes need to run at all, so a payload with nothing
secret-looking in it pays only the precheck (`bench/bench_redact.py`,
BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from kernel import ConfigError, RunInfo

#: Env var: extra patterns to redact, one regular expression per line.
REDACT_ENV = "KERNEL_REDACT"

#: Shorter literal secrets are not replaced as substrings (only by key, in a context mapping).
MIN_LITERAL = 6

#: A name (env var, context key) whose value is a secret.
SECRET_NAME = re.compile(
    r"TOKEN|SECRET|KEY|PASSW(?:OR)?D|PASSPHRASE|CREDENTIAL|PRIVATE|COOKIE", re.IGNORECASE)


def marker(kind: str) -> str:
    """The text that replaces a secret of `kind`."""
    return f"[REDACTED:{kind}]"


# Built-in shapes: each rule is (kind, regex, triggers). A rule's regex runs
# only when one of its triggers (lower-case substrings every match contains)
# is in the lowered text, and starts with a literal where it can, so that sre
# finds candidates with a fast prefix search instead of trying every branch
# at every position (one alternation of all shapes costs ~15 us on a 60-char
# line that merely contains "gh"). Word-boundary checks are lookbehinds
# *after* the literal for the same reason. Values never contain `"` or a
# backslash (except as an escape consumed whole), so the same rules work on
# raw text and on JSON text without crossing a JSON string's boundary. Rules
# with a `<kind>_pre` group keep that prefix (the header, the assignment's
# name) and replace the rest.
_W = "[A-Za-z0-9_-]"


def _start(literal: str) -> str:
    """`literal` at the start of a token: not after a word character, except the
    `n`/`r`/`t` of a JSON escape (a token at the start of an encoded line)."""
    return rf"{literal}(?:(?<!{_W}{literal})|(?<=\\[nrt]{literal}))"


_Q = r"(?:\\?[\"'])?"  # an optional quote, possibly JSON-escaped
_NOT_MARKED = r"(?!\[REDACTED:)"
_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # A block whose END is not in this string (cut, or printed one line per
    # event) is marked `private_key_start`: the recorder then replaces the
    # lines that follow until the END line (see KEY_START).
    ("private_key", r"-----BEGIN[A-Z ]{0,40}PRIVATE KEY-----"
                    r"(?:[A-Za-z0-9+/=:,.\s-]|\\[nrt])*?"
                    r"(?:(?P<private_key_end>-----END[A-Z ]{0,40}PRIVATE KEY-----)|(?=\"|\Z))",
     ("private key",)),
    ("anthropic_key", _start("sk-ant-") + "[A-Za-z0-9_-]{8,}", ("sk-",)),
    ("openai_key", _start("sk-") + "(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{16,}", ("sk-",)),
    ("github_token", _start("gh") + "[pousr]_[A-Za-z0-9]{16,}|"
                     + _start("github_pat_") + "[A-Za-z0-9_]{20,}", ("gh", "github_pat_")),
    ("aws_access_key_id", r"A(?<![A-Z0-9]A)[KS]IA[A-Z0-9]{12,16}(?![A-Za-z0-9])",
     ("akia", "asia")),
    ("slack_token", _start("xox") + "[abposr]-[A-Za-z0-9-]{8,}", ("xox",)),
    ("url_credentials", r"(?P<url_credentials_pre>://)[^\s/@:\"'\\]+:[^\s/@\"'\\]+(?=@)",
     ("@",)),
    ("authorization", r"(?P<authorization_pre>(?i:authorization)" + _Q + r"\s*[:=]\s*" + _Q
                      + r"(?i:(?:basic|token|bearer)\s+)?)" + _NOT_MARKED
                      + r"[^\s\"'\\,;]{6,}", ("authorization",)),
    ("bearer", r"(?P<bearer_pre>(?i:bearer)(?:(?<![A-Za-z0-9](?i:bearer))|(?<=\\[nrt](?i:bearer)))"
               r"\s+)" + _NOT_MARKED
               + r"[A-Za-z0-9._~+/=-]{8,}", ("bearer",)),
    ("secret", r"(?P<secret_pre>(?i:secret|passw(?:or)?d|passphrase|token|credentials?"
               r"|api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key)" + _Q
               + r"\s*[:=]\s*" + _Q + r")" + _NOT_MARKED + r"[^\s\"'\\,;&]{4,}",
     ("secret", "passw", "passp", "token", "credential", "key")),
)
_PREFIXED = frozenset(("url_credentials", "bearer", "authorization", "secret"))

class _Rule:
    """One compiled rule. Case-insensitive rules also have a lower-case twin,
    matched against the lowered text (plain literals let sre skip ahead; the
    `(?i:...)` form tries every keyword at every position, ~4x slower), with
    the matches spliced into the original text.

    The regexes are compiled on the rule's first use (a rule runs only when
    its trigger is in the text): compiling all of them costs ~3.5 ms of CPU,
    which a short `kernel run` whose output holds no trigger never pays.
    Two threads compiling at once both get the same pattern."""

    __slots__ = ("_lower", "_rx", "_source", "_twin")

    def __init__(self, kind: str, rx: str) -> None:
        self._source = f"(?P<{kind}>{rx})"
        twin = rx.replace("(?i:", "(?:").replace("REDACTED:", "redacted:")
        self._twin = f"(?P<{kind}>{twin})" if twin != rx else None
        self._rx: re.Pattern[str] | None = None
        self._lower: re.Pattern[str] | None = None

    def sub(self, text: str, lowered: str) -> str:
        if self._twin is None or len(lowered) != len(text):
            rx = self._rx
            if rx is None:
                rx = self._rx = re.compile(self._source)
            return rx.sub(_replace, text)
        lower = self._lower
        if lower is None:
            lower = self._lower = re.compile(self._twin)
        out: list[str] = []
        pos = 0
        for m in lower.finditer(lowered):
            out.append(text[pos:m.start()])
            kind = m.lastgroup or "secret"
            if kind in _PREFIXED:
                start, end = m.span(f"{kind}_pre")
                out.append(text[start:end])
            out.append(marker(kind))
            pos = m.end()
        if not out:
            return text
        out.append(text[pos:])
        return "".join(out)


_COMPILED = tuple((_Rule(kind, rx), triggers) for kind, rx, triggers in _RULES)


def _escaped(value: str) -> str:
    """`value` as it appears inside a JSON string."""
    return orjson.dumps(value).decode()[1:-1]


class Redactor:
    """Replaces secrets in text (raw or JSON) with `[REDACTED:kind]` markers.

    Immutable and safe to share between tasks and threads. Build it with
    `Redactor.from_env()` (shapes, secret-named env vars, `$KERNEL_REDACT`)
    and add per-run secrets with `with_secrets`.

    Args:
        literals: Secret values replaced wherever they appear (those shorter
            than `MIN_LITERAL` are ignored).
        patterns: Extra regular expressions; each match is replaced whole.
        shapes: Recognise the built-in token shapes.

    Raises:
        ConfigError: A pattern is not a valid regular expression, or matches
            the empty string.
    """

    __slots__ = ("_checks", "_literals", "_patterns", "_shapes", "_triggers", "_user")

    def __init__(self, *, literals: Iterable[str] = (), patterns: Iterable[str] = (),
                 shapes: bool = True) -> None:
        self._shapes = shapes
        self._literals = tuple(sorted({v for v in literals if len(v) >= MIN_LITERAL},
                                      key=lambda v: (-len(v), v)))
        self._patterns = tuple(patterns)
        self._user = tuple(_compile_user(p) for p in self._patterns)
        # (lower-case trigger, the rule it arms), literals first: a literal is
        # replaced whole before a shape rule could take part of it. A literal
        # that a shape already covers whole (a `ghp_...` in GITHUB_TOKEN)
        # needs no check of its own.
        checks: list[tuple[str, _Rule]] = []
        shaped = Redactor(patterns=(), shapes=True) if shapes and literals else None
        forms: list[str] = []
        for v in self._literals:  # the raw form and, where it differs, the JSON-escaped one
            if shaped is not None and _is_marker(shaped.text(v)):
                continue
            forms.append(v)
            esc = _escaped(v)
            if esc != v:
                forms.append(esc)
        if forms:
            rule = _Rule("literal", "|".join(map(re.escape, forms)))
            checks.extend((f.lower(), rule) for f in forms)
        if shapes:
            checks.extend((t, rule) for rule, triggers in _COMPILED for t in triggers)
        self._checks = tuple(checks)
        self._triggers = tuple(dict.fromkeys(t for t, _ in checks))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 context: Mapping[str, str] | None = None,
                 patterns: Iterable[str] = ()) -> Redactor:
        """The shapes, the secret-named variables of `environ` (default `os.environ`),
        the secret-named keys of `context`, `$KERNEL_REDACT` and `patterns`.

        Raises:
            ConfigError: A pattern (from `patterns` or `$KERNEL_REDACT`) is not
                a valid regular expression, or matches the empty string.
        """
        env = os.environ if environ is None else environ
        return cls(literals=[*secret_values(env), *secret_values(context or {})],
                   patterns=[*env_patterns(env), *patterns])

    def with_secrets(self, literals: Iterable[str] = (), patterns: Iterable[str] = ()
                     ) -> Redactor:
        """A redactor that also replaces `literals` and matches `patterns`."""
        return Redactor(literals=[*self._literals, *literals],
                        patterns=[*self._patterns, *patterns], shapes=self._shapes)

    def __repr__(self) -> str:  # never the literals themselves
        return (f"Redactor(shapes={self._shapes}, literals={len(self._literals)}, "
                f"patterns={len(self._patterns)})")

    @property
    def active(self) -> bool:
        """False if this redactor can never change anything."""
        return bool(self._checks or self._user)

    # ------------------------------------------------------------- redaction

    def text(self, text: str) -> str:
        """`text` with every secret replaced by its marker."""
        if not text:
            return text
        if self._triggers:
            lowered = text.lower()
            for trigger in self._triggers:  # the hot path: nothing found, nothing else runs
                if trigger in lowered:
                    text = self._armed(text, lowered)
                    break
        for rx in self._user:
            text = rx.sub("[REDACTED:pattern]", text)
        return text

    def _armed(self, text: str, lowered: str) -> str:
        """Run, in order, every rule one of whose triggers is in `lowered`."""
        armed: list[_Rule] = []
        for trigger, rule in self._checks:
            if rule not in armed and trigger in lowered:
                armed.append(rule)
        for rule in armed:
            out = rule.sub(text, lowered)
            if out is not text:
                text, lowered = out, out.lower()
        return text

    def json_text(self, text: str) -> str:
        """An encoded JSON document with every secret replaced; still valid JSON.

        The built-in shapes and literals never cross a string boundary, so
        their replacement keeps the document valid. A user pattern might
        (`password.*`): if the result no longer parses, the document is
        decoded, redacted string by string and encoded again.
        """
        out = self.text(text)
        if out is text or not self._user:
            return out
        try:
            orjson.loads(out)
            return out
        except orjson.JSONDecodeError:
            pass
        try:
            doc: Any = orjson.loads(text)
        except orjson.JSONDecodeError:  # not JSON to begin with: one string
            doc = text
        return orjson.dumps(self.value(doc)).decode()

    def value(self, value: Any) -> Any:
        """A copy of a JSON-like value with every string (and mapping key) redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(k) if isinstance(k, str) else k: self.value(v)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value

    def context(self, context: Mapping[str, Any]) -> dict[str, Any]:
        """A context mapping with secret-named keys' values replaced whole, the rest redacted."""
        return {k: marker("context") if isinstance(v, str) and SECRET_NAME.search(str(k))
                else self.value(v) for k, v in context.items()}

    def inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """A run's inputs redacted; a `context` mapping in them by key as well (`context`)."""
        out = self.value(inputs)
        ctx = inputs.get("context")
        if isinstance(ctx, Mapping):
            out[self.text("context")] = self.context(ctx)
        return dict(out)

    def run_info(self, info: RunInfo) -> RunInfo:
        """A copy of `info` as it may be stored: name, subject and inputs redacted."""
        return dataclasses.replace(info, name=self.text(info.name),
                                   subject_id=self.text(info.subject_id),
                                   inputs=self.inputs(info.inputs))


#: The marker of a private key whose END line was not in the same text.
KEY_START = marker("private_key_start")


def _replace(m: re.Match[str]) -> str:
    kind = m.lastgroup or "secret"
    if kind == "private_key" and m.group("private_key_end") is None:
        return KEY_START
    if kind in _PREFIXED:
        return (m.group(f"{kind}_pre") or "") + marker(kind)
    return marker(kind)


def _is_marker(text: str) -> bool:
    return text.startswith("[REDACTED:") and text.endswith("]") and text.count("[") == 1


def secret_values(mapping: Mapping[str, str]) -> list[str]:
    """The values of `mapping`'s keys whose names look secret (`SECRET_NAME`)."""
    return [v for k, v in mapping.items() if isinstance(v, str) and v and SECRET_NAME.search(k)]


def env_patterns(environ: Mapping[str, str]) -> list[str]:
    """The patterns in `$KERNEL_REDACT` (one per line; blank lines ignored)."""
    return [line for line in environ.get(REDACT_ENV, "").splitlines() if line.strip()]


def _compile_user(pattern: str) -> re.Pattern[str]:
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"redact pattern {pattern!r} is not a valid regular expression: "
                          f"{exc}") from None
    if rx.fullmatch(""):
        raise ConfigError(f"redact pattern {pattern!r} matches the empty string")
    return rx
