"""`LoopAgent`: a YAML state machine the kernel steps one state at a time.

One kernel step = one executed state: `state_enter`, the action (run inside
the step, with `action_start`/`output`/`action_end` events), `evaluate`,
`route`. Moves that execute nothing (into a terminal state, a `maintain`
restart, a retry-exhausted detour) happen inside the step that led to
them, so `max_iterations` counts exactly the states that ran, as the
kernel's `max_steps` does.

Why actions run inside the step rather than as kernel tool calls: a
state's verdict needs its action's result in the same step (signals,
captures, evaluation), per-state timeouts belong to the loop file, and
repeating the same command is what a loop is *for* (polling, fix-until-
pass), so feeding each action to the critic's repeated-tool-call detector
would kill healthy loops. The loop bounds itself (max_iterations,
max_retries, convergence stalls); the critic still sees every state as a
step and every output line as activity.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

from kernel import (
    BudgetRefused,
    ConfigError,
    Limits,
    Result,
    RunContext,
    RunInfo,
    Status,
    Step,
    Usage,
)

from .._proc import last_chars
from . import _evaluators as ev
from . import _template as tpl
from ._process import ActionResult, ChunkSink, LineSink, capture, run_process
from ._simulation import SCENARIOS, SIGNALS, Asker, Simulation, SubloopEnd
from ._spec import (
    CURRENT,
    DEFAULT_ACTION_TIMEOUT,
    DEFAULT_MCP_TIMEOUT,
    LEFT_OUT_EVALUATORS,
    EvaluateSpec,
    LoopSpec,
    StateSpec,
    bind,
    with_context,
)

_DEFAULT_EVALUATOR = {"shell": "exit_code", "prompt": "llm_structured", "mcp_tool": "mcp_result"}
_PREVIEW = 2000
_NO_USAGE = Usage()
#: Seconds between the signs of life a `backoff` wait gives the critic.
_HEARTBEAT = 1.0


@dataclass(slots=True)
class _Outcome:
    verdict: str | None
    target: str | None
    reason: str


class _Live:
    """The real-run strategy: actions run, outputs judged, sub-loops started as child runs.

    The state machine asks its strategy for each state's results; a dry run
    swaps in a `Simulation` (`_simulation.py`). Live work itself is the
    agent's own (`_run_action`, `_judge`, `_run_subloop`); this class only
    says "do it for real", and keeps no transcript.
    """

    simulated = False
    marks: Mapping[str, Any] = {}

    def begin_state(self) -> None:
        """A real run keeps no per-state note."""

    def note(self, text: str) -> None:
        """A real run keeps no transcript: nothing to note."""

    async def action(self, agent: LoopAgent, st: StateSpec,
                     ctx: RunContext) -> tuple[ActionResult, Step | None]:
        result = await agent._run_action(st, ctx)
        return result, agent._signal(st, result, ctx)

    async def verdict(self, agent: LoopAgent, kind: str, spec: EvaluateSpec | None,
                      st: StateSpec, result: ActionResult | None,
                      ctx: RunContext) -> ev.Evaluation:
        return await agent._judge(kind, spec, st, result, ctx)

    async def unresolved_subloop(self, st: StateSpec, why: str) -> ev.Evaluation | None:
        """A sub-loop file that cannot be found is the state machine's error to route."""
        return None

    async def subloop(self, agent: LoopAgent, st: StateSpec, child: LoopAgent,
                      ctx: RunContext) -> SubloopEnd:
        return await agent._run_subloop(st, child, ctx)

    def moved(self, iteration: int, state: str, target: str) -> None:
        """The route event is the record of a real move."""

    def ended(self, iteration: int, state: str, step: Step) -> Step:
        return step


_LIVE = _Live()


class _Fatal(Exception):
    """Ends the run `error` with this message (raised deep, turned into a Step once)."""


class _Refused(Exception):
    """Ends the run `budget_exceeded` with this message: a budget refused a sub-loop's run
    (raised deep, passed to the kernel once as `BudgetRefused`)."""


class LoopAgent:
    """Runs a `LoopSpec` under the kernel, one state per step.

    Args:
        spec: The loop (from `load_loop`).
        context: Variables on top of the file's `context` (the CLI's `--context`); a
            dotted key (`cfg.depth`) sets a field of a mapping (`with_context`).
        judge: Where `llm_structured` verdicts come from; None gives `error` verdicts.
        scenario: For dry runs: all-pass | all-fail | all-error | first-fail |
            alternating. None asks `ask`, else all-pass.
        ask: How a dry run without a scenario asks for each result. None: every
            result passes (the library never reads the terminal; the `kernel`
            CLI passes one that asks there when stdin is a terminal).
        cwd: Working directory of actions (default: the current one).
        env: Extra environment for actions.
        prompt_command: The command prompt/slash_command actions run, the prompt
            appended as the last argument.
        mcp_command: The command mcp_tool actions run, with the tool name and
            the JSON params appended.
        on_line: Called with every action output line (cut at 64 KiB).
        max_output_bytes: How much of each action's stdout/stderr is kept.
        max_line_events: Output lines written to the audit as `output` events per
            run; an action whose lines went past it ends with one
            `output_not_audited` event saying how many were left out.
        grace: Seconds between SIGTERM and SIGKILL when an action is stopped.
        warnings: One-line warnings about the loop file, written to the audit
            at the first step.
        on_output: Called with ("stdout" | "stderr", bytes) for every chunk an
            action prints, untouched (the CLI echoes these: byte-exact). It may
            raise BrokenPipeError when the reader of that stream has gone (and a
            `adapters.shell.WatchedSink` is watched for that): the action's pipe
            is then closed, as in a shell pipeline, and its own exit status
            (141 for SIGPIPE) is evaluated and routed (`output_reader_gone`).

    Attributes:
        captured: Captured action results by name (readable after the run).
        iteration: States executed so far.
        current: The state the next step executes.
        fixed_max_steps: True (`kernel.SupportsFixedCeiling`): the file's
            `max_iterations` (the run's step ceiling) is a bound the critic
            does not raise, however well the loop is progressing.
    """

    fixed_max_steps = True

    def __init__(self, spec: LoopSpec, *, context: Mapping[str, Any] | None = None,
                 judge: ev.VerdictSource | None = None, scenario: str | None = None,
                 ask: Asker | None = None, cwd: str | None = None,
                 env: Mapping[str, str] | None = None,
                 prompt_command: Sequence[str] = ("claude", "-p"),
                 mcp_command: Sequence[str] = ("mcp-call",), on_line: LineSink | None = None,
                 max_output_bytes: int = 256 << 10, max_line_events: int = 1000,
                 grace: float = 2.0, warnings: Sequence[str] = (),
                 on_output: ChunkSink | None = None) -> None:
        if scenario is not None and scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario {scenario!r} (choose from {', '.join(SCENARIOS)})")
        if spec.initial not in spec.states:
            raise ConfigError(f"loop {spec.name!r}: initial state {spec.initial!r} is not a state")
        self.spec = spec
        defaults = {k: p.default for k, p in spec.parameters.items() if p.default is not None}
        self.context: dict[str, Any] = with_context({**spec.context, **defaults},
                                                    context or {})
        self.judge = judge
        self.scenario = scenario
        self.ask = ask
        self.cwd = cwd
        self.env = dict(env or {})
        self.prompt_command = tuple(prompt_command)
        self.mcp_command = tuple(mcp_command)
        self.on_line = on_line
        self.on_output = on_output
        self.max_output_bytes = max_output_bytes
        self.max_line_events = max_line_events
        self.grace = grace
        self.warnings = list(warnings)
        # Runtime state (what `snapshot` saves).
        self.current = spec.initial
        self.iteration = 0
        self.captured: dict[str, Any] = {}
        #: The failure terminal the run ended in, if it did.
        self.failure_terminal: str | None = None
        # The loop files of the runs above this one (a sub-loop chosen at run time
        # must not be one of them: the file check sees only the static ones).
        self.ancestors: tuple[str, ...] = ()
        self.prev: dict[str, Any] | None = None
        self.retries: dict[str, int] = {}
        self.prev_state: str | None = None
        self.last_values: dict[str, float] = {}
        #: diff_stall: per state, the last `git diff --stat` and how many times in a row
        #: it has not changed.
        self.diff_stalls: dict[str, tuple[str, int]] = {}
        self.output = ""
        self.elapsed_offset_ms = 0.0
        self._t0 = 0.0
        self._started_iso = ""
        self._begun = False
        self._backoff_due = False
        self._line_events = 0
        self._lines_dropped = 0
        self._steer: list[str] = []
        self._ctx: RunContext | None = None
        # Who provides each state's results: live by default, a Simulation in a dry run.
        self._mode: _Live | Simulation = _LIVE
        self._step_output: str | None = None
        # What this step's model calls (llm_structured verdicts) used: the step reports it.
        self._step_usage = _NO_USAGE

    # ---------------------------------------------------------------- kernel

    async def step(self, ctx: RunContext) -> Step:
        """Execute one state: enter, act, evaluate, route.

        A `backoff` wait comes first, in the same kernel step (the kernel times
        the whole step): the step's payload says how long it was (`backoff_ms`),
        so the state's own time is the step's less that.
        """
        self._ctx = ctx
        if not self._begun:
            final = self._begin(ctx)
            if final is not None:
                return final
        self._take_steer(ctx)
        waited = 0.0
        if self._backoff_due and self.spec.backoff > 0:
            waited = await self._backoff(ctx)
        self._backoff_due = False
        self._step_usage = _NO_USAGE
        step = await self._advance(ctx)
        if self._step_usage is not _NO_USAGE:
            step = replace(step, usage=self._step_usage if step.usage is None
                           else step.usage + self._step_usage)
        if waited:
            step = replace(step, payload={**(step.payload or {}),
                                          "backoff_ms": round(waited * 1000, 3)})
        return step

    @property
    def asks_model(self) -> bool:
        """Whether a state of this loop (not its sub-loops) asks a model for its verdict
        (`llm_structured`, the default of a prompt state): what a cost budget needs priced."""
        if not self.spec.llm.enabled:
            return False
        return any((st.evaluate.type if st.evaluate is not None
                    else _DEFAULT_EVALUATOR.get(st.mode, "none")) == "llm_structured"
                   for st in self.spec.states.values())

    @property
    def unpriced(self) -> str | None:
        """`SupportsPricing`: why the cost of this loop's verdicts cannot be known (its
        judge says so, and a state asks it), else None."""
        unpriced = getattr(self.judge, "unpriced", None) if self.asks_model else None
        return unpriced if isinstance(unpriced, str) else None

    @functools.cached_property
    def definition(self) -> str:
        """A digest of what the loop file defines (not its comments or layout): a resumed
        run whose file was edited since its checkpoint says so."""
        return hashlib.sha256(repr(self.spec.states).encode()).hexdigest()[:16]

    def snapshot(self) -> dict[str, Any]:
        """The resumable state: where the loop is and what it has captured."""
        return {
            "loop": self.spec.name, "definition": self.definition,
            "state": self.current, "iteration": self.iteration,
            "captured": self.captured, "prev": self.prev, "retries": self.retries,
            "prev_state": self.prev_state, "last_values": self.last_values,
            "diff_stalls": {k: list(v) for k, v in self.diff_stalls.items()},
            "output": last_chars(self.output, _PREVIEW), "elapsed_ms": self._elapsed_ms(),
            "backoff_due": self._backoff_due,
        }

    def restore(self, state: Mapping[str, Any]) -> bool:
        """Continue from a `snapshot()`; False (and nothing changed) if it does not fit."""
        if state.get("loop") != self.spec.name or state.get("state") not in self.spec.states:
            return False
        self.current = str(state["state"])
        self.iteration = _int(state.get("iteration"))
        self.captured = dict(_mapping(state.get("captured")))
        prev = state.get("prev")
        self.prev = dict(prev) if isinstance(prev, Mapping) else None
        self.retries = {str(k): _int(v) for k, v in _mapping(state.get("retries")).items()}
        prev_state = state.get("prev_state")
        self.prev_state = prev_state if isinstance(prev_state, str) else None
        self.last_values = {str(k): float(v) for k, v in _mapping(state.get("last_values")).items()
                            if isinstance(v, (int, float))}
        self.diff_stalls = {str(k): (str(v[0]), _int(v[1]))
                            for k, v in _mapping(state.get("diff_stalls")).items()
                            if isinstance(v, (list, tuple)) and len(v) == 2}
        self.output = str(state.get("output") or "")
        self.elapsed_offset_ms = float(_int(state.get("elapsed_ms")))
        self._backoff_due = bool(state.get("backoff_due"))
        return True

    async def simulate(self, ctx: RunContext) -> str:
        """A dry run: walk the machine with simulated results, execute nothing.

        Returns the path taken, one line per state, which the kernel makes the
        run's output (status `dry_run`). The `state_enter`/`evaluate`/`route`
        events are audited as usual, marked `simulated`.
        """
        self._ctx = ctx
        sim = Simulation.start(self.spec, self.scenario, self.ask)
        limit = ctx.limits.max_steps if ctx.limits.max_steps is not None \
            else self.spec.max_iterations
        await self._walk(ctx, min(limit, self.spec.max_iterations), sim)
        return sim.output

    # ----------------------------------------------------------- the machine

    def _runner_context(self) -> None:
        """What little-loops' runner provides: `run_dir` (created unless simulated), `max_steps`."""
        if "run_dir" not in self.context:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
            base = Path(self.cwd or ".").resolve() / ".loops" / "runs"
            run_dir = base / f"{self.spec.name}-{stamp}"
            if not self._mode.simulated and self._uses_run_dir():
                run_dir.mkdir(parents=True, exist_ok=True)
            self.context["run_dir"] = str(run_dir)
        self.context.setdefault("max_steps", self.spec.max_iterations)

    def _uses_run_dir(self) -> bool:
        return any("context.run_dir" in text for st in self.spec.states.values()
                   for text in (st.action or "", *map(str, st.with_.values())))

    def _begin(self, ctx: RunContext) -> Step | None:
        self._runner_context()
        self._begun = True
        self._t0 = trio.current_time()
        self._started_iso = datetime.now(UTC).isoformat(timespec="seconds")
        for warning in self.warnings:
            ctx.event("warning", payload={"message": warning})
        resumed = ctx.resumed_from
        if isinstance(resumed, Mapping) and self.restore(resumed):
            ctx.event("loop_resumed", name=self.current,
                      payload={"state": self.current, "iteration": self.iteration})
            saved = resumed.get("definition")
            if isinstance(saved, str) and saved != self.definition:
                ctx.event("warning", payload={"message": (
                    f"the loop file was edited since this run's checkpoint: it resumes in "
                    f"state {self.current!r} of the edited file, with what it captured "
                    "before")})
            return None
        if isinstance(resumed, Mapping) and isinstance(resumed.get("state"), str):
            # Saved in a state this loop file no longer has (or under another loop's
            # name): starting over would run finished, side-effecting states again.
            where = resumed["state"]
            why = (f"the loop is now named {self.spec.name!r}, not {resumed.get('loop')!r}"
                   if resumed.get("loop") != self.spec.name
                   else f"the loop file no longer has state {where!r}")
            return Step(final=True, name="resume", error=(
                f"cannot resume in state {where!r}: {why} (the file was edited since the "
                "run was interrupted); nothing was run again"))
        return self._settle(ctx)

    def _settle(self, ctx: RunContext) -> Step | None:
        """Make the moves that execute nothing; a final Step if the loop ends here.

        Counts consecutive re-entries against `max_retries`, turns a terminal
        state into the end of the run (or, with `maintain`, a restart), and
        takes `on_retry_exhausted` detours.
        """
        hops = 0
        while True:
            name = self.current
            st = self.spec.states[name]
            if self.prev_state is not None:
                if name == self.prev_state:
                    self.retries[name] = self.retries.get(name, 0) + 1
                else:
                    self.retries.pop(self.prev_state, None)
            if st.terminal:
                if st.failure:
                    # little-loops: a failure terminal ends the run failed, even under maintain.
                    self.failure_terminal = name
                    return Step(output=self.output, final=True, name=name,
                                error=f"reached failure terminal '{name}'",
                                payload={"terminal": name, "failure": True,
                                         "iteration": self.iteration})
                if not self.spec.maintain:
                    return Step(output=self.output, final=True, name=name,
                                payload={"terminal": name, "iteration": self.iteration})
                target = st.on_maintain or self.spec.initial
                self._route_event(ctx, name, target, "maintain", None)
            elif st.max_retries is not None and self.retries.get(name, 0) > st.max_retries:
                count = self.retries.pop(name)
                if st.on_retry_exhausted is None:
                    return Step(output=self.output, final=True, name=name, error=(
                        f"state '{name}' was re-entered {count} times in a row "
                        f"(max_retries={st.max_retries}) and has no on_retry_exhausted"))
                target = st.on_retry_exhausted
                ctx.event("retry_exhausted", name=name, payload={
                    "state": name, "retries": count, "max_retries": st.max_retries,
                    "next": target})
                self._route_event(ctx, name, target, "retry_exhausted", None)
            else:
                return None
            hops += 1
            if target not in self.spec.states or hops > len(self.spec.states) + 1:
                why = (f"'{target}' is not a state" if target not in self.spec.states
                       else "states route in a circle without executing anything")
                return Step(output=self.output, final=True, name=name,
                            error=f"no valid transition from state '{name}': {why}")
            self.prev_state = name
            self.current = target

    async def _advance(self, ctx: RunContext) -> Step:
        st = self.spec.states[self.current]
        name = st.name
        mode = self._mode
        self.iteration += 1
        mode.begin_state()
        self._step_output = None
        ctx.event("state_enter", name=name, payload={
            "state": name, "iteration": self.iteration, "mode": st.mode, **mode.marks})
        try:
            outcome = await self._execute(st, ctx)
        except tpl.MissingVariable as exc:
            return self._end(Step(output=self.output, final=True, name=name,
                                  error=_missing_message(exc, name)))
        except (tpl.TemplateError, _Fatal) as exc:
            return self._end(Step(output=self.output, final=True, name=name,
                                  error=f"state '{name}': {exc}"))
        except _Refused as exc:
            # A step cannot return `budget_exceeded`: the kernel ends a run whose step
            # raises `BudgetRefused` as it ends one the budget refused at its start.
            raise BudgetRefused(f"state '{name}': {exc}") from None
        if isinstance(outcome, Step):
            return self._end(outcome)
        target, reason = outcome.target, outcome.reason
        if target is None:
            if not self.spec.maintain:
                return self._end(Step(
                    output=self.output, final=True, name=name,
                    error=f"no valid transition from state '{name}' for verdict "
                          f"'{outcome.verdict}'"))
            target, reason = st.on_maintain or self.spec.initial, f"maintain ({reason})"
        if target not in self.spec.states:
            return self._end(Step(output=self.output, final=True, name=name, error=(
                f"state '{name}' routes to '{target}', which is not a state")))
        self._route_event(ctx, name, target, reason, outcome.verdict)
        mode.moved(self.iteration, name, target)
        self.prev_state, self.current = name, target
        self._backoff_due = True
        info = {"state": name, "iteration": self.iteration, "verdict": outcome.verdict,
                "next": target}
        final = self._settle(ctx)
        if final is not None:
            return replace(final, name=name, payload={**info, **(final.payload or {})})
        shown = last_chars(self._step_output, _PREVIEW) if self._step_output is not None else None
        return Step(output=shown, name=name, payload=info)

    def _end(self, step: Step) -> Step:
        """The run ends in the state being executed (the strategy notes it)."""
        return self._mode.ended(self.iteration, self.current, step)

    async def _execute(self, st: StateSpec, ctx: RunContext) -> _Outcome | Step:
        result: ActionResult | None = None
        if st.mode == "loop":
            verdict = await self._subloop(st, ctx)
            if st.next is not None and verdict.verdict != "budget_exceeded":
                # `next` first, as on an action state: on whatever the child's verdict,
                # but to `on_error` when the child errored and there is one.
                self._record_prev(st, None)
                if verdict.verdict == "error" and "error" in st.on:
                    return _Outcome("error", self._resolve(st.on["error"], st, ctx, None),
                                    "on_error (the sub-loop)")
                return _Outcome(verdict.verdict, self._resolve(st.next, st, ctx, None), "next")
        else:
            if st.action is not None:
                result, stop = await self._mode.action(self, st, ctx)
                if stop is not None:
                    return stop
                if result.signal is not None and not _pipeline_end(result):
                    table = st.route
                    target = (table and (table.table.get("error") or table.error)) \
                        or st.on.get("error")
                    if target is None:
                        return Step(output=self.output, final=True, name=st.name, stop=(
                            f"the action of state '{st.name}' was killed by signal "
                            f"{result.signal}"))
                    self._record_prev(st, result)
                    return _Outcome("error", self._resolve(target, st, ctx, None),
                                    f"killed by signal {result.signal}")
            if st.next is not None:
                self._record_prev(st, result)
                if result is not None and result.exit_code != 0 and "error" in st.on:
                    # little-loops: `next` is the success path when on_error is set.
                    ctx.event("evaluate", name=st.name, payload={
                        "state": st.name, "type": "exit_code", "verdict": "error",
                        "details": {"exit_code": result.exit_code,
                                    "why": "a failing action with next and on_error"}})
                    self._mode.note(" => error")
                    return _Outcome("error", self._resolve(st.on["error"], st, ctx, None),
                                    f"on_error (exit {result.exit_code})")
                return _Outcome(None, self._resolve(st.next, st, ctx, None), "next")
            verdict = await self._evaluate(st, result, ctx)
        self._record_prev(st, result)
        target, reason = self._route(st, verdict, ctx)
        return _Outcome(verdict.verdict, target, reason)

    def _route(self, st: StateSpec, verdict: ev.Evaluation,
               ctx: RunContext) -> tuple[str | None, str]:
        """next is handled by the caller; then the route table, then the shorthands."""
        v = verdict.verdict
        spelled = verdict.details.get("as")
        if isinstance(spelled, str) and spelled != v and (
                spelled in st.on or (st.route is not None and spelled in st.route.table)) \
                and not (v in st.on or (st.route is not None and v in st.route.table)):
            v = spelled  # little-loops' name for the same verdict (mcp_result)
        result = {"verdict": v, "details": verdict.details}
        if st.route is not None:
            table = st.route
            if v in table.table:
                return self._resolve(table.table[v], st, ctx, result), f"route.{v}"
            if v == "error" and table.error is not None:
                return self._resolve(table.error, st, ctx, result), "route._error"
            if table.default is not None:
                return self._resolve(table.default, st, ctx, result), "route._"
            if v == "no" and table.error is not None:
                # little-loops: a `no` nobody routes goes where errors go.
                return self._resolve(table.error, st, ctx, result), "route._error (no)"
        if v in st.on:
            return self._resolve(st.on[v], st, ctx, result), f"on_{v}"
        if v == "no" and "error" in st.on:
            return self._resolve(st.on["error"], st, ctx, result), "on_error (no)"
        return None, f"no route for verdict '{v}'"

    def _resolve(self, target: str, st: StateSpec, ctx: RunContext,
                 result: Mapping[str, Any] | None) -> str:
        if target == CURRENT:
            return st.name
        if "${" not in target:
            return target
        return tpl.render(target, self._ns(ctx, st, result)).strip()

    def _route_event(self, ctx: RunContext, src: str, dst: str, reason: str,
                     verdict: str | None) -> None:
        payload: dict[str, Any] = {"from": src, "to": dst, "reason": reason}
        if verdict is not None:
            payload["verdict"] = verdict
        payload.update(self._mode.marks)
        ctx.event("route", name=src, payload=payload)

    def _record_prev(self, st: StateSpec, result: ActionResult | None) -> None:
        if result is not None:
            self.prev = {**capture(result), "state": st.name}

    # ---------------------------------------------------------------- actions

    async def _run_action(self, st: StateSpec, ctx: RunContext) -> ActionResult:
        assert st.action is not None
        ns = self._ns(ctx, st, None)
        mode = st.mode
        timeout = st.timeout or self.spec.default_timeout or (
            DEFAULT_MCP_TIMEOUT if mode == "mcp_tool" else DEFAULT_ACTION_TIMEOUT)
        env = {**os.environ, **self.env}
        extra: dict[str, Any] = {}
        spill_dir: list[str] = []
        if mode == "shell":
            cmd = tpl.render_shell(st.action, ns)
            text, values = tpl.spill(cmd, lambda: _mkdtemp(spill_dir))
            argv = ["bash", "-c", text]
            env.update(values)
            shown = cmd.display
            extra["command"] = _clip(cmd.command, _PREVIEW)
        elif mode == "prompt":
            shown = tpl.render(st.action, ns)
            if self._steer:
                shown += "\n\nNotes from the supervisor:\n" + "\n".join(
                    f"- {m}" for m in self._steer)
                ctx.event("steer_delivered", name=st.name, payload={"messages": self._steer})
                self._steer = []
            argv = [*self.prompt_command, shown]
        else:
            tool = tpl.render(st.action, ns).strip()
            params = json.dumps(tpl.render_obj(st.params, ns), default=str)
            argv = [*self.mcp_command, tool, params]
            shown = f"{tool} {params}"
        ctx.event("action_start", name=mode, payload={
            "state": st.name, "action_type": mode, "action": _clip(shown, _PREVIEW),
            "timeout": timeout, **extra})
        dropped_before = self._lines_dropped

        def started(record: dict[str, Any]) -> None:
            ctx.event("process_start", name=argv[0], payload={"state": st.name, **record})

        def reader_gone(stream: str, held: int, dropped: int) -> None:
            # As for a plain command: the action meets the closed pipe itself (SIGPIPE)
            # and its exit status is evaluated and routed like any other.
            payload: dict[str, Any] = {"state": st.name, "stream": stream, "bytes_held": held}
            if dropped:
                payload["bytes_dropped"] = dropped
            ctx.event("output_reader_gone", name=stream, activity=False, payload=payload)

        try:
            _check_exec_size(argv, env)
            result = await run_process(argv, env=env, cwd=self.cwd, timeout=timeout,
                                       on_line=self._line, max_bytes=self.max_output_bytes,
                                       max_line=self.max_output_bytes,
                                       grace=self.grace, on_process=self._on_process,
                                       on_output=self.on_output, on_start=started,
                                       on_reader_gone=reader_gone)
        finally:
            for path in spill_dir:
                shutil.rmtree(path, ignore_errors=True)
        if self._lines_dropped > dropped_before:
            ctx.event("output_not_audited", name=st.name, activity=False, payload={
                "state": st.name, "lines": self._lines_dropped - dropped_before,
                "total": self._lines_dropped, "cap": self.max_line_events})
        ctx.event("action_end", name=mode, duration_ms=result.duration_ms, payload={
            "state": st.name, "exit_code": result.exit_code, "signal": result.signal,
            "timed_out": result.timed_out, "output_tail": last_chars(result.output, _PREVIEW),
            "stderr_tail": last_chars(result.stderr, _PREVIEW),
            **({"output_truncated": True} if result.truncated else {})})
        if st.capture:
            self.captured[st.capture] = capture(result)
        self.output = self._step_output = result.output
        return result

    def _signal(self, st: StateSpec, result: ActionResult, ctx: RunContext) -> Step | None:
        found = detect_signal(result.output)
        if found is None:
            return None
        kind, text = found
        ctx.event("signal", name=st.name, payload={"signal": kind, "text": text,
                                                   "state": st.name})
        return self._signal_step(st, kind, text)

    def _signal_step(self, st: StateSpec, kind: str, text: str) -> Step:
        if kind == "handoff":
            return Step(output=text, final=True, name=st.name,
                        handoff=text or f"handoff requested by state '{st.name}'")
        if kind == "error":
            return Step(output=self.output, final=True, name=st.name,
                        error=text or f"FATAL_ERROR in state '{st.name}'")
        return Step(output=self.output, final=True, name=st.name,
                    stop=text or f"LOOP_STOP in state '{st.name}'")

    def _on_process(self, pid: int, started: bool) -> None:
        """An action's process started (ended): the critic samples its tree meanwhile."""
        ctx = self._ctx
        if ctx is None:
            return
        if started:
            ctx.process_started(pid)
        else:
            ctx.process_exited(pid)

    def _line(self, stream: str, line: str, cut: bool) -> None:
        ctx = self._ctx
        if ctx is not None:
            if self._line_events < self.max_line_events:
                self._line_events += 1
                payload: dict[str, Any] = {"line": line[:_PREVIEW], "state": self.current}
                if cut or len(line) > _PREVIEW:
                    payload["truncated"] = True
                ctx.event("output", name=stream, payload=payload, text=line)
            else:
                self._lines_dropped += 1
                ctx.activity("output", line)
        if self.on_line is not None:
            self.on_line(stream, line)

    def _take_steer(self, ctx: RunContext) -> None:
        """Critic nudges reach a prompt action; anything else can only record them."""
        if not ctx.steer:
            return
        messages = [m.content for m in ctx.steer]
        st = self.spec.states[self.current]
        if st.mode == "prompt":
            self._steer.extend(messages)
        else:
            ctx.event("steer_undeliverable", name=st.name, payload={
                "messages": messages,
                "why": f"state '{st.name}' runs {st.mode}, which has no channel for nudges"})

    async def _backoff(self, ctx: RunContext) -> float:
        """Sleep `backoff` seconds between iterations; the seconds waited.

        The sleep is a plain trio sleep inside the run's cancel scope, so the
        run's deadline, a critic kill or Ctrl-C interrupts it at once.
        Waiting on purpose is not a stall: the `backoff` event tells the
        critic the run is alive as the wait starts, and activity every
        `_HEARTBEAT` second after, so its idle clock (`--idle-timeout`, down
        to about a second) never runs out during a wait however long.
        """
        seconds = self.spec.backoff
        ctx.event("backoff", name=self.current, payload={"seconds": seconds})
        start = trio.current_time()
        end = start + seconds
        while (now := trio.current_time()) < end:
            await trio.sleep(min(end - now, _HEARTBEAT))
            ctx.activity("backoff")
        return trio.current_time() - start

    # -------------------------------------------------------------- evaluate

    async def _evaluate(self, st: StateSpec, result: ActionResult | None,
                        ctx: RunContext) -> ev.Evaluation:
        spec = st.evaluate
        kind = spec.type if spec is not None else _DEFAULT_EVALUATOR.get(st.mode, "none")
        if kind == "none":
            verdict = ev.Evaluation("yes", {"reason": "no action and no evaluator"})
        else:
            verdict = await self._mode.verdict(self, kind, spec, st, result, ctx)
            if verdict.usage is not None:
                self._step_usage = self._step_usage + verdict.usage
        ctx.event("evaluate", name=st.name, payload={
            "state": st.name, "type": kind, "verdict": verdict.verdict,
            "details": verdict.details, **self._mode.marks})
        return verdict

    async def _judge(self, kind: str, spec: EvaluateSpec | None, st: StateSpec,
                     result: ActionResult | None, ctx: RunContext) -> ev.Evaluation:
        ns = self._ns(ctx, st, None)
        text = result.output if result is not None else ""
        if spec is not None and spec.source is not None:
            text = tpl.render(spec.source, ns)
        code = result.exit_code if result is not None else 0
        if kind in LEFT_OUT_EVALUATORS:
            return ev.Evaluation("error", {"error": f"the {kind} evaluator "
                                                 f"({LEFT_OUT_EVALUATORS[kind]}) is not "
                                                 "supported"})
        if code != 0 and kind in _OUTPUT_EVALUATORS:
            # little-loops: an evaluator that reads output does not judge a failed action.
            return ev.Evaluation("error", {"exit_code": code,
                                        "error": f"action exited with code {code}"})
        if kind == "exit_code":
            return ev.exit_code(code)
        if kind == "diff_stall":
            assert spec is not None
            return await self._diff_stall(st.name, spec)
        if kind == "mcp_result":
            return ev.mcp_result(text, code)
        if kind == "llm_structured":
            return await ev.llm_structured(text, spec or EvaluateSpec("llm_structured"),
                                           self.spec.llm, self.judge, ctx)
        assert spec is not None
        operator = spec.operator or "eq"
        if kind == "output_contains":
            # In a worker thread: a pattern that backtracks badly on this output would
            # otherwise hold the trio thread, and with it the deadline and the signals
            # (an abandoned search is left to finish on its own).
            return await trio.to_thread.run_sync(
                functools.partial(ev.output_contains, text, tpl.render(spec.pattern or "", ns),
                                  negate=spec.negate, error_patterns=spec.error_patterns),
                abandon_on_cancel=True)
        if kind == "output_numeric":
            return ev.output_numeric(text, operator, self._param(spec.target, ns))
        if kind == "output_json":
            return ev.output_json(text, spec.path or ".", operator, self._param(spec.target, ns))
        # convergence
        current = ev.parse_number(text)
        if current is None:
            return ev.Evaluation("error",
                                 {"error": f"output is not a number: {text.strip()[:100]!r}"})
        target = ev.parse_number(str(self._param(spec.target, ns)))
        if target is None:
            return ev.Evaluation("error", {"error": f"target is not a number: {spec.target!r}"})
        tolerance = ev.parse_number(str(self._param(spec.tolerance, ns) or 0)) or 0.0
        previous: float | None = self.last_values.get(st.name)
        if spec.previous is not None:
            try:
                previous = ev.parse_number(tpl.render(spec.previous, ns))
            except tpl.MissingVariable:
                previous = None
        self.last_values[st.name] = current
        return ev.convergence(current, previous, target, tolerance=abs(tolerance),
                              direction=spec.direction)

    async def _diff_stall(self, state: str, spec: EvaluateSpec) -> ev.Evaluation:
        """little-loops' diff_stall: `no` once `git diff --stat` has not changed for
        `max_stall` evaluations in a row; `yes` otherwise (the first look included)."""
        argv = ["git", "diff", "--stat", *(["--", *spec.scope] if spec.scope else [])]
        result = await run_process(argv, cwd=self.cwd, timeout=30.0, grace=self.grace)
        if result.exit_code != 0:
            return ev.Evaluation("error", {"error": f"git diff failed: "
                                                 f"{(result.stderr or result.output)[:200]}"})
        previous = self.diff_stalls.get(state)
        if previous is None or previous[0] != result.output:
            self.diff_stalls[state] = (result.output, 0)
            return ev.Evaluation("yes", {"stall_count": 0, "max_stall": spec.max_stall,
                                      "diff_changed": True})
        count = previous[1] + 1
        self.diff_stalls[state] = (result.output, count)
        return ev.Evaluation("no" if count >= spec.max_stall else "yes",
                          {"stall_count": count, "max_stall": spec.max_stall,
                           "diff_changed": False})

    @staticmethod
    def _param(value: Any, ns: tpl.Namespaces) -> Any:
        return tpl.render(value, ns) if isinstance(value, str) and "${" in value else value

    # --------------------------------------------------------------- sub-loop

    async def _subloop(self, st: StateSpec, ctx: RunContext) -> ev.Evaluation:
        child_spec = st.child
        if child_spec is None:
            try:
                child_spec = self._load_child(st, ctx)
            except _Fatal as exc:
                # Chosen at run time from values a dry run does not have: the
                # simulation decides its verdict, as for an action.
                chosen = await self._mode.unresolved_subloop(st, str(exc))
                if chosen is not None:
                    ctx.event("evaluate", name=st.name, payload={
                        "state": st.name, "type": "loop", "verdict": chosen.verdict,
                        "details": chosen.details, **self._mode.marks})
                    return chosen
                if not st.has_error_route():
                    raise
                failed = ev.Evaluation("error", {"error": str(exc)})
                ctx.event("evaluate", name=st.name, payload={
                    "state": st.name, "type": "loop", "verdict": "error",
                    "details": failed.details})
                return failed
        context: dict[str, Any] = {}
        if st.context_passthrough:
            # As in little-loops, the parent's context and its captured outputs (as
            # text); unlike it, they override the child file's own defaults, as
            # --context does for a top-level loop.
            outputs = {k: v["output"] if isinstance(v, Mapping) and "exit_code" in v else v
                       for k, v in self.captured.items()}
            context = {**self.context, **outputs}
        elif st.with_:
            # little-loops' typed bindings: only what the child declares, plus run_dir.
            ns = self._ns(ctx, st, None)
            given = {k: self._param(v, ns) for k, v in st.with_.items()}
            try:
                context = bind(child_spec.parameters, given)
            except ValueError as exc:
                raise _Fatal(f"sub-loop {st.loop}: {exc}") from None
            if "run_dir" in self.context:
                context.setdefault("run_dir", self.context["run_dir"])
        chain = (*self.ancestors, _resolved(self.spec.path))
        target = _resolved(child_spec.path)
        if target and target in chain:
            names = " -> ".join(Path(p).name for p in (*chain[chain.index(target):], target))
            raise _Fatal(f"sub-loops form a cycle: {names} (state {st.name!r} chose it at "
                         "run time)")
        try:
            child = LoopAgent(
                child_spec, context=context, judge=self.judge, scenario=self.scenario,
                ask=self.ask, cwd=self.cwd, env=self.env, prompt_command=self.prompt_command,
                mcp_command=self.mcp_command, on_line=self.on_line,
                max_output_bytes=self.max_output_bytes, max_line_events=self.max_line_events,
                grace=self.grace, on_output=self.on_output)
        except ConfigError as exc:
            raise _Fatal(f"sub-loop {st.loop}: {exc}") from None
        child.ancestors = chain
        end = await self._mode.subloop(self, st, child, ctx)
        verdict, terminated_by, child_error = end.verdict, end.terminated_by, end.error
        if (st.context_passthrough or st.with_) and child.captured:
            self.captured[st.name] = dict(child.captured)
        if st.capture:
            # little-loops: a sub-loop state's capture holds the child's outcome (its
            # output without trailing newlines, as an action's capture keeps it).
            self.captured[st.capture] = {
                "output": end.output.rstrip("\n"),
                "stderr": "", "exit_code": 0 if verdict.verdict == "yes" else 1,
                "duration_ms": 0, "verdict": verdict.verdict}
        # little-loops: how the child ended, under the state's name (after the
        # merges above, which replace the whole entry).
        outcome = self.captured.setdefault(st.name, {})
        if isinstance(outcome, dict):
            outcome["terminated_by"] = terminated_by
            if child.failure_terminal is not None:
                outcome["failure_terminal"] = True
            if terminated_by == "error" and child_error:
                outcome["error"] = child_error
        ctx.event("evaluate", name=st.name, payload={
            "state": st.name, "type": "loop", "verdict": verdict.verdict,
            "details": verdict.details, **self._mode.marks})
        return verdict

    async def _run_subloop(self, st: StateSpec, child: LoopAgent,
                           ctx: RunContext) -> SubloopEnd:
        """Run the child loop as a child run of this one; how it ended, as routes see it."""
        child_spec = child.spec
        info = RunInfo(name=child_spec.name, subject_id=f"loop:{child_spec.name}", inputs={
            "loop": child_spec.path, "parent_state": st.name,
            "context": {k: tpl.to_text(v) for k, v in child.context.items()}})
        limits = self._child_limits(child_spec, ctx, st.timeout)
        res = await _while_alive(ctx, ctx.run_child(child, info, limits))
        self.output = res.output if isinstance(res.output, str) else tpl.to_text(res.output)
        self._step_output = self.output
        status = res.status
        if status is Status.BUDGET_EXCEEDED:
            # Not a verdict unless the state routes it by name (`on_budget_exceeded`,
            # `route: {budget_exceeded: ...}`): the budget that refused the child (or
            # the usage limit it ran out of, which it inherited) is this run's too. A
            # usage cap of this run that the child used up ends this run now
            # (`report_usage` checks the caps, the child's usage counted, and cancels
            # the run at the checkpoint); any other refusal ends it `budget_exceeded`
            # naming the refusal, unless routed.
            ctx.report_usage(_NO_USAGE)
            await trio.lowlevel.checkpoint()
            if not _routes(st, "budget_exceeded"):
                why = res.error or "no reason given"
                if res.reason in _REFUSALS and res.steps == 0:  # (refused at its start)
                    raise _Refused(f"the budget refused sub-loop '{child_spec.name}' (a run "
                                   f"of its own, counted against the caller's budget): {why}")
                raise _Refused(f"sub-loop '{child_spec.name}' was stopped by the budget "
                               f"({res.reason or 'budget'}): {why}")
        terminated_by = ("terminal" if child.failure_terminal is not None else
                         _TERMINATED_BY.get(status, str(status)))
        if child.failure_terminal is not None:
            name = "no"  # little-loops: a child ending in a failure terminal is a `no`
        elif status is Status.BUDGET_EXCEEDED:
            name = "budget_exceeded"  # routed by name (above)
        elif status is Status.OK:
            name = "yes"
        elif status is Status.ERROR and st.has_error_route():
            name = "error"
        elif terminated_by in _CUT_OFF and _routes(st, "timeout"):
            name = "timeout"  # little-loops: cut off mid-work goes to on_timeout
        else:
            name = "no"
        verdict = ev.Evaluation(name, {"child_run_id": res.run_id,
                                       "child_status": str(status), "child_error": res.error,
                                       "child_reason": res.reason,
                                       "failure_terminal": child.failure_terminal,
                                       "terminated_by": terminated_by})
        return SubloopEnd(verdict, terminated_by, res.error, self.output)

    @staticmethod
    def _child_limits(child: LoopSpec, ctx: RunContext, state_timeout: float | None) -> Limits:
        """The child's own max_iterations and timeout (none only when neither the child's
        file nor this run has one).

        The `loop:` state's own `timeout` caps the child's (little-loops), so
        a child can be cut off while the parent still has time to route it
        (`on_timeout`).

        The parent's deadline bounds the child anyway (the child runs inside
        the parent's cancel scope, and is recorded `cancelled` when the parent
        runs out of time). A child whose file sets no timeout gets a backstop a
        little past the parent's *hard* one (`Limits.timeout`), so that when
        both would fire it is the parent that ends `timeout`, rather than the
        child ending first and the parent routing on a child timeout in the
        same instant. Not past the parent's current deadline (`ctx.deadline`):
        that one is the critic's, which it extends while the run progresses
        (`--soft-timeout`); a child given only that much was cut off `timeout`
        at the parent's first soft deadline, however well it was doing.
        """
        hard = ctx.limits.timeout
        timeout = child.timeout
        if timeout is None and hard is not None:
            timeout = max(ctx.started_at + hard - trio.current_time(), 0.0) + 1.0
        if state_timeout is not None:
            timeout = state_timeout if timeout is None else min(timeout, state_timeout)
        return Limits(max_steps=child.max_iterations, timeout=timeout, tool_timeout=None,
                      poll_interval=ctx.limits.poll_interval)

    def _load_child(self, st: StateSpec, ctx: RunContext) -> LoopSpec:
        from ._validate import load_loop, resolve_subloop

        assert st.loop is not None
        parent = Path(self.spec.path) if self.spec.path else Path.cwd() / "loop.yaml"
        ref = st.loop
        if "${" in ref:
            try:
                ref = tpl.render(ref, self._ns(ctx, st, None)).strip()
            except tpl.MissingVariable as exc:
                raise _Fatal(f"sub-loop {st.loop}: {exc}") from None
        path = resolve_subloop(parent, ref) if ref else None
        if path is None:
            from ._compose import not_a_file

            what = not_a_file(parent.parent, ref) if ref else ""
            raise _Fatal(f"sub-loop file '{ref}' not found{what}")
        try:
            return load_loop(path, context=self.context if st.context_passthrough else None)
        except ConfigError as exc:
            raise _Fatal(f"sub-loop {st.loop}: {exc}") from None

    async def _walk(self, ctx: RunContext, limit: int, sim: Simulation) -> bool | None:
        """Walk the machine under `sim`: True when it reached a terminal state,
        None when it ran out of steps first, False when it ended otherwise."""
        self._mode = sim
        self._runner_context()
        self._t0 = trio.current_time()
        self._begun = True
        final = self._settle(ctx)
        steps = 0
        while final is None:
            if steps >= limit:
                sim.out_of_steps(limit)
                return None
            step = await self._advance(ctx)
            steps += 1
            if step.final:
                final = step
        return sim.finished(self, final)

    # ------------------------------------------------------------- variables

    def _ns(self, ctx: RunContext, st: StateSpec,
            result: Mapping[str, Any] | None) -> tpl.Namespaces:
        elapsed = self._elapsed_ms()
        path = Path(self.spec.path).resolve() if self.spec.path else None
        context: Mapping[str, Any] = self.context
        captured: Mapping[str, Any] = self.captured
        prev = self.prev
        if self._mode.simulated:
            # A dry run has no real values: what is missing reads as a stand-in.
            context = tpl.StandIn("context", self.context)
            captured = tpl.StandIn("captured", self.captured)
            prev = tpl.StandIn("prev", self.prev)
        ns = tpl.Namespaces(
            context=context, captured=captured, prev=prev, result=result,
            state={"name": st.name, "iteration": self.iteration},
            loop={"name": self.spec.name, "elapsed_ms": int(elapsed),
                  "elapsed": _duration(elapsed), "started_at": self._started_iso,
                  "dir": str(path.parent) if path else os.getcwd(),
                  "file": str(path) if path else "", "run_id": ctx.run_id},
            env={**os.environ, **self.env}, dry=self._mode.simulated)
        if st.fragment is not None and (st.with_ or st.fragment_params):
            given = {k: self._param(v, ns) for k, v in st.with_.items()}
            try:
                ns.param = bind(st.fragment_params, given)
            except ValueError as exc:
                raise _Fatal(f"fragment '{st.fragment}': {exc}") from None
        return ns

    def _elapsed_ms(self) -> float:
        if not self._begun:
            return self.elapsed_offset_ms
        return self.elapsed_offset_ms + (trio.current_time() - self._t0) * 1000


# ------------------------------------------------------------------ helpers


def detect_signal(output: str) -> tuple[str, str] | None:
    """The first output signal line: ("handoff" | "error" | "stop", its text), or None."""
    for line in output.splitlines():
        stripped = line.strip()
        for marker, kind in SIGNALS.items():
            if stripped.startswith(marker):
                return kind, stripped[len(marker):].strip()
    return None


#: Evaluators that judge output, not exit status: a non-zero exit is `error` for them.
_OUTPUT_EVALUATORS = ("output_contains", "output_numeric", "output_json", "convergence")


def _mkdtemp(made: list[str]) -> str:
    """A private directory for values too large for the environment (removed after the action)."""
    made.append(tempfile.mkdtemp(prefix="kernel-loop-"))
    return made[-1]


# Linux: one argv/environment string may not exceed MAX_ARG_STRLEN (32 pages).
_MAX_ARG_STRLEN = 32 * 4096


def _pipeline_end(result: ActionResult) -> bool:
    """Whether the action died of SIGPIPE after the reader of its echo went away
    (`kernel run loop.yaml | head -1`): the end of a shell pipeline, its exit status
    (141) evaluated and routed like any other, not an interruption that stops the
    loop when the state has no error route (which other deaths by a signal are)."""
    return result.reader_gone and result.signal == signal.SIGPIPE


def _check_exec_size(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Fail the run, clearly, when the process could not be started for its size (E2BIG).

    Shell values never get here too large (see `tpl.spill`); a prompt, MCP
    parameters, a `:raw` value or the inherited environment can.
    """
    strings = [*argv, *(f"{k}={v}" for k, v in env.items())]
    sizes = [len(x.encode("utf-8", "surrogateescape")) + 1 for x in strings]
    biggest = max(range(len(strings)), key=sizes.__getitem__)
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        arg_max = 2 << 20
    total = sum(sizes) + 8 * (len(sizes) + 2)
    if sizes[biggest] > _MAX_ARG_STRLEN:
        what = (f"argument {biggest}" if biggest < len(argv)
                else f"environment variable {strings[biggest].partition('=')[0]}")
        raise _Fatal(f"the action cannot start: its {what} is "
                     f"{sizes[biggest]} bytes, over the system's {_MAX_ARG_STRLEN}-byte "
                     "limit for one argument")
    if total > arg_max - 4096:
        raise _Fatal(f"the action cannot start: its arguments and "
                     f"environment take {total} bytes, over the system's limit ({arg_max})")


#: little-loops' `terminated_by` for how a child run ended (a failure terminal
#: is "terminal" too); statuses it has no name for keep the kernel's.
_TERMINATED_BY = {Status.OK: "terminal", Status.ERROR: "error", Status.TIMEOUT: "timeout",
                  Status.MAX_STEPS: "max_steps", Status.HANDOFF: "handoff",
                  Status.CANCELLED: "interrupted", Status.KILLED: "killed",
                  Status.BUDGET_EXCEEDED: "budget_exceeded"}
#: A child run's `reason` when its budget check said no (or could not be made).
_REFUSALS = ("budget refused", "budget check failed")
#: The endings little-loops routes to `on_timeout`: the child was cut off mid-work.
_CUT_OFF = ("timeout", "max_steps")


async def _while_alive(ctx: RunContext, child: Awaitable[Result]) -> Result:
    """Await a child run, telling the critic every `_HEARTBEAT` second that this run is alive.

    A run waiting on its child does nothing itself: without a sign of life its
    critic judged it stalled (`--idle-timeout`) and killed it while the child
    worked. The child is watched on its own (a stalled child is killed, and
    this run routes that), and this run's deadline and kills still hold.
    """
    result: Result | None = None
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_heartbeat, ctx)
        try:
            result = await child
        except Exception as exc:  # (raised after the nursery: not as an ExceptionGroup)
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    assert result is not None
    return result


async def _heartbeat(ctx: RunContext) -> None:
    while True:
        await trio.sleep(_HEARTBEAT)
        ctx.activity("subloop")


def _routes(st: StateSpec, verdict: str) -> bool:
    """True when `st` names a route for `verdict` (`on_<verdict>` or the route table)."""
    return verdict in st.on or (st.route is not None and verdict in st.route.table)


def _missing_message(exc: tpl.MissingVariable, state: str) -> str:
    head = exc.name.split(".")
    if head[0] == "context":
        hint = f"; pass it with --context {head[1]}=VALUE"
    elif head[0] == "env":
        hint = "; set it in the environment or add :default=VALUE"
    else:
        hint = "; add :default=VALUE, or ? for empty"
    return f"missing variable ${{{exc.name}}} in state '{state}': {exc.why}{hint}"


def _duration(ms: float) -> str:
    seconds = int(ms // 1000)
    if seconds < 1:
        return f"{int(ms)}ms"
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m {seconds}s" if seconds else f"{minutes}m"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _mapping(value: Any) -> Mapping[Any, Any]:
    return value if isinstance(value, Mapping) else {}


def _resolved(path: str) -> str:
    """A loop file's path as one spelling (cycles are found by comparing them)."""
    return str(Path(path).resolve()) if path else ""
