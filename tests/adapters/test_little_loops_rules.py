"""little-loops' documented loop semantics, one small shell-only loop per rule (issue 18).

Each test names the section of little-loops' documentation it follows
(`docs/generalized-fsm-loop.md` and `docs/guides/LOOPS_GUIDE.md` in
BrennonTWilliams/little-loops); the loops are written here, not copied.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from loop_support import routes, run, spec_of, verdicts

from kernel import Limits, Status

pytestmark = pytest.mark.realtime


class TestRouting:
    async def test_no_without_on_no_goes_to_on_error(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Layer 2: Route > Shorthand Syntax ("on_no -> on_error
        fallthrough"): a `no` verdict with on_error and no on_no routes to on_error."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check: {action: "exit 1", on_yes: done, on_error: recover}
              recover: {action: "true", next: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id)[0] == ("check", "recover", "on_error (no)")

    async def test_a_route_table_sends_an_unrouted_no_to_error(self, tmp_path: Path) -> None:
        """Same section, route tables: `no` with `_error` and no `no:` key (and no `_`)
        goes to `_error`; a `_` default still takes it first."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check:
                action: "exit 1"
                route: {yes: done, _error: recover}
              recover:
                action: "exit 1"
                route: {yes: done, _: done, _error: never}
              never: {terminal: true}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id) == [("check", "recover", "route._error (no)"),
                                                ("recover", "done", "route._")]

    async def test_next_with_on_error_sends_a_failing_action_to_on_error(
            self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Resolution Order ("on_error precedence"): with both
        `next` and `on_error`, a non-zero exit goes to on_error; exit 0 follows next;
        without on_error, next is followed either way."""
        spec = spec_of(tmp_path, """
            initial: ok
            states:
              ok: {action: "true", next: failing, on_error: wrong}
              failing: {action: "exit 3", next: wrong, on_error: plain}
              plain: {action: "exit 1", next: done}
              wrong: {terminal: true}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id) == [("ok", "failing", "next"),
                                                ("failing", "plain", "on_error (exit 3)"),
                                                ("plain", "done", "next")]
        assert verdicts(audit, result.run_id) == ["error"]

    @pytest.mark.parametrize("evaluate", [
        "{type: output_contains, pattern: READY}",
        "{type: output_numeric, operator: eq, target: 7}",
        "{type: output_json, path: .n, target: 7}",
    ])
    async def test_output_evaluators_call_a_failed_action_an_error(
            self, tmp_path: Path, evaluate: str) -> None:
        """LOOPS_GUIDE.md, "Exit-code short-circuit": an evaluator that reads output gives
        `error` for a non-zero exit, even when the output would match."""
        spec = spec_of(tmp_path, f"""
            initial: check
            states:
              check:
                action: "echo READY; exit 2"
                evaluate: {evaluate}
                on_yes: wrong
                on_no: wrong
                on_error: done
              wrong: {{terminal: true}}
              done: {{terminal: true}}
        """.replace("echo READY", "echo READY" if "contains" in evaluate
                    else "echo 7" if "numeric" in evaluate else "echo '{\\\"n\\\": 7}'"))
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert verdicts(audit, result.run_id) == ["error"]
        assert routes(audit, result.run_id) == [("check", "done", "on_error")]

    async def test_error_patterns_turn_a_missing_match_into_error(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Evaluator Types > output_contains (`error_patterns`):
        pattern not found and an error pattern present -> error; found -> yes regardless."""
        spec = spec_of(tmp_path, """
            initial: auth
            states:
              auth:
                action: "echo 'HTTP 401 unauthorized'"
                evaluate: {type: output_contains, pattern: "^OK", error_patterns: ["401", "403"]}
                on_yes: wrong
                on_no: wrong
                on_error: retry
              retry:
                action: "echo 'OK but 401 in the log'"
                evaluate: {type: output_contains, pattern: "^OK", error_patterns: ["401"]}
                on_yes: done
                on_error: wrong
              wrong: {terminal: true}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert verdicts(audit, result.run_id) == ["error", "yes"]
        assert routes(audit, result.run_id)[-1] == ("retry", "done", "on_yes")


class TestShorthands:
    async def test_evaluate_without_type_uses_the_action_default(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Layer 1: Evaluate > Default Evaluation by Action Type:
        an `evaluate:` naming no type gets the action's default (shell: exit_code)."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check: {action: "exit 1", evaluate: {}, on_yes: wrong, on_no: done}
              wrong: {terminal: true}
              done: {terminal: true}
        """)
        assert spec.states["check"].evaluate is not None
        assert spec.states["check"].evaluate.type == "exit_code"
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("check", "done", "on_no")]

    async def test_flow_expands_into_a_chain_with_branches(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Linear Flow Shorthand (`flow:`): entries chain with
        `next`, `name?yes:no` branches, the last is terminal, `state_defs` merge in."""
        spec = spec_of(tmp_path, """
            initial: lint
            flow:
              - lint
              - check?ship:fix
              - fix
              - ship
            state_defs:
              lint: {action: "echo lint"}
              check: {action: "test -f ok"}
              fix: {action: "touch ok", next: check}
        """)
        assert spec.states["ship"].terminal
        result, audit, _ = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.OK
        assert [(a, b) for a, b, _ in routes(audit, result.run_id)] == [
            ("lint", "check"), ("check", "fix"), ("fix", "check"), ("check", "ship")]

    @pytest.mark.parametrize(("text", "line", "message"), [
        ("initial: a\nflow: [a, b]\nstates: {a: {terminal: true}}\n", 2,
         "'flow' and 'states' are mutually exclusive"),
        ("initial: a\nflow:\n  - a?b\n  - b\n", 2, "a branch is written name?yes_state:no_state"),
        ("initial: a\nflow: [a, a]\n", 2, "state 'a' appears twice in flow"),
    ])
    def test_a_malformed_flow_is_an_error_with_its_line(self, tmp_path: Path, text: str,
                                                        line: int, message: str) -> None:
        """Same section, Constraints: flow and states exclude each other; branches need
        both targets."""
        from loop_support import write

        from adapters.loop import check_loop

        report = check_loop(write(tmp_path, text))
        assert not report.ok
        assert any(message in p.message and p.line == line for p in report.errors), \
            report.errors


class TestTerminalsAndSubLoops:
    async def test_a_failure_terminal_ends_the_run_failed(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Authoring Conventions > Failure Terminals ("Mark the
        terminal failure: true"): reaching it ends the run failed; `failed`/`error`/
        `aborted`/`finalize_aborted` are failures by default, `failure: false` opts out."""
        for name, extra, failed in [("blocked", ", failure: true", True), ("failed", "", True),
                                    ("aborted", ", failure: false", False),
                                    ("done_empty", "", False)]:
            spec = spec_of(tmp_path, f"""
                initial: work
                states:
                  work: {{action: "true", next: {name}}}
                  {name}: {{terminal: true{extra}}}
            """)
            result, _, agent = await run(spec)
            assert (result.status is Status.ERROR) is failed, name
            assert (agent.failure_terminal == name) is failed
            if failed:
                assert result.error == f"reached failure terminal '{name}'"

    async def test_a_child_in_a_failure_terminal_routes_the_parent_on_no(
            self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Sub-Loop Composition and Failure Terminals ("a parent
        loop routes on_no"): even with on_error present, a failure terminal is a `no`."""
        (tmp_path / "child.yaml").write_text(
            "initial: try\nstates:\n  try: {action: 'exit 1', on_yes: done, on_no: blocked}\n"
            "  done: {terminal: true}\n  blocked: {terminal: true, failure: true}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: child, on_yes: wrong, on_no: handled, on_error: wrong}
              handled: {terminal: true}
              wrong: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id) == [("sub", "handled", "on_no")]
        child = next(r for r in audit.runs.values() if r.info.parent_run_id == result.run_id)
        assert child.status is Status.ERROR

    async def test_a_dry_run_walks_into_a_failure_terminal(self, tmp_path: Path) -> None:
        """A dry run reports the failure terminal it reaches, and a parent takes `no`."""
        (tmp_path / "child.yaml").write_text(
            "initial: go\nstates:\n  go: {action: 'true', next: failed}\n"
            "  failed: {terminal: true}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: child, on_yes: wrong, on_no: done}
              done: {terminal: true}
              wrong: {terminal: true}
        """)
        result, _, _ = await run(spec, scenario="all-pass",
                                 limits=Limits(max_steps=spec.max_iterations, dry_run=True))
        assert result.status is Status.DRY_RUN
        assert "reached failure terminal 'failed'" in result.output
        assert "reached terminal state 'done'" in result.output

    async def test_passthrough_shares_context_and_captures_both_ways(
            self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Sub-Loop Composition (`context_passthrough: true`): the
        child gets the parent's context and captured values (a capture as its output text);
        the child's captures come back as ${captured.<parent state>.<capture>}."""
        (tmp_path / "child.yaml").write_text(
            "initial: use\nstates:\n"
            "  use: {action: 'echo \"${context.topic}/${context.ticket}\"', capture: seen,"
            " next: done}\n  done: {terminal: true}\n")
        spec = spec_of(tmp_path, """
            initial: pick
            context: {topic: loops}
            states:
              pick: {action: "echo T-7", capture: ticket, next: sub}
              sub: {loop: child, context_passthrough: true, on_yes: show, on_no: wrong}
              show:
                action: echo "got ${captured.sub.seen.output}"
                capture: shown
                next: done
              done: {terminal: true}
              wrong: {terminal: true}
        """)
        result, _, agent = await run(spec)
        assert result.status is Status.OK, result.error
        assert agent.captured["shown"]["output"] == "got loops/T-7"


class TestQuotedHeredocs:
    async def test_a_captured_value_is_data_in_a_quoted_heredoc(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Variable Interpolation > Resolution Rules ("Resolved at
        runtime, just before use"): little-loops writes the value in before the shell runs;
        in a quoted heredoc that is data. A value holding the delimiter line would end the
        body early, so the run stops there and nothing runs."""
        (tmp_path / "ok.txt").write_text("$(touch INJECTED) `touch INJECTED` $HOME\n")
        (tmp_path / "evil.txt").write_text("x\nEOF\ntouch INJECTED\n")
        spec = spec_of(tmp_path, """
            initial: read
            states:
              read: {action: cat ok.txt, capture: ok, next: write}
              write:
                action: |
                  cat > out.txt <<'EOF'
                  got: ${captured.ok.output}
                  EOF
                next: read_evil
              read_evil: {action: cat evil.txt, capture: evil, next: write_evil}
              write_evil:
                action: |
                  cat > out2.txt <<'EOF'
                  ${captured.evil.output}
                  EOF
                next: done
              done: {terminal: true}
        """)
        result, _, _ = await run(spec, cwd=str(tmp_path))
        assert (tmp_path / "out.txt").read_text() == \
            "got: $(touch INJECTED) `touch INJECTED` $HOME\n"
        assert result.status is Status.ERROR
        assert "would end the quoted heredoc early" in (result.error or "")
        assert not (tmp_path / "out2.txt").exists()
        assert not (tmp_path / "INJECTED").exists()


class TestKnownKeys:
    def test_tooling_keys_are_quiet_left_out_features_say_so_typos_warn(
            self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Universal FSM Schema > Schema Definition (category,
        labels, scope, commands, ...), and validation's known top-level keys: tooling
        metadata and `*_ok` lint suppressions are accepted quietly; a feature we leave
        out gets one line naming it; a typo still warns."""
        from loop_support import write

        from adapters.loop import check_loop

        path = write(tmp_path, """
            name: demo
            category: code-quality
            labels: [ci]
            visibility: public
            scope: [src/]
            commands: [{cmd: kernel run demo.yaml, comment: run it}]
            singleton: true
            partial_route_ok: true
            on_handoff: spawn
            circuit: {threshold: 3}
            initail: x
            initial: a
            states:
              a:
                action: "true"
                agent: reviewer
                evaluate: {type: score_stall, max_stall: 2}
                on_yes: done
                on_error: done
              done: {terminal: true}
        """)
        report = check_loop(path)
        assert report.ok, report.errors
        lines = sorted((p.where, p.message) for p in report.warnings)
        assert lines == [
            ("circuit", "'circuit': the rate-limit circuit breaker is not supported here "
                        "(ignored)"),
            ("initail", "unknown loop key 'initail' (ignored)"),
            ("on_handoff", "'on_handoff': little-loops' handoff policy (here CONTEXT_HANDOFF "
                           "ends the run 'handoff') is not supported here (ignored)"),
            ("states.a.agent", "'agent': choosing the prompt agent per state is not "
                               "supported here (ignored)"),
            ("states.a.evaluate.type", "'score_stall': score-history stall detection is not "
                                       "supported here (a run judges it 'error')"),
        ]

    async def test_a_left_out_evaluator_still_walks_and_runs(self, tmp_path: Path) -> None:
        """A dry run walks it with the scenario's verdicts; a real run judges it `error`."""
        spec = spec_of(tmp_path, """
            initial: a
            states:
              a:
                action: "true"
                evaluate: {type: score_stall}
                on_yes: done
                on_error: stopped
              done: {terminal: true}
              stopped: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("a", "stopped", "on_error")]
        dry, _, _ = await run(spec, scenario="all-pass",
                              limits=Limits(max_steps=10, dry_run=True))
        assert "reached terminal state 'done'" in dry.output


EVIL = "a'; touch INJECTED; echo '"


class TestComposition:
    async def test_from_inherits_and_overrides(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Inheritance pattern (`from:`): the parent is deep-merged
        under the child: mappings (context, states) merge, scalars in the child win; the
        parent is found relative to the child (then the directories above)."""
        (tmp_path / "lib").mkdir()
        (tmp_path / "lib" / "base.yaml").write_text(
            "name: base\nmax_steps: 7\ncontext: {greeting: hello, who: base}\n"
            "states:\n  done: {terminal: true}\n")
        (tmp_path / "loops").mkdir()
        spec = spec_of(tmp_path / "loops", """
            name: child
            from: lib/base
            initial: say
            context: {who: child}
            states:
              say: {action: 'echo "${context.greeting} ${context.who}"', capture: said,
                    next: done}
        """)
        assert (spec.name, spec.max_iterations) == ("child", 7)
        result, _, agent = await run(spec)
        assert result.status is Status.OK
        assert agent.captured["said"]["output"] == "hello child"

    @pytest.mark.parametrize(("files", "message"), [
        ({"loop.yaml": "from: nowhere\ninitial: a\nstates: {a: {terminal: true}}\n"},
         "loop 'nowhere' not found"),
        ({"loop.yaml": "from: b\ninitial: a\nstates: {a: {terminal: true}}\n",
          "b.yaml": "from: loop\n"}, "'from:' forms a cycle: loop.yaml -> b.yaml -> loop.yaml"),
        ({"loop.yaml": "import: [lib.yaml]\ninitial: a\nstates:\n  a: {fragment: nope}\n"},
         "fragment library 'lib.yaml' not found"),
        ({"loop.yaml": "initial: a\nfragments: {x: {next: a}}\nstates:\n  a: {fragment: y}\n"},
         "fragment 'y' is not defined (known: x)"),
    ])
    def test_broken_composition_is_an_error_at_its_line(self, tmp_path: Path,
                                                         files: dict[str, str],
                                                         message: str) -> None:
        """Same sections: a missing parent or library, a cycle, an unknown fragment."""
        from adapters.loop import check_loop

        for name, text in files.items():
            (tmp_path / name).write_text(text)
        report = check_loop(tmp_path / "loop.yaml")
        assert not report.ok
        assert any(message in str(p) and p.line is not None for p in report.errors), \
            report.errors

    async def test_fragments_with_parameters(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Schema Definition (`fragment:`, `with:`) and
        `import:`/`fragments:`: an imported fragment is deep-merged under the state (state
        keys win), `with:` binds its `parameters:` (defaults apply), read as ${param.*};
        local fragments override imported ones."""
        (tmp_path / "lib.yaml").write_text(textwrap.dedent("""
            fragments:
              counted:
                description: count up to a limit
                parameters:
                  key: {type: string, required: true}
                  limit: {type: integer, default: 3}
                action: |
                  n=$(cat "${param.key}" 2>/dev/null || echo 0); n=$((n + 1))
                  echo "$n" > "${param.key}"; test "$n" -lt "${param.limit}"
                evaluate: {type: exit_code}
              shell_exit: {evaluate: {type: output_contains, pattern: never}}
        """))
        spec = spec_of(tmp_path, """
            initial: count
            import: [lib.yaml]
            fragments:
              shell_exit: {action_type: shell, evaluate: {type: exit_code}}
            states:
              count:
                fragment: counted
                with: {key: "${context.file}"}
                on_yes: count
                on_no: check
              check: {fragment: shell_exit, action: "test -f tally", on_yes: done}
              done: {terminal: true}
            context: {file: tally}
        """)
        result, audit, _ = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.OK, result.error
        assert (tmp_path / "tally").read_text() == "3\n"
        assert verdicts(audit, result.run_id) == ["yes", "yes", "no", "yes"]

    @pytest.mark.parametrize(("state", "message"), [
        ("{fragment: f, action: 'echo ${param.nope}', next: done}",
         "state 'a' has no parameter 'nope'"),
        ("{fragment: f, with: {other: 1}, next: done}", "fragment 'f' declares no parameter"),
        ("{fragment: g, next: done}", "fragment 'g' requires parameter 'x'"),
    ])
    def test_parameter_mistakes_are_errors(self, tmp_path: Path, state: str,
                                           message: str) -> None:
        """Unknown ${param.*}, unknown with: keys and unbound required parameters."""
        from loop_support import write

        from adapters.loop import check_loop

        report = check_loop(write(tmp_path, f"""
            initial: a
            fragments:
              f: {{parameters: {{x: {{type: string, default: d}}}}, action: 'echo ${{param.x}}'}}
              g: {{parameters: {{x: {{type: string, required: true}}}}, action: 'true'}}
            states:
              a: {state}
              done: {{terminal: true}}
        """))
        assert any(message in p.message for p in report.errors), report.problems

    async def test_a_param_value_cannot_inject(self, tmp_path: Path) -> None:
        """A hostile value bound through `with:` stays data in the fragment's action."""
        (tmp_path / "evil.txt").write_text(EVIL + "\n")
        spec = spec_of(tmp_path, """
            initial: read
            fragments:
              show: {parameters: {v: {type: string}}, action: "printf '[%s]' ${param.v}"}
            states:
              read: {action: cat evil.txt, capture: evil, next: show}
              show: {fragment: show, with: {v: "${captured.evil.output}"}, capture: out,
                     next: done}
              done: {terminal: true}
        """)
        result, _, agent = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.OK
        assert agent.captured["out"]["output"] == f"[{EVIL}]"
        assert not (tmp_path / "INJECTED").exists()

    async def test_sub_loop_parameters_bound_with_with(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Typed parameter bindings (`parameters:` / `with:`): the
        child gets exactly its bound parameters (defaults applied), typed after
        interpolation; its captures come back under the state's name."""
        (tmp_path / "child.yaml").write_text(textwrap.dedent("""
            parameters:
              input: {type: string, required: true}
              times: {type: integer, default: 2}
            initial: go
            context: {secret: child-only}
            states:
              go: {action: 'echo "${context.input} x${context.times}"', capture: said,
                   next: done}
              done: {terminal: true}
        """))
        parent = """
            initial: pick
            context: {secret: parent-only}
            states:
              pick: {action: "echo ISSUE-9", capture: picked, next: sub}
              sub: {loop: child, with: {input: "${captured.picked.output}"}, on_yes: done,
                    on_no: wrong}
              done: {terminal: true}
              wrong: {terminal: true}
        """
        spec = spec_of(tmp_path, parent)
        result, _, agent = await run(spec)
        assert result.status is Status.OK, result.error
        assert agent.captured["sub"]["said"]["output"] == "ISSUE-9 x2"
        bad = spec_of(tmp_path, parent.replace('input: "${captured.picked.output}"',
                                               'input: x, times: "${captured.picked.output}"'),
                      name="bad.yaml")
        result, _, _ = await run(bad)
        assert result.status is Status.ERROR
        assert "parameter 'times' must be an integer" in (result.error or "")

    def test_sub_loop_with_mistakes_are_errors(self, tmp_path: Path) -> None:
        """Same section: unknown `with:` keys and missing required parameters are caught at
        load time; `with` and `context_passthrough` exclude each other."""
        from loop_support import write

        from adapters.loop import check_loop

        (tmp_path / "child.yaml").write_text(
            "parameters: {input: {type: string, required: true}}\n"
            "initial: a\nstates: {a: {terminal: true}}\n")
        report = check_loop(write(tmp_path, """
            initial: a
            states:
              a: {loop: child, with: {inptu: x}, next: b}
              b: {loop: child, with: {input: x}, context_passthrough: true, next: c}
              c: {terminal: true}
        """))
        messages = [p.message for p in report.errors]
        assert "the sub-loop declares no parameter 'inptu' (it declares: input)" in messages
        assert "the sub-loop requires parameter 'input': bind it in 'with:'" in messages
        assert "'with' and 'context_passthrough' exclude each other" in messages

    def test_required_inputs_must_be_given(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Schema Definition (`required_inputs`, `input_key`): the
        run refuses to start while a required input is empty, naming --context; a dry run
        walks with a placeholder."""
        from loop_support import write

        from kernel import ConfigError
        from kernel_cli.loops import build_loop

        path = write(tmp_path, """
            initial: a
            input_key: issue
            required_inputs: [issue]
            context: {issue: ""}
            states:
              a: {action: 'echo ${context.issue}', next: done}
              done: {terminal: true}
        """)
        with pytest.raises(ConfigError, match=r"requires input 'issue'.*--context issue=VALUE"):
            build_loop(str(path), {}, warn=None)
        build_loop(str(path), {"issue": "ENH-1"}, warn=None)
        agent, _, _ = build_loop(str(path), {}, scenario="all-pass", warn=None)
        assert agent.context["issue"] == "<issue>"


class TestDiffStall:
    async def test_no_once_the_diff_stops_changing(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Evaluator Types > diff_stall: the first look is `yes`,
        a changed `git diff --stat` is `yes` (and resets the count), `max_stall` unchanged
        looks in a row are `no`; outside a git work tree it is `error`."""
        import subprocess

        outside = spec_of(tmp_path, """
            initial: a
            states:
              a: {action: "true", evaluate: {type: diff_stall}, on_error: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(outside, cwd=str(tmp_path))
        assert verdicts(audit, result.run_id) == ["error"]

        repo = tmp_path / "repo"
        repo.mkdir()
        for argv in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"],
                     ["git", "config", "user.name", "t"]):
            subprocess.run(argv, cwd=repo, check=True, timeout=60)
        (repo / "f.txt").write_text("0\n")
        subprocess.run(["git", "add", "f.txt"], cwd=repo, check=True, timeout=60)
        subprocess.run(["git", "commit", "-qm", "init"], cwd=repo, check=True, timeout=60)
        # Edits f.txt on the first two passes only, then stops changing anything.
        spec = spec_of(repo, """
            initial: work
            states:
              work:
                action: |
                  n=$(cat count 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > count
                  if [ "$n" -le 2 ]; then seq "$n" > f.txt; fi
                next: check
              check:
                action: "true"
                evaluate: {type: diff_stall, scope: [f.txt], max_stall: 2}
                on_yes: work
                on_no: stalled
              stalled: {terminal: true}
        """, name="stall.yaml")
        result, audit, _ = await run(spec, cwd=str(repo))
        assert result.status is Status.OK, result.error
        # passes 1, 2 change f.txt; 3 and 4 do not: the second unchanged look stalls
        assert verdicts(audit, result.run_id) == ["yes", "yes", "yes", "no"]


class TestDynamicSubLoops:
    async def test_a_sub_loop_chosen_at_run_time(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Sub-Loop Composition (`loop: <name>` is interpolated,
        as the catalogue's routers do with `loop: "${captured.chosen.output}"`): the file
        is found and checked when the state starts; a dry run simulates the state."""
        (tmp_path / "fast.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'echo fast', capture: said, next: done}\n"
            "  done: {terminal: true}\n")
        spec = spec_of(tmp_path, """
            initial: choose
            states:
              choose: {action: "echo fast", capture: chosen, next: run}
              run:
                loop: "${captured.chosen.output}"
                context_passthrough: true
                on_yes: done
                on_no: wrong
                on_error: wrong
              done: {terminal: true}
              wrong: {terminal: true}
        """)
        result, _, agent = await run(spec)
        assert result.status is Status.OK, result.error
        assert agent.captured["run"]["said"]["output"] == "fast"
        dry, _, _ = await run(spec, scenario="all-pass",
                              limits=Limits(max_steps=10, dry_run=True))
        assert "chosen at run time" in dry.output
        assert "reached terminal state 'done'" in dry.output

    async def test_a_sub_loop_state_captures_its_outcome(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Sub-Loop Composition: a `loop:` state's `capture:` holds
        the child's outcome (its output, and the verdict it gave the parent)."""
        (tmp_path / "child.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'echo child-out', next: done}\n"
            "  done: {terminal: true}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: child, capture: outcome, on_yes: show, on_no: show}
              show: {action: 'echo "${captured.outcome.verdict}"', capture: shown, next: done}
              done: {terminal: true}
        """)
        result, _, agent = await run(spec)
        assert result.status is Status.OK, result.error
        assert agent.captured["shown"]["output"] == "yes"

    async def test_a_dry_run_walks_without_runner_values(self, tmp_path: Path) -> None:
        """A child's context the runner would seed (little-loops seeds config thresholds)
        is absent in a dry run: it reads as a stand-in and the walk reaches the end."""
        (tmp_path / "child.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'test 80 -ge ${context.readiness_threshold}',"
            " on_yes: done}\n  done: {terminal: true}\n")
        from loop_support import write

        from adapters.loop import check_loop

        spec = check_loop(write(tmp_path, """
            initial: sub
            states:
              sub: {loop: child, on_yes: done}
              done: {terminal: true}
        """)).spec
        assert spec is not None
        dry, _, _ = await run(spec, scenario="all-pass",
                              limits=Limits(max_steps=10, dry_run=True))
        assert "<context.readiness_threshold>" in dry.output
        assert dry.output.rstrip().endswith("reached terminal state 'done' after 1 iteration(s)")


class TestMcpVerdictNames:
    @pytest.mark.parametrize(("reply", "route"), [
        ('{"isError": false}', "route.success"), ('{"isError": true}', "route.tool_error")])
    async def test_mcp_result_routes_little_loops_names(self, tmp_path: Path, reply: str,
                                                        route: str) -> None:
        """generalized-fsm-loop.md, Tier 3: MCP Evaluator > mcp_result: a state routing
        success / tool_error / not_found / timeout gets those names for yes / no / error."""
        import sys

        spec = spec_of(tmp_path, """
            initial: shot
            states:
              shot:
                action: playwright/screenshot
                action_type: mcp_tool
                route: {success: done, tool_error: retry, not_found: done}
              retry: {terminal: true}
              done: {terminal: true}
        """)
        command = [sys.executable, "-c", f"print({reply!r})"]
        result, audit, _ = await run(spec, mcp_command=command)
        assert routes(audit, result.run_id)[0][2] == route


class TestSubLoopEndings:
    async def test_a_child_cut_off_routes_on_timeout(self, tmp_path: Path) -> None:
        """executor.py `_execute_sub_loop` (ENH-3019; LOOPS_GUIDE.md, "`terminated_by` exit
        reasons"): a child that hits its step limit or its timeout (the `loop:` state's
        `timeout` caps the child's) routes to `on_timeout`; without one, to `on_no`."""
        (tmp_path / "spin.yaml").write_text(
            "initial: a\nmax_iterations: 2\nstates:\n  a: {action: 'true', next: a}\n")
        (tmp_path / "slow.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'sleep 60', next: done}\n"
            "  done: {terminal: true}\n")
        spec = spec_of(tmp_path, """
            initial: steps
            states:
              steps: {loop: spin, on_yes: wrong, on_no: wrong, on_timeout: slow}
              slow: {loop: slow, timeout: 1, on_yes: wrong, on_no: wrong, on_timeout: plain}
              plain: {loop: spin, on_yes: wrong, on_no: done}
              done: {terminal: true}
              wrong: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK, result.error
        assert routes(audit, result.run_id) == [("steps", "slow", "on_timeout"),
                                                ("slow", "plain", "on_timeout"),
                                                ("plain", "done", "on_no")]
        children = sorted((r for r in audit.runs.values()
                           if r.info.parent_run_id == result.run_id),
                          key=lambda r: r.started_at)
        assert [c.status for c in children] == [Status.MAX_STEPS, Status.TIMEOUT,
                                                Status.MAX_STEPS]

    async def test_terminated_by_is_captured_under_the_state_name(
            self, tmp_path: Path) -> None:
        """executor.py `_execute_sub_loop` (ENH-3019, ENH-2814) with EVENT-SCHEMA.md
        `loop_complete.terminated_by`: after a `loop:` state, `${captured.<state>.
        terminated_by}` says how the child ended (`terminal` for any terminal, with
        `failure_terminal` true for a failure one; `error` with the child's `error`;
        `max_steps` at its step limit)."""
        (tmp_path / "ok.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'true', next: done}\n  done: {terminal: true}\n")
        (tmp_path / "bad.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'true', next: failed}\n"
            "  failed: {terminal: true}\n")
        (tmp_path / "boom.yaml").write_text(
            "initial: a\nstates:\n  a: {action: 'echo FATAL_ERROR: disk gone', next: a}\n")
        (tmp_path / "spin.yaml").write_text(
            "initial: a\nmax_iterations: 2\nstates:\n  a: {action: 'true', next: a}\n")
        spec = spec_of(tmp_path, """
            initial: ok
            states:
              ok: {loop: ok, on_yes: bad}
              bad: {loop: bad, on_no: boom}
              boom: {loop: boom, on_error: spin}
              spin: {loop: spin, on_no: show}
              show:
                action: >-
                  echo "${captured.ok.terminated_by} ${captured.bad.terminated_by}
                  ${captured.bad.failure_terminal} ${captured.boom.terminated_by}
                  ${captured.spin.terminated_by} ${captured.ok.failure_terminal:default=-}";
                  echo "${captured.boom.error}"
                capture: shown
                next: done
              done: {terminal: true}
        """)
        result, _, agent = await run(spec)
        assert result.status is Status.OK, result.error
        first, second = agent.captured["shown"]["output"].splitlines()
        assert first.split() == ["terminal", "terminal", "true", "error", "max_steps", "-"]
        assert "disk gone" in second

    async def test_a_dry_run_routes_a_child_out_of_steps_on_timeout(
            self, tmp_path: Path) -> None:
        """The same rule in a dry run: a simulated child that never reaches a terminal
        within its max_iterations takes `on_timeout`."""
        (tmp_path / "spin.yaml").write_text(
            "initial: a\nmax_iterations: 2\nstates:\n  a: {action: 'true', next: a}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: spin, on_yes: wrong, on_no: wrong, on_timeout: done}
              done: {terminal: true}
              wrong: {terminal: true}
        """)
        dry, _, _ = await run(spec, scenario="all-pass",
                              limits=Limits(max_steps=10, dry_run=True))
        assert "[loop spin] => timeout" in dry.output
        assert dry.output.rstrip().endswith("reached terminal state 'done' after 1 iteration(s)")


class TestBashOperatorsOnLoopVariables:
    async def test_validate_warns_dry_runs_walk_runs_end_error(self, tmp_path: Path) -> None:
        """generalized-fsm-loop.md, Resolution Rules ("Bash default values", BUG-2346;
        "Undefined variable": the loop terminates with error): `${loop.started_at:0:19}`
        is not applied. The file validates with a warning at its line, a dry run walks
        it, and a run that reaches it ends `error` before the action starts."""
        from loop_support import write

        from adapters.loop import check_loop

        path = write(tmp_path, """
            initial: stamp
            states:
              stamp:
                action: 'echo "${loop.started_at:0:19}"; touch RAN'
                next: done
              done: {terminal: true}
        """)
        report = check_loop(path)
        assert not [p for p in report.problems if p.severity == "error"]
        (warning,) = [p for p in report.problems if "bash syntax" in p.message]
        assert warning.line == 4
        assert report.spec is not None
        dry, _, _ = await run(report.spec, scenario="all-pass",
                              limits=Limits(max_steps=10, dry_run=True))
        assert "<loop.started_at:0:19>" in dry.output
        assert "reached terminal state 'done'" in dry.output
        result, _, _ = await run(report.spec, cwd=str(tmp_path))
        assert result.status is Status.ERROR
        assert "state 'stamp': ${loop.started_at:0:19}: ':0:19' is bash syntax" in (
            result.error or "")
        assert not (tmp_path / "RAN").exists()
