"""`CLIAgent`: a CLI coding agent run as a subprocess streaming JSON events.

One invocation of the CLI (prompt in, result out) is one kernel step.
Inside the step, every stdout line is parsed into events that drive the
`StateMachine`, feed the critic (`ctx.event` counts as activity) and are
audited with the state and lifecycle in their payload, so `kernel show`
tells what the agent was doing at each moment::

    step(ctx)
      spawn (own process group)        lifecycle spawning, audit process_start
      read stdout lines -> events      audit agent_event / tool_start / tool_end
      idle watchdog                    no event for idle_ttl -> SIGTERM/SIGKILL the group
      approval watchdog                waiting for approval longer than approval_ttl -> same
      session id reported              -> ctx.checkpoint() (the session is the checkpoint)
      idle after a done/error event    for exit_grace seconds -> the CLI is stopped
      process gone                     lifecycle killed, audit process_exit
      -> Step(output=result, final=True, usage=...)   or   Step(final=True, error=...)

How the step ends: the last done/error event decides when there is one (a
CLI that reported success and then exited non-zero is still ok; the exit
code is kept). A `retry` event (a CLI retrying a failed request by itself)
or more work after an error event means the turn goes on. Without an end
event, exit 0 is ok (the text streamed so far is the output) and anything
else is a crash mid-turn: `error`, naming the state the agent was in and its
last stderr line. An idle kill ends the run `killed` (`stalled`); a wait for
approval past `approval_ttl` ends it `killed` (`awaiting_approval`), and
while the CLI waits for a person the critic is told it is alive.

`SessionCLIAgent` adds resumption: its `snapshot()` is the CLI's session id,
saved as soon as the CLI reports it, and a resumed run starts the CLI's own
resume command (`claude --resume ID`, `codex exec resume ID`) instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from kernel import Message, RunContext, Step, ToolCall, ToolResult, Usage

from .._proc import Child, cannot_start, pump_lines, spawn
from ._events import AgentEvent, EventType, parse_line
from ._state import Lifecycle, State, StateMachine, Transition

#: Called after each event is applied, e.g. to refresh a live progress line.
EventHook = Callable[[AgentEvent, Transition], None]


@dataclass
class CLIAgent:
    """Runs a CLI agent once, supervised, following its event stream.

    Args:
        argv: The command line, e.g. `["claude", "-p", "...", "--output-format",
            "stream-json", "--verbose"]` or `["codex", "exec", "--json", "..."]`.
        cwd: Working directory (default: the current one).
        env: Extra environment variables, added to the inherited environment.
        idle_ttl: Seconds without any event (stdout or stderr line) after which
            the process group is killed.
        start_ttl: Seconds the CLI may take from the spawn to its first event
            (a node CLI can take many seconds to start on a loaded machine);
            None: the larger of `idle_ttl` and 120 s.
        exit_grace: Seconds the CLI may take to exit after its done/error event.
        grace: Seconds between SIGTERM and SIGKILL when stopping the group.
        max_line_bytes: Longer stdout lines are cut (and then read as unknown).
        max_audit_events: Agent events written to the audit; after that they
            only count as activity for the critic (the step event gives totals).
        max_text: Characters of text/input/output kept per audited event.
        stdin_steer: Write critic nudges to stdin as stream-json user messages
            (for CLIs started with `--input-format stream-json`); otherwise
            stdin is /dev/null and nudges are audited as undeliverable.
        stdin_prompt: Send the task itself as the first stream-json user
            message on stdin (instead of on the command line). Stdin is closed
            once the CLI has answered every message written, so it exits.
        approval_ttl: Seconds the CLI may wait for a tool approval (state
            waiting_for_approval) before it is stopped, ending the run
            `killed` with reason `awaiting_approval`.
        client: The client's name ("claude", "codex", "gemini"; "" for any CLI).
        resume_argv: Builds the command line that continues session ID
            (`SessionCLIAgent` uses it when the run is resumed).
        resume_prompt: What the resumed CLI is told (stdin or last argument,
            as `resume_argv` decides).
        on_event: Called after every event with the transition it caused.

    Attributes:
        machine: The runtime state machine (state, lifecycle, last_active).
    """

    argv: Sequence[str]
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    idle_ttl: float = 600.0
    start_ttl: float | None = None
    exit_grace: float = 5.0
    grace: float = 2.0
    max_line_bytes: int = 8 << 20
    max_audit_events: int = 10_000
    max_text: int = 2000
    stdin_steer: bool = False
    stdin_prompt: str | None = None
    approval_ttl: float = 600.0
    client: str = ""
    resume_argv: Callable[[str], Sequence[str]] | None = None
    resume_prompt: str = ("Continue the task. You were interrupted; check what is already "
                          "done before redoing it.")
    on_event: EventHook | None = None
    machine: StateMachine = field(init=False)

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("CLIAgent needs a command to run")
        if self.idle_ttl <= 0:
            raise ValueError(f"idle_ttl must be > 0, got {self.idle_ttl}")
        if self.start_ttl is not None and self.start_ttl <= 0:
            raise ValueError(f"start_ttl must be > 0, got {self.start_ttl}")
        self._start_ttl = (self.start_ttl if self.start_ttl is not None
                           else max(self.idle_ttl, 120.0))
        if self.approval_ttl <= 0:
            raise ValueError(f"approval_ttl must be > 0, got {self.approval_ttl}")
        self.machine = StateMachine(now=trio.current_time)
        self._reset()

    def _reset(self) -> None:
        self._ctx: RunContext | None = None
        self._proc: Child | None = None
        self._audited = 0
        self._counts: dict[str, int] = {}
        self._fragments: list[str] = []
        self._last_whole: str | None = None
        self._terminal: AgentEvent | None = None
        self._usage = Usage()
        self._session = ""
        self._tool_started: dict[str, tuple[str, float]] = {}
        self._stderr: deque[str] = deque(maxlen=20)
        self._done = trio.Event()
        self._idle_killed: float | None = None
        self._never_started = False
        self._approval_killed: tuple[str, float] | None = None
        self._waiting_tool = ""
        self._lingered = False
        self._cache_read = 0
        self._cache_write = 0
        self._inputs = 0
        self._ends = 0
        self._stdin_open = False
        self._stdin_done = trio.Event()
        self._session_seen = trio.Event()
        self._resumed_session = ""
        self._msgs: dict[str, tuple[int, int, int, int]] = {}
        self._reported = Usage()  # what `ctx.report_usage` has been told this step
        self._current_msg = ""
        self._stdin_error = ""

    @property
    def command(self) -> str:
        """The command line, shell-quoted, for display."""
        return shlex.join(self.argv)

    async def simulate(self, ctx: RunContext) -> str:
        """A dry run reports what would be executed."""
        return f"would run agent CLI: {self.command}"

    # ------------------------------------------------------------------ step

    def _launch(self, ctx: RunContext) -> tuple[list[str], str | None]:
        """The command line and stdin prompt: a resumed session's, or the task's."""
        state = ctx.resumed_from
        sid = _dict_get(state, "session_id")
        if sid and self.resume_argv is not None:
            self._resumed_session = self._session = sid
            argv = list(self.resume_argv(sid))
            ctx.event("resume_session", name=self.client or self.argv[0], activity=False,
                      payload={"session_id": sid, "argv": argv})
            return argv, self.resume_prompt if self.stdin_prompt is not None else None
        if state is not None:
            ctx.event("resume_session", name=self.client or self.argv[0], activity=False,
                      payload={"session_id": None, "why": "no session was reported before "
                               "the interruption: starting the task again"})
        return list(self.argv), self.stdin_prompt

    async def step(self, ctx: RunContext) -> Step:
        """Run the CLI to completion (or to its idle kill) and report how it ended."""
        self._reset()
        self._ctx = ctx
        m = self.machine
        env = {**os.environ, **self.env} if self.env else None
        argv, first_input = self._launch(ctx)
        piped = self.stdin_steer or first_input is not None
        m.mark_spawning()
        try:
            proc = await spawn(argv, cwd=self.cwd, env=env, stdin_pipe=piped)
        except OSError as exc:
            m.mark_killed()
            error, code = cannot_start(argv[0], exc, self.cwd)
            return Step(final=True, name="agentcli", error=error, exit_code=code)
        self._proc = proc
        self._stdin_open = piped
        t0 = trio.current_time()
        ctx.event("process_start", name=argv[0], payload={
            "argv": argv, **proc.record(), **self._views()})
        ctx.process_started(proc.pid)  # the critic samples the CLI's process tree
        finished = False
        try:
            async with trio.open_nursery() as nursery:
                assert proc.stdout is not None and proc.stderr is not None
                out_done, err_done = trio.Event(), trio.Event()
                # The pumps and the watchdog first: a CLI that does not read its
                # stdin (or exits at once) must not leave the step blocked in a
                # write with no idle clock running and its stderr unread.
                nursery.start_soon(self._pump, proc.stdout, self._stdout_line, out_done)
                nursery.start_soon(self._pump, proc.stderr, self._stderr_line, err_done)
                nursery.start_soon(self._watchdog, proc)
                nursery.start_soon(self._stop_after_done, proc)
                nursery.start_soon(self._save_session, ctx)
                if piped:
                    nursery.start_soon(self._send_first, first_input, list(ctx.steer))
                    nursery.start_soon(self._close_stdin_when_answered, proc)
                elif ctx.steer:
                    nursery.start_soon(self.on_steer, list(ctx.steer))
                await proc.wait()
                # The pipes may still hold the last lines, or be held open by
                # children the CLI left behind: read briefly, then stop them.
                with trio.move_on_after(0.5):
                    await out_done.wait()
                    await err_done.wait()
                nursery.cancel_scope.cancel()
            finished = True
        finally:
            with trio.CancelScope(shield=True):
                await self._terminate(proc)
            ctx.process_exited(proc.pid)
            self._proc = None
            state_at_exit = m.state
            m.mark_killed()
            m.mark_idle()
            rc = proc.returncode
            if not finished and rc is not None:  # the run stopped it mid-step
                ctx.event("process_exit", name=argv[0],
                          duration_ms=(trio.current_time() - t0) * 1000, payload={
                              "exit_code": rc if rc >= 0 else 128 - rc,
                              "signal": -rc if rc < 0 else None, "state_at_exit": state_at_exit,
                              "stopped": True})
            # What the model used, on record however the step ends: a run killed,
            # timed out or cancelled mid-step returns no Step to carry it.
            ctx.event("usage", name=self.client or argv[0], activity=False,
                      payload={**self._usage_record(), "stopped": not finished})
        return self._outcome(ctx, proc, state_at_exit, trio.current_time() - t0)

    def _outcome(self, ctx: RunContext, proc: Child, state_at_exit: str,
                 duration_s: float) -> Step:
        rc = proc.returncode
        assert rc is not None
        exit_code = rc if rc >= 0 else 128 - rc
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        ctx.event("process_exit", name=self.argv[0], duration_ms=duration_s * 1000, payload={
            "exit_code": exit_code, "signal": -rc if rc < 0 else None,
            "state_at_exit": state_at_exit, "idle_killed": self._idle_killed is not None,
            "approval_killed": self._approval_killed is not None,
            "stopped_after_done": self._lingered, **self._views()})
        term = self._terminal
        payload: dict[str, Any] = {
            "exit_code": exit_code, "events": dict(self._counts), "session_id": self._session,
            "state_at_exit": state_at_exit, "client": self.client,
            "cache_read_tokens": self._cache_read + sum(m[2] for m in self._msgs.values()),
            "cache_write_tokens": self._cache_write + sum(m[3] for m in self._msgs.values()),
            **self._views()}
        if self._resumed_session:
            payload["resumed_session"] = self._resumed_session
        rest = self._unreported()  # the rest was reported as it streamed
        usage = rest if rest else None
        if self._approval_killed is not None:
            tool, waited = self._approval_killed
            return Step(final=True, name="agentcli", exit_code=exit_code, usage=usage,
                        output=self._text(), payload={**payload, "approval_killed": True},
                        kill="awaiting_approval",
                        error=f"agent CLI waited {waited:.1f}s for approval of "
                              f"{tool or 'a tool'} (approval TTL {self.approval_ttl:g}s): "
                              "killed")
        if self._idle_killed is not None:
            error = (f"agent CLI produced no event in {self._idle_killed:.1f}s after its start "
                     f"(start TTL {self._start_ttl:g}s): killed" if self._never_started else
                     f"agent CLI idle for {self._idle_killed:.1f}s with no events "
                     f"(idle TTL {self.idle_ttl:g}s, state {state_at_exit}): killed")
            return Step(final=True, name="agentcli", exit_code=exit_code, usage=usage,
                        output=self._text(), payload={**payload, "idle_killed": True},
                        kill="stalled", error=error)
        if term is not None and term.type is EventType.DONE:
            return Step(output=self._text(), final=True, name="agentcli", exit_code=exit_code,
                        usage=usage, payload=payload)
        if term is not None:
            return Step(output=self._text(), final=True, name="agentcli", exit_code=exit_code,
                        usage=usage, payload=payload,
                        error=f"agent CLI reported an error: {term.text or term.source}")
        tail = " | ".join(list(self._stderr)[-3:])
        if self._stdin_error:
            # It never read its task: whatever its exit code, nothing was done.
            return Step(output=self._text(), final=True, name="agentcli", exit_code=exit_code,
                        usage=usage, payload=payload,
                        error=f"agent CLI {how} before reading its input "
                              f"({self._stdin_error})" + (f": {tail}" if tail else ""))
        if rc == 0:
            return Step(output=self._text(), final=True, name="agentcli", exit_code=0,
                        usage=usage, payload=payload)
        return Step(output=self._text(), final=True, name="agentcli", exit_code=exit_code,
                    usage=usage, payload=payload,
                    error=f"agent CLI {how} mid-turn (state {state_at_exit}, no result event)"
                          + (f": {tail}" if tail else ""))

    def _text(self) -> str:
        term = self._terminal
        if term is not None and term.type is EventType.DONE and term.text:
            return term.text
        if self._last_whole is not None:
            return self._last_whole
        return "".join(self._fragments)

    def _views(self) -> dict[str, str]:
        return {"state": str(self.machine.state), "lifecycle": str(self.machine.lifecycle)}

    def _unreported(self) -> Usage:
        """What the model used this step that `ctx.report_usage` was not told yet (a
        closing report below what was streamed counts nothing back)."""
        total, r = self._total_usage(), self._reported
        return Usage(max(total.input_tokens - r.input_tokens, 0),
                     max(total.output_tokens - r.output_tokens, 0),
                     max(total.thinking_tokens - r.thinking_tokens, 0),
                     max(total.cost_usd - r.cost_usd, 0.0))

    def _report_usage(self) -> None:
        """Tell the kernel what the model used since the last report, as it streams: the
        run's usage caps and its caller's budget then stop a CLI agent mid-session."""
        ctx = self._ctx
        report = getattr(ctx, "report_usage", None)  # a host's own context may lack it
        delta = self._unreported()
        if report is None or not delta:
            return
        self._reported = self._reported + delta
        report(delta)

    def _streamed_usage(self) -> Usage:
        """What the model messages streamed since the last closing usage report used."""
        msgs = self._msgs.values()
        return Usage(input_tokens=sum(m[0] for m in msgs),
                     output_tokens=sum(m[1] for m in msgs)) if msgs else Usage()

    def _total_usage(self) -> Usage:
        """The closing reports' usage, plus what was streamed since the last of them."""
        return self._usage + self._streamed_usage() if self._msgs else self._usage

    def _usage_record(self) -> dict[str, Any]:
        """The usage so far, for the audit: tokens, cache, cost and where they come from."""
        total = self._total_usage()
        return {"input_tokens": total.input_tokens, "output_tokens": total.output_tokens,
                "cache_read_tokens": self._cache_read + sum(m[2] for m in self._msgs.values()),
                "cache_write_tokens": self._cache_write + sum(m[3] for m in self._msgs.values()),
                "cost_usd": total.cost_usd,
                # Streamed figures are tokens only: a client reports its cost at the end.
                "streamed_messages": len(self._msgs), "final_report": not self._msgs}

    def _message_usage(self, ev: AgentEvent) -> bool:
        """Take a model message's usage so far; True if it changed the figures."""
        u = ev.message_usage
        assert u is not None
        if ev.message_id:
            self._current_msg = ev.message_id
        mid = ev.message_id or self._current_msg or "?"
        old = self._msgs.get(mid, (0, 0, 0, 0))
        new = (max(old[0], u.input_tokens), max(old[1], u.output_tokens),
               max(old[2], ev.cache_read), max(old[3], ev.cache_write))
        if new == old:
            return False
        self._msgs[mid] = new
        return True

    def _model_flight(self, ev: AgentEvent) -> None:
        """Tell the critic when a model request is in flight, as the LLM adapter does.

        A request goes out when the session starts, after a tool's result, after a
        retry notice and after a prompt is echoed back; streamed tokens keep it alive;
        it is over when the reply asks for a tool or approval, or the turn ends.
        The critic's `model_timeout` then bounds a hung stream.
        """
        ctx = self._ctx
        if ctx is None:
            return
        t, src = ev.type, ev.source
        if t in (EventType.SESSION_START, EventType.TOOL_RESULT, EventType.RETRY) or src in (
                "user/prompt", "message/user", "turn.started"):
            ctx.activity("model_request")
        elif t in (EventType.TOOL_USE, EventType.APPROVAL, EventType.DONE, EventType.ERROR) or (
                src == "stream_event/message_stop"):
            ctx.activity("model_call")
        elif src.startswith("stream_event/") or t in (EventType.THINKING,
                                                       EventType.TEXT_DELTA):
            ctx.activity("model_token")

    # ---------------------------------------------------------------- events

    def _stdout_line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace")
        for ev in parse_line(line):
            self._apply(ev)

    def _stderr_line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            return
        self._stderr.append(line[: self.max_text])
        # stderr is output too: the agent is alive, but its state is unchanged.
        self.machine.apply(EventType.UNKNOWN)
        self._audit("output", name="stderr",
                    payload={"line": line[: self.max_text], **self._views()})

    def _apply(self, ev: AgentEvent) -> None:
        tr = self.machine.apply(ev)
        self._counts[ev.type.value] = self._counts.get(ev.type.value, 0) + 1
        now = trio.current_time()
        payload: dict[str, Any] = {"event": ev.type.value, "source": ev.source,
                                   **self._views()}
        if tr.state_from is not tr.state_to:
            payload["from"] = str(tr.state_from)
        kind, name, duration_ms = "agent_event", ev.type.value, None
        if ev.type is EventType.TOOL_USE:
            kind, name = "tool_start", ev.tool or "tool"
            payload.update(args=_clip_json(ev.input, self.max_text), id=ev.tool_id)
            if ev.tool_id:
                self._tool_started[ev.tool_id] = (name, now)
        elif ev.type is EventType.TOOL_RESULT:
            started = self._tool_started.pop(ev.tool_id, None)
            kind, name = "tool_end", ev.tool or (started[0] if started else "tool")
            if started is not None:
                duration_ms = (now - started[1]) * 1000
            payload.update(id=ev.tool_id, output=ev.text[: self.max_text],
                           error=ev.text[: self.max_text] if ev.is_error else None)
        elif ev.type is EventType.APPROVAL:
            kind, name = "approval", ev.tool or "tool"
            payload.update(id=ev.tool_id, denied=ev.is_error, text=ev.text[: self.max_text],
                           args=_clip_json(ev.input, self.max_text))
            if not ev.is_error:
                self._waiting_tool = name
        elif ev.text:
            payload["text"] = ev.text[: self.max_text]
        if ev.type is EventType.TEXT_DELTA:
            if ev.whole:
                self._last_whole = ev.text
            else:
                self._fragments.append(ev.text)
        if ev.session_id and ev.session_id != self._session:
            self._session = ev.session_id
            self._session_seen.set()
        if ev.usage:
            payload["usage"] = {"input_tokens": ev.usage.input_tokens,
                                "output_tokens": ev.usage.output_tokens,
                                "cache_read_tokens": ev.cache_read,
                                "cache_write_tokens": ev.cache_write,
                                "cost_usd": ev.usage.cost_usd}
            self._usage = self._usage + ev.usage
            self._cache_read += ev.cache_read
            self._cache_write += ev.cache_write
            self._msgs.clear()  # the closing report covers the messages streamed before it
        elif ev.message_usage is not None and self._message_usage(ev):
            mu = ev.message_usage
            payload["message_usage"] = {"message_id": ev.message_id or self._current_msg,
                                        "input_tokens": mu.input_tokens,
                                        "output_tokens": mu.output_tokens,
                                        "cache_read_tokens": ev.cache_read,
                                        "cache_write_tokens": ev.cache_write}
            payload["usage_so_far"] = self._usage_record()
        report = ev.usage or ev.message_usage is not None
        if ev.type in (EventType.DONE, EventType.ERROR):
            self._terminal = ev
            self._ends += 1
            self._done.set()
            self._stdin_done.set()
        if ev.type is EventType.TOOL_USE:
            self._model_flight(ev)  # the reply is over before the tool is in flight
            self._audit(kind, name=name, payload=payload, duration_ms=duration_ms)
        else:
            self._audit(kind, name=name, payload=payload, duration_ms=duration_ms)
            self._model_flight(ev)
        if report:
            # Last: a usage cap this exceeds ends the run here (its scope cancelled).
            self._report_usage()
        if self.on_event is not None:
            self.on_event(ev, tr)

    def _audit(self, kind: str, *, name: str, payload: Mapping[str, Any],
               duration_ms: float | None = None) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        if kind == "tool_start":
            # Through the kernel: counted, audited, and seen by the critic's loop check.
            self._audited += 1
            args = payload.get("args")
            call = ToolCall(name, args if isinstance(args, Mapping) else {"input": args},
                            str(payload.get("id") or ""))
            ctx.tool_start(call, payload={k: v for k, v in payload.items()
                                          if k not in ("args", "id")})
        elif self._audited < self.max_audit_events or kind == "tool_end":
            self._audited += 1
            text = payload.get("text")
            ctx.event(kind, name=name, payload=payload, duration_ms=duration_ms,
                      text=text if isinstance(text, str) else None)
            if kind == "tool_end":
                # The outcome, so the critic tells a loop (same call, same result)
                # from a poll whose answer changes.
                out, err = payload.get("output"), payload.get("error")
                ctx.tool_end(ToolResult(ToolCall(name, {}, str(payload.get("id") or "")),
                                        output=out, error=err if isinstance(err, str) else None))
        else:
            text = payload.get("text")
            ctx.activity(kind, text if isinstance(text, str) else None)

    # ------------------------------------------------------------ processes

    async def _pump(self, stream: trio.abc.ReceiveStream, sink: Callable[[bytes], None],
                    done: trio.Event) -> None:
        # A line with no end in sight is handed on cut to max_line_bytes, the rest dropped.
        try:
            await pump_lines(stream, lambda raw, _cut: sink(raw), max_line=self.max_line_bytes)
        finally:
            done.set()

    async def _watchdog(self, proc: Child) -> None:
        """Kill the group after `idle_ttl` s without events, or `approval_ttl` s of waiting.

        While the CLI waits for an approval it is silent on purpose: the critic
        is told it is alive (activity `waiting_for_approval`, once a second),
        and only the approval bound applies.
        """
        m = self.machine
        while True:
            last = m.last_active
            assert last is not None  # mark_spawning set it
            waiting = m.state is State.WAITING_APPROVAL
            ttl = (self.approval_ttl if waiting
                   else self._start_ttl if m.lifecycle is Lifecycle.SPAWNING else self.idle_ttl)
            now = trio.current_time()
            if now - last >= ttl:
                break
            if waiting and self._ctx is not None:
                self._ctx.activity("waiting_for_approval")
            await trio.sleep_until(min(last + ttl, now + 1.0))
        if m.state is State.WAITING_APPROVAL:
            waited = m.idle_for()
            self._approval_killed = (self._waiting_tool, waited)
            if self._ctx is not None:
                self._ctx.event("approval_timeout", name=self._waiting_tool or "tool",
                                activity=False, payload={
                                    "waited_s": round(waited, 3),
                                    "approval_ttl": self.approval_ttl, **self._views()})
            await self._terminate(proc)
            return
        self._idle_killed = m.idle_for()
        self._never_started = m.lifecycle is Lifecycle.SPAWNING
        if self._ctx is not None:
            self._ctx.event("idle_kill", name=self.argv[0], activity=False, payload={
                "idle_s": round(self._idle_killed, 3), "idle_ttl": self.idle_ttl,
                "before_first_event": self._never_started, **self._views()})
        await self._terminate(proc)

    async def _stop_after_done(self, proc: Child) -> None:
        """Stop a CLI that stays idle for `exit_grace` seconds after its done/error event.

        A CLI that carries on after an error event (a transient "reconnecting"
        error) is back to working, and the countdown waits for the next end.
        The task is cancelled as soon as the process exits by itself.
        """
        m = self.machine
        while True:
            await self._done.wait()
            while m.lifecycle is Lifecycle.IDLE:
                last = m.last_active
                assert last is not None
                if trio.current_time() - last >= self.exit_grace:
                    self._lingered = True
                    await self._terminate(proc)
                    return
                await trio.sleep_until(last + self.exit_grace)
            self._done = trio.Event()

    async def _save_session(self, ctx: RunContext) -> None:
        """Checkpoint as soon as the CLI reports a (new) session id: it is what resumes."""
        while True:
            await self._session_seen.wait()
            self._session_seen = trio.Event()
            await ctx.checkpoint()

    async def _close_stdin_when_answered(self, proc: Child) -> None:
        """Close stdin once every user message written has had its result: the CLI exits."""
        while True:
            await self._stdin_done.wait()
            self._stdin_done = trio.Event()
            if self._ends >= self._inputs and proc.stdin is not None:
                self._stdin_open = False
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await proc.stdin.aclose()
                return

    async def _send_first(self, first_input: str | None, steer: list[Message]) -> None:
        """Write the task (and nudges already queued) to stdin, once the pumps run.

        A CLI that exits, or closes its stdin, before reading it is not an error
        of ours: the write failing is noted, and the step ends on the CLI's exit
        code and stderr.
        """
        try:
            if first_input is not None:
                await self._write_user(first_input)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._stdin_error = (f"its stdin was closed before the task was written: "
                                 f"{type(exc).__name__}")
            self._stdin_open = False
            return
        if steer:
            await self.on_steer(steer)

    async def _write_user(self, text: str) -> None:
        """Write one stream-json user message to the CLI's stdin."""
        proc = self._proc
        if proc is None or proc.stdin is None or not self._stdin_open:
            raise trio.ClosedResourceError("stdin is closed")
        line = json.dumps({"type": "user", "session_id": "", "parent_tool_use_id": None,
                           "message": {"role": "user",
                                       "content": [{"type": "text", "text": text}]}})
        self._inputs += 1
        await proc.stdin.send_all(line.encode() + b"\n")

    async def _terminate(self, proc: Child) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, and reap the CLI."""
        await proc.stop(self.grace)

    async def on_steer(self, messages: list[Message]) -> None:
        """Write nudges to stdin (stream-json user messages) when enabled, else audit them."""
        ctx, proc = self._ctx, self._proc
        why = "the agent CLI's stdin is not a stream-json input"
        if self.stdin_steer and proc is not None and not self._stdin_open:
            why = "the agent CLI has answered and its stdin is closed"
        if self.stdin_steer and proc is not None and self._stdin_open:
            try:
                for m in messages:
                    await self._write_user(m.content)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                why = "the agent CLI's stdin is closed"
            else:
                if ctx is not None:
                    ctx.event("steer_delivered", activity=False, payload={
                        "messages": [m.content for m in messages], "via": "stdin"})
                return
        if ctx is not None:
            ctx.event("steer_undeliverable", payload={  # the critic: not delivered
                "messages": [m.content for m in messages], "why": why})


def _clip_json(value: Any, limit: int) -> Any:
    """`value` as is if its JSON is short, else its JSON text cut to `limit`."""
    if value is None:
        return None
    text = json.dumps(value, default=str)
    return value if len(text) <= limit else text[:limit] + "…"


def _dict_get(state: Any, key: str) -> str:
    value = state.get(key) if isinstance(state, Mapping) else None
    return value if isinstance(value, str) else ""


@dataclass
class SessionCLIAgent(CLIAgent):
    """An `CLIAgent` whose session id is its checkpoint, so `kernel recover` resumes it.

    Needs `resume_argv`. The kernel saves `snapshot()` as soon as the CLI
    reports its session id (and after the step); a resumed run runs
    `resume_argv(session_id)` with `resume_prompt`, continuing the same
    client session rather than starting the task again.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resume_argv is None:
            raise ValueError("SessionCLIAgent needs resume_argv")

    def snapshot(self) -> dict[str, Any]:
        """The resumable state: which client, and its session id."""
        return {"version": 1, "client": self.client, "session_id": self._session}
