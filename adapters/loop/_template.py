"""Interpolation: `${namespace.path}` in actions, sources and route targets.

Syntax::

    ${context.x}                  a variable
    ${captured.lint.output?}      `?`: missing -> empty string
    ${env.HOME:default=/root}     `:default=VALUE` (takes the rest, up to `}`)
    ${captured.msg.output:raw}    `:raw`: insert into a shell action unquoted
    $${HOME}                      a literal `${HOME}` (for the shell)

Namespaces: context, captured (NAME.output|stderr|exit_code|duration_ms),
prev (output|stderr|exit_code|duration_ms|state), result (verdict|details.*),
state (name|iteration), loop (name|elapsed_ms|elapsed|started_at|dir|file|
run_id), env.

**Shell actions never parse an interpolated value.** `render_shell` does
not paste values into the command text (where quoting mistakes become
injection); it passes each value to bash as an environment variable and
writes a quoted *reference* to it ("${KLOOP_1}") at the placeholder. The
shell expands a parameter without re-reading it as syntax, so a captured
`a'; touch INJECTED; echo '` stays one argument. The reference is written
to suit the quoting context it lands in (a small scanner tracks quotes,
`$(...)`, backquotes, comments and heredocs), and a wrong guess costs at
worst word splitting, never execution: the value is not in the text. One
place cannot take a reference and is refused by validation: a quoted
heredoc body (nothing is expanded there). `:raw` opts out (validation
warns), and a command that itself evaluates its arguments (eval, bash -c,
arithmetic) is outside what any quoting can protect.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NAMESPACES = ("context", "captured", "prev", "result", "state", "loop", "env")

#: The fields a capture (and `prev`) holds.
CAPTURE_FIELDS = ("output", "stderr", "exit_code", "duration_ms")
STATE_FIELDS = ("name", "iteration")
LOOP_FIELDS = ("name", "elapsed_ms", "elapsed", "started_at", "dir", "file", "run_id")
PREV_FIELDS = (*CAPTURE_FIELDS, "state")

ENV_PREFIX = "KLOOP_"


class TemplateError(ValueError):
    """A template is malformed (unclosed `${`, unknown namespace or modifier)."""


class MissingVariable(LookupError):
    """A variable has no value and no default; `name` is `namespace.path`."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"${{{name}}}: {why}")
        self.name = name
        self.why = why


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One `${...}` in a template."""

    source: str
    namespace: str
    path: tuple[str, ...]
    default: str | None = None
    optional: bool = False
    raw: bool = False

    @property
    def name(self) -> str:
        """`namespace.path`, as written (without modifiers)."""
        return ".".join((self.namespace, *self.path))


Segment = str | Placeholder


def parse(template: str) -> list[Segment]:
    """Split `template` into literal text and placeholders.

    Raises:
        TemplateError: unclosed `${`, an empty or namespace-less variable, an
            unknown namespace or modifier.
    """
    out: list[Segment] = []
    buf: list[str] = []
    i, n = 0, len(template)
    while i < n:
        if template.startswith("$${", i):
            buf.append("${")
            i += 3
            continue
        if template.startswith("${", i):
            end = template.find("}", i + 2)
            if end < 0:
                raise TemplateError(f"unclosed '${{' at {_excerpt(template[i:])}")
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(_placeholder(template[i:end + 1]))
            i = end + 1
            continue
        buf.append(template[i])
        i += 1
    if buf:
        out.append("".join(buf))
    return out


def _placeholder(source: str) -> Placeholder:
    inner = source[2:-1]
    var, _, rest = inner.partition(":")
    default: str | None = None
    raw = False
    while rest:
        if rest.startswith("default="):
            default = rest[len("default="):]
            break
        mod, _, rest = rest.partition(":")
        if mod == "raw":
            raw = True
        else:
            raise TemplateError(
                f"unknown modifier ':{mod}' in {source} (known: ':default=VALUE', ':raw')")
    var = var.strip()
    optional = var.endswith("?")
    if optional:
        var = var[:-1]
    if not var:
        raise TemplateError(f"empty variable {source}")
    namespace, _, path = var.partition(".")
    if namespace not in NAMESPACES:
        hint = (f"; write $${{{var}}} for a shell variable" if not path else "")
        raise TemplateError(f"unknown namespace '{namespace}' in {source} "
                            f"(known: {', '.join(NAMESPACES)}){hint}")
    if not path or any(not part for part in path.split(".")):
        raise TemplateError(f"{source} needs a path after '{namespace}.'")
    return Placeholder(source, namespace, tuple(path.split(".")), default, optional, raw)


def placeholders(template: str) -> list[Placeholder]:
    """The placeholders of `template` (raises `TemplateError` like `parse`)."""
    return [s for s in parse(template) if isinstance(s, Placeholder)]


def _excerpt(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ------------------------------------------------------------------ values


@dataclass(slots=True)
class Namespaces:
    """The values placeholders resolve against, one mapping per namespace."""

    context: Mapping[str, Any]
    captured: Mapping[str, Any]
    prev: Mapping[str, Any] | None
    result: Mapping[str, Any] | None
    state: Mapping[str, Any]
    loop: Mapping[str, Any]
    env: Mapping[str, str]


def lookup(ph: Placeholder, ns: Namespaces) -> Any:
    """The raw value of `ph` (defaults not applied). Raises `MissingVariable`."""
    if ph.namespace == "prev" and ns.prev is None:
        raise MissingVariable(ph.name, "no state has run an action yet")
    if ph.namespace == "result" and ns.result is None:
        raise MissingVariable(ph.name, "there is no evaluation result here (only in routes)")
    if ph.namespace == "env":
        key = ".".join(ph.path)
        if key not in ns.env:
            raise MissingVariable(ph.name, f"environment variable {key} is not set")
        return ns.env[key]
    current: Any = getattr(ns, ph.namespace)
    for depth, part in enumerate(ph.path):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            where = ".".join((ph.namespace, *ph.path[:depth + 1]))
            if ph.namespace == "captured" and depth == 0:
                why = f"no state has captured '{part}' yet"
            elif depth == 0:
                why = f"'{where}' is not defined"
            else:
                why = f"'{where}' does not exist"
            raise MissingVariable(ph.name, why)
    return current


def to_text(value: Any) -> str:
    """How a value reads when interpolated: None -> '', bools lower-case, containers as JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, default=str, sort_keys=True)
    return str(value)


def value_of(ph: Placeholder, ns: Namespaces) -> str:
    """The text `ph` stands for, applying `:default=` and `?`."""
    try:
        return to_text(lookup(ph, ns))
    except MissingVariable:
        if ph.default is not None:
            return ph.default
        if ph.optional:
            return ""
        raise


def render(template: str, ns: Namespaces) -> str:
    """Interpolate `template` as plain text (prompts, sources, route targets, paths)."""
    return "".join(s if isinstance(s, str) else value_of(s, ns) for s in parse(template))


def render_obj(obj: Any, ns: Namespaces) -> Any:
    """Interpolate every string inside a JSON-like structure (MCP params)."""
    if isinstance(obj, str):
        return render(obj, ns)
    if isinstance(obj, Mapping):
        return {k: render_obj(v, ns) for k, v in obj.items()}
    if isinstance(obj, list):
        return [render_obj(v, ns) for v in obj]
    return obj


# ------------------------------------------------------------------- shell


@dataclass(frozen=True, slots=True)
class ShellCommand:
    """A shell action ready to run.

    Attributes:
        command: The text bash runs (placeholders replaced by references).
        env: The values, by the environment variable names the text refers to.
        display: For humans only: the command with the values written in (quoted
            where they stand outside quotes).
    """

    command: str
    env: dict[str, str]
    display: str


# The quoting contexts the scanner distinguishes, and what a reference looks
# like in each. "heredoc_q" (a quoted heredoc body) expands nothing, so no
# reference can work there; validation refuses it.
_REFERENCE = {
    "top": '"${{{0}}}"',
    "sub": '"${{{0}}}"',
    "bq": '"${{{0}}}"',
    "arith": '"${{{0}}}"',
    "dq": "${{{0}}}",
    "heredoc": "${{{0}}}",
    "comment": "${{{0}}}",
    "sq": "'\"${{{0}}}\"'",
    "ansi": "'\"${{{0}}}\"$'",
}

_HOLE = "\x00"
_WORD_BREAK = set(" \t\n;&|()<>")


def shell_contexts(segments: list[Segment]) -> list[str]:
    """The quoting context of each placeholder of a shell template, in order."""
    text = "".join(s if isinstance(s, str) else _HOLE for s in segments)
    return _Scanner(text).run()


class _Scanner:
    """Walks shell text and reports the quoting context at each hole.

    It knows single/double/ANSI quotes, backslash escapes, `$(...)` and
    `$((...))`, backquotes, `#` comments and heredocs (`<<`, `<<-`, quoted or
    not). It is not a shell parser; see the module docstring for why an
    imperfect answer is still safe.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.found: list[str] = []
        self.stack: list[list[Any]] = [["top", 0]]
        self.heredocs: list[tuple[str, bool, bool]] = []

    def run(self) -> list[str]:
        text, i, n = self.text, 0, len(self.text)
        while i < n:
            ch = text[i]
            kind = self.stack[-1][0]
            if ch == _HOLE:
                self.found.append(kind)
                i += 1
                continue
            if kind == "sq":
                if ch == "'":
                    self.stack.pop()
                i += 1
            elif kind == "ansi":
                if ch == "\\":
                    i += 2
                    continue
                if ch == "'":
                    self.stack.pop()
                i += 1
            elif kind == "comment":
                if ch == "\n":
                    self.stack.pop()
                    i = self._newline(i)
                else:
                    i += 1
            elif kind == "dq":
                i = self._in_dq(i)
            else:
                i = self._in_code(i)
        return self.found

    def _in_dq(self, i: int) -> int:
        text, ch = self.text, self.text[i]
        if ch == "\\":
            return i + 2
        if ch == '"':
            self.stack.pop()
            return i + 1
        if text.startswith("$((", i):
            self.stack.append(["arith", 2])
            return i + 3
        if text.startswith("$(", i):
            self.stack.append(["sub", 1])
            return i + 2
        if ch == "`":
            self.stack.append(["bq", 0])
        return i + 1

    def _in_code(self, i: int) -> int:
        text, ch = self.text, self.text[i]
        frame = self.stack[-1]
        kind = frame[0]
        if ch == "\\":
            return i + 2
        if ch == "'":
            self.stack.append(["sq", 0])
            return i + 1
        if ch == '"':
            self.stack.append(["dq", 0])
            return i + 1
        if text.startswith("$'", i):
            self.stack.append(["ansi", 0])
            return i + 2
        if text.startswith("$((", i) or (text.startswith("((", i) and self._word_start(i)):
            start = 3 if ch == "$" else 2
            self.stack.append(["arith", 2])
            return i + start
        if text.startswith("$(", i):
            self.stack.append(["sub", 1])
            return i + 2
        if ch == "`":
            if kind == "bq":
                self.stack.pop()
            else:
                self.stack.append(["bq", 0])
            return i + 1
        if kind in ("sub", "arith") and ch in "()":
            frame[1] += 1 if ch == "(" else -1
            if frame[1] <= 0:
                self.stack.pop()
            return i + 1
        if ch == "#" and self._word_start(i):
            self.stack.append(["comment", 0])
            return i + 1
        if text.startswith("<<", i) and not text.startswith("<<<", i):
            return self._heredoc_op(i + 2)
        if ch == "\n":
            return self._newline(i)
        return i + 1

    def _word_start(self, i: int) -> bool:
        return i == 0 or self.text[i - 1] in _WORD_BREAK

    def _heredoc_op(self, i: int) -> int:
        text, n = self.text, len(self.text)
        strip = i < n and text[i] == "-"
        if strip:
            i += 1
        while i < n and text[i] in " \t":
            i += 1
        word: list[str] = []
        quoted = False
        while i < n and text[i] not in _WORD_BREAK:
            ch = text[i]
            if ch in "'\"":
                quoted = True
                end = text.find(ch, i + 1)
                end = n if end < 0 else end
                word.append(text[i + 1:end])
                i = end + 1
            elif ch == "\\":
                quoted = True
                word.append(text[i + 1:i + 2])
                i += 2
            else:
                word.append(ch)
                i += 1
        if word:
            self.heredocs.append(("".join(word), quoted, strip))
        return i

    def _newline(self, i: int) -> int:
        """At a newline in code: read any pending heredoc bodies, line by line."""
        i += 1
        text, n = self.text, len(self.text)
        while self.heredocs and i <= n:
            delim, quoted, strip = self.heredocs.pop(0)
            while i < n:
                end = text.find("\n", i)
                end = n if end < 0 else end
                line = text[i:end]
                if (line.lstrip("\t") if strip else line) == delim:
                    i = end + 1
                    break
                self.found.extend(["heredoc_q" if quoted else "heredoc"] * line.count(_HOLE))
                i = end + 1
        return i


def render_shell(template: str, ns: Namespaces) -> ShellCommand:
    """Interpolate a shell action: values travel as environment variables, never as text.

    Raises:
        MissingVariable: a variable without value or default.
        TemplateError: a placeholder inside a quoted heredoc.
    """
    segments = parse(template)
    contexts = iter(shell_contexts(segments))
    command: list[str] = []
    display: list[str] = []
    env: dict[str, str] = {}
    for seg in segments:
        if isinstance(seg, str):
            command.append(seg)
            display.append(seg)
            continue
        context = next(contexts, "top")
        value = value_of(seg, ns)
        quoted = seg.raw or context not in ("top", "sub", "bq", "arith")
        display.append(_clip(value) if quoted else shlex.quote(_clip(value)))
        if seg.raw:
            command.append(value)
            continue
        if context == "heredoc_q":
            raise TemplateError(
                f"{seg.source} is inside a quoted heredoc, where nothing is expanded; "
                "use an unquoted heredoc (<<EOF) or :raw")
        var = f"{ENV_PREFIX}{len(env) + 1}"
        env[var] = value
        command.append(_REFERENCE[context].format(var))
    return ShellCommand("".join(command), env, "".join(display))


def _clip(value: str, limit: int = 200) -> str:
    return value if len(value) <= limit else value[:limit] + "..."
