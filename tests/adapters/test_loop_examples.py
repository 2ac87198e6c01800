"""The example loops in examples/: they validate cleanly, run green, and show their events."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import trio
from loop_support import events, path_taken, run

from adapters.loop import SCENARIOS, check_loop, load_loop
from kernel import Limits, Status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_there_are_the_three_promised_examples() -> None:
    """examples/ holds the fix-until-pass loop, the polling loop and the sub-loop example."""
    assert {p.name for p in FILES} >= {"fix-until-tests-pass.yaml", "poll-until-done.yaml",
                                       "ci-gate.yaml"}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_each_example_validates_without_a_single_warning(path: Path) -> None:
    """The examples are what `kernel validate` calls clean."""
    report = check_loop(path)
    assert report.problems == []


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
async def test_each_example_dry_runs_under_every_scenario(path: Path, scenario: str,
                                                          autojump_clock: trio.abc.Clock) -> None:
    """A dry run of each example ends `dry_run` under each scenario."""
    spec = load_loop(path)
    limits = Limits(max_steps=spec.max_iterations, dry_run=True)
    result, _, _ = await run(spec, limits=limits, scenario=scenario)
    assert result.status is Status.DRY_RUN
    assert result.output.startswith(f"dry run of loop '{spec.name}'")


@pytest.mark.realtime
class TestRunningTheExamples:
    async def test_fix_until_tests_pass(self) -> None:
        """The tiny project's two bugs are fixed in two rounds; the examples tree is untouched."""
        before = (EXAMPLES / "tiny_project" / "calc.py").read_text()
        spec = load_loop(EXAMPLES / "fix-until-tests-pass.yaml")
        result, audit, agent = await run(spec)
        assert result.status is Status.OK, result.error
        assert path_taken(audit, result.run_id) == ["setup", "test", "fix", "test", "fix",
                                                    "test", "cleanup"]
        assert [e.payload["verdict"] for e in events(audit, result.run_id, "evaluate")] \
            == ["no", "yes", "no", "yes", "yes"]
        assert not Path(agent.captured["work"]["output"]).exists()  # cleaned up
        assert (EXAMPLES / "tiny_project" / "calc.py").read_text() == before

    async def test_poll_until_done(self) -> None:
        """The poll converges to 0: progress verdicts, then target, then finish."""
        spec = load_loop(EXAMPLES / "poll-until-done.yaml")
        # The job's clock runs from the start action; the first poll (two Python
        # start-ups later) must come before it ends, whatever the machine's load:
        # 3 s is a wide margin over the ~0.1 s those take.
        result, audit, _ = await run(spec, context={"job_seconds": "3"})
        assert result.status is Status.OK, result.error
        verdicts = [e.payload["verdict"] for e in events(audit, result.run_id, "evaluate")]
        assert verdicts[-1] == "target"
        assert set(verdicts[:-1]) <= {"progress", "stall"} and verdicts[0] == "progress"
        assert events(audit, result.run_id, "backoff")

    async def test_ci_gate_runs_its_sub_loop_as_a_child_run(self) -> None:
        """ci-gate runs fix-until-tests-pass as a child run and reports its last fix."""
        spec = load_loop(EXAMPLES / "ci-gate.yaml")
        result, audit, _ = await run(spec)
        assert result.status is Status.OK, result.error
        assert "last fix: fixed: mul()" in result.output
        (child,) = [r for r in audit.runs.values() if r.info.parent_run_id == result.run_id]
        assert (child.info.name, child.status) == ("fix-until-tests-pass", Status.OK)

    def test_kernel_run_then_kernel_show(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """Under the installed CLI the loop runs green; `kernel show --raw` lists its events."""
        proc = subprocess.run(
            [kernel_exe, "run", "--json", str(EXAMPLES / "fix-until-tests-pass.yaml")],
            capture_output=True, text=True, env=cli_env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["status"] == "ok"
        show = subprocess.run([kernel_exe, "show", "--raw", doc["run_id"]], capture_output=True,
                              text=True, env=cli_env, timeout=60)
        assert show.returncode == 0, show.stderr
        for kind in ("state_enter", "evaluate", "route", "action_start", "action_end"):
            assert kind in show.stdout
