"""`kernel show RUN_ID --html FILE` and `kernel report FILE`: timelines as self-contained HTML.

`render(run, events)` takes the run's row and its events as plain data (the
shapes `kernel show --json` prints) and returns the page: inline CSS, inline
SVG and a few lines of inline JavaScript; no network, no server. It draws

- a Gantt chart: the loop's states, the steps, actions / tool calls / model
  calls as bars on their own lanes, with the critic's decisions (nudges,
  extensions, the kill) as vertical markers and the run's end;
- the output rate (lines per second, from `output` events);
- usage over time (cumulative steps, tool calls and tokens).

`render_report(runs, since, until)` makes the page of a time range: an
overview with one bar per run from its start to its end (coloured by
status, critic kills marked), the counts by status, then each run's own
Gantt chart as `render` draws it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape
from typing import Any

WIDTH = 1100
LABEL = 120
PLOT = WIDTH - LABEL - 20
LANE = 26
BUCKETS = 60
PALETTE = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#bab0ac", "#f28e2b", "#86bcb6")
CRITIC_CLASS = {"steer": "critic-nudge", "kill": "critic-kill"}
DAY_MS = 86_400_000.0

#: What an HTML page may not hold as text: control characters other than ASCII
#: whitespace (NUL, ESC, DEL, C1; each a parse error, NUL read as U+FFFD anyway) and
#: lone surrogates (not UTF-8 at all: the page could not even be written).
_NOT_HTML = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def _clean(page: str) -> str:
    """`page` with every character HTML may not hold as U+FFFD (the replacement character).

    Run names, state names, tool names and errors come from commands, YAML
    files and models: whatever they hold, the page stays valid HTML that can
    be written as UTF-8. Done once on the finished page: escaping never
    makes such a character, so the result is the same as cleaning each value.
    """
    return _NOT_HTML.sub("\ufffd", page)


def _number(value: Any) -> float:
    """`value` as a finite float; 0.0 for None, NaN, an infinity or anything not a number.

    Times and counts come from stored rows and payloads: one that is not a
    finite number (a row written by another tool) must neither stretch the
    time axis to infinity (its ticks would never end) nor stop the page.
    """
    try:
        number = float(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def _ms(event: Mapping[str, Any], t0: float) -> float:
    if event.get("offset_ms") is not None:
        return _number(event["offset_ms"])
    ts = event.get("ts")
    if isinstance(ts, datetime):
        return ts.timestamp() * 1000 - t0
    return _number(ts) * 1000 - t0


def _payload(event: Mapping[str, Any]) -> dict[str, Any]:
    raw = event.get("payload")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return dict(raw) if isinstance(raw, Mapping) else {}


def _short(value: Any, width: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


class _Bar:
    __slots__ = ("cls", "detail", "end", "label", "lane", "start")

    def __init__(self, lane: str, start: float, end: float, label: str, detail: str,
                 cls: str) -> None:
        self.lane, self.start, self.end = lane, start, max(end, start)
        self.label, self.detail, self.cls = label, detail, cls


def _bars(events: Sequence[Mapping[str, Any]], t0: float, end_ms: float) -> list[_Bar]:
    """Bars for states (until the next state), steps, actions, tool calls, model calls."""
    bars: list[_Bar] = []
    state: tuple[str, float, dict[str, Any]] | None = None
    open_actions: list[tuple[float, dict[str, Any]]] = []
    open_tools: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for e in events:
        kind, at, payload = e.get("kind"), _ms(e, t0), _payload(e)
        name = str(e.get("name") or "")
        if kind == "state_enter":
            if state is not None:
                bars.append(_Bar("states", state[1], at, state[0], _short(state[2]), "state"))
            state = (str(payload.get("state") or name or "?"), at, payload)
        elif kind == "step":
            dur = _number(e.get("duration_ms"))
            bars.append(_Bar("steps", at - dur, at, name or f"step {e.get('iteration', '')}",
                             f"{dur:.0f} ms", "step"))
        elif kind == "action_start":
            open_actions.append((at, payload))
        elif kind == "action_end":
            start, began = open_actions.pop(0) if open_actions else (
                at - _number(e.get("duration_ms")), {})
            label = str(began.get("state") or payload.get("state") or name)
            detail = f"{_short(began.get('action', ''), 120)} → exit {payload.get('exit_code')}"
            bars.append(_Bar("actions", start, at, label, detail, "action"))
        elif kind == "tool_start":
            open_tools.setdefault(name, []).append((at, payload))
        elif kind == "tool_end":
            waiting = open_tools.get(name)
            start, _ = waiting.pop(0) if waiting else (at - _number(e.get("duration_ms")), {})
            failed = " tool-error" if payload.get("error") else ""
            bars.append(_Bar("tools", start, at, name, _short(payload.get("error") or
                                                              payload.get("output") or ""),
                             "tool" + failed))
        elif kind == "model_call":
            dur = _number(e.get("duration_ms"))
            tokens = f"{payload.get('input_tokens', 0)} in / {payload.get('output_tokens', 0)} out"
            bars.append(_Bar("model calls", at - dur, at, str(payload.get("model") or name),
                             tokens, "model"))
    if state is not None:
        bars.append(_Bar("states", state[1], end_ms, state[0], _short(state[2]), "state"))
    for start, began in open_actions:  # still running when the run ended (killed)
        bars.append(_Bar("actions", start, end_ms, str(began.get("state") or "action"),
                         "did not finish", "action unfinished"))
    for tool, waiting in open_tools.items():
        for start, _ in waiting:
            bars.append(_Bar("tools", start, end_ms, tool, "did not finish", "tool unfinished"))
    return bars


def render(run: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
    """The whole HTML page for one run (its row and its events in seq order)."""
    gantt, t0, end_ms = _gantt(run, events, "timeline")
    return _page(run, gantt, _rate_chart(events, t0, end_ms), _usage_chart(events, t0, end_ms))


def _gantt(run: Mapping[str, Any], events: Sequence[Mapping[str, Any]],
           svg_id: str) -> tuple[str, float, float]:
    """The run's Gantt chart as an SVG element, its time origin (ms) and its length (ms)."""
    started = run.get("started_at")
    t0 = started.timestamp() * 1000 if isinstance(started, datetime) else 0.0
    if not isinstance(started, datetime) and events:
        first = events[0].get("ts")
        t0 = first.timestamp() * 1000 if isinstance(first, datetime) else 0.0
    runtime_ms = _number(run.get("runtime_seconds")) * 1000
    last_ms = max([_ms(e, t0) for e in events] or [0.0])
    end_ms = max(runtime_ms, last_ms, 1.0)
    scale = PLOT / end_ms

    def x(ms: float) -> float:
        return LABEL + max(0.0, min(ms, end_ms)) * scale

    bars = _bars(events, t0, end_ms)
    lanes = [lane for lane in ("states", "steps", "actions", "tools", "model calls")
             if any(b.lane == lane for b in bars)]
    colours: dict[str, str] = {}
    parts: list[str] = []
    height = 30 + LANE * max(len(lanes), 1) + 30
    for i, lane in enumerate(lanes):
        y = 30 + i * LANE
        parts.append(f'<text class="lane-label" x="{LABEL - 8}" y="{y + 17}" '
                     f'text-anchor="end">{escape(lane)}</text>')
        parts.append(f'<line class="lane-rule" x1="{LABEL}" x2="{LABEL + PLOT}" '
                     f'y1="{y + LANE}" y2="{y + LANE}"/>')
        for b in (b for b in bars if b.lane == lane):
            colour = colours.setdefault(b.label, PALETTE[len(colours) % len(PALETTE)])
            w = max(2.0, (b.end - b.start) * scale)
            detail = f"{b.lane}: {b.label} ({b.end - b.start:.0f} ms) {b.detail}".strip()
            parts.append(
                f'<g class="bar {escape(b.cls)}" data-detail="{escape(detail)}">'
                f'<rect x="{x(b.start):.1f}" y="{y + 3}" width="{w:.1f}" height="{LANE - 6}" '
                f'rx="3" fill="{colour}"/><title>{escape(detail)}</title>'
                + (f'<text x="{x(b.start) + 4:.1f}" y="{y + 17}" class="bar-label">'
                   f'{escape(b.label[: int(w / 7)])}</text>' if w > 30 else "")
                + "</g>")
    # Critic decisions and the end of the run: vertical markers across every lane.
    for e in events:
        if e.get("kind") != "critic" or e.get("name") in (None, "watch"):
            continue
        decision = str(e.get("name"))
        payload = _payload(e)
        cls = CRITIC_CLASS.get(decision, "critic-other")
        at = x(_ms(e, t0))
        reason = payload.get("reason") or ""
        detail = f"critic {decision}: {reason} {payload.get('detail') or ''}".strip()
        label = {"steer": "nudge", "kill": "kill"}.get(decision, decision)
        if reason:
            label += f": {reason}"
        parts.append(
            f'<g class="marker {cls}" data-detail="{escape(detail)}">'
            f'<line x1="{at:.1f}" x2="{at:.1f}" y1="22" y2="{height - 24}"/>'
            + (f'<text x="{at - 3:.1f}" y="16" text-anchor="end">'
               if at > LABEL + PLOT / 2 else f'<text x="{at + 3:.1f}" y="16">')
            + f'{escape(label)}</text>'
            f'<title>{escape(detail)}</title></g>')
    status = str(run.get("status") or "running")
    end_x = x(end_ms)
    parts.append(f'<g class="marker run-end status-{escape(status)}">'
                 f'<line x1="{end_x:.1f}" x2="{end_x:.1f}" y1="22" y2="{height - 24}"/></g>')
    parts.extend(_axis(end_ms, scale, height - 20))
    gantt = (f'<svg id="{escape(svg_id)}" class="gantt" xmlns="http://www.w3.org/2000/svg" '
             f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">'
             + "".join(parts) + "</svg>")
    return gantt, t0, end_ms


STATUS_COLOURS = {"ok": "#59a14f", "error": "#e15759", "killed": "#e15759",
                  "timeout": "#f28e2b", "cancelled": "#f28e2b", "budget_exceeded": "#b07aa1",
                  "max_steps": "#edc948", "handoff": "#76b7b2", "dry_run": "#bab0ac",
                  "lost": "#9c755f", "running": "#4e79a7"}


def render_report(runs: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]],
                  since: datetime, until: datetime, *, left_out: int = 0,
                  title: str | None = None) -> str:
    """The HTML page of the runs started between `since` and `until`, oldest first.

    `runs` holds each run's row and its events (as `render` takes them);
    `left_out` is how many more runs the range held (said on the page);
    `title` heads the page (default: the range).
    """
    t0 = since.timestamp() * 1000
    span = max((until - since).total_seconds() * 1000, 1.0)
    scale = PLOT / span

    def x(ms: float) -> float:
        return LABEL + max(0.0, min(ms - t0, span)) * scale

    height = 30 + LANE * max(len(runs), 1) + 30
    parts: list[str] = []
    counts: dict[str, int] = {}
    for i, (run, events) in enumerate(runs):
        status = str(run.get("status") or "running")
        counts[status] = counts.get(status, 0) + 1
        stamps = [at for at in map(_epoch_ms, (e.get("ts") for e in events)) if at is not None]
        start = _epoch_ms(run.get("started_at")) or min(stamps, default=t0)
        end = _epoch_ms(run.get("ended_at"))
        if end is None:  # still running, or lost: its last event
            end = max([start, *stamps])
        y = 30 + i * LANE
        run_id = str(run.get("run_id") or "")
        label = str(run.get("name") or run_id[:8])
        w = max(2.0, x(end) - x(start))
        why = run.get("reason") or run.get("error") or ""
        detail = (f"{label} [{run_id[:8]}] {status}, {_number(run.get('runtime_seconds')):.1f}"
                  f" s, {run.get('steps') or 0} steps" + (f": {_short(why, 160)}" if why else ""))
        parts.append(f'<text class="lane-label" x="{LABEL - 8}" y="{y + 17}" '
                     f'text-anchor="end">{escape(_short(label, 16))}</text>')
        parts.append(
            f'<a href="#run-{escape(run_id)}"><g class="bar run-bar status-{escape(status)}" '
            f'data-run="{escape(run_id)}" data-detail="{escape(detail)}">'
            f'<rect x="{x(start):.1f}" y="{y + 3}" width="{w:.1f}" height="{LANE - 6}" rx="3" '
            f'fill="{STATUS_COLOURS.get(status, "#777")}"/><title>{escape(detail)}</title></g></a>')
        for e in events:
            kill_at = _epoch_ms(e.get("ts"))
            if e.get("kind") == "critic" and e.get("name") == "kill" and kill_at is not None:
                at = x(kill_at)
                parts.append(f'<g class="marker critic-kill" data-detail="{escape(detail)}">'
                             f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{y + 1}" '
                             f'y2="{y + LANE - 1}"/></g>')
    parts.extend(_axis(span, scale, height - 20))
    overview = (f'<svg id="overview" class="gantt" xmlns="http://www.w3.org/2000/svg" '
                f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">'
                + "".join(parts) + "</svg>")
    sections = []
    for run, events in runs:
        run_id = str(run.get("run_id") or "")
        status = str(run.get("status") or "running")
        gantt, _, _ = _gantt(run, events, f"timeline-{run_id}")
        sections.append(
            f'<section class="run" id="run-{escape(run_id)}">'
            f'<h2>{escape(str(run.get("name") or run_id))} '
            f'<span class="status status-{escape(status)}">{escape(status)}</span></h2>'
            f'<div class="meta">{escape(_facts(run))}</div>{gantt}</section>')
    total = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    more = f" ({left_out} more not shown: narrow the range or raise --limit)" if left_out else ""
    title = (f"{title}: " if title else "") + (
        f"runs {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC")
    return _clean(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f'<div class="meta" id="counts">{len(runs)} run(s){": " + escape(total) if total else ""}'
        f"{escape(more)}</div>"
        f"<h2>Runs</h2>{overview}<div id=\"detail\">hover a run; click it for its timeline</div>"
        + "".join(sections) + f"<script>{_JS}</script></body></html>\n")


def _epoch_ms(value: Any) -> float | None:
    """A timestamp as epoch milliseconds; None when there is none."""
    return value.timestamp() * 1000 if isinstance(value, datetime) else None


def _facts(run: Mapping[str, Any]) -> str:
    facts = [f"run {run.get('run_id')}"]
    started = run.get("started_at")
    if isinstance(started, datetime):
        facts.append(f"started {started:%Y-%m-%d %H:%M:%S} UTC")
    if run.get("runtime_seconds") is not None:
        facts.append(f"{_number(run['runtime_seconds']):.2f} s")
    facts.append(f"{run.get('steps') or 0} steps, {run.get('tool_calls') or 0} tool calls")
    why = run.get("reason") or run.get("error")
    if why:
        facts.append(_short(why, 160))
    return " · ".join(facts)


def _axis(end_ms: float, scale: float, y: float) -> list[str]:
    step = _nice_step(end_ms / 8)
    out = [f'<line class="axis" x1="{LABEL}" x2="{LABEL + PLOT}" y1="{y}" y2="{y}"/>']
    t = 0.0
    while t <= end_ms + 1e-9:
        px = LABEL + t * scale
        out.append(f'<line class="tick" x1="{px:.1f}" x2="{px:.1f}" y1="{y}" y2="{y + 4}"/>'
                   f'<text class="tick-label" x="{px:.1f}" y="{y + 15}" text-anchor="middle">'
                   f'{_fmt_ms(t)}</text>')
        t += step
    return out


def _nice_step(raw: float) -> float:
    """The tick spacing (ms) at or above `raw`: 1-2-5 steps, clock units, then days.

    Beyond an hour it keeps to hours, days and 1-2-5 multiples of days, so a
    range of any length (`kernel report --since 36500d`, a run whose clock
    jumped by years) has about eight ticks, never hundreds of thousands.
    """
    if not (math.isfinite(raw) and raw > 0):
        return 1.0
    for unit in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000, 60_000,
                 120_000, 300_000, 600_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000,
                 43_200_000):
        if unit >= raw:
            return float(unit)
    days = raw / DAY_MS
    if days <= 1:
        return DAY_MS
    magnitude = 10.0 ** math.floor(math.log10(days))
    for factor in (1, 2, 5, 10):
        if factor * magnitude >= days:
            return factor * magnitude * DAY_MS
    return 10 * magnitude * DAY_MS  # pragma: no cover - the loop's 10 always fits


def _fmt_ms(ms: float) -> str:
    if ms < 1000:
        return f"{ms:.0f}ms"
    if ms < 120_000:
        return f"{ms / 1000:g}s"
    if ms < 7_200_000:
        return f"{ms / 60_000:g}m"
    if ms < 3 * DAY_MS:
        return f"{ms / 3_600_000:g}h"
    return f"{ms / DAY_MS:g}d"


def _rate_chart(events: Sequence[Mapping[str, Any]], t0: float, end_ms: float) -> str:
    """Output lines per second, in `BUCKETS` equal slices of the run."""
    counts = [0] * BUCKETS
    for e in events:
        if e.get("kind") == "output":
            i = min(BUCKETS - 1, int(_ms(e, t0) / end_ms * BUCKETS))
            counts[max(i, 0)] += 1
    height, top = 110, 10
    width_ms = end_ms / BUCKETS
    rates = [c / (width_ms / 1000) for c in counts]
    peak = max(rates) or 1.0
    bw = PLOT / BUCKETS
    parts = [f'<text class="lane-label" x="{LABEL - 8}" y="{top + 12}" text-anchor="end">'
             f'lines/s</text>',
             f'<text class="tick-label" x="{LABEL - 8}" y="{top + 26}" text-anchor="end">'
             f'peak {peak:.3g}</text>']
    for i, rate in enumerate(rates):
        h = (height - top - 20) * rate / peak
        parts.append(f'<rect class="rate" x="{LABEL + i * bw:.1f}" y="{height - 20 - h:.1f}" '
                     f'width="{max(bw - 1, 1):.1f}" height="{h:.1f}">'
                     f'<title>{_fmt_ms(i * width_ms)}: {counts[i]} lines</title></rect>')
    parts.append(f'<line class="axis" x1="{LABEL}" x2="{LABEL + PLOT}" y1="{height - 20}" '
                 f'y2="{height - 20}"/>')
    return (f'<svg id="output-rate" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
            f'height="{height}">' + "".join(parts) + "</svg>")


def _usage_chart(events: Sequence[Mapping[str, Any]], t0: float, end_ms: float) -> str:
    """Cumulative steps, tool calls and tokens, each scaled to its own final value."""
    series: dict[str, list[tuple[float, float]]] = {"steps": [(0, 0)], "tool calls": [(0, 0)],
                                                    "tokens": [(0, 0)]}
    totals = dict.fromkeys(series, 0.0)
    for e in events:
        kind, at = e.get("kind"), _ms(e, t0)
        key = {"step": "steps", "tool_end": "tool calls", "model_call": "tokens"}.get(
            str(kind))
        if key is None:
            continue
        payload = _payload(e)
        totals[key] += (_number(payload.get("input_tokens"))
                        + _number(payload.get("output_tokens"))) if key == "tokens" else 1
        series[key].append((at, totals[key]))
    height, top = 140, 14
    colours = {"steps": "#4e79a7", "tool calls": "#59a14f", "tokens": "#e15759"}
    parts = []
    legend_x = LABEL
    for key, points in series.items():
        total = totals[key]
        parts.append(f'<text class="legend" x="{legend_x}" y="{top}" fill="{colours[key]}">'
                     f'{escape(key)}: {total:g}</text>')
        legend_x += 150
        if total == 0:
            continue
        points = [*points, (end_ms, total)]
        coords = " ".join(
            f"{LABEL + min(at, end_ms) / end_ms * PLOT:.1f},"
            f"{height - 20 - (height - top - 30) * value / total:.1f}" for at, value in points)
        parts.append(f'<polyline class="usage usage-{key.replace(" ", "-")}" points="{coords}" '
                     f'fill="none" stroke="{colours[key]}" stroke-width="2"/>')
    parts.append(f'<line class="axis" x1="{LABEL}" x2="{LABEL + PLOT}" y1="{height - 20}" '
                 f'y2="{height - 20}"/>')
    parts.append(f'<text class="lane-label" x="{LABEL - 8}" y="{top + 20}" text-anchor="end">'
                 f'usage</text>')
    return (f'<svg id="usage" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
            f'height="{height}">' + "".join(parts) + "</svg>")


_CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px; }
.meta { color: #555; margin-bottom: 10px; }
.status { font-weight: 600; padding: 1px 6px; border-radius: 3px; color: #fff; background: #777; }
.status-ok { background: #59a14f; } .status-killed, .status-error { background: #e15759; }
.status-timeout, .status-cancelled { background: #f28e2b; }
h2 { font-size: 14px; margin: 14px 0 2px; }
svg text { font-size: 11px; fill: #333; }
.lane-label { font-weight: 600; } .bar-label { fill: #fff; pointer-events: none; }
.lane-rule { stroke: #eee; } .axis, .tick { stroke: #999; } .tick-label { fill: #666; }
.bar rect { opacity: .9; } .bar:hover rect { opacity: 1; stroke: #222; }
.unfinished rect { stroke: #e15759; stroke-dasharray: 4 2; stroke-width: 1.5; }
.tool-error rect { stroke: #e15759; stroke-width: 2; }
.marker line { stroke-width: 2; } .critic-nudge line { stroke: #f28e2b; stroke-dasharray: 5 3; }
.critic-nudge text { fill: #b85f00; } .critic-kill line { stroke: #d62728; }
.critic-kill text { fill: #d62728; font-weight: 700; } .critic-other line { stroke: #4e79a7; }
.run-end line { stroke: #222; stroke-dasharray: 2 2; }
.rate { fill: #76b7b2; } .legend { font-weight: 600; }
#detail { min-height: 1.4em; padding: 4px 8px; background: #f6f6f6; border-radius: 4px;
          font-family: ui-monospace, monospace; white-space: pre-wrap; }
"""

_JS = """
document.querySelectorAll('[data-detail]').forEach(function (el) {
  el.addEventListener('mouseenter', function () {
    document.getElementById('detail').textContent = el.getAttribute('data-detail');
  });
});
"""


def _page(run: Mapping[str, Any], gantt: str, rate: str, usage: str) -> str:
    status = str(run.get("status") or "running")
    title = f"{run.get('name') or 'run'} · {status}"
    facts = [f"run {run.get('run_id')}"]
    if run.get("runtime_seconds") is not None:
        facts.append(f"{_number(run['runtime_seconds']):.2f} s")
    facts.append(f"{run.get('steps') or 0} steps, {run.get('tool_calls') or 0} tool calls")
    tokens = (run.get("input_tokens") or 0) + (run.get("output_tokens") or 0)
    if tokens:
        facts.append(f"{tokens} tokens")
    why = run.get("reason") or run.get("error")
    reason = f' — {escape(_short(why, 160))}' if why else ""
    return _clean(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{escape(str(run.get('name') or 'run'))} "
        f"<span class=\"status status-{escape(status)}\">{escape(status)}</span></h1>"
        f"<div class=\"meta\">{escape(' · '.join(facts))}{reason}</div>"
        f"<h2>Timeline</h2>{gantt}<div id=\"detail\">hover a bar or a marker</div>"
        f"<h2>Output rate</h2>{rate}<h2>Usage over time</h2>{usage}"
        f"<script>{_JS}</script></body></html>\n")
