"""Dry runs of a loop: the simulation strategy the state machine runs under.

`LoopAgent` walks its states the same way in a real run and in a dry run;
what differs is who provides each state's results. In a real run the agent
runs the action, judges its output and starts sub-loops as child runs (its
default strategy, `Live` in `_agent.py`). In a dry run a `Simulation`
stands in: an action is rendered, not run; a verdict comes from a scenario
or from an injected `Asker` (the CLI asks on the terminal; the library
never reads stdin); a sub-loop is walked inline, indented, with the same
decider. The path taken is kept as the run's output, one line per state.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernel import RunContext, Step

from . import _evaluators as ev
from . import _template as tpl
from ._process import ActionResult, capture

if TYPE_CHECKING:
    from ._agent import LoopAgent
    from ._spec import EvaluateSpec, LoopSpec, StateSpec

SCENARIOS = ("all-pass", "all-fail", "all-error", "first-fail", "alternating")
SIGNALS = {"CONTEXT_HANDOFF:": "handoff", "FATAL_ERROR:": "error", "LOOP_STOP:": "stop"}

#: Asked, in an interactive dry run, what a state's result should be:
#: called with (state name, what it would run); returns "pass" | "fail" | "error".
#: The CLI passes one that asks on the terminal (`kernel_cli.loops.ask_on_terminal`).
Asker = Callable[[str, str], Awaitable[str]]


@dataclass(slots=True)
class SubloopEnd:
    """How a `loop:` state's child ended, as the state machine routes and captures it."""

    verdict: ev.Evaluation
    terminated_by: str
    error: str | None
    output: str


class _Decider:
    """Decides simulated results: a scenario, else the asker, else pass. Shared with sub-loops."""

    def __init__(self, scenario: str | None, ask: Asker | None) -> None:
        self.scenario = scenario
        self.ask = ask
        self.count = 0

    async def outcome(self, state: str, action: str) -> str:
        self.count += 1
        n, scenario = self.count, self.scenario
        if scenario == "all-fail":
            return "fail"
        if scenario == "all-error":
            return "error"
        if scenario == "first-fail":
            return "fail" if n == 1 else "pass"
        if scenario == "alternating":
            return "fail" if n % 2 else "pass"
        if scenario is None and self.ask is not None:
            answer = await self.ask(state, action)
            return answer if answer in ("pass", "fail", "error") else "pass"
        return "pass"


class Simulation:
    """The dry-run strategy: simulated results, and the path taken as text.

    One per loop level: a sub-loop gets `nested()`, which shares the
    decider (so a scenario counts across levels) and the transcript, one
    indent deeper.
    """

    simulated = True
    marks: dict[str, Any] = {"simulated": True}

    def __init__(self, decider: _Decider, lines: list[str], indent: str = "") -> None:
        self._decider = decider
        self.lines = lines
        self.indent = indent
        self._note = ""
        self._shown = ""

    @classmethod
    def start(cls, spec: LoopSpec, scenario: str | None, ask: Asker | None) -> Simulation:
        """The top level of a dry run of `spec`; the transcript says how results are decided."""
        note = "" if scenario is not None or ask is not None else (
            " (no --scenario and no way to ask: assuming all-pass)")
        how = f"scenario {scenario}" if scenario else "asking" if ask else "all-pass"
        return cls(_Decider(scenario, ask), [f"dry run of loop '{spec.name}' ({how}){note}"])

    def nested(self) -> Simulation:
        """The strategy for a sub-loop walked inline."""
        return Simulation(self._decider, self.lines, self.indent + "      ")

    @property
    def output(self) -> str:
        """The transcript: the run's output."""
        return "\n".join(self.lines)

    # What the state machine asks of its strategy -------------------------

    def begin_state(self) -> None:
        self._note = ""

    def note(self, text: str) -> None:
        self._note += text

    async def action(self, agent: LoopAgent, st: StateSpec,
                     ctx: RunContext) -> tuple[ActionResult, Step | None]:
        """Render the action instead of running it; a visible signal is taken as sent."""
        assert st.action is not None
        ns = agent._ns(ctx, st, None)
        if st.mode == "shell":
            shown = tpl.render_shell(st.action, ns, checked=False).display
        elif st.mode == "mcp_tool":
            shown = f"{tpl.render(st.action, ns)} {json.dumps(tpl.render_obj(st.params, ns))}"
        else:
            shown = tpl.render(st.action, ns)
        self._shown = shown
        self._note = f" [{st.mode}] would run: {_clip(' '.join(shown.split()), 120)}"
        result = ActionResult(f"[simulated output of state {st.name}]", "", 0, 0.0)
        if st.capture:
            agent.captured[st.capture] = capture(result)
        agent.output = result.output
        for marker, kind in SIGNALS.items():
            at = shown.find(marker)
            if at >= 0:
                text = shown[at + len(marker):].split("\n")[0].strip(" '\"")
                self._note += f" => signals {marker}"
                return result, agent._signal_step(st, kind, text)
        return result, None

    async def verdict(self, agent: LoopAgent, kind: str, spec: EvaluateSpec | None,
                      st: StateSpec, result: ActionResult | None,
                      ctx: RunContext) -> ev.Evaluation:
        """The scenario's (or the asker's) result, as the verdict `kind` would give."""
        outcome = await self._decider.outcome(st.name, self._note)
        verdict = ev.Evaluation(simulated_verdict(kind, outcome), {"simulated": outcome})
        if kind == "mcp_result":
            verdict.details["as"] = {"pass": "success", "fail": "tool_error"}.get(
                outcome, "not_found")
        self._note += f" => {outcome} ({verdict.verdict})"
        return verdict

    async def unresolved_subloop(self, st: StateSpec, why: str) -> ev.Evaluation | None:
        """A sub-loop chosen at run time from values a dry run lacks: the scenario decides."""
        if st.loop is None or "${" not in st.loop:
            return None
        outcome = await self._decider.outcome(st.name, self._note)
        verdict = ev.Evaluation(simulated_verdict("loop", outcome),
                                {"simulated": outcome, "why": why})
        self._note = (f" [loop {st.loop}, chosen at run time] => {outcome} "
                      f"({verdict.verdict})")
        return verdict

    async def subloop(self, agent: LoopAgent, st: StateSpec, child: LoopAgent,
                      ctx: RunContext) -> SubloopEnd:
        """Walk the child inline, one indent deeper; no child run is started."""
        self.lines.append(f"{self.indent}     sub-loop '{child.spec.name}':")
        ended = await child._walk(ctx, child.spec.max_iterations, self.nested())
        terminated_by = "terminal" if ended else "max_steps" if ended is None else "error"
        name = ("yes" if ended and child.failure_terminal is None else
                "timeout" if ended is None and _routes(st, "timeout") else "no")
        verdict = ev.Evaluation(name, {"simulated": True, "terminated_by": terminated_by})
        self._note = f" [loop {child.spec.name}] => {verdict.verdict}"
        return SubloopEnd(verdict, terminated_by, None, f"[simulated output of {st.name}]")

    def moved(self, iteration: int, state: str, target: str) -> None:
        self.lines.append(f"{self.indent}{iteration:>3}. {state}{self._note} -> {target}")

    def ended(self, iteration: int, state: str, step: Step) -> Step:
        what = (f"error: {step.error}" if step.error is not None
                else f"handoff: {step.handoff}" if step.handoff is not None
                else f"stop: {step.stop}" if step.stop is not None else "end")
        self.lines.append(f"{self.indent}{iteration:>3}. {state}{self._note} -> {what}")
        return step

    def out_of_steps(self, limit: int) -> None:
        self.lines.append(f"{self.indent}stopped: max_iterations={limit} "
                          "reached (the run would end max_steps)")

    def finished(self, agent: LoopAgent, step: Step) -> bool:
        """Write how the walk ended; True when it reached a terminal state."""
        if agent.failure_terminal is not None:
            self.lines.append(f"{self.indent}reached failure terminal "
                              f"'{agent.failure_terminal}' after {agent.iteration} "
                              "iteration(s) (the run would end error)")
            return True
        ended_ok = step.error is None and step.handoff is None and step.stop is None
        if ended_ok:
            self.lines.append(f"{self.indent}reached terminal state '{agent.current}' "
                              f"after {agent.iteration} iteration(s)")
        return ended_ok


def simulated_verdict(kind: str, outcome: str) -> str:
    """The verdict evaluator `kind` gives for a simulated pass/fail/error."""
    if outcome == "error":
        return "error"
    if kind == "convergence":
        return "target" if outcome == "pass" else "progress"
    return "yes" if outcome == "pass" else "no"


def _routes(st: StateSpec, verdict: str) -> bool:
    """True when `st` names a route for `verdict` (`on_<verdict>` or the route table)."""
    return verdict in st.on or (st.route is not None and verdict in st.route.table)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
