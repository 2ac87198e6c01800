"""Secrets out of everything the kernel stores: the one redactor the batteries share.

A `Redactor` replaces secrets in text with a marker such as
`[REDACTED:github_token]` (no part of the secret is kept). It knows three
kinds of secret:

- **Token shapes**: OpenAI (`sk-`, `sk-proj-`) and Anthropic (`sk-ant-`) keys,
  Stripe secret keys (`sk_live_`, `rk_test_`, ...), GitHub tokens (`ghp_ gho_
  ghu_ ghs_ ghr_ github_pat_`), GitLab (`glpat-`), Hugging Face (`hf_`)
  and Google API keys (`AIza`), AWS access key ids (`AKIA`/`ASIA`), Slack
  tokens (`xox[abposr]-`, `xapp-`), the path of Slack and Discord webhook
  URLs, JSON web tokens, bearer tokens, `Authorization:` and `Cookie:`
  headers, the password of a URL (`user:password@`, `:password@`), private
  keys (PEM and PGP blocks, raw, JSON-escaped, or behind a `grep -r`
  prefix), the value of an assignment whose name looks secret
  (`AWS_SECRET_ACCESS_KEY=...`, `"password": "..."`, `api_key: ...`,
  `DB_PASS="two words"`), and the argument after a secret-named flag
  (`--token VALUE`, `--password VALUE`; not `--token-file PATH`).
- **Literal values**: the values of environment variables whose names look
  secret (`*TOKEN*`, `*SECRET*`, `*KEY*`, `*PASSWORD*`, `*PASSWD*`,
  `*PASSPHRASE*`, `*CREDENTIAL*`, `*PRIVATE*`, `*COOKIE*`, and `PASS`, `PW`,
  `AUTH` as a word of the name: `DB_PASS`, `MYSQL_PWD`, `GH_AUTH`, but not
  `PWD` or `GIT_AUTHOR_NAME`) and of `--context`
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
    r"TOKEN|SECRET|KEY|PASSW(?:OR)?D|PASSPHRASE|CREDENTIAL|PRIVATE|COOKIE"
    r"|(?<![A-Z])PASS(?![A-Z])|SSHPASS|(?<=[_-])PWD(?![A-Z])|(?<![A-Z])PW(?![A-Z])"
    r"|(?<![A-Z])AUTH(?![A-Z])", re.IGNORECASE)


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
# What follows a secret's name in an assignment (`NAME=`, `"name": `), and its value
# (a quoted value whole, up to its closing quote).
_ASSIGNED = (_Q + r"\s*[:=]\s*" + _Q + r")" + _NOT_MARKED
             + r"(?:(?<=\")[^\"\\]{1,256}(?=\\?\")|(?<=')[^'\\]{1,256}(?=')|[^\s\"'\\,;&]{4,})")

# Private keys. A PEM block (or a PGP `PRIVATE KEY BLOCK`) is replaced whole,
# whatever its lines hold (a `grep -r` prefix, JSON escapes of a key kept in a
# JSON file), up to its END line. A block whose END is not in the same string
# (cut, or printed one line per event) keeps only its header's marker,
# `private_key_start`, for it and the body lines after it; the text after the
# body is kept, and the recorder goes on replacing the key's lines in the
# events that follow (see `KEY_START`, `Redactor.key_body`). Body lines before
# an END whose BEGIN was cut off (the tail of a long stderr) go too.
_PK_NAME = r"[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
_PK_BEGIN = "-----BEGIN" + _PK_NAME
_PK_END = "-----END" + _PK_NAME
_B64 = "A-Za-z0-9+/="
# 16+ base64 characters with a digit, `+`, `/` or a capital past the first (a
# key's body has them all; a long English word has none).
_B64_RUN = r"(?=[" + _B64 + r"][" + _B64 + r"]*?[0-9+/A-Z])[" + _B64 + r"]{16,}"
# A line break: raw, JSON-escaped, or escaped twice (a key in a JSON string in JSON).
_NL = r"(?:[\r\n]|\\{1,2}[rn])"
_LINE_START = r"(?:(?<=[\r\n\"])|(?<=\\[rn])|\A)"
# One line of a key's body, with an optional `path:` prefix (grep -r), or a PEM header.
_PK_LINE = (r"(?:[^\s\"\\:]{1,200}:)?(?:" + _B64_RUN + r"|[" + _B64 + r"]{1,15}(?=\\?\"|\Z)"
            r"|(?:Proc-Type|DEK-Info|Version|Comment|Hash):[^\r\n\"\\]{0,200})")
#: A run of base64 long enough to be part of a key's body (inside a key that
#: began in an earlier text): not inside a longer word, nor an escape's letter.
_PK_FRAGMENT = re.compile(r"(?:(?<![" + _B64 + r"\\_-])|(?<=\\[nrt]))" + _B64_RUN)
_PK_END_RX = re.compile(_PK_END)
_PK_TRIGGERS = ("private key",)
_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("private_key", _PK_BEGIN + r"(?:[^\"\\]|\\.){0,20000}?" + _PK_END, _PK_TRIGGERS),
    ("private_key_start", _PK_BEGIN + r"(?:" + _NL + r"+" + _PK_LINE + r"){0,500}",
     _PK_TRIGGERS),
    ("private_key_tail", _LINE_START + r"(?:(?:[^\s\"\\:]{1,200}:)?[" + _B64 + r"]+" + _NL
                         + r"+){1,500}"
                         r"(?:[^\s\"\\:]{1,200}:)?" + _PK_END, _PK_TRIGGERS),
    ("anthropic_key", _start("sk-ant-") + "[A-Za-z0-9_-]{8,}", ("sk-",)),
    ("openai_key", _start("sk-") + "(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{16,}", ("sk-",)),
    ("stripe_key", _start("sk_") + "(?:live|test)_[A-Za-z0-9]{16,}|"
                   + _start("rk_") + "(?:live|test)_[A-Za-z0-9]{16,}", ("k_live_", "k_test_")),
    ("github_token", _start("gh") + "[pousr]_[A-Za-z0-9]{16,}|"
                     + _start("github_pat_") + "[A-Za-z0-9_]{20,}", ("gh", "github_pat_")),
    ("gitlab_token", _start("glpat-") + "[A-Za-z0-9_-]{20,}", ("glpat-",)),
    ("huggingface_token", _start("hf_") + "[A-Za-z0-9]{30,}", ("hf_",)),
    ("google_api_key", _start("AIza") + "[A-Za-z0-9_-]{30,}", ("aiza",)),
    ("aws_access_key_id", r"A(?<![A-Z0-9]A)[KS]IA[A-Z0-9]{12,16}(?![A-Za-z0-9])",
     ("akia", "asia")),
    ("slack_token", _start("xox") + "[abposr]-[A-Za-z0-9-]{8,}|"
                    + _start("xapp-") + "[0-9]-[A-Za-z0-9-]{8,}", ("xox", "xapp-")),
    # The path of a Slack or Discord webhook URL is its credential.
    ("webhook", r"(?P<webhook_pre>hooks\.slack\.com/(?:services|workflows|triggers)/"
                r"|discord(?:app)?\.com/api/webhooks/)[A-Za-z0-9/_-]{8,}",
     ("hooks",)),
    # `scheme://user:password@` and `scheme://:password@` (redis, postgres).
    ("url_credentials", r"(?P<url_credentials_pre>://[^\s/@:\"'\\]*:)" + _NOT_MARKED
                        + r"[^\s/@\"'\\]+(?=@)", ("@",)),
    ("authorization", r"(?P<authorization_pre>(?i:authorization)" + _Q + r"\s*[:=]\s*" + _Q
                      + r"(?i:(?:basic|token|bearer)\s+)?)" + _NOT_MARKED
                      + r"[^\s\"'\\,;]{6,}", ("authorization",)),
    ("bearer", r"(?P<bearer_pre>(?i:bearer)(?:(?<![A-Za-z0-9](?i:bearer))|(?<=\\[nrt](?i:bearer)))"
               r"\s+)" + _NOT_MARKED
               + r"[A-Za-z0-9._~+/=-]{8,}", ("bearer",)),
    # A JSON web token anywhere else (after the header rules, which name it better).
    ("jwt", _start("eyJ") + r"[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*", ("eyj",)),
    # A Cookie / Set-Cookie header: its value, to the end of the line.
    ("cookie", r"(?P<cookie_pre>(?i:(?<![a-z-])(?:set-)?cookie)" + _Q + r"\s*:\s*" + _Q + r")"
               + _NOT_MARKED + r"[^\s\"\\;=]{1,200}=[^\r\n\"\\]{1,8192}", ("cookie",)),
    # `NAME=value`, `"name": "value"`, `--name=value` for a secret-looking name;
    # a quoted value is taken whole, up to its closing quote.
    ("secret", r"(?P<secret_pre>(?i:secret|passw(?:or)?d|passphrase|token|credentials?"
               r"|api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key)"
               + _ASSIGNED, ("secret", "passw", "passp", "token", "credential", "key")),
    # Short names, each its own rule starting with its literal (sre then skips to
    # it: a `PASSED` line costs a search, not the alternation tried everywhere).
    ("secret", r"(?P<secret_pre>(?i:pass)(?<![a-z](?i:pass))(?![a-z])" + _ASSIGNED, ("pass",)),
    ("secret", r"(?P<secret_pre>(?i:pwd)(?<=[_-](?i:pwd))(?![a-z])" + _ASSIGNED, ("pwd",)),
    ("secret", r"(?P<secret_pre>(?i:auth)(?<![a-z](?i:auth))(?![a-z])" + _ASSIGNED, ("auth",)),
    ("secret", r"(?P<secret_pre>[?&](?i:key)" + _ASSIGNED, ("?key", "&key")),
    # `--token VALUE`, `--password VALUE`, `--api-key VALUE` on a command line, in
    # text or as a JSON array of arguments. Flags naming a file, a path or the
    # like (`--token-file`, `--password-stdin`) take no secret.
    ("flag", r"(?P<flag_pre>-(?<![A-Za-z0-9_-]-)-?(?!-)(?i:(?!no-)[a-z0-9_-]*?"
             r"(?:token|secret|passw(?:or)?d|passphrase|api[_-]?key|access[_-]?key"
             r"|secret[_-]?key|private[_-]?key|credentials?|auth(?!or))"
             r"(?![a-z0-9_-]*(?:file|path|dir|stdin|name|id|type|env|var|url|method|mode)"
             r"(?![a-z0-9_-]))[a-z0-9_-]*)"
             r"(?:\s+|\\?\"\s*,\s*\\?\"))" + _NOT_MARKED
             + r"(?!-)(?:'[^'\\]{1,256}'|[^\s\"'\\]{1,256})",
     ("token", "secret", "passw", "passp", "key", "credential", "auth")),
)
#: An argument that takes a secret as the next argument (the `flag` rule's name part).
_SECRET_FLAG = re.compile(
    r"--?(?!-)(?!no-)[a-z0-9_-]*?(?:token|secret|passw(?:or)?d|passphrase|api[_-]?key"
    r"|access[_-]?key|secret[_-]?key|private[_-]?key|credentials?|auth(?!or))"
    r"(?![a-z0-9_-]*(?:file|path|dir|stdin|name|id|type|env|var|url|method|mode)"
    r"(?![a-z0-9_-]))[a-z0-9_-]*", re.IGNORECASE)
_PREFIXED = frozenset(("url_credentials", "bearer", "authorization", "secret", "cookie",
                       "flag", "webhook"))

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
            than `MIN_LITERAL` are ignored); a value of several lines also line
            by line.
        patterns: Extra regular expressions; each match is replaced whole.
        shapes: Recognise the built-in token shapes.

    Raises:
        ConfigError: A pattern is not a valid regular expression, or matches
            the empty string.
    """

    __slots__ = ("_checks", "_gated", "_literals", "_order", "_patterns", "_shapes", "_triggers",
                 "_user")

    def __init__(self, *, literals: Iterable[str] = (), patterns: Iterable[str] = (),
                 shapes: bool = True) -> None:
        self._shapes = shapes
        # A multi-line secret is also replaced line by line: output is recorded a line
        # per event, where the whole value never appears.
        self._literals = tuple(sorted({v for lit in literals
                                       for v in (lit, *(p.strip() for p in lit.splitlines()
                                                        if "\n" in lit or "\r" in lit))
                                       if len(v) >= MIN_LITERAL},
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
        # The gate before them: a trigger holding another one adds nothing to it. Each
        # gate knows the checks whose trigger holds it, the only ones that can then pass.
        triggers = list(dict.fromkeys(t for t, _ in checks))
        self._triggers = tuple(t for t in triggers
                               if not any(o != t and o in t for o in triggers))
        self._gated = tuple(tuple((t, rule) for t, rule in checks if gate in t)
                            for gate in self._triggers)
        self._order = {rule: i for i, (_, rule) in reversed(list(enumerate(checks)))}

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
                    text = self._armed(text, lowered, self._triggers.index(trigger))
                    break
        for rx in self._user:
            text = rx.sub("[REDACTED:pattern]", text)
        return text

    def _armed(self, text: str, lowered: str, first: int) -> str:
        """Run, in order, every rule one of whose triggers is in `lowered` (the gates
        before `first` are not: neither is any trigger holding one of them)."""
        armed: set[_Rule] = set()
        triggers, gated = self._triggers, self._gated
        for i in range(first, len(triggers)):
            if triggers[i] in lowered:
                for trigger, rule in gated[i]:
                    if rule not in armed and trigger in lowered:
                        armed.add(rule)
        for rule in sorted(armed, key=self._order.__getitem__):
            out = rule.sub(text, lowered)
            if out is not text:
                text, lowered = out, out.lower()
        return text

    def key_body(self, text: str) -> tuple[str, bool]:
        """`text` read as the continuation of a private key whose BEGIN line was in an
        earlier text: runs of base64 long enough to be its body are replaced, up to
        the key's END line (the text after it is left as it is). Returns the text
        and whether the END line was in it. Safe on JSON text (a run never holds
        a quote, a backslash or an escape's letter).
        """
        end = _PK_END_RX.search(text)
        head = text if end is None else text[:end.start()]
        if len(head) >= 16:
            head = _PK_FRAGMENT.sub(_KEY_BODY, head)
        return (head, False) if end is None else (head + text[end.start():], True)

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
            out: list[Any] = []
            secret_next = False  # an argument list: the value after `--token`, `--password`
            for v in value:
                if secret_next and isinstance(v, str) and v and not v.startswith("-"):
                    out.append(v if _is_marker(v) else marker("flag"))
                    secret_next = False
                    continue
                secret_next = isinstance(v, str) and _SECRET_FLAG.fullmatch(v) is not None
                out.append(self.value(v))
            return out
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
_KEY_BODY = marker("private_key")


def _replace(m: re.Match[str]) -> str:
    kind = m.lastgroup or "secret"
    if kind == "private_key_tail":
        return marker("private_key")
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
