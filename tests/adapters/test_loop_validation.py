"""Malformed loop files: one-line errors naming file, line and key; never a traceback.

Hand-written cases cover each rule; hypothesis throws arbitrary documents,
mutated valid loops and raw text at the loader.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loop_support import write

from adapters.loop import LoopFileError, check_loop, load_loop
from kernel import ConfigError

GOOD = "initial: a\nstates:\n  a: {action: 'true', on_yes: b}\n  b: {terminal: true}\n"

# (id, file text, line, key path in the message, message fragment)
MALFORMED: list[tuple[str, str, int | None, str, str]] = [
    ("yaml-unclosed-flow", "initial: a\nstates: [\n", 3, "", "YAML syntax error"),
    ("yaml-tab-indent", "initial: a\nstates:\n\ta: {terminal: true}\n", 3, "",
     "YAML syntax error"),
    ("yaml-bad-mapping", "initial: a\nstates:\n  a: x: y\n", 3, "", "YAML syntax error"),
    ("duplicate-key", "initial: a\ninitial: b\nstates: {a: {terminal: true}}\n", 2, "",
     "key 'initial' appears twice"),
    ("top-level-list", "- initial\n- states\n", 1, "", "must be a mapping of keys, got a list"),
    ("top-level-text", "just some words\n", 1, "", "must be a mapping of keys, got text"),
    ("empty-file", "", 1, "", "must be a mapping of keys, got nothing"),
    ("missing-initial", "states:\n  a: {terminal: true}\n", 1, "initial",
     "missing 'initial'"),
    ("unknown-initial", "initial: start\nstates:\n  stat: {terminal: true}\n", 1, "initial",
     "initial state 'start' is not a state (did you mean 'stat'?)"),
    ("missing-states", "initial: a\n", 1, "states", "missing 'states'"),
    ("states-list", "initial: a\nstates:\n  - a\n", 2, "states",
     "expected a non-empty mapping of state name -> state, got a list"),
    ("states-empty", "initial: a\nstates: {}\n", 2, "states", "non-empty mapping"),
    ("state-is-text", "initial: a\nstates:\n  a: echo hi\n", 3, "states.a",
     "a state must be a mapping, got text"),
    ("state-is-empty", "initial: a\nstates:\n  a:\n", 3, "states.a", "the state is empty"),
    ("unknown-on-yes", GOOD.replace("on_yes: b", "on_yes: c"), 3, "states.a.on_yes",
     "route target 'c' is not a state"),
    ("unknown-next", "initial: a\nstates:\n  a:\n    next: nowhere\n", 4, "states.a.next",
     "route target 'nowhere' is not a state (states: a)"),
    ("unknown-route-target", "initial: a\nstates:\n  a:\n    route:\n      yes: b\n"
     "      _: zz\n  b: {terminal: true}\n", 6, "states.a.route._", "'zz' is not a state"),
    ("unknown-retry-target", GOOD.replace("on_yes: b", "on_yes: b, max_retries: 2, "
                                                       "on_retry_exhausted: gone"),
     3, "states.a.on_retry_exhausted", "'gone' is not a state"),
    ("unknown-maintain-target", GOOD.replace("{terminal: true}",
                                             "{terminal: true, on_maintain: x}"),
     4, "states.b.on_maintain", "'x' is not a state"),
    ("action-and-loop", "initial: a\nstates:\n  a:\n    action: ls\n    loop: other\n"
     "    next: a\n", 5, "states.a.loop", "either an action or a loop, not both"),
    ("unknown-action-type", GOOD.replace("on_yes: b", "on_yes: b, action_type: python"),
     3, "states.a.action_type", "unknown action_type 'python'"),
    ("evaluate-without-type", "initial: a\nstates:\n  a:\n    evaluate: {pattern: x}\n"
     "    on_yes: a\n", 4, "states.a.evaluate.type", "missing 'type'"),
    ("unknown-evaluator", "initial: a\nstates:\n  a:\n    evaluate:\n      type: vibes\n"
     "    on_yes: a\n", 5, "states.a.evaluate.type", "unknown evaluator 'vibes'"),
    ("contains-without-pattern", "initial: a\nstates:\n  a:\n    action: ls\n    evaluate:\n"
     "      type: output_contains\n    on_yes: a\n", 5, "states.a.evaluate.pattern",
     "the output_contains evaluator needs 'pattern'"),
    ("numeric-without-target", "initial: a\nstates:\n  a:\n    action: ls\n    evaluate:\n"
     "      type: output_numeric\n      operator: gt\n    on_yes: a\n", 5,
     "states.a.evaluate.target", "needs 'target'"),
    ("json-without-path", "initial: a\nstates:\n  a:\n    action: ls\n    evaluate:\n"
     "      {type: output_json, target: 1}\n    on_yes: a\n", 5, "states.a.evaluate.path",
     "needs 'path'"),
    ("convergence-without-target", "initial: a\nstates:\n  a:\n    action: ls\n"
     "    evaluate: {type: convergence}\n    on_yes: a\n", 5, "states.a.evaluate.target",
     "needs 'target'"),
    ("unknown-operator", "initial: a\nstates:\n  a:\n    evaluate:\n      type: output_numeric\n"
     "      target: 1\n      operator: '>='\n    on_yes: a\n", 7,
     "states.a.evaluate.operator", "unknown operator '>='"),
    ("unknown-direction", "initial: a\nstates:\n  a:\n    evaluate:\n      type: convergence\n"
     "      target: 1\n      direction: sideways\n    on_yes: a\n", 7,
     "states.a.evaluate.direction", "unknown direction 'sideways'"),
    ("non-numeric-target", "initial: a\nstates:\n  a:\n    evaluate:\n      type: output_numeric\n"
     "      target: high\n    on_yes: a\n", 6, "states.a.evaluate.target",
     "expected a number, got 'high'"),
    ("max-iterations-text", "initial: a\nmax_iterations: ten\n" + GOOD[11:], 2,
     "max_iterations", "expected a whole number, got 'ten'"),
    ("max-iterations-zero", "initial: a\nmax_iterations: 0\n" + GOOD[11:], 2, "max_iterations",
     "must be at least 1, got 0"),
    ("negative-timeout", "timeout: -5\n" + GOOD, 1, "timeout", "must be greater than 0"),
    ("backoff-text", GOOD + "backoff: fast\n", 5, "backoff", "expected a number, got 'fast'"),
    ("terminal-text", GOOD.replace("{terminal: true}", "{terminal: sure}"), 4,
     "states.b.terminal", "expected true or false, got 'sure'"),
    ("context-list", GOOD + "context: [a, b]\n", 5, "context", "expected a mapping of "
                                                              "variables, got a list"),
    ("context-bad-name", GOOD + "context:\n  1x: v\n", 6, "context.1x",
     "'1x' is not a valid variable name"),
    ("capture-bad-name", GOOD.replace("on_yes: b", "on_yes: b, capture: 'has space'"), 3,
     "states.a.capture", "'has space' is not a valid capture name"),
    ("template-unclosed", GOOD.replace("'true'", "'echo ${context.x'"), 3, "states.a.action",
     "unclosed '${'"),
    ("template-namespace", GOOD.replace("'true'", "'cd ${work}'"), 3, "states.a.action",
     "unknown namespace 'work'"),
    ("template-modifier", GOOD.replace("'true'", "'echo ${env.HOME:upper}'"), 3,
     "states.a.action", "unknown modifier ':upper'"),
    ("template-state-field", GOOD.replace("'true'", "'echo ${state.number}'"), 3,
     "states.a.action", "state has name, iteration"),
    ("template-capture-field", "initial: a\nstates:\n  a: {action: ls, capture: x, next: b}\n"
     "  b: {action: 'echo ${captured.x.stdout}', next: c}\n  c: {terminal: true}\n", 4,
     "states.b.action", "a capture has output, stderr, exit_code, duration_ms"),
    ("missing-context-variable", GOOD.replace("'true'", "'echo ${context.target}'"), 3,
     "states.a.action", "context variable 'target' is not defined (pass --context "
                        "target=VALUE"),
    ("quoted-heredoc-in-backquotes", "initial: a\nstates:\n  a:\n    action: |\n"
     "      x=`cat <<'EOF'\n      ${env.HOME}\n      EOF\n      `\n    next: a\n", 4,
     "states.a.action", "inside a quoted heredoc inside backquotes"),
    ("route-not-mapping", "initial: a\nstates:\n  a:\n    route: [b]\n  b: {terminal: true}\n",
     4, "states.a.route", "expected a mapping of verdict -> state, got a list"),
    ("evaluate-list", "initial: a\nstates:\n  a:\n    evaluate: [exit_code]\n    next: a\n", 4,
     "states.a.evaluate", "expected a mapping with a 'type', got a list"),
    ("reserved-state-name", "initial: a\nstates:\n  a: {next: a}\n  $current: {terminal: true}\n",
     4, "states.$current", "'$current' is reserved"),
    ("params-not-mapping", GOOD.replace("on_yes: b", "on_yes: b, params: [1, 2]"), 3,
     "states.a.params", "expected a mapping, got a list"),
    ("llm-not-mapping", GOOD + "llm: claude\n", 5, "llm", "expected a mapping, got text"),
    ("negative-retries", GOOD.replace("on_yes: b", "on_yes: b, max_retries: -1"), 3,
     "states.a.max_retries", "must be at least 0, got -1"),
    ("target-is-list", GOOD.replace("on_yes: b", "on_yes: [b]"), 3, "states.a.on_yes",
     "expected a state name, got ['b']"),
    ("negative-confidence", "initial: a\nstates:\n  a:\n    evaluate:\n"
     "      type: llm_structured\n      min_confidence: -1\n    on_yes: a\n", 6,
     "states.a.evaluate.min_confidence", "must be at least 0"),
    ("schema-not-mapping", "initial: a\nstates:\n  a:\n    evaluate:\n"
     "      type: llm_structured\n      schema: yes-please\n    on_yes: a\n", 6,
     "states.a.evaluate.schema", "expected a JSON schema mapping"),
    ("subloop-missing", "initial: a\nstates:\n  a: {loop: nothere, on_yes: a}\n", 3,
     "states.a.loop", "sub-loop file 'nothere' not found"),
    ("subloop-cycle", "initial: a\nstates:\n  a: {loop: loop.yaml, on_yes: a}\n", 3,
     "states.a.loop", "sub-loops form a cycle: loop.yaml -> loop.yaml"),
]


def assert_one_line_error(exc: BaseException, path: Path) -> str:
    """The error is a ConfigError whose message is one line starting with the file."""
    assert isinstance(exc, ConfigError)
    message = str(exc)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(str(path))
    return message


class TestMalformedFiles:
    @pytest.mark.parametrize(("text", "line", "where", "fragment"),
                             [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
    def test_each_gives_one_line_naming_the_location(self, tmp_path: Path, text: str,
                                                     line: int | None, where: str,
                                                     fragment: str) -> None:
        """load_loop raises one line: file:line: key.path: what is wrong."""
        path = tmp_path / "loop.yaml"
        path.write_text(text)
        with pytest.raises(LoopFileError) as info:
            load_loop(path)
        message = assert_one_line_error(info.value, path)
        if line is not None:
            assert message.startswith(f"{path}:{line}"), message
        if where:
            assert f": {where}: " in message, message
        assert fragment in message, message

    def test_there_are_at_least_thirty_cases(self) -> None:
        """The issue asks for thirty malformed files at least; each id is distinct."""
        assert len({c[0] for c in MALFORMED}) == len(MALFORMED) >= 30

    def test_a_child_loops_error_is_reported_on_the_parent_state(self, tmp_path: Path) -> None:
        """An error inside a sub-loop file is named with the child's own location."""
        write(tmp_path, "initial: x\nstates:\n  x: {next: y}\n", name="child.yaml")
        path = write(tmp_path, "initial: a\nstates:\n  a: {loop: child, on_yes: a}\n")
        with pytest.raises(LoopFileError) as info:
            load_loop(path)
        message = assert_one_line_error(info.value, path)
        assert f"{path}:3: states.a.loop: in sub-loop: {tmp_path / 'child.yaml'}:3: " \
               "states.x.next: route target 'y' is not a state" in message

    def test_not_utf8_is_a_clear_error(self, tmp_path: Path) -> None:
        """Bytes that are not UTF-8 are reported, not decoded into garbage."""
        path = tmp_path / "loop.yaml"
        path.write_bytes(b"initial: \xff\xfe\n")
        with pytest.raises(LoopFileError, match="not UTF-8 text"):
            load_loop(path)

    def test_every_error_is_reported_at_once(self, tmp_path: Path) -> None:
        """check_loop lists all problems, in file order; the error counts the rest."""
        path = write(tmp_path, """
            initial: a
            max_iterations: zero
            states:
              a: {next: nope}
              b: {on_yes: nada}
        """)
        report = check_loop(path)
        assert [p.where for p in report.errors] == ["max_iterations", "states.a.next",
                                                    "states.b.on_yes"]
        with pytest.raises(LoopFileError, match=r"\(and 2 more errors; run 'kernel validate'\)"):
            load_loop(path)


class TestWarnings:
    def test_unknown_keys_warn_with_their_location(self, tmp_path: Path) -> None:
        """Unknown keys at every level are warnings naming key and line; the loop still loads."""
        path = write(tmp_path, """
            initial: a
            categroy: demo
            states:
              a:
                action: ls
                colour: blue
                evaluate: {type: exit_code, strictness: 3}
                on_yes: b
              b: {terminal: true}
        """)
        report = check_loop(path)
        assert report.ok
        assert [(p.line, p.where) for p in report.warnings] == [
            (2, "categroy"), (6, "states.a.colour"), (7, "states.a.evaluate.strictness")]
        assert load_loop(path).states["a"].action == "ls"

    @pytest.mark.parametrize(("text", "fragment"), [
        ("initial: a\nstates:\n  a: {next: a}\n  b: {terminal: true}\n", "unreachable"),
        ("initial: a\nstates:\n  a: {next: a}\n", "no state is terminal"),
        ("initial: a\nstates:\n  a: {action: 'echo ${env.X:raw}', next: b}\n"
         "  b: {terminal: true}\n", "inserted unquoted (:raw)"),
        ("initial: a\nstates:\n  a: {action: 'echo $(( ${env.N} + 1 ))', next: b}\n"
         "  b: {terminal: true}\n", "evaluates arithmetic"),
        ("initial: a\nstates:\n  a: {action: 'printf -v ${env.N} hi', next: b}\n"
         "  b: {terminal: true}\n", "reads a variable's name"),
        ("initial: a\nstates:\n  a: {action: 'arr=([${env.N}]=1)', next: b}\n"
         "  b: {terminal: true}\n", "evaluates arithmetic"),
        ("initial: a\nstates:\n  a: {action: ls}\n", "no transition out"),
        ("initial: a\nstates:\n  a: {action: ls, max_retries: 2, on_yes: a}\n",
         "max_retries without on_retry_exhausted"),
        ("initial: a\nstates:\n  a: {next: b}\n  b: {terminal: true, action: ls}\n",
         "a terminal state never runs its action"),
        ("initial: a\nstates:\n  a: {action: ls, next: b, on_no: b}\n  b: {terminal: true}\n",
         "'next' wins"),
        ("initial: a\nstates:\n  a: {action: 'echo ${captured.nope.output}', next: b}\n"
         "  b: {terminal: true}\n", "no state captures 'nope'"),
        ("initial: a\nstates:\n  a: {action: 'echo ${context.who}', next: b}\n"
         "  b: {terminal: true}\n", "pass --context who=VALUE"),
        ("initial: a\nstates:\n  a:\n    action: ./metric\n    evaluate: {type: convergence, "
         "target: 0}\n    on_success: b\n  b: {terminal: true}\n",
         "routes none of the verdicts convergence gives (progress, stall, target)"),
    ])
    def test_suspicious_but_runnable_loops_warn(self, tmp_path: Path, text: str,
                                                fragment: str) -> None:
        """Each suspicious pattern is a warning (with a location), not an error."""
        report = check_loop(write(tmp_path, text))
        assert report.ok, report.errors
        assert any(fragment in str(p) for p in report.warnings), report.warnings

    def test_yes_and_no_stay_text(self, tmp_path: Path) -> None:
        """`yes`/`no`/`on` are verdicts and names, not YAML 1.1 booleans."""
        path = write(tmp_path, """
            initial: on
            states:
              on:
                action: ls
                route: {yes: off, no: on}
              off: {terminal: true}
        """)
        spec = load_loop(path)
        assert spec.initial == "on"
        assert spec.states["on"].route is not None
        assert spec.states["on"].route.table == {"yes": "off", "no": "on"}


# ------------------------------------------------------------- hypothesis

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 100),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(alphabet=string.ascii_letters + "${}.:_ -'\"/\\#<()`", max_size=20))
KEYS = st.sampled_from(["name", "initial", "states", "context", "action", "evaluate", "type",
                        "route", "next", "on_yes", "on_no", "terminal", "capture", "timeout",
                        "max_retries", "loop", "params", "target", "pattern", "a", "b", "_",
                        "max_iterations", "backoff", "maintain", "llm", "operator"])
DOCS = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)), max_leaves=25)

VALID: dict[str, Any] = {
    "name": "v", "initial": "test", "max_iterations": 5, "context": {"x": "1"},
    "states": {
        "test": {"action": "echo ${context.x}", "capture": "t",
                 "evaluate": {"type": "output_numeric", "operator": "ge", "target": 1},
                 "on_yes": "done", "on_no": "fix"},
        "fix": {"action": "true", "next": "test", "max_retries": 2,
                "on_retry_exhausted": "done"},
        "done": {"terminal": True},
    },
}


def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path inside a nested mapping."""
    out: list[tuple[Any, ...]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.append((*prefix, key))
            out += paths_of(value, (*prefix, key))
    return out


def mutated(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A deep copy of VALID with the value at `path` replaced."""
    doc: Any = yaml.safe_load(yaml.safe_dump(VALID))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    result: dict[str, Any] = doc
    return result


def check_any(tmp_path: Path, text: str) -> None:
    """Loading `text` either works or fails with a one-line ConfigError naming the file."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    try:
        load_loop(path)
    except ConfigError as exc:
        assert_one_line_error(exc, path)


FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


class TestGeneratedFiles:
    @FUZZ
    @given(doc=DOCS)
    def test_arbitrary_documents(self, tmp_path: Path, doc: Any) -> None:
        """Any YAML document loads or gives a one-line error: never another exception."""
        check_any(tmp_path, yaml.safe_dump(doc))

    @FUZZ
    @given(data=st.data())
    def test_mutated_valid_loops(self, tmp_path: Path, data: st.DataObject) -> None:
        """A valid loop with one value replaced by junk loads or fails naming a line."""
        path = data.draw(st.sampled_from(paths_of(VALID)))
        value = data.draw(DOCS)
        text = yaml.safe_dump(mutated(path, value))
        target = tmp_path / "fuzz.yaml"
        target.write_text(text)
        report = check_loop(target)
        for problem in report.problems:
            assert "\n" not in str(problem)
            assert problem.line is not None, problem
        if not report.ok:
            with pytest.raises(LoopFileError) as info:
                load_loop(target)
            assert str(info.value).startswith(f"{target}:")

    @FUZZ
    @given(text=st.text(max_size=200))
    def test_arbitrary_text(self, tmp_path: Path, text: str) -> None:
        """Random text (broken YAML, odd characters) gives a one-line error or loads."""
        check_any(tmp_path, text)


class TestArithmeticWarnings:
    def test_every_arithmetic_spot_is_reported_with_its_line(self, tmp_path: Path) -> None:
        """`kernel validate` names each placeholder that must hold an integer (issue 13.4)."""
        from test_loop_template import ARITHMETIC

        for template in ARITHMETIC:
            body = template.replace("${context.x}", "${env.N}")
            text = ("initial: a\nstates:\n  a:\n    action: |\n"
                    + "".join(f"      {line}\n" for line in body.splitlines())
                    + "    next: b\n  b: {terminal: true}\n")
            report = check_loop(write(tmp_path, text))
            assert report.ok, report.errors
            found = [p for p in report.warnings if "evaluates arithmetic" in p.message]
            assert found and found[0].line == 4, (template, report.warnings)
