"""`kernel export --otlp URL`: stored runs sent to an OpenTelemetry collector as traces.

Reading and sending are apart: `stored_runs` reads each run's row and events
as plain data (one short read session), `send_runs` hands them to
`batteries.otel.export_run`, the converter live runs use too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

Run = tuple[dict[str, Any], list[dict[str, Any]]]


def stored_runs(cur: Any, run_ids: Sequence[str], since: timedelta | None) -> list[Run]:
    """The finished runs asked for (short ids, prefixes or `last`; none: all, or `since` ago).

    Raises:
        ConfigError: An unknown or ambiguous run id, or one that has not ended.
    """
    from batteries.audit import queries
    from kernel import ConfigError

    from .ids import resolve, short_id

    if run_ids:
        ids = [resolve(cur, text) for text in run_ids]
        status = dict(queries.rows(cur, "SELECT run_id, status FROM runs WHERE run_id IN ("
                                   + ", ".join("?" * len(ids)) + ")", ids)[1])
        running = [run_id for run_id in ids if status.get(run_id) in (None, "running")]
        if running:
            # Its span would end now, as an error of type `running`: a trace that the
            # run's real end, exported later, would then contradict.
            raise ConfigError(f"run {short_id(running[0])} has not ended yet: export it "
                              "once it has (a running run has no trace to send)")
    else:
        sql = "SELECT run_id FROM runs WHERE status IS NOT NULL"
        params: list[Any] = []
        start = queries.cutoff(since)
        if start is not None:
            sql += " AND started_at >= ?"
            params.append(start)
        ids = [row[0] for row in queries.rows(cur, sql + " ORDER BY started_at", params)[1]]
    runs = [queries.timeline(cur, run_id) for run_id in ids]
    parents = dict(queries.rows(cur, "SELECT run_id, parent_run_id FROM runs "
                                     "WHERE parent_run_id IS NOT NULL")[1])
    for run, _ in runs:
        run["root_run_id"] = _root(str(run["run_id"]), parents)
    return runs


def _root(run_id: str, parents: dict[str, str]) -> str:
    """The top of `run_id`'s chain of parents (its trace's root run), itself for a root.

    A parent whose own row is gone (purged) is the root (as it was when the run was
    exported live); a cycle (only a hand-edited database holds one) ends the walk.
    """
    seen = {run_id}
    while (parent := parents.get(run_id)) is not None and parent not in seen:
        seen.add(parent)
        run_id = parent
    return run_id


def send_runs(endpoint: str, runs: Sequence[Run]) -> tuple[int, str | None]:
    """Send `runs` as traces to `endpoint`; returns (spans exported, what failed or None).

    An unreachable collector is given up on at its first refused connection
    (`OTLPTraces`): the export ends within seconds, whatever the number of runs.

    Raises:
        ConfigError: A malformed endpoint, or the otel extra is not installed.
    """
    from batteries.otel import OTLPTraces, export_run

    traces = OTLPTraces(endpoint, batch=False)
    try:
        for run, events in runs:
            export_run(traces.tracer, run, events)
            if traces.unreachable is not None:
                break  # nothing more can go: the failure says so
    finally:
        traces.shutdown()
    return traces.exported_spans, traces.failure()
