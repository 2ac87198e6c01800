"""`kernel batch`: a file of runs, `--concurrency N` at a time, resumable by batch id.

The CLI is a thin layer over `batteries.batch`: it reads and validates the
whole task file (every line, before anything runs), turns each line into
the same run spec `kernel run` stores, and hands the specs to
`BatchRunner` with the usual ports (one journal for audit, budgets and
checkpoints; the critic). The agent of a spec is built by
`adapters.agent_from_spec` as `run_cmd`'s planner builds it for a quiet run
(`_plan`: no command reads our stdin, a loop file's warning is said once).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager, redirect_stdout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO

import typer

from . import numbers, output
from .dberrors import guard_database
from .dbopt import DB_HELP, STORE_OPTION

if TYPE_CHECKING:
    from batteries.batch import TaskOutcome
    from batteries.store import BatchRow, BatchStore, BatchTask
    from kernel import AgentSpec, Limits, LoopSpec, Ports


BATCH_HELP = """Run every line of TASKS.jsonl as a supervised, audited run, N at a time.

\b
Each line is one JSON object:
  {"command": ["sh", "-c", "make test"]}
  {"loop": "fix.yaml", "context": {"dir": "src"}}
  {"agent": "claude", "prompt": "..."}
with optional "id" (unique in the file), "name", "caller", "context" and the
limits `kernel run` takes: "timeout", "soft_timeout", "idle_timeout",
"model_timeout", "tool_timeout" (seconds or "90s", "5m", "2h"...),
"max_steps", "checkpoint_interval", "no_critic"; agents also take "model",
"base_url", "cmd", "api_key_env", "allow_shell", "target", "max_turns", and
loops and llm agents "price": [IN, OUT] US dollars per million tokens (a
caller whose budget caps cost is refused an unpriced model).
With --ray, "ray": {"num_cpus": 0.5, "resources": {"NAME": 1}, "memory": BYTES}
is what the run holds on the cluster (default: one CPU).
The whole file is checked first: a bad line is one error naming its line
number and field (exit 2), and nothing runs. Lines end at a newline (CRLF
and a leading UTF-8 byte order mark are fine); blank lines are skipped; a
line may hold at most 4 MiB. '-' reads the tasks from stdin, which must not
be a terminal. A warning about a loop file is said once.

\b
  kernel batch tasks.jsonl --concurrency 32
  kernel batch tasks.jsonl --json | jq .status     one JSON line per finished run
  kernel batch --list                              batches, newest first
  kernel batch --resume b7kq2xmp                   finish an interrupted batch
  kernel batch tasks.jsonl --ray auto --store postgresql://db/kernel
                                                   spread the runs over a Ray cluster

The batch id is printed on stderr when the batch starts. A batch whose
process died (or was stopped by SIGTERM, SIGHUP or Ctrl-C) is resumed with
--resume (-j N changes its concurrency): finished runs are skipped,
interrupted ones continue from their checkpoint (a plain command runs
again), the rest run; kernel recover leaves a batch's runs to it. A run
still held by a live process (the dead batch's workers exiting) is tried
again for up to 10 s. A task that did not end (held so, or its --workers
process died while running it) is reported as the journal has it (`running`,
or `pending` if it never started), exit 1, and leaves the batch unfinished:
--resume finishes it. A finished batch runs no task again: one whose run was
purged since (kernel purge) is reported `purged`. A run that had ended when
the batch process died, before its status was recorded, is closed `lost`
and not run again. With --json, a reader that goes away (`| head -1`), or
an output that cannot be written (a full disk), stops the batch as a signal
does (exit 130); a reader that does not keep up holds up no run (the lines
wait for it; after a signal, 2 s at most). More runs at once than the
open-file limit allows (ulimit -n): the soft limit is raised as far as the
hard one allows, beyond that the runs go fewer at a time (said in one line).

\b
  kernel batch tasks.jsonl --deliver-dir out/ --webhook https://example.invalid/hook

--deliver-dir and --webhook deliver each run's result as `kernel run` does
(DIR/RUN_ID/, a JSON POST) when the run ends, up to 32 results at once and
apart from the runs: a slow or failing webhook holds up no run, and the batch
exits once every delivery has ended. A bad URL is refused before anything
runs. Where each task's delivery stands is kept with the batch (--list counts
the undelivered). A failed delivery is a warning on stderr and in the run's
--json line ("delivery": "failed", port_failures; the line comes once its
delivery ended), and the exit code is 1: --resume delivers again every result
not delivered (its delivery failed, or had not ended when the batch process
died or was stopped), as the journal has it (secrets redacted, the output as
stored), without running its task again: to every webhook, and to DIR unless
the run's folder is there already. Both are stored with the batch, so
--resume delivers the runs it finishes the same way (a webhook URL's password
is not stored: give --webhook again; given to --resume, --deliver-dir and
--webhook replace the stored ones for that resume, said in a note). After a
signal, deliveries under way get up to 30 s more (a second signal stops them);
a signal once every run has ended only does that, and the batch finishes.

\b
Exit codes: 0 every run ended ok (and was delivered); 1 at least one did not
(error, timeout, killed, budget_exceeded, max_steps, lost, ...), its result
was not delivered (--resume delivers it), or audit rows were lost (neither
written nor kept in a spill file); 2 bad input (a bad task
line, an empty file, an unknown batch, a batch another process is running);
130 interrupted by a signal, or by --json output that could not be written
(resumable).
"""

#: Keys of a task line, by where they go.
_COMMON = frozenset({"id", "name", "caller", "context", "timeout", "soft_timeout",
                     "idle_timeout", "model_timeout", "tool_timeout", "max_steps",
                     "checkpoint_interval", "no_critic", "ray"})
_KIND_KEYS = {"command": frozenset(),
              "loop": frozenset({"model", "base_url", "api_key_env", "price"}),
              "agent": frozenset({"prompt", "model", "base_url", "cmd", "api_key_env",
                                  "allow_shell", "target", "max_turns", "price"})}
_DURATIONS = ("timeout", "soft_timeout", "idle_timeout", "model_timeout", "tool_timeout",
              "checkpoint_interval")
_MAX_ID = 200
#: Runs at once when -j is not given (a resumed batch keeps its own).
DEFAULT_CONCURRENCY = 8


def register(app: typer.Typer) -> None:
    """Add `kernel batch` to the app."""
    app.command("batch", help=BATCH_HELP)(guard_database(batch))


def batch(
    tasks_file: str | None = typer.Argument(
        None, metavar="TASKS.jsonl", show_default=False,
        help="The runs, one JSON object per line ('-' reads stdin)."),
    concurrency: int | None = typer.Option(
        None, "--concurrency", "-j", metavar="N", parser=numbers.count(minimum=1),
        show_default=False,
        help="Runs at once. [default: 8; with --resume: what the batch was started with]"),
    json_out: bool = typer.Option(
        False, "--json", help="One JSON object per finished run on stdout (with --list: "
                              "one per batch): JSON lines."),
    fmt: str | None = typer.Option(
        None, "--format", metavar=output.FORMAT_METAVAR, show_default=False,
        help="With --list: " + output.FORMAT_HELP + " [default: table]"),
    list_only: bool = typer.Option(False, "--list", help="List batches, newest first, with "
                                                         "their runs counted by status and "
                                                         "their undelivered results."),
    resume: str | None = typer.Option(
        None, "--resume", metavar="BATCH_ID",
        help="Finish an interrupted batch (its id, a unique prefix of it, or 'last')."),
    name: str | None = typer.Option(None, "--name", metavar="LABEL",
                                    help="A label for the batch (default: the file name)."),
    context: list[str] | None = typer.Option(
        None, "--context", "-c", metavar="KEY=VALUE",
        help="With --resume: a secret context value the tasks were given (secrets are not "
             "stored, so tasks that had one run only when it is given again)."),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
    redact: list[str] | None = typer.Option(
        None, "--redact", metavar="REGEX",
        help="Also redact what this regular expression matches from everything stored "
             "(repeatable)."),
    workers: int | None = typer.Option(
        None, "--workers", metavar="N", parser=numbers.count(minimum=1),
        show_default=False,
        help="Run the runs in N worker processes (the batch process hands them out and "
             "reports), never more than the tasks or -j. [default: one per CPU, at most "
             "one per 100 runs; 1 runs them in this process]"),
    deliver_dir: str | None = typer.Option(
        None, "--deliver-dir", metavar="DIR",
        help="Also write each run's result to DIR/RUN_ID/ (result.json, output.txt, "
             "artifacts/), as kernel run does. Stored with the batch (--resume delivers "
             "there; given with --resume, it replaces the stored one)."),
    webhook: list[str] | None = typer.Option(
        None, "--webhook", metavar="URL",
        help="Also POST each run's result as JSON to URL (retried; repeatable). A failed "
             "delivery is a warning and exit 1; --resume delivers it again. Stored with "
             "the batch without a password; given with --resume, these replace the stored "
             "ones (needed when a stored URL held a password)."),
    ray_address: str | None = typer.Option(
        None, "--ray", metavar="auto|ADDRESS",
        help="Run on a Ray cluster ('auto': $RAY_ADDRESS or the local one; else its head's "
             "host:port). Every node needs run-kernel[ray] and the same --store (a "
             "postgresql:// URL; a --db path only when all nodes share this machine)."),
) -> None:
    """Run a file of runs; exit 0 only if every run ended ok."""
    from kernel import AuditError, ConfigError

    chosen = sum(x for x in (tasks_file is not None, list_only, resume is not None))
    if chosen != 1:
        _fail("give exactly one of TASKS.jsonl, --list or --resume BATCH_ID")
    if fmt is not None and not list_only:
        _fail("--format goes with --list (a batch prints --json lines or progress)")
    if list_only:
        if deliver_dir is not None or webhook:
            _fail("--deliver-dir and --webhook go with TASKS.jsonl or --resume")
        raise typer.Exit(_list(db, fmt=output.pick(fmt, json_out)))
    from batteries.delivery import check_delivery_options

    try:
        # Checked first: a typo in a URL is bad input before any batch is made.
        deliver_dir, webhooks = check_delivery_options(deliver_dir, webhook or ())
        if resume is not None:
            runner_args = _prepare_resume(resume, db, context or [], concurrency,
                                          deliver_dir=deliver_dir, webhooks=webhooks)
        else:
            assert tasks_file is not None
            runner_args = _prepare_new(tasks_file, db, concurrency or DEFAULT_CONCURRENCY,
                                       name, redact or [])
            runner_args.deliver_dir, runner_args.webhooks = deliver_dir, webhooks
    except (ConfigError, AuditError) as exc:
        _fail(str(exc))
    if ray_address is not None:
        if not ray_address.strip():
            _fail("--ray expects auto or the head's host:port")
        try:
            import ray  # noqa: F401  (only to say what is missing before anything runs)
        except ModuleNotFoundError:
            _fail("--ray needs Ray: pip install 'run-kernel[ray]'")
        runner_args.ray = ray_address.strip()
        if workers is not None:
            _fail("--workers and --ray do not go together (Ray places the runs)")
    else:
        from .batch_workers import default_workers

        # A worker more than the runs that can be at once (or than the tasks) idles.
        runner_args.workers = max(1, min(workers or default_workers(runner_args.total),
                                         runner_args.total, runner_args.concurrency))
        _fit_open_files(runner_args)
    import trio

    from adapters._proc import own_fds

    # This process and its workers start a command per task and pass no fd on to
    # anyone: one close_range per start instead of listing the fds (adapters._proc).
    own_fds()
    _fork_workers(runner_args)
    run = partial(_execute, runner_args, json_out=json_out, results=sys.stdout)
    if runner_args.ray is None:
        code = trio.run(run)
    else:
        # A Ray driver prints the cluster's messages ("node ... marked dead") on
        # sys.stdout: they go to stderr, so stdout keeps only the results.
        with redirect_stdout(sys.stderr):
            code = trio.run(run)
    raise typer.Exit(code)


#: Open files a run may hold at once: a command's two pipes and its pidfd, its pipes'
#: other ends while it starts, and a run that ended still closing them while the next
#: starts (measured: up to ~7 a run for `-j 240` of 0.2 s commands), an HTTP connection.
FDS_PER_RUN = 8
#: Open files a batch process (or worker) holds besides its runs': the journal and
#: its WAL, the workers' pipes, stdio, the event loop's, a few threads' files.
FDS_RESERVE = 64


def _fit_open_files(args: _Args) -> None:
    """Make room for `-j` runs in each process's open-file limit (`ulimit -n`).

    At the usual soft limit of 1,024, `-j 3000 --workers 1` started ~330 runs and
    failed the other 2,665 at their start ("Too many open files"), in a batch that
    then finished and would not run them again. The soft limit is raised as far as
    needed, up to the hard one (as Go programs do); when even that is too low, the
    runs go fewer at a time, said in one line.
    """
    import resource

    from batteries.batch import DELIVERY_LIMIT

    each = -(-args.concurrency // args.workers)  # a worker's share (WorkerDispatch)
    reserve = FDS_RESERVE + DELIVERY_LIMIT * len(args.webhooks)
    need = reserve + FDS_PER_RUN * each
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - Linux always answers
        return
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (OSError, ValueError):
            pass
    if need <= soft:
        return
    fit = max(1, (soft - reserve) // FDS_PER_RUN) * args.workers
    if fit >= args.concurrency:  # pragma: no cover - need > soft says otherwise
        return
    print(f"kernel: note: {args.concurrency} runs at once need ~{need:,} open files per "
          f"process and the limit is {soft:,} (ulimit -n; hard limit {_limit(hard)}): "
          f"running {fit} at a time", file=sys.stderr)
    args.at_once = fit


def _limit(value: int) -> str:
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else f"{value:,}"


def _fail(message: str) -> None:
    print(f"kernel batch: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


# ------------------------------------------------------------- the task file


class TaskLineError(Exception):
    """A task line that cannot run: `file:line: field: why`."""

    def __init__(self, where: str, line: int, key: str | None, why: str) -> None:
        self.where, self.line, self.key, self.why = where, line, key, why
        super().__init__(f"{where}:{line}: {key + ': ' if key else ''}{why}")


@dataclass
class Parsed:
    """A validated task: its id, its run spec (as `kernel run` stores it) and context."""

    line: int
    task_id: str
    spec: dict[str, Any]
    context: dict[str, str] = field(default_factory=dict)
    #: The `kernel.RunSpec` `spec` was made from (what `_build` reads back).
    built: Any = None


def read_tasks(lines: Iterable[str], where: str, *, caller: str, cwd: str) -> list[Parsed]:
    """Every task of a task file's lines, validated; the first bad line raises
    `TaskLineError`."""
    from kernel import ConfigError

    out: list[Parsed] = []
    ids: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw, object_pairs_hook=_unique_keys)
        except _RepeatedKey as exc:
            raise TaskLineError(where, n, exc.key, "given twice (a key may appear once in "
                                                   "an object)") from None
        except ValueError as exc:
            if not out and raw.lstrip().startswith("["):  # the whole file, an array
                raise TaskLineError(where, n, None, _NOT_AN_ARRAY) from None
            raise TaskLineError(where, n, None, f"not JSON ({exc.args[0].split(':')[0]})") \
                from None
        if not out and isinstance(obj, list) and all(isinstance(o, dict) for o in obj):
            raise TaskLineError(where, n, None, _NOT_AN_ARRAY)
        if not isinstance(obj, dict):
            raise TaskLineError(where, n, None, "expects a JSON object")
        task = _task(obj, n, where, caller=caller, cwd=cwd)
        if task.task_id in ids:
            raise TaskLineError(where, n, "id", f"{task.task_id!r} is already the id of line "
                                                f"{ids[task.task_id]}")
        ids[task.task_id] = n
        out.append(task)
    if not out:
        raise ConfigError(f"{where} holds no tasks")
    return out


_NOT_AN_ARRAY = ("expects one JSON object per line (JSON lines), not a JSON array "
                 "(jq -c '.[]' FILE writes one)")
#: Bytes a task line may hold (its newline aside): more is refused before it is decoded.
#: A command's whole argv must fit in ARG_MAX (2 MiB on Linux by default) and a
#: model's longest prompt in a few MiB; each line is stored with its run several times,
#: so a 100 MB line took 1.1 GB and 20 s to fail at its start.
MAX_LINE = 4 << 20


def task_lines(stream: BinaryIO, where: str) -> list[str]:
    """The lines of a task file, decoded: newline-separated (JSON lines), a CRLF's CR
    and a leading UTF-8 byte order mark dropped.

    Only a newline ends a line: JSON text may hold U+2028, U+0085 ... raw in a string
    (`str.splitlines` would cut the line there).

    Raises:
        TaskLineError: A line over `MAX_LINE` bytes (read no further than that) or not
            UTF-8.
    """
    lines: list[str] = []
    while line := stream.readline(MAX_LINE + 2):
        n = len(lines) + 1
        body = line[:-1] if line.endswith(b"\n") else line
        if body.endswith(b"\r"):
            body = body[:-1]
        if len(body) > MAX_LINE:
            raise TaskLineError(where, n, None, f"the line is longer than {MAX_LINE >> 20} MiB "
                                                f"({MAX_LINE:,} bytes), the most a task line "
                                                "may hold")
        if n == 1 and body.startswith(codecs.BOM_UTF8):
            body = body[len(codecs.BOM_UTF8):]
        try:
            lines.append(body.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise TaskLineError(where, n, None, f"not UTF-8 (byte 0x{body[exc.start]:02x} at "
                                                f"byte {exc.start + 1} of the line)") from None
    return lines


class _RepeatedKey(Exception):
    """A JSON object of a task line with a key given twice (JSON would keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`' object hook: the object, refused if a key comes twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _task(obj: dict[str, Any], n: int, where: str, *, caller: str, cwd: str) -> Parsed:
    from kernel import CommandSpec, ConfigError, Limits, PortSpec, RunSpec

    from .run_cmd import agent_spec

    def bad(key: str | None, why: str) -> TaskLineError:
        return TaskLineError(where, n, key, why)

    kinds = [k for k in _KIND_KEYS if k in obj]
    if len(kinds) != 1:
        raise bad(None, 'expects exactly one of "command", "loop" or "agent"'
                  + (f", got {' and '.join(kinds)}" if kinds else ""))
    kind = kinds[0]
    allowed = _COMMON | _KIND_KEYS[kind] | {kind}
    for key in obj:
        if key not in allowed:
            raise bad(key, f"unknown field for a {kind} task" if key in set().union(
                *_KIND_KEYS.values()) else "unknown field")
    task_id = obj.get("id", str(n))
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
        raise bad("id", "expects a string")
    task_id = str(task_id)
    if not task_id.strip() or len(task_id) > _MAX_ID or not task_id.isprintable():
        raise bad("id", f"expects 1-{_MAX_ID} printable characters")
    ctx = _context(obj.get("context"), bad)
    strings = {k: _string(obj, k, bad) for k in ("name", "caller", "model", "base_url", "cmd",
                                                  "api_key_env", "target", "prompt")}
    durations = {k: _duration(obj, k, bad) for k in _DURATIONS}
    max_steps = _count(obj, "max_steps", bad, minimum=0)
    max_turns = _count(obj, "max_turns", bad, minimum=1)
    price = _price(obj, bad)
    flags = {k: _flag(obj, k, bad) for k in ("no_critic", "allow_shell")}
    try:
        if kind == "command":
            argv = obj["command"]
            if (not isinstance(argv, list) or not argv
                    or not all(isinstance(a, str) for a in argv)):
                raise bad("command", "expects a non-empty list of strings")
            spec: CommandSpec | LoopSpec | AgentSpec = CommandSpec(tuple(argv), ctx)
        elif kind == "loop":
            path = obj["loop"]
            if not isinstance(path, str) or not path:
                raise bad("loop", "expects the path of a loop file")
            spec = agent_spec([str(Path(cwd) / path)], ctx, agent=None,
                              model=strings["model"], base_url=strings["base_url"],
                              prompt=None, cmd=None, api_key_env=strings["api_key_env"],
                              allow_shell=False, scenario=None, price=price)
        else:
            if not isinstance(obj["agent"], str) or not obj["agent"]:
                raise bad("agent", "expects an agent kind (llm, agentcli, pane, claude, "
                                   "codex, gemini)")
            spec = agent_spec([], ctx, agent=obj["agent"], model=strings["model"],
                              base_url=strings["base_url"], prompt=strings["prompt"],
                              cmd=strings["cmd"], api_key_env=strings["api_key_env"],
                              allow_shell=flags["allow_shell"], scenario=None,
                              target=strings["target"], max_turns=max_turns, price=price)
        plan = _plan(spec)
    except ConfigError as exc:
        raise bad(kind, str(exc)) from None
    info = plan.info
    if strings["name"]:
        info.name = strings["name"]
    info.caller_id = strings["caller"] or caller
    base = plan.limits or Limits()
    timeout, soft, tool = durations["timeout"], durations["soft_timeout"], \
        durations["tool_timeout"]
    try:
        limits = Limits(
            max_steps=base.max_steps if max_steps is None else max_steps,
            timeout=base.timeout if timeout is None else (timeout or None),
            soft_timeout=(soft or None) if soft is not None else base.soft_timeout,
            tool_timeout=base.tool_timeout if tool is None else (tool or None),
            checkpoint_every_seconds=max(base.checkpoint_every_seconds,
                                         durations["checkpoint_interval"] or 0.0))
    except ConfigError as exc:
        raise bad(None, str(exc).replace("Limits.", "")) from None
    opts = PortSpec(no_critic=flags["no_critic"], soft_timeout=soft,
                    idle_timeout=durations["idle_timeout"],
                    model_timeout=durations["model_timeout"], tool_timeout=tool)
    built = RunSpec(spec, info, limits, opts, cwd=cwd)
    run_spec = built.to_dict()
    if "ray" in obj:
        from batteries.ray_dispatch import RayOptions

        try:
            run_spec["ray"] = RayOptions.parse(obj["ray"]).to_dict()
        except ValueError as exc:
            raise bad("ray", str(exc)) from None
    return Parsed(n, task_id, run_spec, ctx, built)


def _context(value: Any, bad: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("context", "expects an object of KEY: value")
    out = {}
    for key, v in value.items():
        if not key or not key.replace("_", "a").replace("-", "a").replace(".", "a").isalnum():
            raise bad("context", f"key {key!r} may hold only letters, digits, _ - .")
        if isinstance(v, (dict, list)) or v is None:
            raise bad("context", f"{key}: expects a string, number or boolean")
        out[key] = json.dumps(v) if isinstance(v, bool) else str(v)
    return out


def _string(obj: Mapping[str, Any], key: str, bad: Any) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(key, "expects a string")
    return value


def _flag(obj: Mapping[str, Any], key: str, bad: Any) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise bad(key, "expects true or false")
    return value


def _duration(obj: Mapping[str, Any], key: str, bad: Any) -> float | None:
    """Seconds: a JSON number, or a string in `kernel run`'s duration grammar."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad(key, f"expects a duration like {numbers.DURATION_FORMS}, got {value!r}")
    if isinstance(value, (int, float)):
        value = repr(value) if isinstance(value, float) else str(value)
        if "e" in value.lower() or value.startswith("-") or not math.isfinite(float(value)):
            raise bad(key, f"expects a duration like {numbers.DURATION_FORMS}, got {value}")
    if not isinstance(value, str):
        raise bad(key, f"expects a duration like {numbers.DURATION_FORMS}")
    try:
        return numbers.parse_duration(value)
    except ValueError as exc:
        raise bad(key, str(exc)) from None


def _price(obj: Mapping[str, Any], bad: Any) -> tuple[float, float] | None:
    value = obj.get("price")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise bad("price", "expects [IN, OUT]: US dollars per million input and output "
                           "tokens, like [0.15, 0.6]")
    try:
        return (numbers.parse_amount(repr(float(value[0])), maximum=1e6),
                numbers.parse_amount(repr(float(value[1])), maximum=1e6))
    except ValueError:
        raise bad("price", f"expects two amounts >= 0, got {value!r}") from None


def _count(obj: Mapping[str, Any], key: str, bad: Any, *, minimum: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise bad(key, "expects a whole number")
    try:
        return numbers.parse_count(str(value), minimum=minimum)
    except ValueError as exc:
        raise bad(key, str(exc)) from None


# ------------------------------------------------------------------ running


@dataclass
class _Args:
    """What `_execute` runs: a new batch (tasks given) or a stored one (resume)."""

    db: str | None
    concurrency: int
    batch_id: str
    tasks: list[BatchTask] | None = None
    name: str = ""
    source: str = ""
    redactor: Any = None
    given: Any = None  # batteries.recovery.Secrets on resume
    total: int = 0
    redact: list[str] = field(default_factory=list)
    ray: str | None = None  # --ray: the cluster's address
    workers: int = 1  # --workers: processes running the runs (1: this one)
    at_once: int = 0  # runs at once when the open-file limit allows fewer (0: concurrency)
    forked: list[Any] = field(default_factory=list)  # batch_workers.Forked, once forked
    deliver_dir: str | None = None  # --deliver-dir, absolute
    webhooks: tuple[str, ...] = ()  # --webhook URLs, as given (secrets included)
    notes: list[str] = field(default_factory=list)  # said when the batch starts

    def options(self) -> dict[str, Any]:
        """What is stored with a new batch (`BatchRow.options`) for `--resume`: the
        --redact patterns and where its runs are delivered. A webhook URL is stored
        as the batch's redactor leaves it (as `kernel run` stores its spec): one that
        held a secret is listed under `redacted`, and a resume must be given it again."""
        opts: dict[str, Any] = {"redact": self.redact}
        if self.deliver_dir is not None:
            opts["deliver_dir"] = self.deliver_dir
        if self.webhooks:
            stored = [self.redactor.value(url) for url in self.webhooks]
            opts["webhooks"] = stored
            hidden = [["webhooks", i] for i, (url, kept) in
                      enumerate(zip(self.webhooks, stored, strict=True)) if url != kept]
            if hidden:
                opts["redacted"] = hidden
        return opts


def _prepare_new(tasks_file: str, db: str | None, concurrency: int, name: str | None,
                 patterns: list[str]) -> _Args:
    from adapters.specs import spec_secrets
    from batteries.batch import new_batch_id
    from batteries.checkpoint import stored_spec
    from batteries.redact import env_patterns
    from batteries.store import BatchTask
    from kernel import ConfigError, RunSpec

    from .run_cmd import make_redactor

    caller = os.environ.get("KERNEL_CALLER") or os.environ.get("USER", "")
    try:
        if tasks_file == "-":
            where = "<stdin>"
            if sys.stdin.isatty():
                raise ConfigError("'-' reads the tasks from stdin, which is a terminal: pipe "
                                  "or redirect them in (kernel batch - < tasks.jsonl)")
            lines = task_lines(sys.stdin.buffer, where)
        else:
            where = tasks_file
            try:
                with open(tasks_file, "rb") as stream:
                    lines = task_lines(stream, where)
            except FileNotFoundError:
                raise ConfigError(f"no task file {tasks_file}") from None
            except OSError as exc:
                raise ConfigError(f"cannot read {tasks_file}: {exc.strerror or exc}") from None
        parsed = read_tasks(lines, where, caller=caller, cwd=os.getcwd())
    except TaskLineError as exc:
        raise ConfigError(str(exc)) from None
    del lines
    merged: dict[str, str] = {}
    for p in parsed:
        merged.update(p.context)
    redactor = make_redactor(merged, patterns)
    # The tasks' API keys, whatever their variables are called (`spec_secrets`).
    keys = {key for p in parsed if p.spec["agent"].get("kind") != "command"
            for key in spec_secrets(RunSpec.from_dict(p.spec))}
    if keys:
        redactor = redactor.with_secrets(sorted(keys))
    batch_id = new_batch_id()
    tasks = []
    quick = not patterns and not env_patterns(os.environ)
    for p in parsed:
        _BUILT[p.spec["info"]["run_id"]] = p.built
        spec = _stored(p, redactor, quick)
        if spec is None:
            spec = stored_spec(RunSpec.from_dict(p.spec), redactor)
            if spec["redacted"]:  # the run itself gets what the line says
                _AS_READ[p.spec["info"]["run_id"]] = p.spec
        spec["batch"] = {"batch_id": batch_id, "task_id": p.task_id}
        tasks.append(BatchTask(p.task_id, p.spec["info"]["run_id"], spec))
    source = "<stdin>" if tasks_file == "-" else str(Path(tasks_file).resolve())
    return _Args(db, concurrency, batch_id, tasks, name or Path(where).name, source, redactor,
                 total=len(tasks), redact=patterns)


def _stored(task: Parsed, redactor: Any, quick: bool) -> dict[str, Any] | None:
    """The task's spec as stored when redaction finds nothing in it, else None.

    One pass of the redactor over the spec's JSON text instead of one per
    string (a thousand-line task file: ~70,000 calls fewer), as the audit
    redacts its payloads. Only without user patterns (`--redact`,
    `$KERNEL_REDACT`: one anchored at a string's start would not match inside
    the JSON text) and without secret-named context keys (replaced whole).
    """
    from batteries.redact import SECRET_NAME

    if not quick or any(SECRET_NAME.search(k) for k in task.context):
        return None
    text = json.dumps(task.spec, ensure_ascii=False)
    if redactor.text(text) != text:
        return None
    return {**task.spec, "redacted": []}


def _store(db: str | None) -> BatchStore:
    """The store in effect (`--store` / `$KERNEL_STORE`, else the journal beside --db).

    Raises:
        ConfigError: A bad store URL, or a store that keeps no batches.
    """
    from batteries.store import open_store
    from kernel import ConfigError

    store = open_store(db)
    if not callable(getattr(store, "batches", None)):
        raise ConfigError(f"the store at {store.path} keeps no batches")
    return store  # type: ignore[return-value]


def _find(db: str | None, wanted: str) -> BatchRow:
    """The stored batch `wanted` names (id, unique prefix, or 'last')."""
    from kernel import ConfigError

    store = _store(db)
    try:
        want = wanted.strip().lower()
        if want == "last":
            rows = store.batches(limit=1)
        else:
            rows = store.batches(batch_id=want) or store.batches(prefix=want) if want else []
    finally:
        store.close()
    if not rows:
        raise ConfigError(f"no batch {wanted!r} (see kernel batch --list)")
    if len(rows) > 1:
        raise ConfigError(f"{wanted!r} names {len(rows)} batches: "
                          + ", ".join(r.batch_id for r in rows[:5]))
    return rows[0]


def _prepare_resume(wanted: str, db: str | None, context: list[str],
                    concurrency: int | None = None, *, deliver_dir: str | None = None,
                    webhooks: tuple[str, ...] = ()) -> _Args:
    from batteries.batch import run_spec_of
    from batteries.recovery import NotResumable, Secrets, restore_secrets
    from kernel import ConfigError, RunSpec

    from .recover_cmd import give_back
    from .run_cmd import make_redactor, parse_context

    row = _find(db, wanted)
    if row.status == "running" and not row.owner.gone():
        raise ConfigError(f"batch {row.batch_id} is being run by pid {row.owner.pid} on "
                          f"{row.owner.host}")
    given = Secrets(context=parse_context(context))
    store = _store(db)
    try:
        tasks = store.batch_tasks(row.batch_id)
    finally:
        store.close()
    missing: set[str] = set()
    left = 0
    # Results owed a delivery (it failed, or never ended): the resume delivers them.
    owed = sum(t.ended is not None for t in tasks)
    for t in tasks:
        # What the resume runs: an interrupted run, or a task that never started (in a
        # batch that had finished, a task without a run had one, purged since).
        unfinished = (t.saved is not None and t.saved.status == "running") or (
            t.run_status is None and not t.started and row.status != "finished")
        left += unfinished
        if unfinished and t.spec.get("redacted"):
            try:
                _, lacking = restore_secrets(
                    RunSpec.from_dict(run_spec_of(t.spec)), given)
            except NotResumable as exc:
                missing.add(f"{exc}; run it again with `kernel run`")
                continue
            if lacking:
                missing.add("its secrets are not stored; give them again: kernel batch "
                            f"--resume {row.batch_id} {give_back(lacking)}")
    stored_dir, stored_hooks = _stored_delivery(row)
    if not webhooks and stored_hooks is None and (left or owed):
        missing.add("its secrets are not stored; give them again: kernel batch --resume "
                    f"{row.batch_id} {give_back(('ports.webhooks',))}")
    if missing:
        raise ConfigError(f"batch {row.batch_id}: " + "; ".join(sorted(missing)))
    redactor = make_redactor(parse_context(context), list(row.options.get("redact") or []))

    patterns = list(row.options.get("redact") or [])
    return _Args(db, concurrency or row.concurrency, row.batch_id, None, row.name,
                 row.source, redactor, given, total=len(tasks), redact=patterns,
                 deliver_dir=deliver_dir or stored_dir,
                 webhooks=webhooks or stored_hooks or (),
                 notes=_replaced(row, deliver_dir, webhooks))


def _replaced(row: BatchRow, deliver_dir: str | None, webhooks: tuple[str, ...]) -> list[str]:
    """A note for each stored destination a resume's --deliver-dir / --webhook replace
    (the stored ones are kept for a later resume): the results it delivers, those owed
    from before included, go only where it was told, which a user may not expect."""
    from batteries.delivery import shown_url

    notes = []
    stored_dir = row.options.get("deliver_dir")
    if deliver_dir is not None and isinstance(stored_dir, str) and deliver_dir != stored_dir:
        notes.append(f"kernel: note: batch {row.batch_id} delivers to --deliver-dir "
                     f"{deliver_dir}, not to the one it was started with ({stored_dir})")
    stored = [shown_url(u) for u in row.options.get("webhooks") or [] if isinstance(u, str)]
    given = [shown_url(u) for u in webhooks]
    if webhooks and stored and sorted(set(given)) != sorted(set(stored)):
        notes.append(f"kernel: note: batch {row.batch_id} delivers to --webhook "
                     f"{', '.join(given)}, not to the one(s) it was started with "
                     f"({', '.join(stored)})")
    return notes


def _stored_delivery(row: BatchRow) -> tuple[str | None, tuple[str, ...] | None]:
    """Where a stored batch delivers (`_Args.options`): its directory and webhook URLs;
    None for the URLs when one held a secret, which is not stored.

    Raises:
        ConfigError: Its stored options are not what this kernel writes.
    """
    from batteries.delivery import check_delivery_options
    from kernel import ConfigError

    opts = row.options
    where = opts.get("deliver_dir")
    urls = opts.get("webhooks") or []
    if (where is not None and not isinstance(where, str)) or not isinstance(urls, list) \
            or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"batch {row.batch_id}: its stored delivery options are malformed")
    if opts.get("redacted"):
        return where, None
    try:
        return check_delivery_options(where, urls)  # stored by a version that took them
    except ConfigError as exc:
        raise ConfigError(f"batch {row.batch_id}: its stored {exc}") from None


#: Run id -> its task's run spec as read from the file, for the tasks of a batch this
#: process created whose stored spec had secrets taken out: their runs get the real
#: values, as under `kernel run` (the batch's workers are forked after the file is
#: read: they hold it too). Only the redacted spec is stored; a resumed batch puts the
#: secrets back from what `--resume ... -c` gives (`given`).
_AS_READ: dict[str, dict[str, Any]] = {}
#: Run id -> the `kernel.RunSpec` its task line was read into, for the tasks of a batch
#: this process created (its forked workers hold it too): the run is built from it
#: once (taken out when it is), instead of reading its stored spec back
#: (`RunSpec.from_dict`, half of a build); the line as read, so secrets included.
_BUILT: dict[str, Any] = {}


def _build(spec: Mapping[str, Any], given: Any = None,
           as_read: Mapping[str, Any] | None = None) -> tuple[Any, Any, Limits]:
    """A task's run spec -> (agent, info, limits); secrets put back from `given`, or the
    whole spec as read from its line (`as_read`, sent with a task to a Ray worker)."""
    from adapters.shell import ShellAgent
    from batteries.batch import run_spec_of
    from kernel import ConfigError, RunSpec

    built = None
    if as_read is not None:
        spec = as_read
    elif _AS_READ or _BUILT:
        info = spec.get("info")
        run_id = str(info.get("run_id")) if isinstance(info, Mapping) else ""
        built = _BUILT.pop(run_id, None)
        spec = _AS_READ.get(run_id, spec)
    # Without where to place it ("ray").
    run_spec = built if built is not None else RunSpec.from_dict(run_spec_of(spec))
    if given is not None and run_spec.redacted:
        from batteries.recovery import NotResumable, restore_secrets

        try:
            run_spec, missing = restore_secrets(run_spec, given)
        except NotResumable as exc:
            raise ConfigError(str(exc)) from None
        if missing:
            raise ConfigError("its secrets are not stored")
    plan = _plan(run_spec)
    cwd = spec.get("cwd")
    if getattr(plan.agent, "cwd", "") is None and isinstance(cwd, str) and os.path.isdir(cwd):
        plan.agent.cwd = cwd  # where the batch started, also when it is resumed elsewhere
    elif isinstance(plan.agent, ShellAgent) and plan.agent.cwd == os.getcwd():
        # Run from where it was read: the command starts in this process's own
        # directory, the same one, so `spawn` compares no directories (two stats)
        # for each start and can use posix_spawn (which has no chdir).
        plan.agent.cwd = None
    return plan.agent, run_spec.info, run_spec.limits


def _plan(spec: Any) -> Any:
    """The agent a spec describes, as `run_cmd.plan_from_spec(quiet=True)` builds it, but
    with no command reading our stdin (many run at once) and each warning about a loop
    file said once per process: a task file of 5,000 runs of one loop said it 10,000
    times (once when the line was checked, once when its run was built).

    Raises:
        ConfigError: What is wrong with the spec, in one line.
    """
    from adapters import agent_from_spec

    return agent_from_spec(spec, warn=_warn_once, inherit_stdin=False)


#: The loop-file warnings this process has said (`_warn_once`); forked workers inherit it.
_WARNED: set[str] = set()


def _warn_once(line: str) -> None:
    if line not in _WARNED:
        _WARNED.add(line)
        from .run_cmd import _say

        _say(line)


def _ray_dispatch(args: _Args, journal: Any) -> Any:
    """`--ray`: the runs go to Ray workers, each opening the same store with the CLI's ports."""
    from batteries.audit.paths import resolve_db_path
    from batteries.ray_dispatch import RayDispatch, RayOptions, WorkerCall
    from batteries.store import store_url

    store = store_url() or str(resolve_db_path(args.db))
    call = WorkerCall(store, partial(_build, given=args.given),
                      ports=partial(worker_ports, db=args.db, redactor=args.redactor),
                      critic_for=_critics(), redacted=True)

    def call_for(task: Any) -> Any:
        as_read = _AS_READ.get(task.run_id)
        if as_read is None:
            return call
        return dataclasses.replace(call, build=partial(_build, given=args.given,
                                                       as_read=as_read))

    return RayDispatch(journal, call, address=args.ray or "auto",
                       options_for=lambda task: RayOptions.parse(task.spec.get("ray")),
                       call_for=call_for)


#: What `ray.init` logs when it connects from a thread other than the main one (ours
#: does, under trio): it sets no SIGTERM handler of its own, which `kernel batch` never
#: wanted (it takes SIGTERM itself and stops the batch, resumable).
RAY_SIGTERM_NOTE = "SIGTERM handler is not set because current thread is not the main thread"


def _quiet_ray_sigterm_note() -> None:
    """Drop Ray's `RAY_SIGTERM_NOTE` warning, which every `--ray` batch got on stderr."""
    import logging

    logging.getLogger("ray._private.worker").addFilter(
        lambda record: RAY_SIGTERM_NOTE not in record.getMessage())


@asynccontextmanager
async def worker_ports(store: str, *, db: str | None, redactor: Any,
                       journals: list[Any] | None = None) -> AsyncIterator[Ports]:
    """A worker's ports (Ray, `--workers`): the CLI's own (one journal on the shared store),
    on the worker; its journal is added to `journals` (what it kept or lost at exit)."""
    from batteries.runner import open_ports
    from batteries.store import choose
    from kernel import PortSpec

    from .run_cmd import _say

    if store.startswith(("postgresql://", "postgres://")):
        choose(store)
    else:
        db = store
    journals = [] if journals is None else journals
    async with _spill_noted(open_ports(PortSpec(db=db, no_critic=True), redactor=redactor,
                                       journals=journals), journals, _say) as ports:
        yield ports


@asynccontextmanager
async def _spill_noted(opening: Any, journals: list[Any], say: Any) -> AsyncIterator[Ports]:
    """`opening`'s ports (`open_ports`); once it closed, a warning line (`say`) for each of
    its journals that kept rows in a spill file (`run_cmd.journal_notes`)."""
    from .run_cmd import journal_notes

    try:
        async with opening as ports:
            yield ports
    finally:
        for line in journal_notes(journals):
            say(line)


def _critics() -> Any:
    """Per-task critic thresholds -> one critic per distinct set (shared by its tasks)."""
    from batteries.runner import make_critic
    from kernel import PortSpec

    made: dict[tuple[Any, ...], Any] = {}

    def critic_for(spec: Mapping[str, Any]) -> Any:
        p = dict(spec.get("ports") or {})
        key = (bool(p.get("no_critic")), p.get("soft_timeout"), p.get("idle_timeout"),
               p.get("model_timeout"), p.get("tool_timeout"))
        if key not in made:
            made[key] = None if key[0] else make_critic(PortSpec(
                soft_timeout=key[1], idle_timeout=key[2], model_timeout=key[3],
                tool_timeout=key[4]))
        return made[key]

    return critic_for


def _fork_workers(args: _Args) -> None:
    """`--workers N` (N > 1): fork the worker processes now, before trio starts."""
    if args.workers <= 1 or args.ray is not None:
        return
    from batteries.audit.paths import resolve_db_path
    from batteries.store import store_url

    from .batch_workers import fork_workers

    setup = {"store": store_url() or str(resolve_db_path(args.db)), "db": args.db,
             "redactor": args.redactor, "given": args.given}
    try:
        args.forked = fork_workers(args.workers, setup)
    except RuntimeError as exc:  # a thread already runs here: a fork would lose it
        print(f"kernel: note: the runs stay in this process ({exc})", file=sys.stderr)
        args.workers = 1
        return
    # The workers build every run (each holds its copy); this process builds none.
    _BUILT.clear()


@asynccontextmanager
async def _workers(args: _Args) -> AsyncIterator[Any]:
    """A dispatcher onto the forked workers (ended with the block); None without any."""
    if not args.forked:
        yield None
        return
    from .batch_workers import open_workers

    async with open_workers(args.forked) as dispatch:
        yield dispatch


async def _execute(args: _Args, *, json_out: bool, results: TextIO) -> int:
    """Run the batch; its exit code. What it prints goes through `_Lines` (off the trio
    thread) from start to end, so no reader that stops reading holds it up."""
    import trio

    #: The cancel scopes to stop the batch with (its runs; then the output's last lines).
    stop: list[trio.CancelScope] = []
    #: The output could not be written (`| head` gone, a full disk): the batch is stopped.
    closed: list[str] = []
    #: The signals received.
    got: list[int] = []
    #: Signals received once every run had ended, deliveries still under way: they only
    #: bound the deliveries (the batch is not interrupted: nothing is left to run).
    late: list[int] = []
    #: Delivers the runs' results (--deliver-dir, --webhook), once it is made.
    deliveries: list[Any] = []
    out_fd, err_fd = _fileno(results), _fileno(sys.stderr)
    # A writer each, so a stdout nobody reads keeps no message from stderr; one for both
    # when they are one file (`2>&1`): two writers could cut each other's lines.
    lines = _Lines()
    err_lines = lines if _same_file(out_fd, err_fd) else _Lines()
    from .batch_progress import wanted

    terminal = wanted()  # then the live line shows (rich puts messages above it)

    def say(message: str) -> None:
        if terminal:
            print(message, file=sys.stderr)
        else:
            err_lines.put(err_fd, message + "\n", sys.stderr)

    def stopping() -> None:
        """Stop the batch (a signal, stdout gone): its runs now, resumable; the deliveries
        of runs that ended get `STOP_DRAIN` seconds more."""
        for scope in stop:
            scope.cancel()
        for d in deliveries:
            d.scope.deadline = min(d.scope.deadline, trio.current_time() + STOP_DRAIN)

    def cannot_write(fd: int, exc: OSError) -> None:
        """A write of the batch's lines failed. Stdout: the batch stops, interrupted and
        resumable, as a command is stopped by SIGPIPE (and `kernel run` by the same reader
        gone); what it would have printed is in the journal. Stderr: its lines are lost."""
        if fd != out_fd:
            _to_devnull(sys.stderr)
            return
        closed.append("stdout")
        _to_devnull(results)
        why = "output pipe closed (stdout)" if isinstance(exc, BrokenPipeError) else \
            f"cannot write the results on stdout ({exc.strerror or exc})"
        say(f"kernel: {why}: cancelling batch {args.batch_id} (resume it with "
            f"kernel batch --resume {args.batch_id})")
        stopping()

    async def on_signal(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if (got or late) and deliveries:  # again: stop delivering too
                say(f"kernel: {name}: stopping {deliveries[0].pending} delivery(ies)")
                deliveries[0].scope.cancel()
                if not got:  # the batch is stopped now, its deliveries left owed: 130
                    got.append(signum)
                continue
            if deliveries and deliveries[0].closed and not closed:
                # Every run has ended; only deliveries are under way. Stopping the batch
                # would leave it unfinished for a resume that has nothing to run.
                late.append(signum)
                d = deliveries[0]
                d.scope.deadline = min(d.scope.deadline, trio.current_time() + STOP_DRAIN)
                say(f"kernel: {name}: every run of batch {args.batch_id} has ended; its "
                    f"{d.pending} delivery(ies) get at most {STOP_DRAIN:g}s more (again: "
                    "stop them; kernel batch --resume delivers what is left)")
                continue
            got.append(signum)
            say(f"kernel: {name}: cancelling batch {args.batch_id} (resume it with kernel "
                f"batch --resume {args.batch_id})")
            stopping()

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                   signal.SIGQUIT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lines.serve, cannot_write)
            if err_lines is not lines:
                nursery.start_soon(err_lines.serve, cannot_write)
            nursery.start_soon(on_signal, signals)
            code = await _run_batch(args, json_out=json_out, say=say, lines=lines,
                                    output=(out_fd, results), stop=stop,
                                    stopping=stopping, got=got, closed=closed,
                                    deliveries=deliveries)
            # The lines still waiting for their reader are written before the batch
            # ends (as any program's output would be), until a signal says stop; after
            # a stop, a reader that does not read them soon loses them.
            with trio.CancelScope() as drain:
                stop.append(drain)
                if got or closed or late:
                    drain.deadline = trio.current_time() + LINES_DRAIN
                await err_lines.close()
                await lines.close()
            nursery.cancel_scope.cancel()
    if lines.left.get(out_fd) and not err_lines.left.get(err_fd):
        print(f"kernel: {lines.left[out_fd]} line(s) of --json output not written (their "
              "reader did not read them; the journal has every run: kernel query)",
              file=sys.stderr)
    return code


async def _run_batch(args: _Args, *, json_out: bool, say: Any, lines: _Lines,
                     output: tuple[int, TextIO], stop: list[Any], stopping: Any,
                     got: list[int], closed: list[str], deliveries: list[Any]) -> int:
    import trio

    from batteries.batch import BatchBusyError, BatchRunner, KernelDispatch
    from batteries.runner import open_ports
    from kernel import ConfigError, PortFailure, PortSpec

    from . import batch_progress
    from .recover_cmd import stop_leftovers

    warnings: list[PortFailure] = []
    counts: Counter[str] = Counter()
    failed: list[TaskOutcome] = []
    t0 = time.monotonic()
    #: Runs whose delivery failed, and how.
    undelivered: list[tuple[TaskOutcome, PortFailure]] = []
    #: Tasks whose result is still owed a delivery (failed, or never delivered): the
    #: journal keeps them so and --resume delivers them.
    owed: list[TaskOutcome] = []
    out_fd, results = output

    def on_outcome(out: TaskOutcome) -> None:
        counts[out.status] += 1
        failures = [f for f in (out.result.port_failures if out.result is not None else ())
                    if f.port == "delivery"]
        if out.undelivered:
            owed.append(out)
            if not failures:  # owed from before, and this process delivers nowhere
                failures = [PortFailure("delivery", "deliver", _NOWHERE.format(out.delivery))]
        for failure in failures:
            undelivered.append((out, failure))
            if live is None:
                say(_undelivered_line(out, failure))
        if json_out and not closed:
            doc = out.to_dict()
            doc["batch_id"] = args.batch_id
            lines.put(out_fd, json.dumps(doc, default=str) + "\n", results)
        if not out.ok:
            failed.append(out)
            if live is None and not json_out:
                say(_failure_line(out))

    async def before_resume(run_id: str) -> None:
        await trio.to_thread.run_sync(partial(stop_leftovers, run_id, db=args.db))

    live = None
    journals: list[Any] = []
    #: The --workers dispatcher, once the workers are open (what their journals lost).
    remotes: list[Any] = []
    async with _spill_noted(open_ports(PortSpec(db=args.db, no_critic=True), warnings=warnings,
                                       redactor=args.redactor, journals=journals),
                            journals, say) as ports:
        journal = journals[0]
        given = args.given
        dispatch: Any
        if args.ray is not None:
            _quiet_ray_sigterm_note()
            dispatch = _ray_dispatch(args, journal)
            try:
                await dispatch.connect()
                await dispatch.check_store()
            except (ConnectionError, ConfigError) as exc:
                say(f"kernel batch: error: {exc}")
                return 2
        else:
            dispatch = KernelDispatch(ports, lambda spec: _build(spec, given),
                                      critic_for=_critics(), redacted=True)
        runner = BatchRunner(journal, dispatch, concurrency=args.concurrency,
                             before_resume=before_resume)
        try:
            if args.tasks is not None:
                await runner.create(args.tasks, batch_id=args.batch_id, name=args.name,
                                    source=args.source, options=args.options())
                verb = "started"
            else:
                verb = "resumed"
            # Before anything starts (the workers' runs, progress): a batch another
            # process runs is one line, exit 2, whether or not it has workers.
            await runner.claim(args.batch_id)
        except BatchBusyError as exc:
            say(f"kernel batch: error: {exc}")
            async with _workers(args):  # they were forked for nothing: let them go
                pass
            return 2
        except Exception as exc:
            say(f"kernel batch: error: {exc}")
            return 2
        runner.concurrency = args.at_once or args.concurrency
        say(f"kernel: batch {args.batch_id} {verb}: {args.total} task(s), concurrency "
            f"{runner.concurrency}" + (f", {args.workers} workers" if args.workers > 1 else ""))
        for note in args.notes:
            say(note)
        async with _delivering(args, on_outcome) as delivery, trio.open_nursery() as nursery:
            # Delivering, the runner submits each outcome to the delivery, which reports
            # it (`on_outcome`) once its delivery ended.
            if delivery is not None:
                deliveries.append(delivery)
                nursery.start_soon(delivery.serve)
            if batch_progress.wanted():
                live = batch_progress.BatchProgress(runner, args.total, delivery)
                nursery.start_soon(batch_progress.show, live)
            with trio.CancelScope() as runs:
                stop.append(runs)
                if got or closed:  # stopped already (a signal; the pipe closed)
                    stopping()
                async with _workers(args) as remote:
                    if remote is not None:
                        runner.dispatch = remote
                        remotes.append(remote)
                    await runner.run(
                        args.batch_id, on_outcome=on_outcome if delivery is None else None,
                        on_start=live.on_start if live is not None else None,
                        delivery=delivery)
            if delivery is not None:
                delivery.close()  # every run has ended: deliver what is left
                await delivery.served.wait()
            nursery.cancel_scope.cancel()
    for failure in warnings:
        say(f"kernel: warning: {failure}")
    if live is not None:
        for out, failure in undelivered:
            say(_undelivered_line(out, failure))
    if live is not None and not json_out:
        for out in failed:
            say(_failure_line(out))
    if owed:
        say(f"kernel: warning: batch {args.batch_id}: {len(owed)} run(s) not delivered "
            f"everywhere (see above); kernel batch --resume {args.batch_id} delivers them "
            "again")
    elapsed = time.monotonic() - t0
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if owed:
        summary += f", {len(owed)} undelivered"
    if got or closed:
        summary = summary or "nothing finished"
        say(f"kernel: batch {args.batch_id} interrupted after {elapsed:.1f}s ({summary}); "
            f"resume: kernel batch --resume {args.batch_id}")
        return 130
    # A result that did not reach its destinations is work the batch still owes, as a
    # task that did not end is: exit 1 until --resume delivers it.
    code = 0 if counts and set(counts) == {"ok"} and not owed else 1
    # Audit rows the journals lost (not written, nor kept in a spill file), here or in a
    # worker: what the journal says of these runs is not what happened (as `kernel run`).
    # (Events, and operations such as the batch's finish or its delivery marks.)
    lost = sum(j.unwritten + j.unwritten_ops for j in journals) + sum(
        r.unwritten for r in remotes)
    why_exit = ""
    if code == 0 and lost:
        code, why_exit = 1, f": {lost} audit row(s) were lost"
    say(f"kernel: batch {args.batch_id}: {summary} in {elapsed:.1f}s (exit {code}{why_exit})")
    if not runner.finished:
        from batteries.batch import UNFINISHED

        left = sum(n for s, n in counts.items() if s in UNFINISHED)
        say(f"kernel: batch {args.batch_id} is not finished: {left} task(s) did not end "
            f"here; kernel batch --resume {args.batch_id} finishes them")
    return code


def _same_file(a: int, b: int) -> bool:
    try:
        x, y = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _fileno(stream: TextIO) -> int:
    """The stream's file descriptor, its Python buffer flushed first (its lines are
    written to the descriptor from now on: `_Lines`)."""
    stream.flush()
    return stream.fileno()


class _Lines:
    """The runs' lines (--json on stdout, messages on stderr), written in order by a
    worker thread instead of the trio thread when the descriptor has a reader (a pipe,
    a terminal, a socket); a regular file's on the trio thread, as before.

    A reader that stops reading (`| less` left on its first page, a full pipe to a
    slow consumer) used to block the trio thread inside `write`: every run, deadline
    and signal of the batch stopped with it (SIGINT waited 14 s for a reader that
    slept 20 s, for ever for one that never reads). Now the lines wait in memory for
    the reader while the batch goes on; a write that fails calls `serve`'s
    `cannot_write` once for its descriptor, whose later lines are dropped.
    """

    def __init__(self) -> None:
        self._queued: list[tuple[int, bytes]] = []
        self._more: Any = None  # a trio.Event, made in trio (`serve`)
        self._closed = False
        self._failed: set[int] = set()
        self._served: Any = None
        self._inline: dict[int, bool] = {}
        #: Descriptor -> lines not written to it because the batch ended first (a reader
        #: that did not read them in time); those of a descriptor whose write failed
        #: are not counted.
        self.left: dict[int, int] = {}

    def put(self, fd: int, line: str, stream: TextIO) -> None:
        """Queue `line` (encoded as `stream` would) for `fd`."""
        if fd in self._failed:
            return
        encoding = getattr(stream, "encoding", None) or "utf-8"
        self._queued.append((fd, line.encode(encoding, getattr(stream, "errors", None)
                                              or "strict")))
        if self._more is not None:
            self._more.set()

    async def serve(self, cannot_write: Any) -> None:
        """Write what is queued until `close` (cancelled: what is queued is left)."""
        import trio

        self._more = trio.Event()
        self._served = trio.Event()
        try:
            while True:
                if not self._queued:
                    if self._closed:
                        return
                    await self._more.wait()
                    self._more = trio.Event()
                    continue
                fd = self._queued[0][0]
                inline = self._inline.get(fd)
                if inline is None:
                    inline = self._inline[fd] = _never_blocks(fd)
                if not inline and not self._closed:
                    # A thread's round trip per line costs more than the write (5,000
                    # lines to a pipe: +0.5 s): the lines of the next moment go together.
                    await trio.sleep(GATHER)
                n = next((i for i, (f, _) in enumerate(self._queued) if f != fd),
                         len(self._queued))
                chunk, self._queued = self._queued[:n], self._queued[n:]
                data = b"".join(data for _, data in chunk)
                try:
                    if inline:
                        _write_all(fd, data)
                    else:
                        await trio.to_thread.run_sync(_write_all, fd, data,
                                                      abandon_on_cancel=True)
                except OSError as exc:  # its lines are dropped: `cannot_write` says why
                    self._failed.add(fd)
                    self._queued = [item for item in self._queued if item[0] != fd]
                    cannot_write(fd, exc)
                except BaseException:
                    self._queued[:0] = chunk
                    raise
        finally:
            for fd, _ in self._queued:
                self.left[fd] = self.left.get(fd, 0) + 1
            self._queued = []
            self._served.set()

    async def close(self) -> None:
        """No more lines: wait until every queued one is written (or `serve` ended)."""
        self._closed = True
        if self._served is None:
            return
        self._more.set()
        await self._served.wait()


#: Seconds the lines bound for a pipe or terminal are gathered before a thread writes them.
GATHER = 0.01


def _never_blocks(fd: int) -> bool:
    """True for a descriptor a write never waits on a reader for: a regular file (a
    disk write, as before), /dev/null. Its lines are written on the trio thread."""
    import stat

    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            return True
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev
    except OSError:
        return False


def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (in a worker thread: it may block on a full pipe)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


#: Seconds the lines of a stopped batch (a signal, stdout gone) get to reach their reader:
#: plenty for one that reads, and a stalled one never holds up the exit.
LINES_DRAIN = 2.0
#: Seconds the deliveries of ended runs get once the batch is stopped (a signal, stdout
#: gone): what a run's own delivery gets (`Limits.finalize_timeout`'s default).
STOP_DRAIN = 30.0
#: Threads writing --deliver-dir folders at once: few, so they never take the worker
#: threads the journal's reads (and Ray's waits) need.
DIRECTORY_THREADS = 4


@asynccontextmanager
async def _delivering(args: _Args, on_delivered: Any) -> AsyncIterator[Any]:
    """A `BatchDelivery` to --deliver-dir and each --webhook (None without them).

    The webhooks share one HTTP client (a client costs ~30 ms of CPU to make, as
    much as 20 runs: `kernel run` makes one for its one delivery) that keeps no
    cookies, so each delivery is sent as `kernel run` would send it.
    """
    if args.deliver_dir is None and not args.webhooks:
        yield None
        return
    import trio

    from batteries.batch import DELIVERY_LIMIT, BatchDelivery
    from batteries.delivery import DirectoryDelivery, FanOutDelivery, WebhookDelivery

    chosen: list[Any] = []
    # What --resume delivers again (the journal's copy of a result: its output as stored,
    # no artifacts) never replaces a run folder that is there already: delivered whole.
    again: list[Any] = []
    if args.deliver_dir is not None:
        limiter = trio.CapacityLimiter(DIRECTORY_THREADS)
        chosen.append(DirectoryDelivery(args.deliver_dir, limiter=limiter))
        again.append(DirectoryDelivery(args.deliver_dir, limiter=limiter, replace=False))
    hooks = [WebhookDelivery(url) for url in args.webhooks]
    # A failed delivery's error is stored with its task, redacted as everything stored.
    redact = args.redactor.text if args.redactor is not None else None
    if not hooks:
        yield BatchDelivery(FanOutDelivery(chosen), on_delivered=on_delivered, redact=redact,
                            redeliver=FanOutDelivery(again))
        return
    import http.cookiejar

    import httpx

    at_once = DELIVERY_LIMIT * len(hooks)
    jar = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    async with httpx.AsyncClient(
            timeout=max(h.timeout for h in hooks), cookies=jar,
            limits=httpx.Limits(max_connections=at_once,
                                max_keepalive_connections=at_once)) as client:
        for hook in hooks:
            hook.client = client
        yield BatchDelivery(FanOutDelivery([*chosen, *hooks]), on_delivered=on_delivered,
                            redact=redact, redeliver=FanOutDelivery([*again, *hooks]))


#: The failure said for a task whose result was owed a delivery before this process (its
#: delivery failed, or never ended) when this process delivers nowhere.
_NOWHERE = ("its result is owed a delivery ({}) and this batch delivers nowhere: give "
            "--deliver-dir or --webhook to --resume")


def _undelivered_line(out: TaskOutcome, failure: Any) -> str:
    from .ids import short_id

    return f"kernel: warning: task {out.task_id} (run {short_id(out.run_id)}): {failure}"


def _to_devnull(stream: TextIO) -> None:
    """Point a stream whose reader went away at /dev/null: what is still buffered, and
    the flush at exit, go nowhere instead of failing again (Python's advice for
    BrokenPipeError)."""
    import contextlib

    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


def _failure_line(out: TaskOutcome) -> str:
    from .ids import short_id

    why = f": {out.error}" if out.error else ""
    return f"kernel: task {out.task_id} (run {short_id(out.run_id)}) {out.status}{why}"


# ------------------------------------------------------------------ listing


def _list(db: str | None, *, fmt: str) -> int:
    from kernel import ConfigError

    try:
        store = _store(db)
    except ConfigError as exc:
        _fail(str(exc))
    try:
        rows = store.batches()
    finally:
        store.close()
    records: list[dict[str, Any]] = [
        {"batch_id": row.batch_id, "name": row.name, "source": row.source,
         "created_at": row.created_at, "ended_at": row.ended_at,
         "state": "interrupted" if row.interrupted else row.status, "tasks": row.tasks,
         "concurrency": row.concurrency, "counts": row.counts,
         "deliveries": row.deliveries, "undelivered": _undelivered(row)} for row in rows]
    if output.print_records(fmt, records, _LIST_FIELDS):
        return 0
    if not rows:
        print("no batches", file=sys.stderr)
        return 0
    from datetime import UTC

    table = []
    for r in records:
        counts = " ".join(f"{k}={v}" for k, v in sorted(r["counts"].items(),
                                                         key=lambda kv: -kv[1]))
        when = r["created_at"].astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.append((r["batch_id"], when, r["state"], r["tasks"], counts,
                      r["undelivered"], r["name"] or ""))
    print(output.table(("BATCH", "CREATED (UTC)", "STATE", "TASKS", "RUNS", "UNDELIVERED",
                        "NAME"), table, right=(3, 5)))
    return 0


def _undelivered(row: BatchRow) -> int | None:
    """Tasks of a batch whose run ended and whose result was not delivered (failed, or
    not yet: under way, or the batch process died first); None when it delivers nothing."""
    from batteries.batch import UNDELIVERED

    if not row.deliveries:
        return None
    return sum(n for state, n in row.deliveries.items() if state in UNDELIVERED)


_LIST_FIELDS = ("batch_id", "name", "source", "created_at", "ended_at", "state", "tasks",
                "concurrency", "counts", "deliveries", "undelivered")
