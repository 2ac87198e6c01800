"""Whole-loop checks and the file loader: what `kernel validate` reports.

Errors mean the loop cannot run as written (an unknown route target, no
initial state, an evaluator missing its parameters, a malformed template, a
broken sub-loop); warnings mean it runs but something looks wrong
(unreachable states, unknown keys, raw shell insertion, a context variable
that must come from `--context`).
"""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel import ConfigError

from . import _template as tpl
from ._compose import Composer, find_loop_file, not_a_file
from ._evaluators import DEFAULT_SCHEMA, verdict_enum
from ._spec import (
    CURRENT,
    LEFT_OUT_EVALUATORS,
    LoopSpec,
    Problem,
    Severity,
    StateSpec,
    parse_loop,
    with_context,
)
from ._yaml import YamlError, load_yaml

MAX_FILE_BYTES = 1 << 20

#: Context variables the runner provides (as little-loops' runner does): `run_dir`,
#: a per-run directory; `max_steps`, the step limit.
RUNNER_CONTEXT = ("run_dir", "max_steps")


class LoopFileError(ConfigError):
    """A loop file cannot be run; `problems` lists everything found (errors first).

    `str()` is one line: the first error, its location, and how many more.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        errors = [p for p in problems if p.severity == "error"]
        first = errors[0] if errors else problems[0]
        more = len(errors) - 1
        suffix = f" (and {more} more error{'s' if more > 1 else ''}; run 'kernel validate')" \
            if more > 0 else ""
        super().__init__(f"{first}{suffix}")


@dataclass(slots=True)
class Report:
    """The outcome of checking a loop file.

    Attributes:
        spec: The parsed loop (None when the file could not be read or parsed).
        problems: Every problem, in file order, errors and warnings mixed.
    """

    spec: LoopSpec | None
    problems: list[Problem] = field(default_factory=list)
    #: Context variables the loop uses that neither the file nor the caller defines.
    missing_context: set[str] = field(default_factory=set)
    #: The `${context.*}` paths the loop (and the sub-loops it passes its context to)
    #: reads; None when that cannot be known (a sub-loop chosen at run time gets it).
    used_context: set[tuple[str, ...]] | None = field(default_factory=set)

    @property
    def errors(self) -> list[Problem]:
        """The problems that stop the loop from running."""
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        """The problems that do not."""
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors


def check_loop(path: str | Path, *, context: Mapping[str, Any] | None = None,
               context_required: bool = False) -> Report:
    """Read, parse and validate the loop file at `path`, and its sub-loops.

    Args:
        path: The loop file.
        context: Variables that will be given on top of the file's `context`
            (the CLI's `--context KEY=VALUE`).
        context_required: Treat a `${context.x}` that neither the file nor
            `context` defines as an error (at run time) rather than a warning
            (at `kernel validate`, where `--context` is not known yet).
    """
    return _check(Path(path), dict(context or {}), context_required, stack=())


def load_loop(path: str | Path, *, context: Mapping[str, Any] | None = None) -> LoopSpec:
    """The loop at `path`, ready to run, or `LoopFileError` naming the first error.

    Missing context variables are errors here: this is the last check
    before a run. Warnings are kept on the result of `check_loop`; callers
    that want them (the CLI) call that instead.
    """
    report = check_loop(path, context=context, context_required=True)
    if report.errors or report.spec is None:
        raise LoopFileError(report.problems or [Problem("error", "", "cannot load", str(path))])
    return report.spec


def _check(path: Path, context: dict[str, Any], required: bool,
           stack: tuple[Path, ...], *, sealed: bool = False) -> Report:
    shown = str(path)
    raw = _read_bounded(path)
    if isinstance(raw, str):
        return Report(None, [Problem("error", "", raw, shown)])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Report(None, [Problem("error", "", f"not UTF-8 text (byte {exc.start})", shown)])
    try:
        data = load_yaml(text)
    except YamlError as exc:
        msg = f"YAML syntax error: {exc.message}" if exc.syntax else exc.message
        return Report(None, [Problem("error", "", msg, shown, exc.line, exc.column)])
    composer = Composer(path, _read_yaml)
    data = composer.resolve(data)
    spec, problems = parse_loop(data, file=shown, default_name=path.stem)
    problems[:0] = composer.problems
    if spec is None:
        return Report(None, problems)
    checker = _Checker(spec, problems, path, context, required, stack, sealed=sealed)
    checker.run()
    if not stack:
        checker.given_context()
    problems.sort(key=lambda p: (p.line or 0))
    return Report(spec, problems, checker.missing, checker.used)


def _read_yaml(path: Path) -> tuple[Any, str | None]:
    """A YAML file another loop names (from:, import:): (data, None) or (None, why not)."""
    raw = _read_bounded(path)
    if isinstance(raw, str):
        return None, f"{path}: {raw}"
    try:
        return load_yaml(raw.decode("utf-8")), None
    except UnicodeDecodeError as exc:
        return None, f"{path}: not UTF-8 text (byte {exc.start})"
    except YamlError as exc:
        where = f"{path}:{exc.line}" if exc.line else str(path)
        return None, f"{where}: {exc.message}"


def _read_bounded(path: Path) -> bytes | str:
    """The file's bytes, or why not: never blocks on a FIFO, never reads past the size limit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return "no such loop file"
    except IsADirectoryError:
        return "is a directory, not a loop file"
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            return "is a directory, not a loop file"
        if not stat.S_ISREG(info.st_mode):
            return f"not a regular file ({_file_kind(info.st_mode)}), not a loop file"
        if info.st_size > MAX_FILE_BYTES:
            return f"too large for a loop file ({info.st_size} bytes; the limit is " \
                   f"{MAX_FILE_BYTES})"
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            return f"too large for a loop file (over {MAX_FILE_BYTES} bytes)"
        return b"".join(chunks)
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


class _Checker:
    """The cross-reference checks over one parsed loop."""

    def __init__(self, spec: LoopSpec, problems: list[Problem], path: Path,
                 context: dict[str, Any], required: bool, stack: tuple[Path, ...], *,
                 sealed: bool = False) -> None:
        self.spec = spec
        #: A sub-loop run without context_passthrough: no --context reaches it.
        self.sealed = sealed
        self.problems = problems
        self.path = path
        self.context = context
        self.required = required
        self.stack = (*stack, path.resolve())
        self.missing: set[str] = set()
        # A dotted --context key (cfg.depth) defines its head (cfg) for the checks.
        self.context_heads = {k.split(".", 1)[0] for k in context}
        #: The `${context.*}` paths read (None: unknowable, see `Report.used_context`).
        self.used: set[tuple[str, ...]] | None = set()
        self.captures = {s.capture for s in spec.states.values() if s.capture}
        self.subloop_states = {s.name for s in spec.states.values() if s.loop is not None}
        self.subloop_states |= {s.capture for s in spec.states.values()
                                if s.loop is not None and s.capture}
        self.captures |= self.subloop_states

    def add(self, severity: Severity, where: str, message: str) -> None:
        self.problems.append(Problem(severity, where, message, self.spec.path,
                                     self.spec.line_of(where)))

    def run(self) -> None:
        spec = self.spec
        if not spec.states:
            return
        names = list(spec.states)
        if spec.initial and spec.initial not in spec.states:
            self.add("error", "initial", f"initial state '{spec.initial}' is not a state"
                                         f"{_suggest(spec.initial, names)}")
        for state in spec.states.values():
            self.state(state, names)
        self.reachability()
        if not spec.maintain and not any(s.terminal for s in spec.states.values()):
            self.add("warning", "states", "no state is terminal: the loop can only end by "
                                          "max_iterations, timeout, or a signal")

    # -- one state

    def state(self, st: StateSpec, names: list[str]) -> None:
        where = f"states.{st.name}"
        self.current = st
        for key, target in st.targets():
            if target == CURRENT or "${" in target:
                if "${" in target:
                    # The evaluation result is there when a verdict is routed (not for
                    # `next`, or the moves that execute nothing).
                    self.template(target, f"{where}.{key}", shell=False,
                                  result=key not in _NO_RESULT_TARGETS)
                continue
            if target not in self.spec.states:
                self.add("error", f"{where}.{key}",
                         f"route target '{target}' is not a state{_suggest(target, names)}")
        if st.action is not None and st.loop is not None:
            self.add("error", f"{where}.loop", "a state has either an action or a loop, not both")
        if st.terminal:
            ignored = [k for k, v in (("action", st.action), ("loop", st.loop),
                                      ("evaluate", st.evaluate), ("next", st.next)) if v]
            if ignored:
                self.add("warning", f"{where}.terminal",
                         f"a terminal state never runs its {', '.join(ignored)}")
        elif not (st.next or st.route or st.on or self.spec.maintain or _signals(st.action)):
            self.add("warning", where, "no transition out (no next, route or on_*): the run "
                                       "ends 'error' after this state unless its output signals")
        if st.next is not None and (st.route is not None or set(st.on) - {"error"}):
            self.add("warning", f"{where}.next", "'next' wins: route/on_* keys other than "
                                                 "on_error are never used")
        if st.action_type is not None and st.action is None:
            self.add("warning", f"{where}.action_type", "action_type without an action")
        if st.params and st.mode != "mcp_tool":
            self.add("warning", f"{where}.params", "params are only used by mcp_tool actions")
        if st.max_retries is not None and st.on_retry_exhausted is None:
            self.add("warning", f"{where}.max_retries",
                     "max_retries without on_retry_exhausted: the run ends 'error' when the "
                     "retries run out")
        if st.on_retry_exhausted is not None and st.max_retries is None:
            self.add("warning", f"{where}.on_retry_exhausted",
                     "on_retry_exhausted without max_retries is never used")
        if st.context_passthrough and st.loop is None:
            self.add("warning", f"{where}.context_passthrough", "only used with 'loop'")
        if st.action is not None:
            self.template(st.action, f"{where}.action", shell=st.mode == "shell")
        for key, value in _strings(st.params, f"{where}.params"):
            self.template(value, key, shell=False)
        if st.evaluate is not None:
            self.evaluate(st, f"{where}.evaluate")
        elif st.mode == "none" and not st.terminal and st.next is None and (st.on or st.route):
            # No action, no evaluator: the verdict is always "yes".
            routes = set(st.on) | (set(st.route.table) if st.route else set())
            if routes and "yes" not in routes and not (st.route and st.route.default):
                self.add("warning", where, "without an action or evaluate, the verdict is "
                                           "always 'yes', and no route takes it")
        if st.loop is not None:
            self.subloop(st, f"{where}.loop")
        elif st.fragment is not None:
            for key, value in st.with_.items():
                if isinstance(value, str):
                    self.template(value, f"{where}.with.{key}", shell=False)
            unknown = [k for k in st.with_ if st.fragment_params and k not in st.fragment_params]
            for key in unknown:
                self.add("error", f"{where}.with.{key}", f"fragment '{st.fragment}' declares no "
                                                         f"parameter '{key}'")
            for key, spec in st.fragment_params.items():
                if spec.required and key not in st.with_ and spec.default is None:
                    self.add("error", f"{where}.with", f"fragment '{st.fragment}' requires "
                                                       f"parameter '{key}': bind it in 'with:'")
        elif st.with_:
            self.add("warning", f"{where}.with", "'with' binds parameters of a fragment or a "
                                                 "sub-loop; this state has neither")
        self.verdicts_routed(st, where)
        self.route_keys(st, where)

    def route_keys(self, st: StateSpec, where: str) -> None:
        """An `on_<verdict>`/route key no evaluator gives (a typo) is an error, with the
        closest key this state's evaluator does give; one that another evaluator gives,
        but not this state's, is a warning (the route is never taken)."""
        keys = [(f"on_{v}", v, f"{where}.on_{v}") for v in st.on]
        if st.route is not None:
            keys += [(v, v, f"{where}.route.{v}") for v in st.route.table]
        if not keys:
            return
        kind = st.evaluate.type if st.evaluate else _DEFAULT_EVALUATOR.get(
            st.mode, "none" if st.mode == "none" else None)
        if kind in LEFT_OUT_EVALUATORS:
            return  # judged `error` (validation says so already)
        gives = _gives(st, kind)
        if gives is None:
            return  # a model schema without a verdict enum: any name may come back
        for key, verdict, at in keys:
            if verdict in _LEFT_OUT_ROUTES:
                self.add("warning", at, f"'{key}': {_LEFT_OUT_ROUTES[verdict]} is not "
                                        "supported here: this route is never taken")
                continue
            if verdict in gives or verdict == "error":
                continue  # (`error` is every state's way out: never a dead route)
            shorthand = key.startswith("on_")
            given = sorted(gives)
            if verdict not in _ALL_VERDICTS:
                names = [f"on_{g}" for g in given] if shorthand else given
                if shorthand and "yes" in gives:
                    names += ["on_success", "on_failure"]
                close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
                hint = (f"did you mean '{close[0]}'?" if close
                        else f"{_what(kind)} gives: {', '.join(given)}")
                self.add("error", at, f"'{key}' routes a verdict no evaluator gives "
                                      f"('{verdict}'): {hint}")
            elif st.next is None:
                self.add("warning", at, f"{_what(kind)} never gives '{verdict}' (it gives "
                                        f"{', '.join(given)}): this route is never taken")

    def verdicts_routed(self, st: StateSpec, where: str) -> None:
        """Warn when a state routes none of the verdicts its evaluator can give."""
        if st.next is not None or st.terminal or (st.route and st.route.default):
            return
        kind = st.evaluate.type if st.evaluate else _DEFAULT_EVALUATOR.get(st.mode)
        gives = _VERDICTS.get(kind or "")
        routed = set(st.on) | (set(st.route.table) if st.route else set())
        if "error" in st.on or (st.route and st.route.error):
            routed.add("no")  # a `no` without its own route goes where errors go
        if gives is None or not routed or routed & gives:
            return
        self.add("warning", where, f"routes none of the verdicts {kind} gives "
                                   f"({', '.join(sorted(gives))}); routed: "
                                   f"{', '.join(sorted(routed))}")

    def evaluate(self, st: StateSpec, where: str) -> None:
        ev = st.evaluate
        assert ev is not None
        need: dict[str, tuple[str, ...]] = {
            "output_contains": ("pattern",),
            "output_numeric": ("target",),
            "output_json": ("path", "target"),
            "convergence": ("target",),
        }
        for key in need.get(ev.type, ()):
            if getattr(ev, key) is None:
                self.add("error", f"{where}.{key}", f"the {ev.type} evaluator needs '{key}'")
        if ev.type == "output_numeric" and ev.target is not None:
            self.numeric(ev.target, f"{where}.target")
        if ev.type == "convergence":
            for key in ("target", "tolerance"):
                value = getattr(ev, key)
                if value is not None:
                    self.numeric(value, f"{where}.{key}")
        if ev.type == "output_contains" and ev.pattern is not None:
            self.template(ev.pattern, f"{where}.pattern", shell=False)
        for key in ("source", "previous"):
            value = getattr(ev, key)
            if value is not None:
                self.template(value, f"{where}.{key}", shell=False)
        if ev.type == "mcp_result" and st.mode not in ("mcp_tool", "none"):
            self.add("warning", f"{where}.type", "mcp_result expects an mcp_tool action")
        if st.next is not None:
            self.add("warning", f"{where}", "'next' skips evaluation: this evaluator never runs")

    def numeric(self, value: Any, where: str) -> None:
        if isinstance(value, str) and "${" in value:
            self.template(value, where, shell=False)
            return
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            self.add("error", where, f"expected a number, got {value!r}")
            return
        try:
            float(value)
        except ValueError:
            self.add("error", where, f"expected a number, got {value!r}")

    def template(self, text: str, where: str, *, shell: bool, result: bool = False) -> None:
        """Check the placeholders of `text`; `result`: it is a route target, where
        `${result.*}` (the evaluation) has a value."""
        try:
            segments = tpl.parse(text)
        except tpl.TemplateError as exc:
            self.add("error", where, str(exc))
            return
        holes = [s for s in segments if isinstance(s, tpl.Placeholder)]
        spots = tpl.shell_holes(segments) if shell else [tpl.Hole("top")] * len(holes)
        for ph, spot in zip(holes, spots, strict=False):
            self.placeholder(ph, where, shell=shell, spot=spot, result=result)

    def placeholder(self, ph: tpl.Placeholder, where: str, *, shell: bool,
                    spot: tpl.Hole, result: bool = False) -> None:
        context = spot.kind
        if ph.bash_op is not None:
            self.add("warning", where, f"{ph.source}: " + tpl.bash_op_why(ph)
                     + "; a run that reaches it ends error")
        if ph.raw and shell:
            self.add("warning", where, f"{ph.source} is inserted unquoted (:raw): a value "
                                       "containing shell syntax will run as code")
        elif ph.raw:
            self.add("warning", where, f":raw in {ph.source} only matters in shell actions")
        if shell and not ph.raw and context == "heredoc_q_bq":
            self.add("error", where, f"{ph.source} is inside a quoted heredoc inside "
                                     "backquotes, which re-read their text; use $(...)")
        if shell and spot.arith:
            how = ("is pasted unquoted (:raw) into shell arithmetic, which runs "
                   "a value like a[$(cmd)]" if ph.raw else
                   "stands where bash evaluates arithmetic: a value that is not a plain "
                   "integer stops the run before the action runs")
            self.add("warning", where, f"{ph.source} {how}")
        elif shell and spot.name:
            how = ("is pasted unquoted (:raw) where bash reads a variable's name, which "
                   "runs a value like a[$(cmd)]" if ph.raw else
                   "stands where bash reads a variable's name (and evaluates its "
                   "subscript): a value that is not a plain name stops the run before the "
                   "action runs")
            self.add("warning", where, f"{ph.source} {how}")
        fallback = ph.default is not None or ph.optional
        head = ph.path[0]
        if ph.namespace == "param":
            st = self.current
            declared = set(st.fragment_params) | (set(st.with_) if st.fragment else set())
            if head not in declared and not fallback:
                known = ", ".join(sorted(declared)) or "none"
                self.add("error", where, f"{ph.source}: state '{st.name}' has no parameter "
                                         f"'{head}' (its fragment's parameters and with: "
                                         f"bindings: {known})")
        elif ph.namespace == "context":
            if self.used is not None:
                self.used.add(ph.path)
            param_spec = self.spec.parameters.get(head)
            if head not in self.spec.context and head not in self.context_heads \
                    and not fallback \
                    and head not in RUNNER_CONTEXT \
                    and (param_spec is None or param_spec.default is None):
                self.missing.add(head)
                how = ("bind it with 'with:' on the parent's loop: state, or give it the "
                       "parent's context with 'context_passthrough: true'" if self.sealed
                       else f"pass --context {head}=VALUE")
                msg = f"context variable '{head}' is not defined ({how}, or add it under " \
                      "'context:')"
                self.add("error" if self.required else "warning", where, msg)
        elif ph.namespace == "captured":
            if head not in self.captures and not fallback:
                self.add("warning", where, f"no state captures '{head}' (capture: {head})")
            if len(ph.path) == 2 and ph.path[1] not in tpl.CAPTURE_FIELDS \
                    and head not in self.subloop_states and not fallback:
                self.add("error", where, f"{ph.source}: a capture has "
                                         f"{', '.join(tpl.CAPTURE_FIELDS)}")
        elif ph.namespace == "prev" and head not in tpl.PREV_FIELDS:
            self.add("error", where, f"{ph.source}: prev has {', '.join(tpl.PREV_FIELDS)}")
        elif ph.namespace == "state" and head not in tpl.STATE_FIELDS:
            self.add("error", where, f"{ph.source}: state has {', '.join(tpl.STATE_FIELDS)}")
        elif ph.namespace == "loop" and head not in tpl.LOOP_FIELDS:
            self.add("error", where, f"{ph.source}: loop has {', '.join(tpl.LOOP_FIELDS)}")
        elif ph.namespace == "result" and head not in ("verdict", "details"):
            self.add("error", where, f"{ph.source}: result has verdict, details")
        elif ph.namespace == "result" and not result:
            why = (f"{ph.source}: the evaluation result has a value only in a route target "
                   "(route: or on_*), not here")
            if fallback:
                self.add("warning", where, f"{why}: it always reads its default")
            else:
                self.add("error", where, f"{why}; a run that reaches it ends error")

    def subloop(self, st: StateSpec, where: str) -> None:
        assert st.loop is not None
        if "${" in st.loop:
            self.template(st.loop, where, shell=False)
            if st.context_passthrough:
                self.used = None  # which context it reads is known only at run time
            self.add("warning", where, "the sub-loop is chosen at run time: it is checked "
                                       "when it starts (a dry run simulates it)")
            return
        child_path = resolve_subloop(self.path, st.loop)
        if child_path is None:
            what = not_a_file(self.path.parent, st.loop) or (
                f" (looked in {self.path.parent or '.'})")
            self.add("error", where, f"sub-loop file '{st.loop}' not found{what}")
            return
        if child_path.resolve() in self.stack:
            chain = " -> ".join(p.name for p in (*self.stack, child_path))
            self.add("error", where, f"sub-loops form a cycle: {chain}")
            return
        given: dict[str, Any] = {}
        if st.context_passthrough and st.with_:
            self.add("error", where, "'with' and 'context_passthrough' exclude each other")
        if st.context_passthrough:
            given = {**self.spec.context, **self.context, **{c: "" for c in self.captures}}
        elif st.with_:
            given = dict.fromkeys(st.with_, "")
        # A child without context_passthrough gets no --context: the hint for what it
        # lacks names what can give it.
        report = _check(child_path, given, self.required, self.stack,
                        sealed=self.sealed or not st.context_passthrough)
        if st.context_passthrough and self.used is not None:
            if report.used_context is None:
                self.used = None
            else:
                self.used |= report.used_context
        for p in report.problems:  # its warnings too (a typo in it is one here as well)
            self.add(p.severity, where, f"in sub-loop: {p}")
        st.child = report.spec if report.ok else None
        if report.spec is not None and not st.context_passthrough:
            params = report.spec.parameters
            for key in st.with_:
                if params and key not in params:
                    self.add("error", f"states.{st.name}.with.{key}",
                             f"the sub-loop declares no parameter '{key}' (it declares: "
                             f"{', '.join(params)})")
            for key, spec in params.items():
                if spec.required and key not in st.with_ and spec.default is None:
                    self.add("error", f"states.{st.name}.with",
                             f"the sub-loop requires parameter '{key}': bind it in 'with:'")
        for key, value in st.with_.items():
            if isinstance(value, str):
                self.template(value, f"states.{st.name}.with.{key}", shell=False)

    # -- what the caller gives

    def given_context(self) -> None:
        """Check the caller's `--context` keys: a dotted one (`cfg.depth`) must reach into
        a mapping; one the loop never reads is a warning naming it (a typo, most often)."""
        spec = self.spec
        defaults = {k: p.default for k, p in spec.parameters.items() if p.default is not None}
        try:
            with_context({**spec.context, **defaults}, self.context)
        except ConfigError as exc:
            self.problems.append(Problem("error", "", str(exc), spec.path))
        used = self.used
        if used is None or not self.context:
            return
        known = {*spec.context, *spec.parameters, *spec.required_inputs, spec.input_key,
                 *RUNNER_CONTEXT}
        names = sorted({".".join(path[:i + 1]) for path in used for i in range(len(path))}
                       | known)
        for key in self.context:
            parts = tuple(key.split("."))
            if parts[0] in known or any(p[:len(parts)] == parts or parts[:len(p)] == p
                                        for p in used):
                continue
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            # (About the command line, not a line of the file: no line number.)
            self.problems.append(Problem("warning", "", f"--context {key}: the loop never "
                                         f"reads ${{context.{key}}}{hint}", spec.path))

    # -- the whole machine

    def reachability(self) -> None:
        spec = self.spec
        if spec.initial not in spec.states:
            return
        dynamic = any("${" in t for s in spec.states.values() for _, t in s.targets())
        if dynamic:
            return  # a computed target could go anywhere
        seen = {spec.initial}
        todo = [spec.initial]
        while todo:
            st = spec.states[todo.pop()]
            nxt = [t for _, t in st.targets()]
            if spec.maintain and (st.terminal or not nxt):
                nxt.append(st.on_maintain or spec.initial)
            for target in nxt:
                if target in spec.states and target not in seen:
                    seen.add(target)
                    todo.append(target)
        for name in spec.states:
            if name not in seen:
                self.add("warning", f"states.{name}",
                         f"unreachable: no route from '{spec.initial}' leads here")


# The verdicts each evaluator can give besides `error` (llm_structured: its schema's enum).
_VERDICTS = {
    "exit_code": {"yes", "no"}, "output_contains": {"yes", "no"},
    "output_numeric": {"yes", "no"}, "output_json": {"yes", "no"},
    "convergence": {"target", "progress", "stall"},
    "mcp_result": {"yes", "no", "success", "tool_error", "not_found", "timeout"},
    "loop": {"yes", "no", "timeout", "budget_exceeded"}, "diff_stall": {"yes", "no"},
}
_DEFAULT_EVALUATOR = {"shell": "exit_code", "mcp_tool": "mcp_result", "loop": "loop",
                      "prompt": "llm_structured"}
#: Every verdict some evaluator gives (a route key outside these is a typo): a model's
#: (and their `uncertain_suffix` forms) among them.
_MODEL_VERDICTS = ("yes", "no", "partial", "blocked")
_ALL_VERDICTS = frozenset({"error", *_MODEL_VERDICTS, *(f"{v}_uncertain" for v in _MODEL_VERDICTS),
                           *(v for vs in _VERDICTS.values() for v in vs)})
#: little-loops routes of features left out here (the key is read, the route never taken).
_LEFT_OUT_ROUTES = {"rate_limit_exhausted": "little-loops' rate-limit ladder",
                    "throttle_hard": "little-loops' tool-call throttle"}
#: Route keys whose target is chosen without an evaluation result.
_NO_RESULT_TARGETS = ("next", "on_retry_exhausted", "on_maintain")


def _gives(st: StateSpec, kind: str | None) -> set[str] | None:
    """The verdicts a state can be routed on (`error` included), or None when any name
    may come (a model schema without a verdict enum)."""
    if kind == "none":
        return {"yes"}
    if kind == "llm_structured":
        ev = st.evaluate
        enum = verdict_enum(ev.schema if ev is not None and ev.schema else DEFAULT_SCHEMA)
        if enum is None:
            return None
        out = {*enum, "error"}
        if ev is not None and ev.uncertain_suffix:
            out |= {f"{v}_uncertain" for v in enum}
        return out
    gives = _VERDICTS.get(kind or "")
    return None if gives is None else {*gives, "error"}


def _what(kind: str | None) -> str:
    """How a route warning names the evaluator."""
    return {"none": "a state without an action or evaluate", "loop": "a sub-loop state",
            None: "this state"}.get(kind, kind or "this state")


def resolve_subloop(parent: Path, ref: str) -> Path | None:
    """The file a state's `loop:` names: relative to the parent file (then the directories
    above it, as little-loops falls back to its catalogue), `.yaml`/`.yml` optional."""
    return find_loop_file(parent.parent, ref)


def _signals(action: str | None) -> bool:
    """True when an action visibly ends the run itself (prints an output signal)."""
    return action is not None and any(
        marker in action for marker in ("FATAL_ERROR:", "LOOP_STOP:", "CONTEXT_HANDOFF:"))


def _strings(obj: Any, where: str) -> Iterable[tuple[str, str]]:
    if isinstance(obj, str):
        yield where, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{where}.{i}")


def _suggest(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    if close:
        return f" (did you mean '{close[0]}'?)"
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f" (states: {shown})"
