"""The critic corpus harness (bench/critic_corpus.py) keeps working: its counting, and a
few of its cases run for real through `kernel run`, shortened.

What the critic decides is the benchmark's business, not this test's: the real runs
here use the plain step cap (no critic), whose outcome is fixed by the case alone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_corpus() -> ModuleType:
    spec = importlib.util.spec_from_file_location("critic_corpus", ROOT / "bench" /
                                                  "critic_corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["critic_corpus"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cc = load_corpus()


def outcome(case: str, label: str, status: str, *, mode: str = "idle",
            latency: float | None = None) -> object:
    return cc.Outcome(case, label, mode, status, latency_s=latency)


class TestCounting:
    def test_the_corpus_has_the_cases_the_issue_asks_for(self) -> None:
        """At least 8 healthy and 10 stuck behaviours, uniquely named, each runnable."""
        labels = [c.label for c in cc.CASES if not c.extra]
        assert labels.count("healthy") >= 8 and labels.count("stuck") >= 10
        assert len({c.name for c in cc.CASES}) == len(cc.CASES)
        procs = load_procs()
        for c in cc.CASES:
            assert (c.proc is None) != (c.script is None), c.name
            if c.proc is not None:
                assert c.proc in procs.CASES, c.name

    def test_matrix_counts_caught_missed_and_false_kills(self) -> None:
        outcomes = [
            outcome("a", "stuck", "killed", latency=4.0),
            outcome("b", "stuck", "max_steps", latency=9.0),
            outcome("c", "stuck", "timeout", latency=40.0),  # the backstop: missed
            outcome("d", "stuck", "ok", latency=0.5),  # accepted an empty answer: missed
            outcome("e", "healthy", "ok"),
            outcome("f", "healthy", "killed", latency=3.9),
            outcome("g", "healthy", "timeout"),
            outcome("h", "stuck", "killed", mode="defaults", latency=1.0),
        ]
        m = cc.matrix(outcomes, "idle", target_s=cc.idle_target(3))
        assert (m.stuck, m.caught, m.capped, m.missed) == (4, 1, 1, ["c", "d"])
        assert (m.healthy, m.false_kills, m.healthy_wrong) == (3, ["f"], ["g"])
        assert (m.median, m.max, m.within_target) == (6.5, 9.0, 1)
        assert cc.idle_target(3) == pytest.approx(4.25)
        assert [o.verdict for o in outcomes[:7]] == [
            "caught", "caught (step cap)", "MISSED", "MISSED", "ok", "FALSE KILL",
            "WRONG (timeout)"]
        titles = {"idle": "--idle-timeout 3", "defaults": "critic defaults"}
        table = cc.matrix_table([m, cc.matrix(outcomes, "defaults")], titles)
        assert "missed: c, d" in table and "healthy killed: f" in table
        assert "critic defaults" in table
        assert "FALSE KILL" in cc.case_table(outcomes, titles)

    def test_parse_result_takes_the_json_line(self) -> None:
        out = 'some echo\n{"status": "killed", "reason": "stalled"}\n'
        assert cc.parse_result(out) == {"status": "killed", "reason": "stalled"}
        assert cc.parse_result("no json here\n{broken") is None


def load_procs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("corpus_proc", ROOT / "bench" /
                                                  "corpus_proc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.realtime
def test_three_cases_run_through_kernel_run(kernel_exe: str) -> None:
    """A healthy process, a stuck process and a looping model, under the step cap."""
    stepcap = cc.modes(3.0)["stepcap"]

    def run(names: tuple[str, ...], timeout: float) -> dict[str, Any]:
        cases = [c for c in cc.CASES if c.name in names]
        return {o.case: o for o in cc.run_all(cases, [stepcap], kernel=kernel_exe,
                                               timeout=timeout, concurrency=2, scale=0.05)}

    # Only the stuck case may meet its hard timeout; the others get a wide margin so a
    # loaded machine cannot turn their real end into a timeout.
    got: dict[str, Any] = {**run(("sleep_forever",), 2), **run(("steady_output",
                                                                  "llm_exact_loop"), 120)}

    healthy = got["steady_output"]
    assert (healthy.status, healthy.exit_code, healthy.verdict) == ("ok", 0, "ok")
    asleep = got["sleep_forever"]  # only the hard timeout ends it without a critic
    assert (asleep.status, asleep.exit_code, asleep.verdict) == ("timeout", 124, "MISSED")
    assert asleep.latency_s is not None and asleep.leaked == []
    loop = got["llm_exact_loop"]
    assert (loop.status, loop.steps) == ("max_steps", cc.STEP_CAP)
    assert loop.verdict == "caught (step cap)"
    assert loop.model_requests == cc.STEP_CAP and loop.latency_s is not None
