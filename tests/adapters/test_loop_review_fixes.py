"""Loop defects a review reproduced: each test here failed before its fix.

Validation (`${result.*}` outside routes, misspelled verdict routes, bash
operators after a name, `--context` keys no template reads, dotted context
keys), the judge's verdict enum, a backoff under the critic's idle clock and
in the step's time, and a child sub-loop stopped by the budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from loop_support import events, routes, run, spec_of, write

from adapters.loop import JudgeRequest, LoopAgent, check_loop
from adapters.loop import _template as tpl
from kernel import ConfigError, Limits, Ports, Status, Usage


def problems(tmp_path: Path, text: str, *, context: dict[str, str] | None = None,
             ) -> list[tuple[str, str, str]]:
    """(severity, where, message) of every problem `kernel validate` finds in `text`."""
    report = check_loop(write(tmp_path, text), context=context)
    return [(p.severity, p.where, p.message) for p in report.problems]


class TestResultOutsideRoutes:
    """`${result.*}` has a value only where a verdict is routed."""

    LOOP = """
        initial: a
        states:
          a: {{action: "exit 3", on_yes: done, on_error: err}}
          err: {{action: 'echo "verdict was {placeholder}"', next: done}}
          done: {{terminal: true}}
    """

    def test_in_an_action_it_is_an_error(self, tmp_path: Path) -> None:
        """validate refuses it (every run reaching it would end `error`)."""
        found = problems(tmp_path, self.LOOP.format(placeholder="${result.verdict}"))
        errors = [(w, m) for s, w, m in found if s == "error"]
        assert len(errors) == 1, found
        where, message = errors[0]
        assert where == "states.err.action"
        assert "only in a route target" in message

    def test_with_a_default_it_is_a_warning(self, tmp_path: Path) -> None:
        """With `:default=` the run works (always the default): a warning says so."""
        found = problems(tmp_path, self.LOOP.format(placeholder="${result.verdict:default=x}"))
        assert [s for s, _, m in found if "route target" in m] == ["warning"], found

    def test_in_a_route_target_it_is_fine(self, tmp_path: Path) -> None:
        """A route target sees the evaluation: no problem there."""
        found = problems(tmp_path, """
            initial: a
            states:
              a: {action: "true", route: {yes: "${result.verdict}", _: "no"}}
              "yes": {terminal: true}
              "no": {terminal: true}
        """)
        assert not [m for _, _, m in found if "result" in m], found


class TestVerdictRouteKeys:
    """A route key naming a verdict no evaluator gives is a typo: an error, with a hint."""

    def test_a_misspelled_on_key(self, tmp_path: Path) -> None:
        """`on_sucess` beside `on_no` is an error pointing at on_success."""
        found = problems(tmp_path, """
            initial: build
            states:
              build: {action: "true", on_sucess: done, on_no: failed}
              failed: {terminal: true}
              done: {terminal: true}
        """)
        assert [(s, w) for s, w, _ in found] == [("error", "states.build.on_sucess")]
        assert "did you mean 'on_success'?" in found[0][2]

    def test_on_yse_suggests_on_yes(self, tmp_path: Path) -> None:
        found = problems(tmp_path, """
            initial: build
            states:
              build: {action: "true", on_yse: done, on_no: done}
              done: {terminal: true}
        """)
        assert [(s, w) for s, w, _ in found] == [("error", "states.build.on_yse")]
        assert "did you mean 'on_yes'?" in found[0][2]

    def test_a_misspelled_route_key(self, tmp_path: Path) -> None:
        """In a route table: the unknown key is an error listing what the evaluator gives;
        a verdict another evaluator gives (`target`, convergence's) is a warning."""
        found = problems(tmp_path, """
            initial: build
            states:
              build: {action: "true", route: {target: done, sucess: done, _: done}}
              done: {terminal: true}
        """)
        by_where = {w: (s, m) for s, w, m in found}
        severity, message = by_where["states.build.route.sucess"]
        assert severity == "error" and "exit_code gives: error, no, yes" in message
        severity, message = by_where["states.build.route.target"]
        assert severity == "warning" and "exit_code never gives 'target'" in message

    def test_the_verdicts_each_evaluator_gives_pass(self, tmp_path: Path) -> None:
        """Every verdict a state can get routed raises nothing (convergence, a model's
        enum with its `_uncertain` forms, a sub-loop's timeout, mcp_result's names)."""
        write(tmp_path, "initial: a\nstates:\n  a: {terminal: true}\n", "child.yaml")
        found = problems(tmp_path, """
            initial: c
            states:
              c:
                action: echo 1
                evaluate: {type: convergence, target: 0}
                on_target: j
                on_progress: c
                on_stall: j
              j:
                action: /judge
                evaluate: {type: llm_structured, uncertain_suffix: true}
                on_yes: s
                on_no_uncertain: s
                on_blocked: s
                on_partial: s
                on_error: s
              s: {loop: child, on_yes: m, on_no: m, on_timeout: m}
              m:
                action: tool
                action_type: mcp_tool
                route: {success: done, tool_error: done, not_found: done, timeout: done}
              done: {terminal: true}
        """)
        assert not [p for p in found if "verdict" in p[2] or "gives" in p[2]], found

    def test_little_loops_routes_left_out_are_named(self, tmp_path: Path) -> None:
        """`on_rate_limit_exhausted` (a little-loops feature left out) warns, naming it."""
        found = problems(tmp_path, """
            initial: a
            states:
              a: {action: "true", on_yes: done, on_rate_limit_exhausted: done}
              done: {terminal: true}
        """)
        assert [(s, w) for s, w, _ in found] == [("warning", "states.a.on_rate_limit_exhausted")]
        assert "rate-limit" in found[0][2]

    async def test_a_model_verdict_outside_the_enum_routes_as_error(self, tmp_path: Path,
                                                                      ) -> None:
        """A judge answering `maybe` (not yes/no/partial/blocked) is a malformed answer:
        the verdict is `error`, and the state's on_error takes it."""
        spec = spec_of(tmp_path, """
            initial: a
            states:
              a:
                action: /judge this
                on_yes: done
                on_no: done
                on_partial: done
                on_error: handled
              done: {terminal: true}
              handled: {terminal: true}
        """)

        async def judge(request: JudgeRequest) -> Mapping[str, Any]:
            await trio.lowlevel.checkpoint()
            return {"verdict": "maybe", "confidence": 0.9, "reason": "unsure"}

        result, audit, _ = await run(spec, judge=judge, prompt_command=("true",))
        assert result.status is Status.OK, result.error
        assert routes(audit, result.run_id) == [("a", "handled", "on_error")]
        (evaluated,) = events(audit, result.run_id, "evaluate")
        assert evaluated.payload["verdict"] == "error"
        assert "'maybe' is not one of yes, no, partial, blocked" in \
            evaluated.payload["details"]["error"]


class TestBashOperatorsAfterTheName:
    """Bash's trim, replace and case operators are recognised like `:0:19` and `:-`."""

    @pytest.mark.parametrize(("source", "name", "op"), [
        ("${captured.ver.output%%.*}", "captured.ver.output", "%%.*"),
        ("${captured.ver.output#v}", "captured.ver.output", "#v"),
        ("${context.name^^}", "context.name", "^^"),
        ("${context.name,,}", "context.name", ",,"),
        ("${context.x//a/b}", "context.x", "//a/b"),
        ("${context.x/%a/b}", "context.x", "/%a/b"),
        ("${context.x@Q}", "context.x", "@Q"),
        ("${context.x[0]}", "context.x", "[0]"),
    ])
    def test_the_operator_is_not_part_of_the_name(self, source: str, name: str,
                                                  op: str) -> None:
        (ph,) = tpl.placeholders(source)
        assert (ph.name, ph.bash_op) == (name, op)
        ns = tpl.Namespaces(context={"x": "a", "name": "n"},
                            captured={"ver": {"output": "v1.2"}}, prev=None, result=None,
                            state={}, loop={}, env={})
        with pytest.raises(tpl.TemplateError, match="is bash syntax"):
            tpl.render(source, ns)

    @pytest.mark.parametrize(("source", "op"), [("${#context.x}", "#"),
                                                ("${!context.x}", "!")])
    def test_length_and_indirection_before_the_name(self, source: str, op: str) -> None:
        (ph,) = tpl.placeholders(source)
        assert (ph.name, ph.bash_op, ph.bash_prefix) == ("context.x", op, True)
        assert f'"$${{{op}v}}"' in tpl.bash_op_why(ph)

    def test_a_default_may_still_hold_those_characters(self) -> None:
        (ph,) = tpl.placeholders("${context.x:default=a/b#c}")
        assert (ph.bash_op, ph.default) == (None, "a/b#c")

    def test_validate_warns_and_names_the_variable_right(self, tmp_path: Path) -> None:
        """`${context.name^^}`: the bash-operator warning, and the missing context is
        `name` (so the advice is `--context name=VALUE`, not `name^^=VALUE`)."""
        found = problems(tmp_path, """
            initial: a
            states:
              a: {action: 'echo "${context.name^^}"', next: done}
              done: {terminal: true}
        """)
        messages = [m for _, _, m in found]
        assert any("'^^' is bash syntax" in m for m in messages), found
        assert any("context variable 'name' is not defined" in m for m in messages), found
        assert not any("name^^" in m and "not defined" in m for m in messages), found

    async def test_a_run_reaching_one_ends_error_before_the_action(self,
                                                                    tmp_path: Path) -> None:
        spec = spec_of(tmp_path, """
            initial: a
            context: {name: world}
            states:
              a: {action: 'echo "${context.name^^}" > ran', next: done}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec, cwd=str(tmp_path))
        assert result.status is Status.ERROR
        assert "'^^' is bash syntax" in (result.error or "")
        assert not (tmp_path / "ran").exists()


class TestContextKeys:
    """`--context` keys: one no template reads is named; a dotted one reaches a field."""

    LOOP = """
        initial: a
        context: {mode: fast, cfg: {depth: 3, width: 2}}
        states:
          a: {action: 'echo ${context.mode} ${context.cfg.depth} ${context.cfg.width}',
              next: done}
          done: {terminal: true}
    """

    def test_an_unread_key_is_a_warning_with_a_close_match(self, tmp_path: Path) -> None:
        found = problems(tmp_path, self.LOOP, context={"mdoe": "slow"})
        assert ("warning", "", "--context mdoe: the loop never reads ${context.mdoe} "
                               "(did you mean 'mode'?)") in found

    def test_keys_the_loop_reads_or_declares_raise_nothing(self, tmp_path: Path) -> None:
        found = problems(tmp_path, self.LOOP, context={"mode": "slow", "cfg.depth": "9",
                                                       "run_dir": "/tmp/x"})
        assert not [p for p in found if "--context" in p[2]], found

    def test_a_sub_loop_given_the_context_reads_it_too(self, tmp_path: Path) -> None:
        """context_passthrough: what the child reads counts as read."""
        write(tmp_path, """
            initial: a
            states:
              a: {action: 'echo ${context.deep}', next: done}
              done: {terminal: true}
        """, "child.yaml")
        found = problems(tmp_path, """
            initial: s
            states:
              s: {loop: child, context_passthrough: true, on_yes: done, on_no: done}
              done: {terminal: true}
        """, context={"deep": "1", "shallow": "2"})
        assert [m for _, _, m in found if "--context" in m] == [
            "--context shallow: the loop never reads ${context.shallow}"]

    async def test_a_dotted_key_sets_a_field(self, tmp_path: Path) -> None:
        """`-c cfg.depth=9` reaches `${context.cfg.depth}`; the file's other fields stay."""
        spec = spec_of(tmp_path, self.LOOP)
        result, _, agent = await run(spec, context={"cfg.depth": "9"}, cwd=str(tmp_path))
        assert result.status is Status.OK
        assert agent.context["cfg"] == {"depth": "9", "width": 2}
        assert (result.output or "").strip() == "fast 9 2"

    def test_a_dotted_key_into_a_value_is_refused(self, tmp_path: Path) -> None:
        """`-c mode.x=1` where `mode` is a plain value: an error naming both, at validate
        and when the agent is made."""
        found = problems(tmp_path, self.LOOP, context={"mode.x": "1"})
        assert ("error", "", "--context mode.x: context 'mode' is a single value, not a "
                             "mapping with fields") in found
        with pytest.raises(ConfigError, match="context 'mode' is a single value"):
            LoopAgent(spec_of(tmp_path, self.LOOP), context={"mode.x": "1"})
        with pytest.raises(ConfigError, match="context 'a' is a single value"):
            LoopAgent(spec_of(tmp_path, self.LOOP), context={"a.b": "1", "a": "2"})


class TestBackoff:
    """A loop's own `backoff` is a known wait, not work and not a stall."""

    LOOP = """
        initial: a
        backoff: 4.5
        max_iterations: 3
        states:
          a: {next: a}
    """

    async def test_a_backoff_longer_than_the_idle_timeout_is_not_a_stall(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """idle_timeout 3 s (grace 0.75 s), backoff 4.5 s: the run ends at its step limit,
        never `stalled`."""
        from batteries.critic import CriticPolicy, WatchCritic

        critic = WatchCritic(CriticPolicy(idle_timeout=3.0))
        start = trio.current_time()
        result, _, _ = await run(spec_of(tmp_path, self.LOOP), ports=Ports(critic=critic))
        assert (result.status, result.reason) == (Status.MAX_STEPS,
                                                  "step ceiling of 3 reached"), result
        assert trio.current_time() - start == pytest.approx(9.0, abs=0.1)

    async def test_the_wait_is_recorded_apart_from_the_state(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The step after a backoff says how much of it was the wait (`backoff_ms`)."""
        result, audit, _ = await run(spec_of(tmp_path, self.LOOP))
        steps = events(audit, result.run_id, "step")
        assert [s.payload.get("backoff_ms") for s in steps] == [None, 4500.0, 4500.0]
        for step in steps[1:]:
            assert step.duration_ms is not None
            state_ms = step.duration_ms - step.payload["backoff_ms"]
            assert state_ms == pytest.approx(0.0, abs=1.0)


class TestChildStoppedByTheBudget:
    """A child sub-loop stopped by the budget is not a `no` for the parent to route (a
    child the budget refused at its start: test_loop_subloops.py)."""

    PARENT = """
        initial: p
        states:
          p: {loop: child, capture: kid, on_yes: done, on_no: done}
          done: {terminal: true}
    """

    async def test_a_child_out_of_an_inherited_cap_ends_the_parent_budget_exceeded(
            self, tmp_path: Path) -> None:
        """The child used up the parent's token cap: the parent ends `budget_exceeded`."""
        write(tmp_path, """
            initial: a
            states:
              a: {action: /judge, on_yes: done, on_no: done}
              done: {terminal: true}
        """, "child.yaml")

        async def judge(request: JudgeRequest) -> Mapping[str, Any]:
            await trio.lowlevel.checkpoint()
            return {"verdict": "yes", "usage": Usage(8, 4, 0, 0.0)}

        spec = spec_of(tmp_path, self.PARENT)
        limits = Limits(max_steps=10, timeout=60, max_total_tokens=5)
        result, _, _ = await run(spec, limits=limits, judge=judge, prompt_command=("true",))
        assert result.status is Status.BUDGET_EXCEEDED, (result.status, result.error)
