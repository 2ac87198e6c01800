"""Interpolation: the syntax, every namespace and modifier, and injection-proof shell quoting."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from loop_support import events, run, spec_of

from adapters.loop import _template as tpl
from kernel import Status

EVIL = "a'; touch INJECTED; echo '"


def namespaces(**over: Any) -> tpl.Namespaces:
    """A full set of namespaces with recognisable values."""
    base: dict[str, Any] = dict(
        context={"x": "cx", "nested": {"deep": 7}, "flag": True, "none": None},
        captured={"lint": {"output": "3 issues", "stderr": "warn", "exit_code": 1,
                           "duration_ms": 12.5}},
        prev={"output": "prev out", "stderr": "", "exit_code": 0, "duration_ms": 1,
              "state": "lint"},
        result={"verdict": "no", "details": {"exit_code": 1}},
        state={"name": "fix", "iteration": 4},
        loop={"name": "demo", "elapsed_ms": 1500, "elapsed": "1s", "started_at": "T",
              "dir": "/d", "file": "/d/l.yaml", "run_id": "r1"},
        env={"HOME": "/home/me"},
    )
    base.update(over)
    return tpl.Namespaces(**base)


class TestSyntax:
    def test_a_placeholder_with_every_modifier(self) -> None:
        """`?`, `:raw` and `:default=` are parsed; the default takes the rest, colons included."""
        (ph,) = tpl.placeholders("${captured.lint.output?:raw:default=a:b c}")
        assert (ph.namespace, ph.path, ph.optional, ph.raw, ph.default) == (
            "captured", ("lint", "output"), True, True, "a:b c")

    def test_double_dollar_is_a_literal(self) -> None:
        """`$${...}` renders as a literal `${...}` and is not a placeholder."""
        assert tpl.render("echo $${HOME} ${context.x}", namespaces()) == "echo ${HOME} cx"
        assert tpl.placeholders("$${HOME}") == []

    @pytest.mark.parametrize(("template", "message"), [
        ("echo ${context.x", "unclosed '${'"),
        ("${work}", "unknown namespace 'work'"),
        ("${work}", "write $${work} for a shell variable"),
        ("${context}", "needs a path after 'context.'"),
        ("${context..x}", "needs a path"),
        ("${context.x:upper}", "unknown modifier ':upper'"),
        ("${}", "empty variable"),
        # Once printed as the literal text `${context.a}`, never expanded.
        ("${env.X:default=${context.a}}", "a default is literal text"),
    ])
    def test_malformed_templates_are_rejected(self, template: str, message: str) -> None:
        """Each malformed template raises TemplateError saying what is wrong."""
        with pytest.raises(tpl.TemplateError) as info:
            tpl.parse(template)
        assert message in str(info.value)


class TestNamespaces:
    @pytest.mark.parametrize(("template", "expected"), [
        ("${context.x}", "cx"),
        ("${context.nested.deep}", "7"),
        ("${context.flag}", "true"),
        ("${context.none}", ""),
        ("${context.nested}", '{"deep": 7}'),
        ("${captured.lint.output}", "3 issues"),
        ("${captured.lint.stderr}", "warn"),
        ("${captured.lint.exit_code}", "1"),
        ("${captured.lint.duration_ms}", "12.5"),
        ("${prev.output}", "prev out"),
        ("${prev.exit_code}", "0"),
        ("${prev.state}", "lint"),
        ("${result.verdict}", "no"),
        ("${result.details.exit_code}", "1"),
        ("${state.name}", "fix"),
        ("${state.iteration}", "4"),
        ("${loop.name}", "demo"),
        ("${loop.elapsed_ms}", "1500"),
        ("${loop.dir}", "/d"),
        ("${loop.run_id}", "r1"),
        ("${env.HOME}", "/home/me"),
    ])
    def test_every_namespace_resolves(self, template: str, expected: str) -> None:
        """Each namespace and field reads the value it names."""
        assert tpl.render(template, namespaces()) == expected

    @pytest.mark.parametrize(("template", "why"), [
        ("${context.y}", "'context.y' is not defined"),
        ("${captured.test.output}", "no state has captured 'test' yet"),
        ("${captured.lint.nope}", "'captured.lint.nope' does not exist"),
        ("${env.NOPE}", "environment variable NOPE is not set"),
    ])
    def test_missing_variables_say_why(self, template: str, why: str) -> None:
        """A missing variable raises MissingVariable with its name and the reason."""
        with pytest.raises(tpl.MissingVariable) as info:
            tpl.render(template, namespaces())
        assert info.value.why == why
        assert info.value.name == template[2:-1]

    def test_prev_and_result_are_missing_until_they_exist(self) -> None:
        """${prev.*} before any action and ${result.*} outside routing are missing."""
        ns = namespaces(prev=None, result=None)
        for template in ("${prev.output}", "${result.verdict}"):
            with pytest.raises(tpl.MissingVariable):
                tpl.render(template, ns)

    def test_default_and_optional_apply_only_when_missing(self) -> None:
        """`:default=` and `?` fill in for a missing variable and never shadow a present one."""
        ns = namespaces()
        assert tpl.render("${context.y:default=fallback}", ns) == "fallback"
        assert tpl.render("${context.x:default=fallback}", ns) == "cx"
        assert tpl.render("[${context.y?}]", ns) == "[]"

    def test_params_are_interpolated_recursively(self) -> None:
        """MCP params: every string inside nested mappings and lists is interpolated."""
        params = {"q": "${context.x}", "n": 3, "list": ["${state.name}", {"k": "${loop.name}"}]}
        assert tpl.render_obj(params, namespaces()) == {
            "q": "cx", "n": 3, "list": ["fix", {"k": "demo"}]}


class TestShellReferences:
    @pytest.mark.parametrize(("template", "context"), [
        ("echo ${context.x}", "top"),
        ('echo "say ${context.x}"', "dq"),
        ("echo 'say ${context.x}'", "sq"),
        ("echo $'say ${context.x}'", "ansi"),
        ("echo $(cat ${context.x})", "sub"),
        ('echo "$(cat ${context.x})"', "sub"),
        ("echo `cat ${context.x}`", "bq"),
        ("echo $(( ${context.x} + 1 ))", "arith"),
        ("echo hi # ${context.x}", "comment"),
        ("cat <<EOF\n${context.x}\nEOF\necho ${context.x}", "heredoc"),
        ("cat <<'EOF'\n${context.x}\nEOF", "heredoc_q"),
        ("echo 'it''s' ${context.x}", "top"),
        ('echo "a \\" ${context.x}"', "dq"),
    ])
    def test_the_scanner_knows_the_quoting_context(self, template: str, context: str) -> None:
        """The first placeholder's quoting context is recognised."""
        assert tpl.shell_contexts(tpl.parse(template))[0] == context

    def test_values_travel_as_environment_variables(self) -> None:
        """The command refers to KLOOP_n variables; the values are only in the environment."""
        ns = namespaces(context={"x": EVIL})
        cmd = tpl.render_shell("echo ${context.x} \"${context.x}\" '${context.x}'", ns)
        assert cmd.command == "echo \"${KLOOP_1}\" \"${KLOOP_2}\" ''\"${KLOOP_3}\"''"
        assert cmd.env == {"KLOOP_1": EVIL, "KLOOP_2": EVIL, "KLOOP_3": EVIL}
        assert "touch" not in cmd.command

    def test_raw_pastes_the_value_into_the_command(self) -> None:
        """`:raw` opts out: the value becomes part of the command text."""
        cmd = tpl.render_shell("${context.x:raw} --flag", namespaces(context={"x": "ls -l"}))
        assert (cmd.command, cmd.env) == ("ls -l --flag", {})

    def test_display_shows_values_quoted_for_people(self) -> None:
        """The display string is what a person would have typed, values quoted."""
        cmd = tpl.render_shell('grep ${context.x} "in ${context.x}"',
                               namespaces(context={"x": "two words"}))
        assert cmd.display == "grep 'two words' \"in two words\""

    def test_a_quoted_heredoc_gets_the_value_written_in(self) -> None:
        """Nothing expands in a quoted heredoc, so the value is written into the body
        (little-loops substitutes before the shell runs; the body is data to bash)."""
        cmd = tpl.render_shell("cat <<'EOF'\n<${context.x}>\nEOF", namespaces())
        assert (cmd.command, cmd.env) == ("cat <<'EOF'\n<cx>\nEOF", {})

    @pytest.mark.parametrize(("template", "value"), [
        ("cat <<'EOF'\n${context.x}\nEOF", "a\nEOF\ntouch INJECTED"),
        ("cat <<'EOF'\nE${context.x}\nrm -rf data\nEOF", "OF"),
        ("cat <<'EOF'\n${context.x}${context.y}\nEOF", "E"),
        ("cat <<-'EOF'\n\t${context.x}\n\tEOF", "x\n\t\tEOF"),
        ("cat <<\\EOF\n${context.x}\nEOF", "EOF"),
    ])
    def test_a_value_that_would_end_the_heredoc_is_refused(self, template: str,
                                                           value: str) -> None:
        """A line equal to the delimiter, however the value's lines join the text around
        them (and after tabs, for <<-), would turn the rest of the body into code."""
        ns = namespaces(context={"x": value, "y": "OF"})
        with pytest.raises(tpl.UnsafeValue, match="would end the quoted heredoc early"):
            tpl.render_shell(template, ns)


@pytest.mark.realtime
class TestShellExecution:
    @pytest.mark.parametrize(("template", "expected"), [
        ("printf '%s\\n' ${context.x}", EVIL),
        ('printf \'%s\\n\' "<${context.x}>"', f"<{EVIL}>"),
        ("printf '%s\\n' '<${context.x}>'", f"<{EVIL}>"),
        ("printf '%s\\n' $'<${context.x}>'", f"<{EVIL}>"),
        ("printf '%s\\n' \"$(printf '%s' ${context.x})\"", EVIL),
        ("printf '%s\\n' `printf '%s' ${context.x}`", "a';"),
        ("cat <<EOF\n<${context.x}>\nEOF", f"<{EVIL}>"),
        ("cat <<'EOF'\n<${context.x}>\nEOF", f"<{EVIL}>"),
        ("cat <<-\"EOF\"\n\t<${context.x}>\n\tEOF", f"<{EVIL}>"),
        ("x=$(cat <<'EOF'\n<${context.x}>\nEOF\n); printf '%s\\n' \"$x\"", f"<{EVIL}>"),
        ("cat <<EOF\n$(printf '%s' ${context.x})\nEOF", EVIL),
        ("printf '%s\\n' ${context.x} # ${context.x}", EVIL),
        ("x=${context.x}; printf '%s\\n' \"$x\"", EVIL),
    ])
    def test_a_hostile_value_stays_data_in_every_context(self, tmp_path: Path, template: str,
                                                         expected: str) -> None:
        """bash prints the value verbatim and never runs the `touch` inside it."""
        cmd = tpl.render_shell(template, namespaces(context={"x": EVIL}))
        proc = subprocess.run(["bash", "-c", cmd.command], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, **cmd.env}, timeout=10)
        assert not (tmp_path / "INJECTED").exists()
        assert proc.stdout.splitlines()[0] == expected

    def test_raw_really_is_unsafe(self, tmp_path: Path) -> None:
        """The control: the same value inserted with :raw does run its `touch`."""
        cmd = tpl.render_shell("echo '${context.x:raw}'", namespaces(context={"x": EVIL}))
        subprocess.run(["bash", "-c", cmd.command], cwd=tmp_path, capture_output=True,
                       env={**os.environ, **cmd.env}, timeout=10)
        assert (tmp_path / "INJECTED").exists()


@pytest.mark.realtime
class TestInjection:
    async def test_a_captured_value_cannot_inject_into_a_shell_action(self,
                                                                      tmp_path: Path) -> None:
        """A capture holding `a'; touch INJECTED; echo '` is one argument in the next action."""
        (tmp_path / "evil.txt").write_text(EVIL + "\n")
        spec = spec_of(tmp_path, """
            initial: read
            states:
              read:
                action: cat evil.txt
                capture: evil
                next: use
              use:
                action: |
                  printf '[%s]\\n' ${captured.evil.output}
                  printf '[%s]\\n' "${captured.evil.output}"
                  echo '${captured.evil.output}'
                capture: used
                next: done
              done: {terminal: true}
        """)
        result, audit, agent = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.OK
        assert not (tmp_path / "INJECTED").exists()
        assert agent.captured["used"]["output"].splitlines() == [f"[{EVIL}]", f"[{EVIL}]", EVIL]
        start = next(e for e in events(audit, result.run_id, "action_start")
                     if e.payload["state"] == "use")
        assert "touch" not in start.payload["command"]


# Every place where bash evaluates text as arithmetic (issue 13, item 4). A value
# such as `a[$(cmd)]` there runs `cmd`, quoted or not; so a value in these spots
# must be a plain integer, checked before the action runs.
ARITH_PAYLOAD = "a[$(touch INJECTED)]"
ARITHMETIC = [
    "(( ${context.x} > 3 )) && echo big",
    "echo $(( ${context.x} + 1 ))",
    'echo $(( "${context.x}" + 1 ))',
    'echo "$(( ${context.x} * 2 ))"',
    "echo $[ ${context.x} + 1 ]",
    "[[ ${context.x} -gt 3 ]] && echo big",
    '[[ "${context.x}" -ge 3 ]] && echo big',
    "[[ 3 -lt ${context.x} ]] && echo big",
    'if [[ a == a && "${context.x}" -eq 7 ]]; then echo seven; fi',
    'let "y = ${context.x} + 1"; echo $y',
    "let y=${context.x}+1; echo $y",
    "declare -i y=${context.x}; echo $y",
    "declare -ri y=${context.x}; echo $y",
    'f() { local -i y="${context.x}"; echo $y; }; f',
    "typeset -i y=${context.x}; echo $y",
    "a=(1 2 3 4 5 6 7 8 9); echo $${a[${context.x}]}",
    'a=(1 2 3 4 5 6 7 8 9); echo "$${a[${context.x}]}"',
    "a=(); a[${context.x}]=1; echo $${#a[@]}",
    "s=abcdefghij; echo $${s:${context.x}}",
    's=abcdefghij; echo "$${s:1:${context.x}}"',
    "for (( i = 0; i < ${context.x}; i++ )); do :; done; echo $i",
    "cat <<EOF\n$(( ${context.x} + 1 ))\nEOF",
    "echo $(echo $(( ${context.x} )))",
    "arr=([${context.x}]=1); echo $${arr[@]}",
    "declare -a arr=([${context.x}]=1 [2]=2); echo $${arr[@]}",
]

#: Where bash reads a value as a variable's name, and so evaluates its subscript.
NAMES = [
    "[[ -v ${context.x} ]] && echo set; echo done",
    "test -v ${context.x} && echo set; echo done",
    "[ -v ${context.x} ] && echo set; echo done",
    "printf -v ${context.x} hi; echo done",
    'printf -v "${context.x}" hi; echo done',
    "read ${context.x} <<< hi; echo done",
    "read -r -a ${context.x} <<< hi; echo done",
    'declare "${context.x}=1"; echo done',
    "declare -n ref=${context.x}; echo $${ref}",
    "local_f() { local ${context.x}=1; echo done; }; local_f",
    "unset ${context.x}; echo done",
]


class TestNames:
    @pytest.mark.parametrize("template", NAMES)
    def test_a_value_that_is_not_a_name_never_reaches_bash(self, tmp_path: Path,
                                                           template: str) -> None:
        """`a[$(touch INJECTED)]` where bash reads a name is refused before bash sees it."""
        assert tpl.shell_holes(tpl.parse(template))[0].name
        with pytest.raises(tpl.UnsafeValue, match="not a plain name"):
            tpl.render_shell(template, namespaces(context={"x": ARITH_PAYLOAD}))

    @pytest.mark.realtime
    @pytest.mark.parametrize("template", NAMES)
    def test_a_plain_name_works(self, tmp_path: Path, template: str) -> None:
        cmd = tpl.render_shell(template, namespaces(context={"x": "my_var"}))
        got = subprocess.run(["bash", "-c", cmd.command], cwd=tmp_path, capture_output=True,
                             text=True, timeout=10, env={**os.environ, **cmd.env})
        assert got.returncode == 0, got.stderr

    @pytest.mark.parametrize("template", [
        "read -p ${context.x} y <<< hi", "declare x=${context.x}", "export X=${context.x}",
        "printf %s ${context.x}", "git commit -m ${context.x}", "echo [${context.x}]"])
    def test_values_there_are_not_names(self, template: str) -> None:
        hole = tpl.shell_holes(tpl.parse(template))[0]
        assert not hole.name and not hole.arith


class TestArithmetic:
    @pytest.mark.parametrize("template", ARITHMETIC)
    def test_the_scanner_sees_arithmetic(self, template: str) -> None:
        """Each of these spots is recognised as arithmetic."""
        assert tpl.shell_holes(tpl.parse(template))[0].arith

    @pytest.mark.parametrize("template", [
        "echo ${context.x}", '[[ ${context.x} == foo ]]', "[ ${context.x} -gt 3 ]",
        "x=${context.x}", "echo $${s:-${context.x}}", "ls file[${context.x}]",
        'printf "%d" ${context.x}', "cat <<EOF\n${context.x}\nEOF",
        "declare -a y=${context.x}",
    ])
    def test_other_spots_take_any_text(self, template: str) -> None:
        """Text that bash does not evaluate keeps taking any value."""
        assert not tpl.shell_holes(tpl.parse(template))[0].arith
        tpl.render_shell(template, namespaces(context={"x": ARITH_PAYLOAD}))

    @pytest.mark.parametrize("template", ARITHMETIC)
    def test_a_non_integer_never_reaches_arithmetic(self, tmp_path: Path,
                                                    template: str) -> None:
        """`a[$(touch INJECTED)]` is refused before bash sees it."""
        ns = namespaces(context={"x": ARITH_PAYLOAD})
        try:
            cmd = tpl.render_shell(template, ns)
        except tpl.UnsafeValue as exc:
            assert "not a plain integer" in str(exc)
            return
        subprocess.run(["bash", "-c", cmd.command], cwd=tmp_path, capture_output=True,
                       env={**os.environ, **cmd.env}, timeout=10)
        assert not (tmp_path / "INJECTED").exists()
        pytest.fail("the value reached bash arithmetic")

    @pytest.mark.realtime
    @pytest.mark.parametrize("template", ARITHMETIC)
    def test_an_integer_works_as_before(self, tmp_path: Path, template: str) -> None:
        """A captured number (trailing newline included) gives what the plain text gives."""
        cmd = tpl.render_shell(template, namespaces(context={"x": "7\n"}))
        plain = tpl.render_shell(template.replace("${context.x}", "${context.x:raw}"),
                                 namespaces(context={"x": "7"}))
        got, want = (subprocess.run(["bash", "-c", c.command], cwd=tmp_path,
                                    capture_output=True, text=True, timeout=10,
                                    env={**os.environ, **c.env}) for c in (cmd, plain))
        assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
        assert want.stdout.strip()

    @pytest.mark.realtime
    async def test_a_captured_payload_fails_the_run_and_runs_nothing(self,
                                                                    tmp_path: Path) -> None:
        """End to end: the run ends in error naming the placeholder; the action never ran."""
        (tmp_path / "evil.txt").write_text(ARITH_PAYLOAD + "\n")
        spec = spec_of(tmp_path, """
            initial: read
            states:
              read: {action: cat evil.txt, capture: n, next: use}
              use:
                action: '[[ "${captured.n.output}" -gt 3 ]] && echo big; touch RAN'
                next: done
              done: {terminal: true}
        """)
        result, _audit, _agent = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.ERROR
        assert "${captured.n.output}" in (result.error or "")
        assert "not a plain integer" in (result.error or "")
        assert not (tmp_path / "INJECTED").exists()
        assert not (tmp_path / "RAN").exists()


class TestShellModifier:
    """`${x:shell}`: little-loops' explicit quoting modifier (generalized-fsm-loop.md,
    Variable Interpolation; interpolation's `:shell` is shlex quoting)."""

    def test_outside_shell_actions_it_is_the_quoted_text(self) -> None:
        """In prompts, routes and sources the value is written shell-quoted."""
        ns = namespaces(context={"x": EVIL})
        assert tpl.render("run ${context.x:shell}", ns) == "run " + shlex.quote(EVIL)
        assert tpl.render("${context.y:shell:default=two words}", ns) == "'two words'"

    def test_raw_and_shell_contradict(self) -> None:
        with pytest.raises(tpl.TemplateError, match="contradict"):
            tpl.parse("${context.x:raw:shell}")

    @pytest.mark.realtime
    @pytest.mark.parametrize(("template", "expected"), [
        ("printf '%s\\n' ${context.x:shell}", EVIL),
        ("printf '%s\\n' $(printf '%s' ${context.x:shell})", "a';"),
        ('printf \'%s\\n\' "<${context.x:shell}>"', f"<{shlex.quote(EVIL)}>"),
        ("printf '%s\\n' '<${context.x:shell}>'", f"<{shlex.quote(EVIL)}>"),
        ("cat <<EOF\n<${context.x:shell}>\nEOF", f"<{shlex.quote(EVIL)}>"),
        ("x=${context.x:shell}; printf '%s\\n' \"$x\"", EVIL),
        ("cat <<'EOF'\n<${context.x:shell}>\nEOF", f"<{shlex.quote(EVIL)}>"),
    ])
    def test_a_hostile_value_stays_data(self, tmp_path: Path, template: str,
                                        expected: str) -> None:
        """Wherever `:shell` stands, bash never runs the `touch` inside the value."""
        cmd = tpl.render_shell(template, namespaces(context={"x": EVIL}))
        proc = subprocess.run(["bash", "-c", cmd.command], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, **cmd.env}, timeout=10)
        assert not (tmp_path / "INJECTED").exists()
        assert proc.stdout.splitlines()[0] == expected


class TestBashOperators:
    """`${x:0:19}`, `${x:-d}` and kin: bash's operators are not applied to loop variables
    (little-loops, generalized-fsm-loop.md, Resolution Rules: "Bash default values",
    BUG-2346; its interpolation module knows only `:default=`, `?` and `:shell`)."""

    @pytest.mark.parametrize(("source", "op"), [
        ("${loop.started_at:0:19}", ":0:19"), ("${context.x:3}", ":3"),
        ("${context.x:-fallback}", ":-fallback"), ("${context.x:=v}", ":=v"),
        ("${context.x:+set}", ":+set"), ("${context.x:?unset}", ":?unset"),
    ])
    def test_parsed_but_never_given_a_value(self, source: str, op: str) -> None:
        """The operator is recognised (not a typo), and looking the value up is an error
        naming it, in plain text and in a shell action alike."""
        (ph,) = tpl.placeholders(source)
        assert ph.bash_op == op
        ns = namespaces(context={"x": EVIL})
        with pytest.raises(tpl.TemplateError, match=re.escape(f"'{op}' is bash syntax")):
            tpl.render(source, ns)
        with pytest.raises(tpl.TemplateError, match=re.escape(f"'{op}' is bash syntax")):
            tpl.render_shell(f"echo {source}", ns)

    def test_a_dry_run_reads_a_stand_in(self) -> None:
        ns = namespaces()
        ns.dry = True
        assert tpl.render("at ${loop.started_at:0:19}", ns) == "at <loop.started_at:0:19>"

    def test_other_unknown_modifiers_stay_errors(self) -> None:
        with pytest.raises(tpl.TemplateError, match="unknown modifier ':shel'"):
            tpl.parse("${context.x:shel}")

    @pytest.mark.realtime
    @pytest.mark.parametrize("where", [
        'echo "${captured.v.output:0:19}"', "echo ${captured.v.output:0:5}",
        "cat <<'EOF'\n${captured.v.output:0:19}\nEOF", "cat <<EOF\n${captured.v.output:-x}\nEOF",
    ])
    async def test_a_hostile_value_never_reaches_the_shell(self, tmp_path: Path,
                                                           where: str) -> None:
        """A hostile captured value under a bash operator: the run ends `error` before the
        action starts, in any quoting context (nothing is pasted, nothing runs)."""
        spec = spec_of(tmp_path, f"""
            initial: get
            states:
              get: {{action: {json.dumps(f"printf '%s' {shlex.quote(EVIL)}")}, capture: v,
                     next: use}}
              use: {{action: {json.dumps(where + "; touch RAN")}, next: done}}
              done: {{terminal: true}}
        """)
        result, _audit, _agent = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.ERROR
        assert "is bash syntax" in (result.error or "")
        assert not (tmp_path / "INJECTED").exists()
        assert not (tmp_path / "RAN").exists()
