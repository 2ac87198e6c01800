"""Loop actions as real subprocesses: captures, evaluators on real output, signals, timeouts.

Real time, kept short: every action is a quick shell command or a tiny Python.
"""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from pathlib import Path

import pytest
from loop_support import events, path_taken, routes, run, spec_of, verdicts

from kernel import Limits, Ports, Status
from kernel.testing import ScriptedCritic

pytestmark = pytest.mark.realtime


class TestShellActions:
    async def test_a_capture_holds_output_stderr_exit_code_and_duration(self,
                                                                        tmp_path: Path) -> None:
        """`capture:` stores all four fields, readable as ${captured.NAME.*} and ${prev.*}."""
        spec = spec_of(tmp_path, """
            initial: produce
            states:
              produce:
                action: echo out; echo err >&2; exit 1
                capture: p
                evaluate: {type: exit_code}
                on_no: report
              report:
                action: |
                  echo "${captured.p.output}|${captured.p.stderr}|${captured.p.exit_code}|"\\
                  "${prev.state}|${prev.output}"
                capture: r
                next: done
              done: {terminal: true}
        """)
        result, _, agent = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.OK
        assert agent.captured["r"]["output"] == "out|err|1|produce|out"
        assert agent.captured["p"]["duration_ms"] > 0
        assert result.output == "out|err|1|produce|out\n"

    @pytest.mark.parametrize(("command", "verdict"), [
        ("exit 0", "yes"), ("exit 1", "no"), ("exit 3", "error")])
    async def test_exit_code_is_the_default_evaluator(self, tmp_path: Path, command: str,
                                                      verdict: str) -> None:
        """A shell action without `evaluate` is judged by its exit code."""
        spec = spec_of(tmp_path, f"""
            initial: act
            states:
              act: {{action: "{command}", on_yes: done, on_no: done, on_error: done}}
              done: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert verdicts(audit, result.run_id) == [verdict]

    @pytest.mark.parametrize(("action", "evaluate", "verdict"), [
        ("echo 'tests: 12 passed'", "{type: output_contains, pattern: '\\d+ passed'}", "yes"),
        ("echo 'FAILED'", "{type: output_contains, pattern: FAILED, negate: true}", "no"),
        ("echo 87.5", "{type: output_numeric, operator: ge, target: 80}", "yes"),
        ("""echo '{"errors": 2}'""", "{type: output_json, path: .errors, operator: eq, "
                                     "target: 0}", "no"),
        ("echo '{}'", "{type: output_numeric, operator: eq, target: 1}", "error"),
    ])
    async def test_evaluators_read_real_output(self, tmp_path: Path, action: str,
                                               evaluate: str, verdict: str) -> None:
        """Each output evaluator judges what the command really printed."""
        spec = spec_of(tmp_path, f"""
            initial: act
            states:
              act:
                action: {json.dumps(action)}
                evaluate: {evaluate}
                route: {{_: done}}
              done: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert verdicts(audit, result.run_id) == [verdict]

    async def test_convergence_remembers_the_previous_value(self, tmp_path: Path) -> None:
        """A metric going 9, 7, 7 is progress, progress, then stall."""
        (tmp_path / "values").write_text("9\n7\n7\n")
        spec = spec_of(tmp_path, """
            initial: measure
            states:
              measure:
                action: head -n1 values && sed -i 1d values
                evaluate: {type: convergence, target: 0}
                route: {progress: $current, stall: stalled, target: done}
              stalled: {terminal: true}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, cwd=str(tmp_path))
        assert verdicts(audit, result.run_id) == ["progress", "progress", "stall"]
        last = events(audit, result.run_id, "evaluate")[-1].payload["details"]
        assert (last["current"], last["previous"]) == (7.0, 7.0)

    async def test_the_evaluator_source_replaces_the_output(self, tmp_path: Path) -> None:
        """`evaluate.source` judges an interpolated value instead of the action's output."""
        spec = spec_of(tmp_path, """
            initial: count
            states:
              count:
                action: echo 3; echo noise >&2
                capture: c
                evaluate: {type: output_contains, source: "${captured.c.stderr}",
                           pattern: noise}
                on_yes: done
              done: {terminal: true}
        """)
        result, _, _ = await run(spec)
        assert result.status is Status.OK

    async def test_action_events_and_output_lines_are_audited(self, tmp_path: Path) -> None:
        """action_start/output/action_end events carry the command, its lines and exit code."""
        spec = spec_of(tmp_path, """
            initial: talk
            states:
              talk: {action: "echo one; echo two; echo three", next: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, max_line_events=2)
        start, end = events(audit, result.run_id, "action_start", "action_end")
        assert start.payload["action"] == "echo one; echo two; echo three"
        assert start.payload["action_type"] == "shell"
        assert (end.payload["exit_code"], end.payload["output_tail"]) == (0, "one\ntwo\nthree\n")
        assert end.duration_ms is not None and end.duration_ms > 0
        lines = [e.payload["line"] for e in events(audit, result.run_id, "output")]
        assert lines == ["one", "two"]  # capped by max_line_events

    async def test_a_long_line_stays_one_line_and_is_marked_cut(self, tmp_path: Path) -> None:
        """A line over the capture limit is one captured line, cut, with the cut said everywhere."""
        spec = spec_of(tmp_path, """
            initial: big
            states:
              big:
                action: python3 -c "print('{' + 'x' * 1490000 + '}'); print('after')"
                capture: big
                next: done
              done: {terminal: true}
        """)
        echoed: list[bytes] = []
        result, audit, agent = await run(
            spec, max_line_events=1, on_output=lambda stream, chunk: echoed.append(chunk))
        assert result.status is Status.OK
        assert b"".join(echoed) == b"{" + b"x" * 1_490_000 + b"}\nafter\n"
        captured = agent.captured["big"]["output"]  # the last 256 KiB, from one line
        assert captured == "x" * (256 * 1024 - 7) + "\nafter"
        [line] = [e.payload for e in events(audit, result.run_id, "output")]
        assert line["truncated"] is True and len(line["line"]) == 2000
        [end] = events(audit, result.run_id, "action_end")
        assert end.payload["output_truncated"] is True
        [marker] = events(audit, result.run_id, "output_not_audited")
        assert marker.payload["lines"] == 1 and marker.payload["cap"] == 1

    async def test_an_action_that_outlives_its_timeout_is_an_error_verdict(
            self, tmp_path: Path) -> None:
        """The state's timeout stops the command: exit 124, verdict error, on_error taken."""
        spec = spec_of(tmp_path, """
            initial: slow
            states:
              slow: {action: "sleep 30", timeout: 0.3, on_error: recover}
              recover: {terminal: true}
        """)
        result, audit, _ = await run(spec, grace=0.2)
        assert routes(audit, result.run_id) == [("slow", "recover", "on_error")]
        (end,) = events(audit, result.run_id, "action_end")
        assert (end.payload["exit_code"], end.payload["timed_out"]) == (124, True)
        assert result.runtime_seconds < 5


class TestKilledBySignal:
    async def test_on_error_is_taken(self, tmp_path: Path) -> None:
        """A shell action killed by a signal takes on_error, even from a `next` state."""
        spec = spec_of(tmp_path, """
            initial: doomed
            states:
              doomed: {action: "kill -9 $$", next: done, on_error: cleanup}
              cleanup: {terminal: true}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id) == [("doomed", "cleanup", "killed by signal 9")]

    async def test_without_on_error_the_loop_stops(self, tmp_path: Path) -> None:
        """With nowhere to go, a killed action stops the loop: `cancelled`, naming the signal."""
        spec = spec_of(tmp_path, """
            initial: doomed
            states:
              doomed: {action: "kill -TERM $$", next: done}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec)
        assert result.status is Status.CANCELLED
        assert result.reason == "the action of state 'doomed' was killed by signal 15"


class TestSignals:
    async def test_context_handoff_ends_handoff_with_the_continuation(self,
                                                                      tmp_path: Path) -> None:
        """CONTEXT_HANDOFF: <text> ends the run `handoff`; the text is the continuation."""
        spec = spec_of(tmp_path, """
            initial: work
            states:
              work: {action: "echo working; echo 'CONTEXT_HANDOFF: resume at step 4'",
                     next: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert (result.status, result.output) == (Status.HANDOFF, "resume at step 4")
        (signal,) = events(audit, result.run_id, "signal")
        assert signal.payload["signal"] == "handoff"

    async def test_fatal_error_ends_error_with_its_text(self, tmp_path: Path) -> None:
        """FATAL_ERROR: <text> ends the run `error` with that text, whatever the routes say."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check: {action: "echo 'FATAL_ERROR: disk full'", on_yes: done}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec)
        assert (result.status, result.error) == (Status.ERROR, "disk full")

    async def test_loop_stop_ends_cancelled_with_the_reason(self, tmp_path: Path) -> None:
        """LOOP_STOP: <text> ends the run `cancelled` with that reason."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check: {action: "echo '  LOOP_STOP: nothing left to do'", on_yes: check}
        """)
        result, _, _ = await run(spec)
        assert (result.status, result.reason) == (Status.CANCELLED, "nothing left to do")


class TestPromptAndMcp:
    ECHO_PROMPT = [sys.executable, "-c", "import sys; print('MODEL SAW: ' + sys.argv[1])"]

    async def test_a_prompt_action_runs_the_prompt_command(self, tmp_path: Path) -> None:
        """A leading '/' makes a prompt action: the prompt is the command's last argument."""
        spec = spec_of(tmp_path, """
            initial: ask
            context: {topic: tests}
            states:
              ask:
                action: /review the ${context.topic}
                capture: answer
                evaluate: {type: output_contains, pattern: "MODEL SAW: /review the tests"}
                on_yes: done
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, prompt_command=self.ECHO_PROMPT)
        assert result.status is Status.OK
        (start,) = events(audit, result.run_id, "action_start")
        assert start.payload["action_type"] == "prompt"

    async def test_a_prompt_judged_without_a_model_takes_on_error(self, tmp_path: Path) -> None:
        """A prompt's default evaluator is llm_structured: with no model wired it is `error`."""
        spec = spec_of(tmp_path, """
            initial: ask
            states:
              ask: {action: "summarise", action_type: prompt, on_yes: done, on_error: manual}
              manual: {terminal: true}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, prompt_command=self.ECHO_PROMPT)
        assert routes(audit, result.run_id) == [("ask", "manual", "on_error")]

    async def test_critic_nudges_reach_the_next_prompt(self, tmp_path: Path) -> None:
        """A steer message is appended to the prompt of the state that runs next."""
        spec = spec_of(tmp_path, """
            initial: warmup
            states:
              warmup: {next: ask}
              ask:
                action: /continue
                capture: answer
                next: done
              done: {terminal: true}
        """)
        critic = ScriptedCritic(steer_at_step={1: "focus on the failing test"})
        result, audit, agent = await run(spec, prompt_command=self.ECHO_PROMPT,
                                         ports=Ports(critic=critic))
        assert "- focus on the failing test" in agent.captured["answer"]["output"]
        assert events(audit, result.run_id, "steer_delivered")

    async def test_an_mcp_tool_call_is_judged_by_its_envelope(self, tmp_path: Path) -> None:
        """mcp_tool runs the MCP caller with the tool and JSON params; mcp_result judges it."""
        caller = tmp_path / "mcp_call.py"
        caller.write_text(
            "import json, sys\n"
            "tool, params = sys.argv[1], json.loads(sys.argv[2])\n"
            "ok = tool == 'fs/read' and params == {'path': 'a.txt', 'n': 2}\n"
            "print(json.dumps({'content': [], 'isError': not ok}))\n")
        spec = spec_of(tmp_path, """
            initial: call
            context: {file: a.txt}
            states:
              call:
                action: fs/read
                action_type: mcp_tool
                params: {path: "${context.file}", n: 2}
                on_yes: done
                on_no: failed
              done: {terminal: true}
              failed: {terminal: true}
        """)
        result, audit, _ = await run(spec, mcp_command=[sys.executable, str(caller)])
        assert routes(audit, result.run_id) == [("call", "done", "on_yes")]
        assert events(audit, result.run_id, "evaluate")[0].payload["type"] == "mcp_result"


class TestSubLoops:
    CHILD = """
        name: child
        initial: work
        context: {mode: ok}
        states:
          work:
            action: echo "child sees ${context.mode} ${context.parent_value:default=-}"
            capture: seen
            evaluate: {type: output_contains, pattern: "sees ok"}
            on_yes: done
            on_no: spin
          spin: {next: spin}
          done: {terminal: true}
    """

    def parent(self, tmp_path: Path, extra: str = "", passthrough: bool = False) -> str:
        (tmp_path / "child.yaml").write_text(textwrap.dedent(self.CHILD))
        return f"""
            name: parent
            initial: sub
            context: {{parent_value: from-parent{extra}}}
            states:
              sub:
                loop: child
                context_passthrough: {str(passthrough).lower()}
                on_yes: good
                on_no: bad
              good: {{terminal: true}}
              bad: {{terminal: true}}
        """

    async def test_a_sub_loop_is_a_child_run_and_routes_on_its_status(self,
                                                                      tmp_path: Path) -> None:
        """The child gets its own run (parent_run_id set); its `ok` routes the parent on yes."""
        spec = spec_of(tmp_path, self.parent(tmp_path))
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id) == [("sub", "good", "on_yes")]
        child_rows = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert [(r.info.name, r.status) for r in child_rows] == [("child", Status.OK)]
        child_id = child_rows[0].info.run_id
        assert path_taken(audit, child_id) == ["work"]
        (evaluate,) = events(audit, result.run_id, "evaluate")
        assert evaluate.payload["details"]["child_run_id"] == child_id
        assert [e.kind for e in audit.events(result.run_id) if e.kind.startswith("child_")] \
            == ["child_start", "child_end"]

    async def test_next_routes_a_sub_loop_state(self, tmp_path: Path) -> None:
        """`next:` on a `loop:` state goes on whatever the child's verdict, as on an action
        state (README: `next` comes first in routing); `kernel validate` took it, and the
        run ended `error: no valid transition`."""
        text = self.parent(tmp_path).replace("on_yes: good\n                on_no: bad",
                                             "next: good")
        assert "next: good" in text
        spec = spec_of(tmp_path, text)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK, result.error
        assert routes(audit, result.run_id) == [("sub", "good", "next")]

    async def test_a_child_that_does_not_finish_routes_no(self, tmp_path: Path) -> None:
        """A child ending max_steps (not ok) takes the parent's on_no."""
        text = self.parent(tmp_path).replace("parent_value: from-parent", "mode: broken")
        (tmp_path / "child.yaml").write_text(
            (tmp_path / "child.yaml").read_text().replace("initial: work",
                                                          "initial: work\nmax_iterations: 3"))
        spec = spec_of(tmp_path, text.replace("context_passthrough: false",
                                              "context_passthrough: true"))
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("sub", "bad", "on_no")]
        (evaluate,) = events(audit, result.run_id, "evaluate")
        assert evaluate.payload["details"]["child_status"] == "max_steps"

    async def test_passthrough_shares_context_and_brings_captures_back(self,
                                                                       tmp_path: Path) -> None:
        """context_passthrough: the child sees the parent's context; its captures come back."""
        spec = spec_of(tmp_path, self.parent(tmp_path, passthrough=True))
        result, _, agent = await run(spec)
        assert result.status is Status.OK
        assert agent.captured["sub"]["seen"]["output"] == "child sees ok from-parent"

    async def test_without_passthrough_the_child_keeps_to_itself(self, tmp_path: Path) -> None:
        """Without passthrough the child sees only its own context, and none of its captures
        come back: only how it ended (little-loops' `terminated_by`)."""
        spec = spec_of(tmp_path, self.parent(tmp_path))
        _, audit, agent = await run(spec)
        child_id = next(r.info.run_id for r in audit.runs.values() if r.info.parent_run_id)
        (end,) = events(audit, child_id, "action_end")
        assert end.payload["output_tail"] == "child sees ok -\n"
        assert agent.captured["sub"] == {"terminated_by": "terminal"}

    async def test_a_child_error_takes_on_error_when_the_state_has_one(self,
                                                                       tmp_path: Path) -> None:
        """A child ending `error` routes the parent on `error` if it has such a route."""
        (tmp_path / "child.yaml").write_text(
            "initial: boom\nstates:\n  boom: {action: \"echo 'FATAL_ERROR: nope'\"}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: child.yaml, on_yes: good, on_no: bad, on_error: ugly}
              good: {terminal: true}
              bad: {terminal: true}
              ugly: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("sub", "ugly", "on_error")]
        (evaluate,) = events(audit, result.run_id, "evaluate")
        assert evaluate.payload["details"]["child_error"] == "nope"

    async def test_the_child_is_bounded_by_the_parents_deadline(self, tmp_path: Path) -> None:
        """A child without its own timeout still ends when the parent's time is up."""
        (tmp_path / "child.yaml").write_text(
            "initial: slow\nstates:\n  slow: {action: 'sleep 20', next: slow}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: child, on_yes: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, limits=Limits(max_steps=5, timeout=0.5), grace=0.2)
        assert result.status is Status.TIMEOUT
        assert result.runtime_seconds < 5
        child = next(r for r in audit.runs.values() if r.info.parent_run_id)
        assert child.status is not None and child.status is not Status.OK


class TestLargeValues:
    """Issue 13.8: a captured value over 128 KiB used to make the next action fail with
    `Argument list too long` (values travel as environment variables), and the run still
    ended `ok` because the failure was routed as a verdict."""

    async def test_a_large_capture_reaches_the_next_action_byte_for_byte(
            self, tmp_path: Path) -> None:
        """200 KiB (and ten 50 KiB values at once) pass through, unchanged."""
        (tmp_path / "gen.py").write_text(
            "for i in range(200):\n    print('x' * 999)\nprint(' \\\\ \\\\n \"$(x)\\'')\n")
        spec = spec_of(tmp_path, """
            initial: big
            states:
              big:
                action: python3 gen.py
                capture: big
                next: medium
              medium:
                action: python3 -c "print('y' * 50000)"
                capture: medium
                next: use
              use:
                action: |
                  printf '%s' "${captured.big.output}" | sha256sum
                  printf '%s' ${captured.medium.output} ${captured.medium.output} \\
                    ${captured.medium.output} ${captured.medium.output} \\
                    ${captured.medium.output} ${captured.medium.output} \\
                    ${captured.medium.output} ${captured.medium.output} \\
                    ${captured.medium.output} ${captured.medium.output} | wc -c
                  printf '%s' "${captured.big.output}" | wc -c
                capture: used
                on_yes: done
                on_no: failed
              done: {terminal: true}
              failed: {terminal: true}
        """)
        result, audit, agent = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.OK, result.error
        assert routes(audit, result.run_id)[-1] == ("use", "done", "on_yes")
        big = agent.captured["big"]["output"]
        assert big == ("x" * 999 + "\n") * 200 + ' \\ \\n "$(x)\''
        lines = agent.captured["used"]["output"].split()
        assert lines[0] == hashlib.sha256(big.encode()).hexdigest()
        assert lines[2:] == [str(10 * 50000), str(len(big))]
        assert not list(tmp_path.glob("kernel-loop-*"))

    async def test_too_large_for_a_prompt_fails_the_run_and_is_never_a_verdict(
            self, tmp_path: Path) -> None:
        """A prompt must be one argument: past the limit the run ends `error`, naming it."""
        spec = spec_of(tmp_path, """
            initial: big
            states:
              big: {action: "python3 -c \\"print('x' * 200000)\\"", capture: big, next: ask}
              ask:
                action: "/summarise ${captured.big.output}"
                on_yes: done
                on_no: done
                on_error: done
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, prompt_command=TestPromptAndMcp.ECHO_PROMPT)
        assert result.status is Status.ERROR
        assert "cannot start" in (result.error or "")
        assert "over the system's" in (result.error or "")
        assert path_taken(audit, result.run_id) == ["big", "ask"]
