"""How a `loop:` state's child run ends, and what its parent does then: each test here
failed before its fix (the budget ones also need the kernel to end a run whose step
raises `BudgetRefused` `budget_exceeded`: tests/kernel/test_step_budget_refused.py).

A child the budget refused ends the parent `budget_exceeded` naming the refusal, unless
the state routes `budget_exceeded` by name; a parent waiting on a working child is not
a stalled run; a child gets time up to its parent's hard deadline, not up to the
critic's soft one (nor an hour when the parent has no deadline); a sub-loop name that
cannot name a file is "not found", not a traceback; a sub-loop's capture drops trailing
newlines as an action's does; context a child run without `context_passthrough` lacks
is not asked of `--context`, which never reaches it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from loop_support import events, routes, run, spec_of, write

from adapters.loop import check_loop, load_loop
from batteries.critic import CriticPolicy, WatchCritic
from kernel import (
    BudgetRefused,
    ConfigError,
    Limits,
    Ports,
    Status,
    UsageLimits,
)
from kernel.testing import MemoryAudit, RecordingBudget, ScriptedCritic


class _SecondCheckRefused(RecordingBudget):
    """A budget with room for one run: the parent's check passes, its child's is refused."""

    async def check(self, caller_id: str) -> UsageLimits | None:
        if self.checks:
            self.checks.append(caller_id)
            raise BudgetRefused(f"caller {caller_id!r} used 1 of 1 runs")
        return await super().check(caller_id)


CHILD = """
    initial: a
    states:
      a: {action: 'true', next: done}
      done: {terminal: true}
"""


class TestChildRefusedByTheBudget:
    """A child run the budget refused is the parent's refusal, unless routed by name."""

    async def test_the_parent_ends_budget_exceeded_naming_the_refusal(
            self, tmp_path: Path) -> None:
        """Not `error` (exit 1): `budget_exceeded` (exit 3), the refusal in its error, and
        no state after the refused one runs (on_no is not taken)."""
        write(tmp_path, CHILD, "child.yaml")
        audit = MemoryAudit()
        spec = spec_of(tmp_path, """
            initial: p
            states:
              p: {loop: child, capture: kid, on_yes: done, on_no: done}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec, ports=Ports(audit=audit, budget=_SecondCheckRefused()))
        assert (result.status, result.reason) == (Status.BUDGET_EXCEEDED, "budget refused")
        assert result.error is not None
        assert result.error.startswith("state 'p': the budget refused sub-loop 'child'")
        assert "used 1 of 1 runs" in result.error
        child = next(r for r in audit.runs.values() if r.info.parent_run_id == result.run_id)
        assert child.stats is not None and child.stats.status is Status.BUDGET_EXCEEDED
        assert not routes(audit, result.run_id)

    async def test_on_error_does_not_take_it(self, tmp_path: Path) -> None:
        """`on_error` is where failing children go: a refusal sent there would end the
        run `error` again (through a failure terminal), the refusal hidden."""
        write(tmp_path, CHILD, "child.yaml")
        spec = spec_of(tmp_path, """
            initial: p
            states:
              p: {loop: child, on_yes: done, on_no: done, on_error: failed}
              done: {terminal: true}
              failed: {terminal: true}
        """)
        result, audit, _ = await run(spec, ports=Ports(budget=_SecondCheckRefused()))
        assert result.status is Status.BUDGET_EXCEEDED, result.error
        assert not routes(audit, result.run_id)

    @pytest.mark.parametrize("routing", [
        "on_yes: done, on_no: failed, on_budget_exceeded: fallback",
        "route: {yes: done, budget_exceeded: fallback, _: failed}",
        "next: failed, on_budget_exceeded: fallback",
    ])
    async def test_a_state_that_routes_it_by_name_goes_there(self, tmp_path: Path,
                                                             routing: str) -> None:
        """`on_budget_exceeded` (or `budget_exceeded` in the route table) takes it, before
        `next`; `${captured.<state>.terminated_by}` says `budget_exceeded`."""
        write(tmp_path, CHILD, "child.yaml")
        spec = spec_of(tmp_path, f"""
            initial: p
            states:
              p: {{loop: child, {routing}}}
              fallback:
                action: 'echo "child: ${{captured.p.terminated_by}}"'
                capture: said
                next: done
              done: {{terminal: true}}
              failed: {{terminal: true}}
        """)
        result, audit, agent = await run(spec, ports=Ports(budget=_SecondCheckRefused()))
        assert result.status is Status.OK, result.error
        assert routes(audit, result.run_id)[0][:2] == ("p", "fallback")
        assert agent.captured["said"]["output"] == "child: budget_exceeded"
        [evaluated] = events(audit, result.run_id, "evaluate")[:1]
        assert evaluated.payload["verdict"] == "budget_exceeded"
        assert evaluated.payload["details"]["child_reason"] == "budget refused"

    def test_validate_takes_the_route_on_a_loop_state(self, tmp_path: Path) -> None:
        """`on_budget_exceeded` on a `loop:` state is a route, not a misspelt verdict."""
        write(tmp_path, CHILD, "child.yaml")
        report = check_loop(write(tmp_path, """
            initial: p
            states:
              p: {loop: child, on_yes: done, on_no: done, on_budget_exceeded: done}
              done: {terminal: true}
        """))
        assert report.ok and not report.problems, [str(p) for p in report.problems]


# A child that works for 10 s (trio time), saying so every second (its backoff), with no
# process: under autojump_clock the whole family runs in virtual time.
WORKER = """
    initial: a
    backoff: 10
    states:
      a: {next: b}
      b: {next: done}
      done: {terminal: true}
"""
PARENT = """
    initial: p
    states:
      p: {loop: worker, on_yes: done, on_no: failed, on_timeout: failed}
      done: {terminal: true}
      failed: {terminal: true}
"""


class TestTheParentOfAWorkingChild:
    async def test_is_not_killed_as_stalled(self, tmp_path: Path,
                                            autojump_clock: trio.abc.Clock) -> None:
        """idle_timeout 3 s: the child shows progress every second, and the parent, which
        only waits for it, is alive too (it was killed `stalled` at 3.75 s, its child
        cancelled)."""
        write(tmp_path, WORKER, "worker.yaml")
        critic = WatchCritic(CriticPolicy(idle_timeout=3.0, soft_timeout=None))
        start = trio.current_time()
        result, audit, _ = await run(spec_of(tmp_path, PARENT), ports=Ports(critic=critic))
        assert result.status is Status.OK, (result.status, result.reason, result.error)
        assert trio.current_time() - start == pytest.approx(10.0, abs=0.1)
        [child] = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert child.stats is not None and child.stats.status is Status.OK

    async def test_a_stalled_child_is_killed_and_the_parent_routes_it(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The critic kills the child, not the parent waiting for it: the parent takes
        `on_no`, and `${captured.<state>.terminated_by}` is `killed`."""
        write(tmp_path, WORKER, "worker.yaml")
        critic = ScriptedCritic(kill_at_activity="backoff", reason="stalled")
        spec = spec_of(tmp_path, """
            initial: p
            states:
              p: {loop: worker, on_yes: wrong, on_no: show}
              show: {action: 'echo "${captured.p.terminated_by}"', capture: how, next: done}
              done: {terminal: true}
              wrong: {terminal: true}
        """)
        result, audit, agent = await run(spec, ports=Ports(critic=critic))
        assert result.status is Status.OK, (result.status, result.reason, result.error)
        assert agent.captured["how"]["output"] == "killed"
        [child] = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert child.stats is not None and child.stats.status is Status.KILLED


class TestTheChildsTime:
    async def test_runs_to_the_parents_hard_deadline_not_its_soft_one(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The critic's deadline falls at 2 s and is extended at 2 s by 100 (a progressing
        run); the hard one at 60 s. The child, 10 s of work, finishes (it was given 3 s,
        the soft deadline + 1, and cut off `timeout`)."""
        write(tmp_path, WORKER, "worker.yaml")
        critic = ScriptedCritic(deadline_after=2.0, extensions=[(2.0, 100.0)])
        result, audit, _ = await run(spec_of(tmp_path, PARENT), ports=Ports(critic=critic),
                                     limits=Limits(max_steps=5, timeout=60, soft_timeout=2))
        assert result.status is Status.OK, (result.status, result.reason, result.error)
        [child] = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert child.stats is not None and child.stats.status is Status.OK

    async def test_the_hard_deadline_still_bounds_it(self, tmp_path: Path,
                                                     autojump_clock: trio.abc.Clock) -> None:
        """Hard deadline 4 s: the parent ends `timeout` there, its child `cancelled`."""
        write(tmp_path, WORKER, "worker.yaml")
        critic = ScriptedCritic(deadline_after=2.0, extensions=[(2.0, 100.0)])
        start = trio.current_time()
        result, audit, _ = await run(spec_of(tmp_path, PARENT), ports=Ports(critic=critic),
                                     limits=Limits(max_steps=5, timeout=4, soft_timeout=2))
        assert result.status is Status.TIMEOUT, (result.status, result.reason, result.error)
        assert trio.current_time() - start == pytest.approx(4.0, abs=0.1)
        [child] = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert child.stats is not None and child.stats.status is Status.CANCELLED

    async def test_is_unbounded_when_the_parents_is(self, tmp_path: Path,
                                                    autojump_clock: trio.abc.Clock) -> None:
        """A parent without a deadline (`--timeout 0`) and a child file without one: the
        child is not cut off at the library's default hour (it was, `timeout`)."""
        write(tmp_path, WORKER.replace("backoff: 10", "backoff: 4000"), "worker.yaml")
        result, audit, _ = await run(spec_of(tmp_path, PARENT),
                                     limits=Limits(max_steps=5, timeout=None))
        assert result.status is Status.OK, (result.status, result.reason, result.error)
        [child] = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert child.stats is not None and child.stats.status is Status.OK


class TestSubLoopNames:
    @pytest.mark.parametrize("name", ['"."', '""', '"/"', '"~nosuchuser-kernel/x"'])
    def test_a_name_that_cannot_be_a_file_is_not_found(self, tmp_path: Path,
                                                       name: str) -> None:
        """`loop: .` and the like: one "not found" error (it raised ValueError /
        RuntimeError out of `kernel validate` and `kernel run`, a traceback)."""
        report = check_loop(write(tmp_path, f"""
            initial: p
            states:
              p: {{loop: {name}, on_yes: done, on_no: done}}
              done: {{terminal: true}}
        """))
        assert not report.ok
        assert [p.where for p in report.errors] == ["states.p.loop"]
        assert "not found" in report.errors[0].message

    @pytest.mark.parametrize(("name", "says"), [
        ("/dev/zero", "/dev/zero is not a regular file"), ("/", "/ is a directory")])
    def test_what_a_name_is_instead_of_a_file_is_said(self, tmp_path: Path, name: str,
                                                      says: str) -> None:
        """`loop: /dev/zero` said only "not found", as if nothing were there."""
        report = check_loop(write(tmp_path, f"""
            initial: p
            states:
              p: {{loop: "{name}", on_yes: done, on_no: done}}
              done: {{terminal: true}}
        """))
        [error] = report.errors
        assert "not found" in error.message and f"({says})" in error.message, error.message

    def test_from_and_import_names_too(self, tmp_path: Path) -> None:
        """The same lookup serves `from:` and `import:`."""
        for key in ("from: .", "import: ['~nosuchuser-kernel/x']"):
            report = check_loop(write(tmp_path, f"""
                {key}
                initial: a
                states:
                  a: {{terminal: true}}
            """))
            assert not report.ok, key


class TestTheChildsCapture:
    async def test_drops_trailing_newlines_as_an_actions_does(self, tmp_path: Path) -> None:
        """`capture:` on a `loop:` state kept the child's output with its final newline
        (`x=${captured.kid.output}` then split a line); an action's capture drops it."""
        write(tmp_path, """
            initial: a
            states:
              a: {action: 'echo hello', next: done}
              done: {terminal: true}
        """, "child.yaml")
        spec = spec_of(tmp_path, """
            initial: p
            states:
              p: {loop: child, capture: kid, on_yes: show, on_no: show}
              show: {action: 'echo "[${captured.kid.output}]"', capture: shown, next: done}
              done: {terminal: true}
        """)
        result, _, agent = await run(spec)
        assert result.status is Status.OK, result.error
        assert agent.captured["kid"]["output"] == "hello"
        assert agent.captured["shown"]["output"] == "[hello]"


class TestContextTheChildLacks:
    CHILD = """
        initial: a
        states:
          a: {action: 'echo "${context.target}"', next: done}
          done: {terminal: true}
    """

    def test_without_passthrough_the_hint_is_not_context(self, tmp_path: Path) -> None:
        """A child run without `context_passthrough` gets no `--context`: the error said
        "pass --context target=VALUE", and passing it changed nothing."""
        write(tmp_path, self.CHILD, "child.yaml")
        parent = write(tmp_path, """
            initial: p
            states:
              p: {loop: child, on_yes: done, on_no: done}
              done: {terminal: true}
        """)
        with pytest.raises(ConfigError) as caught:
            load_loop(parent, context={"target": "x"})
        message = str(caught.value)
        assert "context variable 'target' is not defined" in message
        assert "bind it with 'with:'" in message and "context_passthrough" in message
        assert "--context" not in message

    def test_with_passthrough_it_is(self, tmp_path: Path) -> None:
        write(tmp_path, self.CHILD, "child.yaml")
        parent = write(tmp_path, """
            initial: p
            states:
              p: {loop: child, context_passthrough: true, on_yes: done, on_no: done}
              done: {terminal: true}
        """)
        with pytest.raises(ConfigError, match="pass --context target=VALUE"):
            load_loop(parent)
        assert load_loop(parent, context={"target": "x"}).states["p"].child is not None


def test_validate_passes_a_sub_loops_warnings_on(tmp_path: Path) -> None:
    """`kernel validate` of a parent shows its sub-loop's warnings too, each under the
    `loop:` state (only the child's errors reached the parent's report before)."""
    write(tmp_path, """
name: child
initial: work
states:
  work:
    action: "true"
    action_type: shell
    params: {x: 1}
    next: done
  done:
    terminal: true
""", "child.yaml")
    report = check_loop(write(tmp_path, """
name: parent
initial: sub
states:
  sub:
    loop: child.yaml
    on_yes: done
    on_no: done
  done:
    terminal: true
"""))
    assert report.ok, report.errors
    said = [str(p) for p in report.warnings]
    assert any("in sub-loop" in s and "params are only used by mcp_tool" in s
               for s in said), said
