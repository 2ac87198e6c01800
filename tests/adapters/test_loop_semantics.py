"""Loop semantics under a real kernel, in virtual time: routing, retries, maintain, limits.

These loops have no actions (verdicts come from `evaluate.source`), so no
process is started and `autojump_clock` drives every sleep and deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from loop_support import events, path_taken, routes, run, spec_of, verdicts, write

from adapters.loop import LoopAgent, check_loop
from kernel import Checkpoint, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, RecordingCheckpointer, ScriptedCritic

# A state whose verdict is "yes" when ${context.answer} is "yes", else "no".
ASK = 'evaluate: {type: output_contains, source: "${context.answer}", pattern: "^yes$"}'


class TestRouting:
    async def test_next_wins_over_every_route(self, tmp_path: Path,
                                              autojump_clock: trio.abc.Clock) -> None:
        """An unconditional `next` is taken even when route/on_* keys match the verdict."""
        spec = spec_of(tmp_path, """
            initial: a
            states:
              a: {next: b, on_yes: c, route: {yes: c}}
              b: {terminal: true}
              c: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert routes(audit, result.run_id) == [("a", "b", "next")]
        assert not events(audit, result.run_id, "evaluate")

    async def test_route_table_matches_the_verdict(self, tmp_path: Path,
                                                   autojump_clock: trio.abc.Clock) -> None:
        """A verdict listed in `route` goes where the table says, before any shorthand."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "no"}}
            states:
              ask:
                {ASK}
                route: {{yes: good, no: bad}}
                on_no: good
              good: {{terminal: true}}
              bad: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("ask", "bad", "route.no")]

    async def test_error_key_comes_before_the_default(self, tmp_path: Path,
                                                      autojump_clock: trio.abc.Clock) -> None:
        """An `error` verdict takes `_error`, other unlisted verdicts take `_`."""
        spec = spec_of(tmp_path, """
            initial: measure
            states:
              measure:
                evaluate: {type: output_numeric, source: "not a number", operator: eq,
                           target: 1}
                route: {yes: done, _: other, _error: broken}
              done: {terminal: true}
              other: {terminal: true}
              broken: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert verdicts(audit, result.run_id) == ["error"]
        assert routes(audit, result.run_id) == [("measure", "broken", "route._error")]

    async def test_default_catches_unlisted_verdicts(self, tmp_path: Path,
                                                     autojump_clock: trio.abc.Clock) -> None:
        """`_` (or `default`) routes a verdict the table does not list."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "maybe"}}
            states:
              ask:
                {ASK}
                route: {{yes: good, default: fallback}}
              good: {{terminal: true}}
              fallback: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("ask", "fallback", "route._")]

    async def test_table_miss_falls_through_to_shorthands(self, tmp_path: Path,
                                                          autojump_clock: trio.abc.Clock
                                                          ) -> None:
        """A verdict the route table lacks (and no default) is tried against on_* next."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "no"}}
            states:
              ask:
                {ASK}
                route: {{yes: good}}
                on_no: retry_later
              good: {{terminal: true}}
              retry_later: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("ask", "retry_later", "on_no")]

    async def test_success_and_failure_are_aliases(self, tmp_path: Path,
                                                   autojump_clock: trio.abc.Clock) -> None:
        """on_success/on_failure route the yes/no verdicts (older loop files use them)."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "yes"}}
            states:
              ask:
                {ASK}
                on_success: good
                on_failure: bad
              good: {{terminal: true}}
              bad: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("ask", "good", "on_yes")]

    async def test_any_on_verdict_key_is_a_route(self, tmp_path: Path,
                                                 autojump_clock: trio.abc.Clock) -> None:
        """`on_<verdict>` routes custom verdicts such as convergence's `target`."""
        spec = spec_of(tmp_path, """
            initial: m
            states:
              m:
                evaluate: {type: convergence, source: "0", target: 0}
                on_target: done
                on_progress: m
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("m", "done", "on_target")]

    async def test_current_reenters_the_same_state(self, tmp_path: Path,
                                                   autojump_clock: trio.abc.Clock) -> None:
        """`$current` as a target re-enters the state that routed."""
        spec = spec_of(tmp_path, """
            initial: count
            states:
              count:
                evaluate: {type: output_numeric, source: "${state.iteration}", operator: ge,
                           target: 3}
                on_yes: done
                on_no: $current
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.OK
        assert path_taken(audit, result.run_id) == ["count", "count", "count"]
        assert result.steps == 3

    async def test_targets_can_be_interpolated(self, tmp_path: Path,
                                               autojump_clock: trio.abc.Clock) -> None:
        """A route target may be computed from variables, e.g. ${result.verdict}."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "no"}}
            states:
              ask:
                {ASK}
                route: {{_: "go_${{result.verdict}}"}}
              go_yes: {{terminal: true}}
              go_no: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        assert routes(audit, result.run_id) == [("ask", "go_no", "route._")]

    async def test_no_valid_transition_ends_error(self, tmp_path: Path,
                                                  autojump_clock: trio.abc.Clock) -> None:
        """A verdict nothing routes ends the run `error`, naming the state and the verdict."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "no"}}
            states:
              ask:
                {ASK}
                on_yes: done
              done: {{terminal: true}}
        """)
        result, _, _ = await run(spec)
        assert result.status is Status.ERROR
        assert result.error == "no valid transition from state 'ask' for verdict 'no'"

    async def test_computed_target_that_is_no_state_ends_error(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """An interpolated target naming no state is caught at run time, not followed."""
        spec = spec_of(tmp_path, """
            initial: a
            context: {where: nowhere}
            states:
              a: {next: "${context.where}"}
              b: {terminal: true}
        """)
        result, _, _ = await run(spec)
        assert result.status is Status.ERROR
        assert "'nowhere', which is not a state" in (result.error or "")

    async def test_a_terminal_initial_state_ends_at_once(self, tmp_path: Path,
                                                         autojump_clock: trio.abc.Clock) -> None:
        """A loop that starts in a terminal state ends ok in its first step."""
        spec = spec_of(tmp_path, "initial: done\nstates:\n  done: {terminal: true}\n")
        result, audit, _ = await run(spec)
        assert (result.status, result.steps) == (Status.OK, 1)
        assert path_taken(audit, result.run_id) == []


class TestRetries:
    LOOP = """
        initial: poll
        states:
          poll:
            evaluate: {type: output_contains, source: "never", pattern: "ready"}
            on_yes: done
            on_no: $current
            max_retries: 2
            on_retry_exhausted: give_up
          give_up: {terminal: true}
          done: {terminal: true}
    """

    async def test_consecutive_reentries_exhaust_max_retries(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """max_retries=2 allows 3 entries in a row, then routes to on_retry_exhausted."""
        result, audit, _ = await run(spec_of(tmp_path, self.LOOP))
        assert result.status is Status.OK
        assert path_taken(audit, result.run_id) == ["poll"] * 3
        exhausted = events(audit, result.run_id, "retry_exhausted")
        assert [e.payload["retries"] for e in exhausted] == [3]
        assert routes(audit, result.run_id)[-1] == ("poll", "give_up", "retry_exhausted")

    async def test_another_state_in_between_resets_the_count(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """Only consecutive re-entries count: a -> b -> a never exhausts a's retries."""
        spec = spec_of(tmp_path, """
            initial: a
            max_iterations: 8
            states:
              a: {next: b, max_retries: 0, on_retry_exhausted: stop}
              b: {next: a}
              stop: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.MAX_STEPS
        assert "stop" not in [to for _, to, _ in routes(audit, result.run_id)]

    async def test_exhaustion_without_a_target_ends_error_naming_the_state(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """With no on_retry_exhausted, running out of retries ends `error` naming the state."""
        spec = spec_of(tmp_path, self.LOOP.replace("on_retry_exhausted: give_up", ""))
        result, _, _ = await run(spec)
        assert result.status is Status.ERROR
        assert "state 'poll'" in (result.error or "")
        assert "max_retries=2" in (result.error or "")


class TestMaintain:
    async def test_maintain_restarts_at_initial_until_the_step_ceiling(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """With maintain, reaching a terminal state restarts the loop instead of ending it."""
        spec = spec_of(tmp_path, """
            initial: work
            maintain: true
            max_iterations: 5
            states:
              work: {next: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.MAX_STEPS
        assert path_taken(audit, result.run_id) == ["work"] * 5
        assert ("done", "work", "maintain") in routes(audit, result.run_id)

    async def test_on_maintain_picks_the_restart_state(self, tmp_path: Path,
                                                       autojump_clock: trio.abc.Clock) -> None:
        """A terminal state's on_maintain is where a maintained loop restarts."""
        spec = spec_of(tmp_path, """
            initial: setup
            maintain: true
            max_iterations: 4
            states:
              setup: {next: work}
              work: {next: done}
              done: {terminal: true, on_maintain: work}
        """)
        result, audit, _ = await run(spec)
        assert path_taken(audit, result.run_id) == ["setup", "work", "work", "work"]

    async def test_no_transition_restarts_in_maintain_mode(self, tmp_path: Path,
                                                           autojump_clock: trio.abc.Clock
                                                           ) -> None:
        """A verdict with no route restarts a maintained loop rather than ending it `error`."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            maintain: true
            max_iterations: 3
            context: {{answer: "no"}}
            states:
              ask:
                {ASK}
                on_yes: ask
        """)
        result, audit, _ = await run(spec)
        assert result.status is Status.MAX_STEPS
        assert all(reason.startswith("maintain") for _, _, reason in routes(audit,
                                                                             result.run_id))


class TestLimits:
    async def test_max_iterations_is_the_step_ceiling(self, tmp_path: Path,
                                                      autojump_clock: trio.abc.Clock) -> None:
        """max_iterations becomes Limits.max_steps: the kernel ends the run `max_steps`."""
        spec = spec_of(tmp_path, """
            initial: spin
            max_iterations: 4
            states:
              spin: {next: spin}
        """)
        assert spec.limits().max_steps == 4
        result, audit, _ = await run(spec)
        assert (result.status, result.steps) == (Status.MAX_STEPS, 4)
        assert len(path_taken(audit, result.run_id)) == 4

    async def test_max_steps_is_accepted_for_max_iterations(self, tmp_path: Path) -> None:
        """`max_steps:` in the file means the same as max_iterations."""
        spec = spec_of(tmp_path, "initial: a\nmax_steps: 7\nstates: {a: {terminal: true}}\n")
        assert spec.limits().max_steps == 7

    async def test_reaching_terminal_on_the_last_allowed_step_is_ok(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The move into a terminal state costs no step: N states fit max_iterations=N."""
        spec = spec_of(tmp_path, """
            initial: a
            max_iterations: 2
            states:
              a: {next: b}
              b: {next: done}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec)
        assert (result.status, result.steps) == (Status.OK, 2)

    async def test_loop_timeout_is_the_run_deadline(self, tmp_path: Path,
                                                    autojump_clock: trio.abc.Clock) -> None:
        """The loop's `timeout` becomes Limits.timeout: the kernel ends the run `timeout`."""
        spec = spec_of(tmp_path, """
            initial: spin
            timeout: 30
            backoff: 7
            max_iterations: 1000
            states:
              spin: {next: spin}
        """)
        assert spec.limits().timeout == 30
        start = trio.current_time()
        result, _, _ = await run(spec)
        assert result.status is Status.TIMEOUT
        assert trio.current_time() - start == pytest.approx(30, abs=0.1)


class TestBackoff:
    LOOP = """
        initial: spin
        backoff: 100
        max_iterations: 3
        states:
          spin: {next: spin}
    """

    async def test_backoff_sleeps_between_iterations(self, tmp_path: Path,
                                                     autojump_clock: trio.abc.Clock) -> None:
        """Three iterations with backoff 100 take 200 s: it sleeps between, not after."""
        start = trio.current_time()
        result, audit, _ = await run(spec_of(tmp_path, self.LOOP))
        assert result.status is Status.MAX_STEPS
        assert trio.current_time() - start == pytest.approx(200, abs=0.1)
        assert [e.payload["seconds"] for e in events(audit, result.run_id, "backoff")] \
            == [100, 100]

    async def test_the_deadline_interrupts_a_backoff(self, tmp_path: Path,
                                                     autojump_clock: trio.abc.Clock) -> None:
        """A run deadline falling inside a backoff ends the run then, not after the sleep."""
        start = trio.current_time()
        result, _, _ = await run(spec_of(tmp_path, self.LOOP),
                                 limits=Limits(max_steps=3, timeout=150))
        assert result.status is Status.TIMEOUT
        assert trio.current_time() - start == pytest.approx(150, abs=0.1)

    async def test_a_critic_kill_interrupts_a_backoff(self, tmp_path: Path,
                                                      autojump_clock: trio.abc.Clock) -> None:
        """The critic's kill lands mid-backoff: the run ends `killed` at once."""
        critic = ScriptedCritic(kill_after=42, reason="stuck")
        start = trio.current_time()
        result, _, _ = await run(spec_of(tmp_path, self.LOOP), ports=Ports(critic=critic),
                                 limits=Limits(max_steps=3, timeout=1000, poll_interval=1))
        assert (result.status, result.reason) == (Status.KILLED, "stuck")
        assert trio.current_time() - start == pytest.approx(42, abs=1.1)

    async def test_the_caller_cancelling_interrupts_a_backoff(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """Cancelling from outside mid-backoff ends the run `cancelled` (recorded) promptly."""
        audit = MemoryAudit()
        start = trio.current_time()
        with trio.move_on_after(50):
            await run(spec_of(tmp_path, self.LOOP), ports=Ports(audit=audit))
        assert trio.current_time() - start == pytest.approx(50, abs=0.1)
        (row,) = audit.runs.values()
        assert row.status is Status.CANCELLED

    async def test_a_backoff_counts_as_activity(self, tmp_path: Path,
                                                autojump_clock: trio.abc.Clock) -> None:
        """A long backoff keeps telling the critic the run is alive (waiting is not a stall)."""
        critic = ScriptedCritic()
        await run(spec_of(tmp_path, self.LOOP), ports=Ports(critic=critic))
        assert critic.handles[0].activities.count("backoff") >= 40


class TestVariables:
    async def test_missing_context_variable_ends_error_with_the_hint(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A variable missing at run time ends `error` naming it, the state, and --context."""
        path = write(tmp_path, """
            initial: ask
            states:
              ask:
                evaluate: {type: output_contains, source: "${context.unset}", pattern: x}
                on_yes: ask
        """)
        report = check_loop(path)  # only a warning here: --context could still supply it
        assert report.ok and report.spec is not None
        result, _, _ = await run(report.spec)
        assert result.status is Status.ERROR
        assert result.error == ("missing variable ${context.unset} in state 'ask': "
                                "'context.unset' is not defined; pass it with --context "
                                "unset=VALUE")

    async def test_state_loop_and_env_namespaces(self, tmp_path: Path,
                                                 autojump_clock: trio.abc.Clock) -> None:
        """${state.*}, ${loop.*} and ${env.*} resolve to the running loop's values."""
        spec = spec_of(tmp_path, """
            name: ns-demo
            initial: check
            states:
              check:
                evaluate:
                  type: output_contains
                  source: "${state.name}/${state.iteration}/${loop.name}/${env.KLOOP_TEST}"
                  pattern: "^check/1/ns-demo/hello$"
                on_yes: done
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, env={"KLOOP_TEST": "hello"})
        assert verdicts(audit, result.run_id) == ["yes"]

    async def test_loop_elapsed_ms_follows_the_trio_clock(self, tmp_path: Path,
                                                          autojump_clock: trio.abc.Clock) -> None:
        """${loop.elapsed_ms} counts from the run's start on the trio clock."""
        spec = spec_of(tmp_path, """
            initial: wait
            backoff: 3
            states:
              wait: {next: check}
              check:
                evaluate: {type: output_numeric, source: "${loop.elapsed_ms}", operator: ge,
                           target: 3000}
                on_yes: done
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert (result.status, verdicts(audit, result.run_id)) == (Status.OK, ["yes"])

    async def test_defaults_and_optional_variables(self, tmp_path: Path,
                                                   autojump_clock: trio.abc.Clock) -> None:
        """`:default=` supplies a value and `?` an empty one when a variable is missing."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check:
                evaluate:
                  type: output_contains
                  source: "[${captured.none.output?}][${env.KLOOP_UNSET:default=d:v}]"
                  pattern: "^\\\\[\\\\]\\\\[d:v\\\\]$"
                on_yes: done
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec)
        assert verdicts(audit, result.run_id) == ["yes"]

    async def test_context_from_the_caller_overrides_the_file(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """--context values win over the file's `context:` defaults."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "no"}}
            states:
              ask:
                {ASK}
                on_yes: done
              done: {{terminal: true}}
        """)
        result, _, _ = await run(spec, context={"answer": "yes"})
        assert result.status is Status.OK


class TestAudit:
    async def test_each_state_is_one_step_with_its_events(self, tmp_path: Path,
                                                          autojump_clock: trio.abc.Clock) -> None:
        """Every executed state is a kernel step named after it, with state_enter/evaluate/route."""
        spec = spec_of(tmp_path, f"""
            initial: ask
            context: {{answer: "yes"}}
            states:
              ask:
                {ASK}
                on_yes: done
              done: {{terminal: true}}
        """)
        result, audit, _ = await run(spec)
        kinds = [e.kind for e in audit.events(result.run_id)
                 if e.kind in ("state_enter", "evaluate", "route", "step")]
        assert kinds == ["state_enter", "evaluate", "route", "step"]
        enter, evaluate, route = events(audit, result.run_id, "state_enter", "evaluate", "route")
        assert enter.payload == {"state": "ask", "iteration": 1, "mode": "none"}
        assert evaluate.payload["verdict"] == "yes"
        assert evaluate.payload["type"] == "output_contains"
        assert evaluate.payload["details"]["matched"] is True
        assert route.payload == {"from": "ask", "to": "done", "reason": "on_yes",
                                 "verdict": "yes"}
        (step,) = events(audit, result.run_id, "step")
        assert (step.name, step.payload["final"]) == ("ask", True)

    async def test_file_warnings_are_audited_at_the_first_step(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """Warnings handed to the agent are written to the run's audit."""
        spec = spec_of(tmp_path, "initial: a\nstates: {a: {terminal: true}}\n")
        result, audit, _ = await run(spec, warnings=["loop.yaml:3: x: unknown key"])
        assert [e.payload["message"] for e in events(audit, result.run_id, "warning")] \
            == ["loop.yaml:3: x: unknown key"]

    async def test_critic_nudges_for_a_shell_free_state_are_recorded(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A steer message that no action can take is audited as undeliverable."""
        spec = spec_of(tmp_path, """
            initial: spin
            max_iterations: 3
            states:
              spin: {next: spin}
        """)
        critic = ScriptedCritic(steer_at_step={1: "try something else"})
        result, audit, _ = await run(spec, ports=Ports(critic=critic))
        (ev,) = events(audit, result.run_id, "steer_undeliverable")
        assert ev.payload["messages"] == ["try something else"]


#: A loop that counts its iterations up to 5 in one state (resumable mid-way).
_COUNTING = """
    initial: count
    states:
      count:
        evaluate: {type: output_numeric, source: "${state.iteration}", operator: ge,
                   target: 5}
        on_yes: done
        on_no: $current
      done: {terminal: true}
"""


async def _stopped_after_two_steps(tmp_path: Path) -> tuple[RunInfo, Checkpoint, LoopAgent]:
    """`_COUNTING` stopped by a step ceiling of 2: its info, last checkpoint and agent."""
    saver = RecordingCheckpointer()
    info = RunInfo(name="resumable")
    first, _, agent = await run(spec_of(tmp_path, _COUNTING),
                                ports=Ports(checkpointer=saver), info=info,
                                limits=Limits(max_steps=2))
    assert first.status is Status.MAX_STEPS
    return info, saver.saves[-1], agent


class TestResume:
    async def test_a_resumed_run_continues_from_its_checkpoint(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """snapshot() holds state, iteration and retries; a resumed run picks them up."""
        text = _COUNTING
        info, checkpoint, agent = await _stopped_after_two_steps(tmp_path)
        assert agent.snapshot()["state"] == "count"
        assert checkpoint.state["iteration"] == 2
        again = RunInfo(name="resumable", run_id=info.run_id)
        result, audit, _ = await run(spec_of(tmp_path, text), resume=checkpoint, info=again)
        assert result.status is Status.OK
        enters = events(audit, result.run_id, "state_enter")
        assert [e.payload["iteration"] for e in enters] == [3, 4, 5]
        assert events(audit, result.run_id, "loop_resumed")

    async def test_a_loop_edited_since_its_checkpoint_is_not_run_again_from_the_start(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The saved state is gone from the edited file: the run ends `error` saying so, and
        no state runs again (starting over would repeat finished side effects)."""
        info, checkpoint, _ = await _stopped_after_two_steps(tmp_path)
        edited = spec_of(tmp_path, _COUNTING.replace("count", "tally"))
        result, audit, _ = await run(edited, resume=checkpoint,
                                     info=RunInfo(name="resumable", run_id=info.run_id))
        assert result.status is Status.ERROR
        assert result.error == (
            "cannot resume in state 'count': the loop file no longer has state 'count' (the "
            "file was edited since the run was interrupted); nothing was run again")
        assert events(audit, result.run_id, "state_enter") == []


    async def test_a_loop_edited_in_place_says_so_on_resume(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The saved state is still there but the file changed: the run resumes in it (an
        edit is how one fixes a loop), and a `warning` event says the file was edited."""
        info, checkpoint, _ = await _stopped_after_two_steps(tmp_path)
        again = RunInfo(name="resumable", run_id=info.run_id)
        result, audit, _ = await run(spec_of(tmp_path, _COUNTING.replace("5", "4")),
                                     resume=checkpoint, info=again)
        assert result.status is Status.OK
        (warning,) = events(audit, result.run_id, "warning")
        assert "the loop file was edited since this run's checkpoint: it resumes in state " \
            "'count'" in warning.payload["message"]
        same, audit, _ = await run(spec_of(tmp_path, _COUNTING), resume=checkpoint,
                                   info=RunInfo(name="resumable", run_id=info.run_id))
        assert same.status is Status.OK and not events(audit, same.run_id, "warning")


class TestSlowEvaluators:
    async def test_a_backtracking_pattern_does_not_hold_the_deadline(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """`output_contains` matches in a worker thread: a pattern that takes seconds on this
        output leaves the trio thread free, and the run's deadline ends it on time (virtual
        time moves on while the thread works; on the trio thread it could not)."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check:
                evaluate: {type: output_contains, source: "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!",
                           pattern: '^(a|aa)+$'}
                on_yes: done
                on_no: done
              done: {terminal: true}
        """)
        result, _, _ = await run(spec, limits=Limits(timeout=600, max_steps=10))
        assert result.status is Status.TIMEOUT


class TestRunTimeSubloops:
    @pytest.mark.realtime
    async def test_a_loop_that_chooses_itself_at_run_time_is_a_cycle(
            self, tmp_path: Path) -> None:
        """A sub-loop chosen from a captured value is checked against the running chain:
        choosing an ancestor ends the run error at once, not ~100 levels deep."""
        spec = spec_of(tmp_path, """
            initial: a
            states:
              a: {action: echo loop.yaml, capture: chosen, next: b}
              b:
                loop: "${captured.chosen.output}"
                on_yes: done
                on_no: done
              done: {terminal: true}
        """)
        with trio.fail_after(60):
            result, audit, _ = await run(spec)
        assert result.status is Status.ERROR
        assert "sub-loops form a cycle: loop.yaml -> loop.yaml" in (result.error or "")
        assert audit.kinds(result.run_id).count("run_start") == 1
