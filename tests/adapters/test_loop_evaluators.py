"""Every evaluator: what verdict each input gives, and that bad input is a verdict, not a crash."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from loop_support import events, run, spec_of

from adapters.loop import JudgeRequest, LLMSpec
from adapters.loop import _evaluators as ev
from adapters.loop._spec import EvaluateSpec
from kernel import Ports, Status, Usage, UsageLimits
from kernel.testing import RecordingBudget


class TestExitCode:
    @pytest.mark.parametrize(("code", "verdict"), [(0, "yes"), (1, "no"), (2, "error"),
                                                   (124, "error"), (137, "error")])
    def test_codes_map_to_verdicts(self, code: int, verdict: str) -> None:
        """0 is yes, 1 is no, 2 and above (timeouts, signals) are error."""
        assert ev.exit_code(code) == ev.Evaluation(verdict, {"exit_code": code})


class TestOutputContains:
    def test_regex_match_and_negation(self) -> None:
        """A regex found gives yes; `negate` turns it into no, and a miss into yes."""
        assert ev.output_contains("3 passed, 0 failed", r"\b0 failed").verdict == "yes"
        assert ev.output_contains("3 passed, 0 failed", r"\b0 failed", negate=True).verdict \
            == "no"
        assert ev.output_contains("all good", "ERROR", negate=True).verdict == "yes"

    def test_multiline_anchors(self) -> None:
        """^ and $ anchor at line boundaries, so a status line can be matched exactly."""
        assert ev.output_contains("log\nOK\n", "^OK$").verdict == "yes"

    def test_an_invalid_regex_is_matched_as_text(self) -> None:
        """A pattern that is not a valid regex is looked for as plain text."""
        verdict = ev.output_contains("cost: [1.5", "[1.5")
        assert (verdict.verdict, verdict.details["as"]) == ("yes", "text")


class TestOutputNumeric:
    @pytest.mark.parametrize(("text", "operator", "target", "verdict"), [
        ("5\n", "eq", 5, "yes"), ("5", "ne", 5, "no"), ("4", "lt", 5, "yes"),
        ("5", "le", 5, "yes"), ("6", "gt", 5, "yes"), ("4.5", "ge", 5, "no"),
        ("coverage report\n87.5\n", "ge", 80, "yes"), ("7", "eq", "7", "yes"),
    ])
    def test_comparisons(self, text: str, operator: str, target: Any, verdict: str) -> None:
        """The number (whole output, or its last line) is compared with each operator."""
        assert ev.output_numeric(text, operator, target).verdict == verdict

    def test_text_that_is_no_number_is_an_error_verdict(self) -> None:
        """Unparseable output gives `error` with the reason, never an exception."""
        verdict = ev.output_numeric("lots", "eq", 1)
        assert verdict.verdict == "error"
        assert "not a number" in verdict.details["error"]

    def test_a_non_numeric_target_is_an_error_verdict(self) -> None:
        """A target that is not a number gives `error`."""
        assert ev.output_numeric("1", "eq", "one").verdict == "error"


class TestOutputJson:
    DOC = json.dumps({"summary": {"failed": 0, "status": "green"}, "items": [{"n": 3}]})

    @pytest.mark.parametrize(("path", "operator", "target", "verdict"), [
        (".summary.failed", "eq", 0, "yes"),
        ("summary.failed", "gt", 0, "no"),
        (".summary.status", "eq", "green", "yes"),
        (".summary.status", "ne", "green", "no"),
        (".items.0.n", "ge", 3, "yes"),
        ("items[0].n", "lt", "4", "yes"),
    ])
    def test_paths_and_operators(self, path: str, operator: str, target: Any,
                                 verdict: str) -> None:
        """jq-like paths reach nested values; numbers compare numerically, text by equality."""
        assert ev.output_json(self.DOC, path, operator, target).verdict == verdict

    @pytest.mark.parametrize(("text", "path", "operator", "message"), [
        ("not json", ".a", "eq", "not JSON"),
        ('{"a": 1}', ".b", "eq", "no value at path"),
        ('{"a": "x"}', ".a", "lt", "lt needs numbers"),
    ])
    def test_problems_are_error_verdicts(self, text: str, path: str, operator: str,
                                         message: str) -> None:
        """Bad JSON, a missing path or an ordering on text give `error` saying which."""
        verdict = ev.output_json(text, path, operator, 1)
        assert verdict.verdict == "error"
        assert message in verdict.details["error"]


class TestConvergence:
    def test_target_progress_and_stall(self) -> None:
        """Within tolerance of the target is `target`; moving toward it `progress`; else `stall`."""
        assert ev.convergence(0.04, 1.0, 0, tolerance=0.05).verdict == "target"
        assert ev.convergence(5, None, 0).verdict == "progress"
        assert ev.convergence(4, 5, 0).verdict == "progress"
        assert ev.convergence(5, 5, 0).verdict == "stall"
        assert ev.convergence(6, 5, 0).verdict == "stall"

    def test_maximize_and_the_noise_band(self) -> None:
        """direction=maximize wants growth; a change within the tolerance is not progress."""
        assert ev.convergence(91, 90, 100, direction="maximize").verdict == "progress"
        assert ev.convergence(90.5, 90, 100, tolerance=1, direction="maximize").verdict \
            == "stall"


class TestMcpResult:
    @pytest.mark.parametrize(("text", "code", "verdict"), [
        ('{"content": [{"type": "text", "text": "ok"}], "isError": false}', 0, "yes"),
        ('{"content": [], "isError": true}', 0, "no"),
        ('{"content": []}', 1, "no"),
        ("", 124, "error"),
        ("", 127, "error"),
        ("", 3, "error"),
        ("plain text", 0, "error"),
    ])
    def test_envelopes_and_exit_codes(self, text: str, code: int, verdict: str) -> None:
        """isError decides yes/no; a timeout, a missing tool or a non-envelope is error."""
        assert ev.mcp_result(text, code).verdict == verdict


class Judge:
    """A hand-written VerdictSource: answers from a script and records what it was asked."""

    def __init__(self, *answers: Mapping[str, Any] | BaseException | None,
                 delay: float = 0.0) -> None:
        self.answers = list(answers)
        self.requests: list[JudgeRequest] = []
        self.delay = delay

    async def __call__(self, request: JudgeRequest) -> Mapping[str, Any]:
        self.requests.append(request)
        await trio.sleep(self.delay)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]


class TestLlmStructured:
    SPEC = EvaluateSpec("llm_structured", prompt="Did the build pass?")

    async def test_without_a_model_the_verdict_is_error_saying_why(self) -> None:
        """No VerdictSource wired: `error`, explaining that none is configured."""
        verdict = await ev.llm_structured("out", self.SPEC, LLMSpec(), None)
        assert verdict.verdict == "error"
        assert "none is configured" in verdict.details["error"]

    async def test_disabled_in_the_loop_file(self) -> None:
        """llm.enabled: false gives `error` even when a model is wired."""
        verdict = await ev.llm_structured("out", self.SPEC, LLMSpec(enabled=False),
                                          Judge({"verdict": "yes"}))
        assert "disabled" in verdict.details["error"]

    async def test_the_model_is_asked_and_its_verdict_normalised(self) -> None:
        """The request carries prompt, output tail, schema and model; success maps to yes."""
        judge = Judge({"verdict": "Success", "confidence": 0.9, "reason": "green"})
        verdict = await ev.llm_structured("x" * 5000 + "BUILD OK", self.SPEC,
                                          LLMSpec(model="small"), judge)
        assert verdict == ev.Evaluation("yes", {"confidence": 0.9, "confident": True,
                                             "reason": "green"})
        (request,) = judge.requests
        assert request.prompt == "Did the build pass?"
        assert request.output.endswith("BUILD OK") and len(request.output) == 4000
        assert request.model == "small"
        assert "verdict" in request.schema["properties"]

    async def test_low_confidence_can_be_marked_uncertain(self) -> None:
        """Below min_confidence, uncertain_suffix appends _uncertain to the verdict."""
        spec = EvaluateSpec("llm_structured", min_confidence=0.8, uncertain_suffix=True)
        verdict = await ev.llm_structured("out", spec, LLMSpec(),
                                          Judge({"verdict": "no", "confidence": 0.3}))
        assert (verdict.verdict, verdict.details["confident"]) == ("no_uncertain", False)

    async def test_a_failing_model_is_an_error_verdict(self) -> None:
        """The model raising gives `error` with its message; nothing propagates."""
        verdict = await ev.llm_structured("out", self.SPEC, LLMSpec(),
                                          Judge(RuntimeError("quota")))
        assert verdict.verdict == "error"
        assert "quota" in verdict.details["error"]

    async def test_an_answer_without_a_verdict_is_an_error_verdict(self) -> None:
        """A malformed answer gives `error` rather than routing on garbage."""
        verdict = await ev.llm_structured("out", self.SPEC, LLMSpec(),
                                          Judge({"confidence": 1}))
        assert verdict.verdict == "error"

    async def test_a_slow_model_times_out(self, autojump_clock: trio.abc.Clock) -> None:
        """The loop's llm.timeout bounds the wait; expiry is an `error` verdict."""
        start = trio.current_time()
        verdict = await ev.llm_structured("out", self.SPEC, LLMSpec(timeout=20),
                                          Judge({"verdict": "yes"}, delay=1000))
        assert verdict.verdict == "error"
        assert trio.current_time() - start == pytest.approx(20)

    async def test_a_state_routes_on_the_models_verdict(self, tmp_path: Path,
                                                        autojump_clock: trio.abc.Clock) -> None:
        """Through the agent: the judged verdict is audited and routes the state."""
        spec = spec_of(tmp_path, """
            initial: review
            states:
              review:
                evaluate: {type: llm_structured, source: "the diff", prompt: "Ready?"}
                on_partial: more
                on_yes: done
              more: {terminal: true}
              done: {terminal: true}
        """)
        judge = Judge({"verdict": "partial", "confidence": 0.7, "reason": "half"})
        result, audit, _ = await run(spec, judge=judge)
        assert result.status is Status.OK
        (evaluate,) = events(audit, result.run_id, "evaluate")
        assert evaluate.payload["verdict"] == "partial"
        assert evaluate.payload["details"]["reason"] == "half"
        assert judge.requests[0].output == "the diff"


class TestJudgeUsage:
    """What a judge's model calls use is the run's: counted in its usage and its budgets."""

    LOOP = """
        initial: review
        states:
          review:
            evaluate: {type: llm_structured, source: "the diff"}
            on_no: review
            on_yes: done
          done: {terminal: true}
    """

    async def test_the_judges_usage_is_the_runs(self, tmp_path: Path,
                                                 autojump_clock: trio.abc.Clock) -> None:
        """Each verdict's usage is in its `evaluate` event and summed in the run's usage."""
        judge = Judge({"verdict": "no", "usage": Usage(10, 5, 0, 0.25), "cost_known": True},
                      {"verdict": "yes", "usage": Usage(20, 1, 0, 0.5), "cost_known": True})
        result, audit, _ = await run(spec_of(tmp_path, self.LOOP), judge=judge)
        assert result.status is Status.OK
        assert result.usage == Usage(30, 6, 0, 0.75)
        details = [e.payload["details"] for e in events(audit, result.run_id, "evaluate")]
        assert [d["usage"]["input_tokens"] for d in details] == [10, 20]
        assert details[1]["usage"]["cost_usd"] == 0.5 and details[1]["usage"]["cost_known"]

    async def test_a_failed_answer_still_counts(self, tmp_path: Path,
                                                autojump_clock: trio.abc.Clock) -> None:
        """A call that answered no verdict, or raised carrying `usage`, used tokens all the
        same: they count, and the verdict is `error`."""
        class Spent(ValueError):
            usage = Usage(7, 3, 0, 0.1)

        judge = Judge({"confidence": 1, "usage": Usage(4, 2, 0, 0.05)}, Spent("not JSON"))
        spec = spec_of(tmp_path, """
            initial: review
            states:
              review:
                evaluate: {type: llm_structured}
                on_error: again
              again:
                evaluate: {type: llm_structured}
                on_error: done
              done: {terminal: true}
        """)
        result, audit, _ = await run(spec, judge=judge)
        assert result.usage == Usage(11, 5, 0, 0.15000000000000002)
        errors = [e.payload["details"]["error"] for e in events(audit, result.run_id,
                                                                 "evaluate")]
        assert "no verdict" in errors[0] and "usage" not in errors[0]
        assert "not JSON" in errors[1]

    async def test_a_cost_cap_ends_a_loop_whose_judge_spends_it(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A budget's cost cap bounds the judge: the loop stops `budget_exceeded` once its
        verdicts have cost more than the cap (it would have gone round forever)."""
        judge = Judge(*[{"verdict": "no", "usage": Usage(10, 5, 0, 0.4)}] * 10)
        budget = RecordingBudget(caps=UsageLimits(max_cost_usd=1.0))
        result, _, _ = await run(spec_of(tmp_path, self.LOOP), judge=judge,
                                 ports=Ports(budget=budget))
        assert result.status is Status.BUDGET_EXCEEDED
        assert "cost" in (result.error or "")
        assert len(judge.requests) == 3
        assert budget.commits[0][2].cost_usd == pytest.approx(1.2)
