"""Dry runs: every scenario, asking at a terminal, sub-loops and signals, nothing executed."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import trio
from loop_support import events, path_taken, run, spec_of

from adapters.loop import LoopAgent, LoopSpec
from kernel import ConfigError, Limits, Status

LOOP = """
    name: fixer
    initial: test
    max_iterations: 6
    states:
      test: {action: "touch RAN && make test", on_yes: done, on_no: fix, on_error: broken}
      fix: {action: "touch RAN && make fix", on_yes: test, on_no: broken, on_error: broken}
      broken: {terminal: true}
      done: {terminal: true}
"""


def dry(spec: LoopSpec) -> Limits:
    """The loop's own limits, as a dry run."""
    base = spec.limits()
    return Limits(max_steps=base.max_steps, timeout=base.timeout, dry_run=True)


class TestScenarios:
    @pytest.mark.parametrize(("scenario", "path"), [
        ("all-pass", ["test"]),
        ("all-fail", ["test", "fix"]),
        ("all-error", ["test"]),
        ("first-fail", ["test", "fix", "test"]),
        ("alternating", ["test", "fix"] * 3),
    ])
    async def test_each_scenario_walks_its_path_and_runs_nothing(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock, scenario: str,
            path: list[str]) -> None:
        """The scenario decides each result; the run ends dry_run and no command ran."""
        spec = spec_of(tmp_path, LOOP)
        result, audit, _ = await run(spec, limits=dry(spec), scenario=scenario,
                                     cwd=str(tmp_path))
        assert result.status is Status.DRY_RUN
        assert path_taken(audit, result.run_id) == path
        assert not (tmp_path / "RAN").exists()
        assert all(e.payload.get("simulated") for e in
                   events(audit, result.run_id, "state_enter", "evaluate", "route"))
        lines = result.output.splitlines()
        assert lines[0] == f"dry run of loop 'fixer' (scenario {scenario})"
        assert lines[1].startswith("  1. test [shell] would run: touch RAN && make test => ")

    async def test_the_output_tells_how_the_path_ends(self, tmp_path: Path,
                                                      autojump_clock: trio.abc.Clock) -> None:
        """The path ends with the terminal state reached, or the step ceiling."""
        spec = spec_of(tmp_path, LOOP)
        passed, _, _ = await run(spec, limits=dry(spec), scenario="all-error")
        assert passed.output.splitlines()[-2:] == [
            "  1. test [shell] would run: touch RAN && make test => error (error) -> broken",
            "reached terminal state 'broken' after 1 iteration(s)"]
        looped, _, _ = await run(spec_of(tmp_path, LOOP), limits=dry(spec),
                                 scenario="alternating")
        assert looped.output.splitlines()[-1] == \
            "stopped: max_iterations=6 reached (the run would end max_steps)"

    async def test_convergence_is_simulated_as_target_or_progress(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """For a convergence state, pass means `target` and fail means `progress`."""
        spec = spec_of(tmp_path, """
            initial: measure
            states:
              measure:
                action: ./metric
                evaluate: {type: convergence, target: 0}
                route: {target: done, progress: $current, stall: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, limits=dry(spec), scenario="first-fail")
        assert [e.payload["verdict"] for e in events(audit, result.run_id, "evaluate")] \
            == ["progress", "target"]

    async def test_an_unknown_scenario_is_refused(self, tmp_path: Path) -> None:
        """A scenario name outside the five is a ConfigError naming the choices."""
        with pytest.raises(ConfigError, match="all-pass, all-fail"):
            LoopAgent(spec_of(tmp_path, LOOP), scenario="most-pass")


class FakeStdin(io.StringIO):
    """A stdin that says whether it is a terminal."""

    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class TestAsking:
    async def test_an_injected_asker_decides_each_result(self, tmp_path: Path,
                                                         autojump_clock: trio.abc.Clock) -> None:
        """Without a scenario, `ask` is called with the state and what it would run."""
        asked: list[tuple[str, str]] = []
        answers = iter(["fail", "error"])

        async def ask(state: str, action: str) -> str:
            asked.append((state, action))
            return next(answers)

        spec = spec_of(tmp_path, LOOP)
        result, audit, _ = await run(spec, limits=dry(spec), ask=ask)
        assert path_taken(audit, result.run_id) == ["test", "fix"]
        assert [s for s, _ in asked] == ["test", "fix"]
        assert "touch RAN && make test" in asked[0][1]
        assert "(asking)" in result.output.splitlines()[0]

    async def test_the_library_never_reads_the_terminal(self, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        autojump_clock: trio.abc.Clock) -> None:
        """Without `ask` a dry run assumes all-pass, even with a terminal on stdin."""
        stdin = FakeStdin("f\n\n", tty=True)
        monkeypatch.setattr(sys, "stdin", stdin)
        spec = spec_of(tmp_path, LOOP)
        result, audit, _ = await run(spec, limits=dry(spec))
        assert path_taken(audit, result.run_id) == ["test"]
        assert stdin.tell() == 0  # nothing was read
        assert "no way to ask: assuming all-pass" in result.output.splitlines()[0]

    async def test_without_a_terminal_it_assumes_all_pass(self, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          autojump_clock: trio.abc.Clock
                                                          ) -> None:
        """No scenario and no TTY: nothing can be asked, so every result passes, and it says so."""
        monkeypatch.setattr(sys, "stdin", FakeStdin("", tty=False))
        spec = spec_of(tmp_path, LOOP)
        result, audit, _ = await run(spec, limits=dry(spec))
        assert path_taken(audit, result.run_id) == ["test"]
        assert "assuming all-pass" in result.output.splitlines()[0]


class TestWhatIsSimulated:
    async def test_a_sub_loop_is_walked_inline(self, tmp_path: Path,
                                               autojump_clock: trio.abc.Clock) -> None:
        """A sub-loop state shows the child's path indented; no child run is started."""
        (tmp_path / "child.yaml").write_text(
            "name: kid\ninitial: a\nstates:\n  a: {action: 'touch RAN', on_yes: end}\n"
            "  end: {terminal: true}\n")
        spec = spec_of(tmp_path, """
            initial: sub
            states:
              sub: {loop: child, on_yes: done, on_no: done}
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, limits=dry(spec), scenario="all-pass",
                                     cwd=str(tmp_path))
        lines = result.output.splitlines()
        assert "     sub-loop 'kid':" in lines
        assert any(line.startswith("        1. a [shell] would run: touch RAN") for line in lines)
        assert "  1. sub [loop kid] => yes -> done" in lines
        assert len(audit.runs) == 1
        assert not (tmp_path / "RAN").exists()

    async def test_an_action_that_prints_a_signal_is_taken_to_send_it(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A dry run shows where a visible FATAL_ERROR/LOOP_STOP/CONTEXT_HANDOFF would end it."""
        spec = spec_of(tmp_path, """
            initial: check
            states:
              check: {action: "./check", on_yes: done, on_no: fail}
              fail: {action: "echo 'FATAL_ERROR: checks failed'"}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec, limits=dry(spec), scenario="all-fail")
        assert result.status is Status.DRY_RUN
        assert result.output.splitlines()[-1].endswith(
            "=> signals FATAL_ERROR: -> error: checks failed")

    async def test_a_missing_variable_shows_in_the_path(self, tmp_path: Path,
                                                        autojump_clock: trio.abc.Clock) -> None:
        """A dry run still interpolates: a variable missing at that point shows as a
        stand-in, `<captured.later.output>`, and the walk goes on (little-loops' catalogue
        dry-runs although captures of simulated sub-loops and runner context are absent)."""
        spec = spec_of(tmp_path, """
            initial: a
            states:
              a: {action: "echo ${captured.later.output}", next: b}
              b: {action: "echo hi", capture: later, next: done}
              done: {terminal: true}
        """)
        result, _, _ = await run(spec, limits=dry(spec), scenario="all-pass")
        assert "would run: echo '<captured.later.output>'" in result.output
        assert "reached terminal state 'done'" in result.output
