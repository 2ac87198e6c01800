"""Interpolation: `${namespace.path}` in actions, sources and route targets.

Syntax::

    ${context.x}                  a variable
    ${captured.lint.output?}      `?`: missing -> empty string
    ${env.HOME:default=/root}     `:default=VALUE` (takes the rest, up to `}`)
    ${captured.msg.output:raw}    `:raw`: insert into a shell action unquoted
    ${context.file:shell}         `:shell`: the value shell-quoted (little-loops);
                                  in a shell action, one word wherever words are read
    $${HOME}                      a literal `${HOME}` (for the shell)
    ${loop.started_at:0:19}       bash's own operators (`:N`, `:N:M`, `:-`, `:=`,
                                  `:+`, `:?`; `#`, `##`, `%`, `%%`, `/`, `//`,
                                  `^`, `^^`, `,`, `,,`, `@Q`, `[i]` after the name;
                                  `${#x}`, `${!x}`) are not applied to loop
                                  variables, as in little-loops: reaching one ends
                                  the run error (a dry run shows a stand-in;
                                  validate warns)

Namespaces: context, captured (NAME.output|stderr|exit_code|duration_ms),
prev (output|stderr|exit_code|duration_ms|state), result (verdict|details.*),
state (name|iteration), loop (name|elapsed_ms|elapsed|started_at|dir|file|
run_id), env, param (a fragment's parameters, bound by the state's `with:`).

**Shell actions never parse an interpolated value.** `render_shell` does
not paste values into the command text (where quoting mistakes become
injection); it passes each value to bash as an environment variable and
writes a quoted *reference* to it ("${KLOOP_1}") at the placeholder (a
quoted heredoc body, where nothing expands, gets the value itself: it is
data there, and a value that would end the body early is refused). The
shell expands a parameter without re-reading it as syntax, so a captured
`a'; touch INJECTED; echo '` stays one argument. The reference is written
to suit the quoting context it lands in (a small scanner tracks quotes,
`$(...)`, backquotes, comments and heredocs), and a wrong guess costs at
worst word splitting, never execution: the value is not in the text. A
quoted heredoc inside backquotes is refused (backquotes re-read their
text). `:raw` opts out (validation
warns). Large values go through a file instead of the environment (see
`spill`).

Quoting cannot protect arithmetic: bash evaluates the *value* of a variable
there, and `a[$(cmd)]` runs `cmd`. The scanner marks the spots where bash
evaluates arithmetic (`$(( ))`, `(( ))`, `$[ ]`, `let`, `declare -i` and
kin, `[[ ]]` numeric tests, array subscripts, `${var:offset}`), and a value
placed there must be a plain integer or `render_shell` raises `UnsafeValue`
before anything runs. A command that evaluates its arguments itself (eval,
bash -c) or a value copied into a variable and used in arithmetic later is
out of the scanner's sight.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

NAMESPACES = ("context", "captured", "prev", "result", "state", "loop", "env", "param")

#: The fields a capture (and `prev`) holds.
CAPTURE_FIELDS = ("output", "stderr", "exit_code", "duration_ms")
STATE_FIELDS = ("name", "iteration")
LOOP_FIELDS = ("name", "elapsed_ms", "elapsed", "started_at", "dir", "file", "run_id")
PREV_FIELDS = (*CAPTURE_FIELDS, "state")

ENV_PREFIX = "KLOOP_"

#: Why a bash operator after a loop variable has no value (little-loops:
#: generalized-fsm-loop.md, "Resolution Rules", BUG-2346).
BASH_OP_WHY = ("'{op}' is bash syntax, which loop variables do not take (as in "
               "little-loops); transform the value in the shell instead "
               "(v=${{...}}; echo \"$${{v{op}}}\")")


def bash_op_why(ph: Placeholder) -> str:
    """`BASH_OP_WHY` for `ph`'s operator (a prefix one, `${#x}`, shown as `$${#v}`)."""
    op = ph.bash_op or ""
    if not ph.bash_prefix:
        return BASH_OP_WHY.format(op=op)
    return (f"'{op}' before the name is bash syntax, which loop variables do not take "
            f"(as in little-loops); use the shell instead (v=${{...}}; echo \"$${{{op}v}}\")")


class TemplateError(ValueError):
    """A template is malformed (unclosed `${`, unknown namespace or modifier)."""


class UnsafeValue(TemplateError):
    """A value cannot stand where a shell action puts it (arithmetic needs an integer)."""


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
    shell: bool = False
    #: A bash parameter operator written after the variable (`:0:19`, `:-x`, `%%.*`,
    #: `^^`): not applied, as in little-loops; looking the value up raises TemplateError.
    bash_op: str | None = None
    #: The operator stands before the name (`${#x}`: length, `${!x}`: indirection).
    bash_prefix: bool = False

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


#: What follows `${name:` when it is bash's own operator: substring
#: (`:0:19`, `:3`) or a default/assign/alternate/error form (`:-`, `:=`, `:+`, `:?`).
_BASH_OP = re.compile(r"-?[0-9]+(?::-?[0-9]+)?|[-=+?].*", re.DOTALL)
#: Where bash's operators written straight after a name begin: `#`/`##` and `%`/`%%`
#: (trim), `/`, `//`, `/#`, `/%` (replace), `^`, `^^`, `,`, `,,` (case), `@Q` and kin
#: (transform), `[` (a subscript). No loop variable's name holds one of these.
_BASH_SUFFIX = re.compile(r"[#%/^,@\[]")
#: A name after `${#` or `${!` (bash's length and indirection).
_BASH_PREFIXED = re.compile(r"[#!][A-Za-z_]")


def _placeholder(source: str) -> Placeholder:
    inner = source[2:-1]
    bash_op: str | None = None
    prefix = False
    if _BASH_PREFIXED.match(inner.lstrip()):
        inner = inner.lstrip()
        bash_op, prefix, inner = inner[0], True, inner[1:]
    colon = inner.find(":")
    found = _BASH_SUFFIX.search(inner)
    if found is not None and (colon < 0 or found.start() < colon) and bash_op is None:
        bash_op, inner = inner[found.start():], inner[:found.start()]
    var, _, rest = inner.partition(":")
    default: str | None = None
    raw = shell = False
    if bash_op is None and _BASH_OP.fullmatch(rest):
        bash_op, rest = ":" + rest, ""
    while rest:
        if rest.startswith("default="):
            default = rest[len("default="):]
            if "${" in default:
                raise TemplateError(f"{source}: a default is literal text, it cannot hold "
                                    "a ${...} reference (give the value in context: instead)")
            break
        mod, _, rest = rest.partition(":")
        if mod == "raw":
            raw = True
        elif mod == "shell":
            shell = True
        else:
            raise TemplateError(f"unknown modifier ':{mod}' in {source} "
                                "(known: ':default=VALUE', ':raw', ':shell')")
    if raw and shell:
        raise TemplateError(f"{source}: ':raw' and ':shell' contradict each other")
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
    return Placeholder(source, namespace, tuple(path.split(".")), default, optional, raw,
                       shell, bash_op, prefix)


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
    param: Mapping[str, Any] = field(default_factory=dict)
    #: A dry run: a placeholder that cannot have a value reads as a stand-in.
    dry: bool = False


def lookup(ph: Placeholder, ns: Namespaces) -> Any:
    """The raw value of `ph` (defaults not applied).

    Raises:
        MissingVariable: no value.
        TemplateError: `ph` carries a bash operator (outside a dry run).
    """
    if ph.bash_op is not None:
        if ns.dry:
            shown = f"{ph.bash_op}{ph.name}" if ph.bash_prefix else f"{ph.name}{ph.bash_op}"
            return StandIn(shown)
        raise TemplateError(f"{ph.source}: {bash_op_why(ph)}")
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


class StandIn(dict[str, Any]):
    """For dry runs: a mapping that has every key, missing ones reading `<namespace.path>`.

    A dry run walks a loop without the values a real run would have (context
    from --context, captures of simulated or skipped states, `prev` before any
    action); these stand-ins keep the walk going and show what was missing.
    """

    def __init__(self, name: str, values: Mapping[str, Any] | None = None) -> None:
        super().__init__(values or {})
        self.name = name

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: str) -> Any:
        return StandIn(f"{self.name}.{key}")


def to_text(value: Any) -> str:
    """How a value reads when interpolated: None -> '', bools lower-case, containers as JSON."""
    if isinstance(value, StandIn) and not dict.__len__(value):
        return f"<{value.name}>"
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
    """The text `ph` stands for, applying `:default=`, `?` and `:shell` (shell-quoted)."""
    try:
        text = to_text(lookup(ph, ns))
    except MissingVariable:
        if ph.default is not None:
            text = ph.default
        elif ph.optional:
            text = ""
        else:
            raise
    return shlex.quote(text) if ph.shell else text


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
# reference can work there: the value is written in (see `render_shell`).
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
_CODE = ("top", "sub", "bq")
# Frames that do not change how a reference is written (the enclosing quoting decides).
_TRANSPARENT = ("param", "subs", "cond")
_ARITH_TESTS = {"-eq", "-ne", "-lt", "-le", "-gt", "-ge"}
_DECLARERS = {"declare", "local", "typeset", "readonly", "export"}
_PREFIX_WORDS = {"!", "then", "do", "else", "elif", "if", "while", "until", "time", "{", "}",
                 "command", "builtin"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=")
_READ_VALUE_OPTIONS = {"-d", "-i", "-n", "-N", "-p", "-t", "-u"}
_NAME_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*", re.ASCII)
_SUBSCRIPTED = re.compile(r"(?:^|[\s;&|(])[A-Za-z_][A-Za-z0-9_]*$")
_INTEGER = re.compile(r"\s*[-+]?[0-9]+\s*", re.ASCII)


@dataclass(frozen=True, slots=True)
class Hole:
    """Where a placeholder stands in a shell action.

    Attributes:
        kind: The quoting context (how a reference must be written there).
        arith: True when bash evaluates the text there as arithmetic (`$(( ))`,
            `(( ))`, `$[ ]`, `let`, `declare -i`, a `[[ ]]` numeric test, an
            array subscript, a `${var:offset}`), where a value like
            `a[$(cmd)]` would run `cmd`.
        body: For a quoted heredoc ("heredoc_q"), which body it is in (an index
            into `Scan.bodies`).
        name: True when bash reads the text there as a variable's name (`[[ -v ]]`,
            `test -v`, `printf -v`, `read`, `unset`, a `declare`/`local`/`export`
            name, `declare -n`'s target), where `a[$(cmd)]` would run `cmd` too.
    """

    kind: str
    arith: bool = False
    body: int | None = None
    name: bool = False


def shell_contexts(segments: list[Segment]) -> list[str]:
    """The quoting context of each placeholder of a shell template, in order."""
    return [h.kind for h in shell_holes(segments)]


def shell_holes(segments: list[Segment]) -> list[Hole]:
    """Where each placeholder of a shell template stands, in order."""
    return _scan(segments).found


@dataclass(frozen=True, slots=True)
class QuotedBody:
    """A quoted heredoc's body (holes as NUL characters) and how it ends."""

    text: str
    delimiter: str
    strip_tabs: bool


def _scan(segments: list[Segment]) -> _Scanner:
    scanner = _Scanner("".join(s if isinstance(s, str) else _HOLE for s in segments))
    scanner.run()
    return scanner


class _Scanner:
    """Walks shell text and reports the quoting context at each hole.

    It knows single/double/ANSI quotes, backslash escapes, `$(...)`,
    `$((...))` and `((...))`, `$[...]`, backquotes, `#` comments, heredocs
    (`<<`, `<<-`, quoted or not), `${...}` with its subscripts and offsets,
    `[[ ... ]]`, and the commands that evaluate their arguments as arithmetic
    (`let`, `declare -i` and its kin). It is not a shell parser; see the
    module docstring for why an imperfect answer is still safe.
    """

    def __init__(self, text: str, kind: str = "top") -> None:
        self.text = text
        self.found: list[Hole] = []
        # Each frame: [kind, depth, start]; `start` is where the current simple
        # command began (code frames), the `[[` (cond) or the `${` (param).
        self.stack: list[list[Any]] = [[kind, 0, 0]]
        self.heredocs: list[tuple[str, bool, bool, bool]] = []
        self.bodies: list[QuotedBody] = []

    def run(self) -> list[Hole]:
        text, i, n = self.text, 0, len(self.text)
        while i < n:
            ch = text[i]
            kind = self.stack[-1][0]
            if ch == _HOLE:
                self.found.append(self._hole(i))
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
            elif kind in ("dq", "heredoc"):
                i = self._in_dq(i)
            elif kind == "param":
                i = self._in_param(i)
            elif kind == "subs" and ch == "]":
                frame = self.stack[-1]
                frame[1] -= 1
                if frame[1] <= 0:
                    self.stack.pop()
                i += 1
            elif kind == "cond" and text.startswith("]]", i) and text[i - 1] in " \t\n":
                self.stack.pop()
                i += 2
            else:
                i = self._in_code(i)
        return self.found

    # -- what a hole is

    def _hole(self, i: int) -> Hole:
        kind = next((f[0] for f in reversed(self.stack) if f[0] not in _TRANSPARENT), "top")
        arith = any(f[0] in ("arith", "subs") or (f[0] == "param" and f[1] < 0)
                    for f in self.stack)
        if not arith:
            arith = self._arith_word(i)
        return Hole(kind, arith, name=not arith and self._name_word(i))

    def _name_word(self, i: int) -> bool:
        """A hole where bash reads a variable's name (and evaluates its subscript)."""
        for frame in reversed(self.stack):
            if frame[0] == "cond":
                before = self.text[frame[2]:i].split()
                return bool(before) and before[-1] in ("-v", "-R") and \
                    self.text[i - 1:i].isspace()
            if frame[0] in _CODE:
                return self._name_argument(frame[2], i)
            if frame[0] not in ("dq", "sq", "ansi", "param"):
                return False
        return False

    def _name_argument(self, start: int, i: int) -> bool:
        left = self.text[start:i]
        words = left.split()
        while words and (words[0] in _PREFIX_WORDS or _ASSIGNMENT.match(words[0])):
            words.pop(0)
        if not words:
            return False
        at_start = not left or left[-1].isspace()  # the hole starts a word
        word = "" if at_start else words[-1]  # the part of its word before the hole
        prev = words[-1] if at_start else (words[-2] if len(words) > 1 else "")
        if word and not word.lstrip("\"'"):  # only an opening quote: it starts the word
            at_start, word = True, ""
        cmd, args = words[0], words[1:] if at_start else words[1:-1]
        if cmd in ("printf", "test", "[") and prev == "-v" and at_start:
            return True
        if cmd == "unset" and at_start:
            return True
        if cmd == "read" and at_start:
            return prev not in _READ_VALUE_OPTIONS
        if cmd in _DECLARERS:
            if "=" not in word:  # the name, before any `=`
                return at_start or _NAME_PART.fullmatch(word) is not None
            return word.endswith("=") and any(
                a.startswith("-") and "n" in a[1:] for a in args)  # `declare -n ref=TARGET`
        return False

    def _arith_word(self, i: int) -> bool:
        """A hole in a `[[` numeric test, or an argument of `let` / `declare -i`."""
        for frame in reversed(self.stack):
            if frame[0] == "cond":
                return self._cond_operand(frame[2], i)
            if frame[0] in _CODE:
                return self._arith_command(frame[2], i)
            if frame[0] not in ("dq", "sq", "ansi", "param"):
                return False
        return False

    def _cond_operand(self, start: int, i: int) -> bool:
        left, right = self.text[start:i], self.text[i + 1:]
        right = right[:right.find("]]")] if "]]" in right else right
        before, after = left.split(), right.split()
        prev = (before[-1:] if left[-1:].isspace() or not left else before[-2:-1])
        nxt = (after[:1] if right[:1].isspace() or not right else after[1:2])
        return bool(set(prev + nxt) & _ARITH_TESTS)

    def _arith_command(self, start: int, i: int) -> bool:
        words = self.text[start:i].split()
        while words and (words[0] in _PREFIX_WORDS or _ASSIGNMENT.match(words[0])):
            words.pop(0)
        if not words or (len(words) == 1 and not self.text[i - 1:i].isspace()):
            return False
        if words[0] == "let":
            return True
        return words[0] in _DECLARERS and any(
            w.startswith("-") and not w.startswith("--") and "i" in w[1:] for w in words[1:])

    # -- the contexts

    def _in_dq(self, i: int) -> int:
        ch = self.text[i]
        if ch == "\\":
            return i + 2
        if ch == '"' and self.stack[-1][0] == "dq":
            self.stack.pop()
            return i + 1
        return self._expansion(i) or i + 1

    def _expansion(self, i: int) -> int:
        """`$((`, `$(`, `$[`, `${` or a backquote at `i`: push its frame; 0 if none."""
        text, ch = self.text, self.text[i]
        if text.startswith("$((", i):
            self.stack.append(["arith", 2, i])
            return i + 3
        if text.startswith("$(", i):
            self.stack.append(["sub", 1, i + 2])
            return i + 2
        if text.startswith("$[", i):
            self.stack.append(["subs", 1, i])
            return i + 2
        if text.startswith("${", i):
            j = i + 2
            while j < len(text) and text[j] in "#!":
                j += 1
            while j < len(text) and (text[j].isalnum() or text[j] in "_@*?-$"):
                j += 1
                if text[j - 1] in "@*?-$#" and j - 1 == i + 2:
                    break
            self.stack.append(["param", 1, i])
            if text.startswith("[", j):
                self.stack.append(["subs", 1, j])
                return j + 1
            return j
        if ch == "`":
            if self.stack[-1][0] == "bq":
                self.stack.pop()
            else:
                self.stack.append(["bq", 0, i + 1])
            return i + 1
        return 0

    def _in_param(self, i: int) -> int:
        text, ch = self.text, self.text[i]
        frame = self.stack[-1]
        if ch == "}":
            self.stack.pop()
            return i + 1
        if ch == ":" and frame[1] > 0 and text[i + 1:i + 2] not in ("-", "=", "?", "+"):
            frame[1] = -1  # ${var:offset:length}: arithmetic up to the brace
            return i + 1
        frame[1] = frame[1] if frame[1] < 0 else 0
        return self._in_code(i)

    def _in_code(self, i: int) -> int:
        text, ch = self.text, self.text[i]
        frame = self.stack[-1]
        kind = frame[0]
        if ch == "\\":
            return i + 2
        if ch == "'":
            self.stack.append(["sq", 0, i])
            return i + 1
        if ch == '"':
            self.stack.append(["dq", 0, i])
            return i + 1
        if text.startswith("$'", i):
            self.stack.append(["ansi", 0, i])
            return i + 2
        if text.startswith("((", i) and self._word_start(i):
            self.stack.append(["arith", 2, i])
            return i + 2
        if text.startswith("[[", i) and self._word_start(i) and text[i + 2:i + 3].isspace():
            self.stack.append(["cond", 0, i + 2])
            return i + 2
        pushed = self._expansion(i)
        if pushed:
            return pushed
        if kind in ("sub", "arith") and ch in "()":
            frame[1] += 1 if ch == "(" else -1
            if frame[1] <= 0:
                self.stack.pop()
            return i + 1
        if kind == "subs" and ch == "[":
            frame[1] += 1
            return i + 1
        if ch == "[" and kind in _CODE and (self._assigns_subscript(i)
                                            or self._compound_subscript(i)):
            self.stack.append(["subs", 1, i])
            return i + 1
        if ch == "#" and self._word_start(i):
            self.stack.append(["comment", 0, i])
            return i + 1
        if text.startswith("<<", i) and not text.startswith("<<<", i):
            return self._heredoc_op(i + 2)
        if ch == "\n":
            i = self._newline(i)
            if kind in _CODE:
                frame[2] = i
            return i
        if kind in _CODE and ch in ";&|()":
            frame[2] = i + 1
        return i + 1

    def _assigns_subscript(self, i: int) -> bool:
        """`name[...]=` or `name[...]+=`: the subscript of an indexed array assignment."""
        if not _SUBSCRIPTED.search(self.text[max(0, i - 200):i]):
            return False
        close = self.text.find("]", i)
        return close > 0 and self.text.startswith(("=", "+="), close + 1)

    def _compound_subscript(self, i: int) -> bool:
        """`([...]=value ...)`: a subscript in an array's compound assignment."""
        if i == 0 or self.text[i - 1] not in "( \t\n":
            return False
        close = self.text.find("]", i)
        return close > 0 and self.text.startswith(("=", "+="), close + 1)

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
            in_bq = any(f[0] == "bq" for f in self.stack)
            self.heredocs.append(("".join(word), quoted, strip, in_bq))
        return i

    def _newline(self, i: int) -> int:
        """At a newline in code: read any pending heredoc bodies."""
        i += 1
        text, n = self.text, len(self.text)
        while self.heredocs and i <= n:
            delim, quoted, strip, in_bq = self.heredocs.pop(0)
            body_start = i
            body_end = n
            while i < n:
                end = text.find("\n", i)
                end = n if end < 0 else end
                line = text[i:end]
                if (line.lstrip("\t") if strip else line) == delim:
                    body_end = i
                    i = end + 1
                    break
                i = end + 1
            else:
                body_end = n
            body = text[body_start:body_end]
            if quoted and in_bq:
                # Backquotes re-read their text: a value could end them.
                self.found.extend([Hole("heredoc_q_bq")] * body.count(_HOLE))
            elif quoted:
                self.bodies.append(QuotedBody(body, delim, strip))
                self.found.extend([Hole("heredoc_q", body=len(self.bodies) - 1)]
                                  * body.count(_HOLE))
            else:
                self.found.extend(_Scanner(body, "heredoc").run())
        return i


def render_shell(template: str, ns: Namespaces, *, checked: bool = True) -> ShellCommand:
    """Interpolate a shell action: values travel as environment variables, never as text.

    A value where bash evaluates arithmetic must be a plain integer (digits,
    an optional sign, surrounding whitespace): anything else raises
    `UnsafeValue` and the action does not run. `checked=False` (dry runs,
    which run nothing and show stand-in values) skips the value checks.

    In a quoted heredoc (`<<'EOF'`) nothing is expanded, so the value is
    written into the body itself: the shell reads it as data, and a value
    containing the delimiter line is refused.

    Raises:
        MissingVariable: a variable without value or default.
        UnsafeValue: a value that is not an integer in an arithmetic context, or
            that would end a quoted heredoc.
        TemplateError: a placeholder inside a quoted heredoc inside backquotes.
    """
    segments = parse(template)
    scan = _scan(segments)
    holes = iter(scan.found)
    pasted: dict[int, list[tuple[Placeholder, str]]] = {}
    command: list[str] = []
    display: list[str] = []
    env: dict[str, str] = {}
    for seg in segments:
        if isinstance(seg, str):
            command.append(seg)
            display.append(seg)
            continue
        hole = next(holes, Hole("top"))
        context = hole.kind
        if seg.shell and context in ("top", "sub", "bq", "arith"):
            # Where the shell reads words, the quoted reference already makes the
            # value one word, which is what `:shell`'s quoting is for.
            seg = replace(seg, shell=False)
        value = value_of(seg, ns).replace("\x00", "")
        quoted = seg.raw or context not in ("top", "sub", "bq", "arith")
        display.append(_clip(value) if quoted else shlex.quote(_clip(value)))
        if seg.raw:
            command.append(value)
            continue
        if context == "heredoc_q_bq":
            raise TemplateError(
                f"{seg.source} is inside a quoted heredoc inside backquotes, which re-read "
                "their text; use $(...) instead of backquotes")
        if context == "heredoc_q" and hole.body is not None:
            # A quoted heredoc body is data to the shell: the value is written
            # in (as little-loops does), once it is known not to end the body.
            pasted.setdefault(hole.body, []).append((seg, value))
            command.append(value)
            continue
        if checked and hole.arith and not _INTEGER.fullmatch(value):
            raise UnsafeValue(
                f"{seg.source} stands where bash evaluates arithmetic, and its value "
                f"{_excerpt(value)} is not a plain integer; the action was not run")
        if checked and hole.name and not _NAME.fullmatch(value):
            raise UnsafeValue(
                f"{seg.source} stands where bash reads a variable's name (and evaluates "
                f"its subscript), and its value {_excerpt(value)} is not a plain name; "
                "the action was not run")
        var = f"{ENV_PREFIX}{len(env) + 1}"
        env[var] = value
        command.append(_REFERENCE[context].format(var))
    for index, values in pasted.items():
        if checked:
            _check_body(scan.bodies[index], values)
    return ShellCommand("".join(command), env, "".join(display))


def _check_body(body: QuotedBody, values: list[tuple[Placeholder, str]]) -> None:
    """Refuse values that would end a quoted heredoc early (a line equal to its delimiter).

    The body is rebuilt with the values written in; bash ends the heredoc at
    the first line equal to the delimiter (after leading tabs, for `<<-`), so
    no line of the rebuilt body may be one, however the value's lines join
    the text around them.
    """
    parts = body.text.split(_HOLE)
    text = parts[0] + "".join(value + part for (_, value), part in zip(values, parts[1:],
                                                                       strict=False))
    for line in text.split("\n"):
        if (line.lstrip("\t") if body.strip_tabs else line) == body.delimiter:
            names = ", ".join(ph.source for ph, _ in values)
            raise UnsafeValue(f"{names}: the value would end the quoted heredoc early (a line "
                              f"reading {body.delimiter!r}); the action was not run")


#: A value up to this many bytes travels in bash's environment; a larger one,
#: or one past `ENV_TOTAL_LIMIT` for the action, through a file.
ENV_VALUE_LIMIT = 16 << 10
ENV_TOTAL_LIMIT = 64 << 10


def spill(cmd: ShellCommand, directory: Callable[[], str]) -> tuple[str, dict[str, str]]:
    """The text and environment bash gets, with large values moved to files.

    Linux caps one environment string at 128 KiB and argv plus environment
    at ARG_MAX, so a large value cannot travel as a variable. It is written
    to a file (mode 0600) in `directory()` (called once, only if needed), the
    environment gets the file's path, and a prefix on the command's first
    line reads the file into the same variable name, byte for byte (bash
    cannot hold NUL bytes; values never contain them). The rest of the
    command is unchanged.
    """
    env: dict[str, str] = {}
    prefix: list[str] = []
    total = 0
    where: str | None = None
    for name, value in cmd.env.items():
        size = len(value.encode("utf-8", "surrogateescape"))
        if size <= ENV_VALUE_LIMIT and total + size <= ENV_TOTAL_LIMIT:
            env[name] = value
            total += size
            continue
        where = where or directory()
        path = os.path.join(where, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(value)
        env[f"{name}_FILE"] = path
        prefix.append(f"IFS= read -r -d '' {name} <\"${{{name}_FILE}}\" || :; ")
    return "".join(prefix) + cmd.command, env


def _clip(value: str, limit: int = 200) -> str:
    return value if len(value) <= limit else value[:limit] + "..."
