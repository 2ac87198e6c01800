"""The critic corpus: does the critic tell stuck runs from slow ones? (issue 14)

    python bench/critic_corpus.py                      # every case, every mode (~6 min)
    python bench/critic_corpus.py --only cpu_silent,llm_exact_loop --modes idle
    python bench/critic_corpus.py --json               # one JSON document instead of tables
    python bench/critic_corpus.py --kernel /other/venv/bin/kernel   # another build

Each case is a small self-contained behaviour, labelled *healthy* (slow but
working; it ends by itself with exit 0) or *stuck* (it never ends by itself).
It is run exactly as a user would: `kernel run ... -- python corpus_proc.py
CASE` for a process, `kernel run --agent llm --base-url http://127.0.0.1:PORT/...`
against a scripted chat-completions server in this process for a model.
Real processes, real time. Each case writes the moment of its last real
progress to a side file (the process behaviours themselves; the fake server
for the model cases), so detection latency ("lat s") = the moment the kernel
ended the run (its `ended_at` in the run's audit file: the process tree is
stopped by then) minus that moment; "+exit" is how much later `kernel run`
itself exited (audit flush, delivery, interpreter exit).

Every case runs in three modes, each with the same hard `--timeout` (the
defaults mode may get a longer one, `--defaults-timeout`, to let a default
idle timeout of minutes play out):

    idle      --idle-timeout 3 (or --idle-timeout S)
    defaults  the critic with its default thresholds
    stepcap   --no-critic --max-steps 25: a plain step cap, LangGraph
              recursion_limit-style; a command is one step, so only the
              hard timeout ends a stuck command

A stuck run is *caught* when the critic ends it (any status but `ok`,
`timeout` or `max_steps`), *caught by the step cap* when it ends `max_steps`,
and *missed* when it ends `ok` (e.g. an empty answer accepted) or `timeout`
(the hard backstop, not the critic). A healthy run is *falsely killed* when it
ends `killed`. Latency is counted for every stopped stuck run (critic or
step cap). Processes left behind after `kernel run` exits are counted as
leaks and then ended by id.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

HERE = Path(__file__).resolve().parent
PROC = HERE / "corpus_proc.py"
STEP_CAP = 25

# ---------------------------------------------------------------- the model


def completion(content: str | None, *calls: dict[str, Any]) -> dict[str, Any]:
    """A chat-completion body as OpenAI sends it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return {"id": "chatcmpl-corpus", "object": "chat.completion", "created": int(time.time()),
            "model": "corpus-model",
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}}


def tool_call(n: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


class Script:
    """A model's behaviour for one run: what turn n answers, after what delay.

    The default 0.5 s a turn keeps the looping cases honest: 100 turns (the
    default step ceiling) take longer than the 40 s hard timeout, so in the
    critic modes only the critic can stop them early, whatever the load.

    `progress_until`: requests 0..progress_until are real progress (the model
    learns something new from each); None means every request is.
    """

    delay: float = 0.5
    progress_until: int | None = None
    allow_shell: bool = False
    prompt: str = "Do the task."
    files: dict[str, str] = {}

    def __init__(self, workdir: Path, scale: float = 1.0) -> None:
        self.workdir = workdir
        self.scale = scale

    def turn(self, n: int) -> dict[str, Any]:
        raise NotImplementedError

    def wait(self, n: int) -> float:
        """How long the model "thinks" before answering request n."""
        return self.delay * self.scale


class SlowTurns(Script):
    """Three model turns of 4 s each: read two files, then answer."""

    delay = 4.0
    prompt = "Add up the totals in notes.txt and data.csv."
    files = {"notes.txt": "total: 30\n", "data.csv": "item,total\nwidgets,12\n"}

    def turn(self, n: int) -> dict[str, Any]:
        if n == 0:
            return completion(None, tool_call(n, "read_file", {"path": "notes.txt"}))
        if n == 1:
            return completion(None, tool_call(n, "read_file", {"path": "data.csv"}))
        return completion("The total is 42.")


class PollJob(Script):
    """Polls a job with the same call; the answer moves 1/8, 2/8 ... 8/8, then done."""

    delay = 1.0
    prompt = "Wait for job 7f3a to finish, then report."
    files = {"job-7f3a.txt": "job 7f3a: queued\n"}

    def turn(self, n: int) -> dict[str, Any]:
        if n < 8:  # the job advances between two polls
            (self.workdir / "job-7f3a.txt").write_text(f"job 7f3a: {n + 1}/8 steps done\n")
            return completion(None, tool_call(n, "read_file", {"path": "job-7f3a.txt"}))
        return completion("Job 7f3a finished: 8/8 steps done.")


class GrowingPoll(Script):
    """Polls a download with the same call; the byte count grows and the ETA shrinks."""

    delay = 1.0
    prompt = "Wait for the download to finish, then report."
    files = {"download.txt": "downloaded 1000000000 of 1400000000 bytes, ETA 50 min\n"}

    def turn(self, n: int) -> dict[str, Any]:
        if n < 8:  # the download advances between two polls
            done = 1_000_000_000 + (n + 1) * 50_000_000
            (self.workdir / "download.txt").write_text(
                f"downloaded {done} of 1400000000 bytes, ETA {45 - 5 * n} min\n")
            return completion(None, tool_call(n, "read_file", {"path": "download.txt"}))
        return completion("The download finished: 1400000000 bytes.")


class SamePreamble(Script):
    """Every turn opens with the same words ("Let me check.") and reads a different file."""

    prompt = "Add up the totals in part0.txt to part5.txt."
    files = {f"part{i}.txt": f"total: {i + 1}\n" for i in range(6)}

    def turn(self, n: int) -> dict[str, Any]:
        if n < 6:
            return completion("Let me check.",
                              tool_call(n, "read_file", {"path": f"part{n}.txt"}))
        return completion("The totals add up to 21.")


class LongTool(Script):
    """One tool call that runs 8 s silently (a test suite), then the answer."""

    allow_shell = True
    prompt = "Run the test suite and report."

    def __init__(self, workdir: Path, scale: float = 1.0) -> None:
        super().__init__(workdir, scale)
        self.files = {"run_tests.sh": f"sleep {8 * scale:g}\necho '112 passed'\n"}

    def turn(self, n: int) -> dict[str, Any]:
        if n == 0:
            return completion("Running the tests.",
                              tool_call(n, "shell", {"command": "sh run_tests.sh"}))
        return completion("All 112 tests pass.")


class ExactLoop(Script):
    """The same call, the same result, forever."""

    progress_until = 1
    prompt = "What does note.txt say?"
    files = {"note.txt": "remember to water the plants\n"}

    def turn(self, n: int) -> dict[str, Any]:
        return completion(None, tool_call(n, "read_file", {"path": "note.txt"}))


class Cycle(Script):
    """A-B-A-B: two calls alternating, each result unchanged."""

    progress_until = 2
    prompt = "Reconcile a.txt with b.txt."
    files = {"a.txt": "balance: 100\n", "b.txt": "balance: 120\n"}

    def turn(self, n: int) -> dict[str, Any]:
        return completion(None, tool_call(n, "read_file", {"path": "ab"[n % 2] + ".txt"}))


class NearDuplicate(Script):
    """The same check with a fresh timestamp and counter each time; the same result."""

    progress_until = 1
    allow_shell = True
    prompt = "Wait until the deployment status is ready."
    files = {"status.txt": "deployment: pending (waiting for approval)\n"}

    def turn(self, n: int) -> dict[str, Any]:
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
        return completion(None, tool_call(n, "shell", {
            "command": f"cat status.txt  # checked at {stamp}, attempt {n + 1}"}))


class SameError(Script):
    """Different build commands, each failing with the identical error."""

    progress_until = 1
    allow_shell = True
    prompt = "Build the project."
    files = {"build.sh": "echo 'src/net.c:3:10: fatal error: openssl/ssl.h: No such file or "
                         "directory' >&2\nexit 1\n"}
    variants = ("", " --verbose", " -j2", " --clean", " --release", " --debug")

    def turn(self, n: int) -> dict[str, Any]:
        cmd = "sh build.sh" + self.variants[n % len(self.variants)]
        return completion(None, tool_call(n, "shell", {"command": cmd}))


class Empty(Script):
    """The model answers with an empty message, every time."""

    progress_until = 0
    prompt = "Summarise the design document."

    def turn(self, n: int) -> dict[str, Any]:
        return completion("")


class ModelServer:
    """A chat-completions server on 127.0.0.1; /<key>/v1 plays the script registered as key.

    It also serves the network cases of corpus_proc.py (their `CORPUS_HTTP`), from
    outside the run's process tree as a real server would: GET /trickle?chunk=N&
    every=S&count=K sends K chunks of N bytes, one every S seconds (a slow
    download); /status answers the same small JSON every time (a job that never
    finishes); /hang reads the request and never answers.
    """

    def __init__(self) -> None:
        self.scripts: dict[str, tuple[Script, Path, list[int]]] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path == "/trickle":
                    chunk, count = int(query.get("chunk", 1024)), int(query.get("count", 8))
                    every = float(query.get("every", 0.25))
                    try:
                        self.send_response(200)
                        self.send_header("Content-Type", "application/octet-stream")
                        self.send_header("Content-Length", str(chunk * count))
                        self.end_headers()
                        for i in range(count):
                            if i and server.stopping.wait(every):
                                return
                            self.wfile.write(os.urandom(chunk))
                            self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the run was stopped mid-download
                elif url.path == "/status":
                    self._send(200, {"job": "7f3a", "state": "pending",
                                     "detail": "waiting for a runner to pick the job up"})
                elif url.path == "/hang":
                    server.stopping.wait()  # never answers (until the harness exits)
                else:
                    self._send(404, {"error": {"message": f"no such path {url.path!r}"}})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                key = self.path.strip("/").split("/", 1)[0]
                with server.lock:
                    entry = server.scripts.get(key)
                    if entry is not None:
                        script, progress, count = entry
                        n = count[0]
                        count[0] += 1
                if entry is None:
                    self._send(404, {"error": {"message": f"no script {key!r}"}})
                    return
                if script.progress_until is None or n <= script.progress_until:
                    write_progress(progress)
                time.sleep(script.wait(n))
                self._send(200, script.turn(n))

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the run was stopped while the model "thought"

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> ModelServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def register(self, key: str, script: Script, progress: Path) -> str:
        with self.lock:
            self.scripts[key] = (script, progress, [0])
        return f"http://127.0.0.1:{self.port}/{key}/v1"

    def requests(self, key: str) -> int:
        with self.lock:
            entry = self.scripts.get(key)
            return entry[2][0] if entry else 0


def write_progress(path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(time.time()))
    os.replace(tmp, path)


# ----------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One behaviour: a process (`proc`, a corpus_proc.py case) or a model script.

    `extra` cases run only when named with --only (they take minutes).
    """

    name: str
    label: str  # "healthy" | "stuck"
    what: str
    proc: str | None = None
    script: type[Script] | None = None
    extra: bool = False


CASES: tuple[Case, ...] = (
    Case("cpu_silent", "healthy", "CPU-bound, prints nothing for 8 s, then the answer",
         proc="cpu_silent"),
    Case("io_writer", "healthy", "writes 1 MiB every 0.1 s to a file for 8 s, silent",
         proc="io_writer"),
    Case("child_worker", "healthy", "silent parent; a child works 8 s and logs to a file",
         proc="child_worker"),
    Case("steady_output", "healthy", "a new line every 0.5 s for 8 s", proc="steady_output"),
    Case("bursty_output", "healthy", "bursts of lines, 6 s of silent CPU work between",
         proc="bursty_output"),
    Case("quiet_build", "healthy", "10 s of short compiler-like children, nothing printed",
         proc="quiet_build"),
    Case("llm_slow_turns", "healthy", "model turns of 4 s each (3 turns)", script=SlowTurns),
    Case("llm_poll_changing", "healthy", "polls a job with the same call: 1/8 ... 8/8",
         script=PollJob),
    Case("llm_long_tool", "healthy", "one silent 8 s tool call (a test suite)",
         script=LongTool),
    Case("cr_progress", "healthy", "a counter redrawn with \\r, 1/12 ... 12/12, no newline",
         proc="cr_progress"),
    Case("llm_poll_growing", "healthy", "polls a download: the byte count grows, the ETA "
         "shrinks", script=GrowingPoll),
    Case("llm_same_preamble", "healthy", "\"Let me check.\" every turn, a different file "
         "each time", script=SamePreamble),
    Case("slow_download", "healthy", "downloads at 4 KiB/s for 10 s into memory: silent, "
         "recv() only", proc="slow_download"),
    Case("cha_progress", "healthy", "a counter redrawn with ESC[1G (no \\r), 1/12 ... 12/12",
         proc="cha_progress"),
    Case("sleep_forever", "stuck", "prints a line, then sleeps: silent, flat",
         proc="sleep_forever"),
    Case("fifo_read", "stuck", "blocked reading a FIFO nobody writes", proc="fifo_read"),
    Case("deadlock", "stuck", "two threads each waiting for the other's lock",
         proc="deadlock"),
    Case("spinner", "stuck", "\\r-redrawn spinner on the same text every 0.5 s",
         proc="spinner"),
    Case("repeated_line", "stuck", "the same status line printed every 0.5 s",
         proc="repeated_line"),
    Case("clock_line", "stuck", "the same line every second, only a clock time changes",
         proc="clock_line"),
    Case("waiting_input", "stuck", "prompts and blocks reading its terminal (a pty)",
         proc="waiting_input"),
    Case("silent_socket", "stuck", "sent an HTTP request; the server never answers",
         proc="silent_socket"),
    Case("wait_loop", "stuck", "a shell loop waiting for a file: `sleep 0.1` ten times a "
         "second", proc="wait_loop"),
    Case("quiet_poll", "stuck", "polls a job's status every 2 s, always 'pending', silent",
         proc="quiet_poll"),
    Case("cha_spinner", "stuck", "a spinner redrawn with ESC[1G (no \\r) on the same text",
         proc="cha_spinner"),
    Case("llm_exact_loop", "stuck", "read_file(note.txt) again and again, same result",
         script=ExactLoop),
    Case("llm_abab", "stuck", "A-B-A-B: read_file(a.txt), read_file(b.txt), ...",
         script=Cycle),
    Case("llm_near_duplicate", "stuck", "same check, only a timestamp/counter differs",
         script=NearDuplicate),
    Case("llm_same_error", "stuck", "different build commands, the identical error",
         script=SameError),
    Case("llm_empty", "stuck", "the model answers with an empty message", script=Empty),
    Case("long_quiet_build", "healthy", "a light, silent 400 s build (for the defaults mode; "
         "give --defaults-timeout 440)", proc="long_quiet_build", extra=True),
)


@dataclass(frozen=True)
class Mode:
    name: str
    title: str
    flags: tuple[str, ...]
    timeout: float | None = None  # this mode's hard timeout, if not the common one


def modes(idle: float, defaults_timeout: float | None = None) -> dict[str, Mode]:
    return {
        "idle": Mode("idle", f"--idle-timeout {idle:g}", ("--idle-timeout", f"{idle:g}")),
        "defaults": Mode("defaults", "critic defaults", (), defaults_timeout),
        "stepcap": Mode("stepcap", f"step cap {STEP_CAP} (no critic)",
                        ("--no-critic", "--max-steps", str(STEP_CAP))),
    }


# ---------------------------------------------------------------- running


@dataclass
class Outcome:
    """What one run of one case in one mode ended as."""

    case: str
    label: str
    mode: str
    status: str
    reason: str | None = None
    error: str | None = None
    exit_code: int | None = None
    wall_s: float = 0.0
    latency_s: float | None = None  # the run's end (audit ended_at) - last real progress
    exit_latency_s: float | None = None  # `kernel run` exited - last real progress
    steps: int | None = None
    tool_calls: int | None = None
    leaked: list[str] = field(default_factory=list)  # alive after `kernel run` exited
    model_requests: int | None = None
    run_id: str | None = None
    critic: list[str] = field(default_factory=list)  # its decisions, from `kernel show`

    @property
    def stopped_by(self) -> str | None:
        """Who ended the run: "critic", "step cap" (max_steps), or None (it ended by
        itself, or the hard backstop ended it, or the harness had to)."""
        if self.status in ("ok", "timeout", "crash"):
            return None
        return "step cap" if self.status == "max_steps" else "critic"

    @property
    def verdict(self) -> str:
        if self.label == "stuck":
            return {"critic": "caught", "step cap": "caught (step cap)"}.get(
                self.stopped_by or "", "MISSED")
        if self.status == "ok":
            return "ok"
        return "FALSE KILL" if self.status == "killed" else f"WRONG ({self.status})"


def default_kernel() -> str:
    exe = Path(sys.executable).parent / "kernel"
    if exe.exists():
        return str(exe)
    found = shutil.which("kernel")
    if found is None:
        sys.exit("critic_corpus: no `kernel` executable next to this Python or on PATH")
    return found


def kernel_argv(kernel: str, case: Case, mode: Mode, timeout: float, db: Path,
                progress: Path, scale: float, base_url: str | None) -> list[str]:
    argv = [kernel, "run", "--json", "--db", str(db), "--timeout", f"{timeout:g}",
            "--name", f"corpus {case.name}", *mode.flags]
    if case.proc is not None:
        return [*argv, "--", sys.executable, str(PROC), case.proc, str(progress), f"{scale:g}"]
    assert case.script is not None and base_url is not None
    argv += ["--agent", "llm", "--model", "corpus-model", "--base-url", base_url,
             "--prompt", case.script.prompt]
    if case.script.allow_shell:
        argv.append("--allow-shell")
    return argv


def run_case(case: Case, mode: Mode, *, kernel: str, timeout: float, root: Path,
             server: ModelServer, scale: float = 1.0) -> Outcome:
    """Run one case in one mode through `kernel run` and classify how it ended."""
    workdir = root / f"{case.name}.{mode.name}"
    workdir.mkdir(parents=True)
    progress = root / f"{case.name}.{mode.name}.progress"
    base_url = key = None
    if case.script is not None:
        script = case.script(workdir, scale)
        for fname, text in script.files.items():
            (workdir / fname).write_text(text)
        key = f"{case.name}.{mode.name}"
        base_url = server.register(key, script, progress)
    db = root / f"{case.name}.{mode.name}.duckdb"
    timeout = mode.timeout or timeout
    argv = kernel_argv(kernel, case, mode, timeout, db, progress, scale, base_url)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "PYTHONDONTWRITEBYTECODE")}
    env["NO_COLOR"] = "1"
    env["CORPUS_HTTP"] = server.url  # the network cases' server
    out_path = root / f"{case.name}.{mode.name}.out"
    err_path = out_path.with_suffix(".err")
    t0 = time.time()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout + 60)  # the hard --timeout plus a generous finalize margin
            crashed = None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            crashed = f"kernel run did not exit within --timeout + 60 s ({timeout + 60:g} s)"
    t1 = time.time()
    leaked = reap(workdir)
    last = read_progress(progress)
    doc = parse_result(out_path.read_text(errors="replace"))
    if doc is None or crashed:
        tail = err_path.read_text(errors="replace").strip().splitlines()[-3:]
        o = Outcome(case.name, case.label, mode.name, "crash",
                    error=crashed or " | ".join(tail) or f"no JSON result (exit {proc.returncode})",
                    exit_code=proc.returncode, wall_s=t1 - t0, leaked=leaked)
    else:
        o = Outcome(case.name, case.label, mode.name, str(doc.get("status")),
                    reason=doc.get("reason"), error=doc.get("error"),
                    exit_code=proc.returncode, wall_s=t1 - t0, steps=doc.get("steps"),
                    tool_calls=doc.get("tool_calls"), leaked=leaked, run_id=doc.get("run_id"))
    if last is not None:
        o.exit_latency_s = t1 - last
        ended = ended_at(db, o.run_id) if o.run_id else None
        o.latency_s = (ended if ended is not None else t1) - last
    if key is not None:
        o.model_requests = server.requests(key)
    if o.verdict in ("MISSED", "FALSE KILL") and o.run_id:
        o.critic = critic_lines(kernel, db, o.run_id, env)
    return o


def ended_at(db: Path, run_id: str) -> float | None:
    """When the kernel ended the run (its process tree stopped), from the audit.

    Builds that journal to SQLite (`DB.journal`, times in microseconds) and
    builds that write the DuckDB file directly are both read.
    """
    journal = Path(str(db) + ".journal")
    if journal.exists():
        try:
            with contextlib.closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as con:
                row = con.execute("SELECT ended_at FROM runs WHERE run_id = ?",
                                  [run_id]).fetchone()
        except sqlite3.Error:
            return None
        return row[0] / 1e6 if row and row[0] is not None else None
    try:
        import duckdb
    except ImportError:  # run by a Python without the project installed
        return None
    try:
        with duckdb.connect(str(db), read_only=True) as con:
            row = con.execute("SELECT epoch(ended_at) FROM runs WHERE run_id = ?",
                              [run_id]).fetchone()
    except duckdb.Error:
        return None
    return float(row[0]) if row and row[0] is not None else None


def critic_lines(kernel: str, db: Path, run_id: str, env: dict[str, str]) -> list[str]:
    """The critic's decisions in a run's timeline (`kernel show`), for saying why."""
    try:
        shown = subprocess.run([kernel, "show", "--db", str(db), run_id], env=env,
                               capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [" ".join(line.split())[:160] for line in shown.splitlines()
            if " critic " in line and " watch " not in line]


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The `kernel run --json` result object: the last line of stdout that is one."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "status" in doc:
                return doc
    return None


def read_progress(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def reap(workdir: Path, grace: float = 3.0) -> list[str]:
    """Processes still working in `workdir` `grace` s after `kernel run` exited ("PID CMDLINE").

    Those are ended by pid. A helper finishing its own exit in the moment after
    (the kernel's lifeline watcher) gets the grace and is not counted.
    """
    deadline = time.monotonic() + grace
    while True:
        found = procs_in(workdir)
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    left = []
    for pid in found:
        with contextlib.suppress(OSError):
            raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            left.append(f"{pid} {cmd}")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


def procs_in(workdir: Path) -> list[int]:
    """The pids whose working directory is `workdir` or below it."""
    mine = str(workdir)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == mine or cwd.startswith(mine + "/"):
            found.append(int(entry.name))
    return found


# --------------------------------------------------------------- reporting


@dataclass
class Matrix:
    """The confusion matrix of one mode."""

    mode: str
    stuck: int = 0
    caught: int = 0  # by the critic
    capped: int = 0  # by the step ceiling (--max-steps)
    missed: list[str] = field(default_factory=list)
    healthy: int = 0
    false_kills: list[str] = field(default_factory=list)
    healthy_wrong: list[str] = field(default_factory=list)  # not ok, not killed
    latencies: list[float] = field(default_factory=list)
    within_target: int | None = None
    target_s: float | None = None
    leaked: int = 0
    wall_s: float = 0.0

    @property
    def median(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    @property
    def max(self) -> float | None:
        return max(self.latencies) if self.latencies else None


def matrix(outcomes: Sequence[Outcome], mode: str, target_s: float | None = None) -> Matrix:
    """Count one mode's outcomes: stuck caught/missed, healthy killed, latencies."""
    m = Matrix(mode, target_s=target_s)
    for o in outcomes:
        if o.mode != mode:
            continue
        m.leaked += len(o.leaked)
        m.wall_s = max(m.wall_s, o.wall_s)
        if o.label == "stuck":
            m.stuck += 1
            if o.stopped_by is not None:
                if o.stopped_by == "critic":
                    m.caught += 1
                else:
                    m.capped += 1
                if o.latency_s is not None:
                    m.latencies.append(o.latency_s)
            else:
                m.missed.append(o.case)
        else:
            m.healthy += 1
            if o.status == "killed":
                m.false_kills.append(o.case)
            elif o.status != "ok":
                m.healthy_wrong.append(o.case)
    if target_s is not None:
        m.within_target = sum(1 for x in m.latencies if x <= target_s)
    return m


def default_idle(kernel: str) -> float | None:
    """The critic's default --idle-timeout, as `kernel run --help` states it."""
    try:
        text = subprocess.run([kernel, "run", "--help"], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"--idle-timeout\b.*?\[default: ([0-9.]+)", text, re.S)
    return float(found.group(1)) if found else None


def idle_target(idle: float) -> float:
    """Issue 14's bound: idle + grace + 0.5 s, grace = min(idle / 4, 60) (today's default)."""
    return idle + min(idle * 0.25, 60.0) + 0.5


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def case_table(outcomes: Sequence[Outcome], mode_titles: dict[str, str]) -> str:
    lines = []
    head = (f"{'case':<20} {'label':<8} {'status':<15} {'reason':<16} {'exit':>4} "
            f"{'wall s':>7} {'lat s':>6} {'+exit':>5} {'steps':>5}  verdict")
    for mode, title in mode_titles.items():
        rows = [o for o in outcomes if o.mode == mode]
        if not rows:
            continue
        lines += ["", f"== {title}", head]
        for o in sorted(rows, key=lambda o: (o.label, o.case)):
            shown = o.label == "stuck" or o.status != "ok"
            lat = o.latency_s if shown else None
            tail = (o.exit_latency_s - o.latency_s if shown and o.latency_s is not None
                    and o.exit_latency_s is not None else None)
            lines.append(
                f"{o.case:<20} {o.label:<8} {o.status:<15} {(o.reason or '-')[:16]:<16} "
                f"{fmt(o.exit_code, 'd'):>4} {o.wall_s:7.1f} {fmt(lat):>6} {fmt(tail):>5} "
                f"{fmt(o.steps, 'd'):>5}  {o.verdict}"
                + (f"  [{len(o.leaked)} process(es) left behind]" if o.leaked else ""))
        for o in sorted(rows, key=lambda o: o.case):
            lines += [f"  left behind by {o.case}: {p[:150]}" for p in o.leaked]
        wrong = [o for o in rows if o.verdict in ("MISSED", "FALSE KILL")]
        for o in sorted(wrong, key=lambda o: o.case):
            lines.append(f"  why {o.case}: {' '.join((o.error or o.status).split())[:150]}")
            lines += [f"    {c}" for c in o.critic]
    return "\n".join(lines)


def matrix_table(ms: Sequence[Matrix], mode_titles: dict[str, str]) -> str:
    lines = [f"{'mode':<26} {'caught':>7} {'step cap':>8} {'missed':>6} "
             f"{'healthy killed':>14} {'lat median':>10} {'lat max':>8}  in target"]
    for m in ms:
        within = ("-" if m.within_target is None else
                  f"{m.within_target}/{len(m.latencies)} (<= {m.target_s:.2f} s)")
        lines.append(
            f"{mode_titles[m.mode]:<26} {m.caught:>4}/{m.stuck:<2} {m.capped:>8} "
            f"{len(m.missed):>6} {len(m.false_kills):>9}/{m.healthy:<4} {fmt(m.median):>10} "
            f"{fmt(m.max):>8}  {within}")
    for m in ms:
        notes = []
        if m.missed:
            notes.append("missed: " + ", ".join(m.missed))
        if m.false_kills:
            notes.append("healthy killed: " + ", ".join(m.false_kills))
        if m.healthy_wrong:
            notes.append("healthy ended otherwise: " + ", ".join(m.healthy_wrong))
        if m.leaked:
            notes.append(f"{m.leaked} process(es) outlived their run")
        if notes:
            lines.append(f"  {mode_titles[m.mode]}: " + "; ".join(notes))
    return "\n".join(lines)


# -------------------------------------------------------------------- main


def run_all(cases: Sequence[Case], chosen: Sequence[Mode], *, kernel: str, timeout: float,
            concurrency: int, scale: float = 1.0,
            on_done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run every case in every chosen mode, `concurrency` at a time."""
    root = Path(tempfile.mkdtemp(prefix="critic-corpus-"))
    jobs = [(c, m) for m in chosen for c in cases]
    # Longest first (stuck processes under no fast critic wait for the backstop).
    jobs.sort(key=lambda j: (j[0].label == "stuck" and j[1].name != "idle"), reverse=True)
    try:
        with ModelServer() as server, ThreadPoolExecutor(concurrency) as pool:
            def one(job: tuple[Case, Mode]) -> Outcome:
                o = run_case(job[0], job[1], kernel=kernel, timeout=timeout, root=root,
                             server=server, scale=scale)
                if on_done is not None:
                    on_done(o)
                return o

            results = list(pool.map(one, jobs))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--idle-timeout", type=float, default=3.0, metavar="S",
                   help="the idle mode's --idle-timeout (default 3)")
    p.add_argument("--timeout", type=float, default=40.0, metavar="S",
                   help="every run's hard --timeout (default 40)")
    p.add_argument("--defaults-timeout", type=float, default=None, metavar="S",
                   help="the defaults mode's hard --timeout (default: --timeout)")
    p.add_argument("--modes", default="idle,defaults,stepcap",
                   help="comma-separated: idle, defaults, stepcap (default: all)")
    p.add_argument("--only", default="", metavar="NAME[,NAME]", help="run only these cases")
    p.add_argument("--concurrency", type=int, default=4, help="runs at a time (default 4)")
    p.add_argument("--kernel", default=None, metavar="PATH",
                   help="the `kernel` executable (default: next to this Python)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)

    if args.list:
        for c in CASES:
            print(f"{c.name:<20} {c.label:<8} {c.what}" + (" (only with --only)" if c.extra
                                                             else ""))
        return 0
    known = modes(args.idle_timeout, args.defaults_timeout)
    try:
        chosen = [known[m.strip()] for m in args.modes.split(",") if m.strip()]
    except KeyError as exc:
        p.error(f"unknown mode {exc.args[0]!r} (choose from {', '.join(known)})")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        p.error(f"unknown case(s): {', '.join(unknown)} (see --list)")
    cases = [c for c in CASES if c.name in names or (not names and not c.extra)]
    kernel = args.kernel or default_kernel()

    def progress(o: Outcome) -> None:
        if not args.json:
            print(f"  {o.mode:<8} {o.case:<20} {o.status:<10} {o.wall_s:5.1f}s  {o.verdict}",
                  file=sys.stderr, flush=True)

    t0 = time.monotonic()
    outcomes = run_all(cases, chosen, kernel=kernel, timeout=args.timeout,
                       concurrency=args.concurrency, on_done=progress)
    total = time.monotonic() - t0
    titles = {m.name: m.title for m in chosen}
    targets = {"idle": idle_target(args.idle_timeout)}
    if "defaults" in titles:
        idle = default_idle(kernel)
        if idle is not None:
            targets["defaults"] = idle_target(idle)
            titles["defaults"] += f" (idle {idle:g})"
    ms = [matrix(outcomes, m.name, targets.get(m.name)) for m in chosen]
    if args.json:
        print(json.dumps({
            "kernel": kernel, "timeout": args.timeout, "idle_timeout": args.idle_timeout,
            "total_s": round(total, 1),
            "outcomes": [{**asdict(o), "verdict": o.verdict} for o in outcomes],
            "matrix": [{**asdict(m), "median": m.median, "max": m.max, "title": titles[m.mode]}
                       for m in ms]}, indent=1))
        return 0
    per_mode = "".join(f", {m.name} {m.timeout:g} s" for m in chosen if m.timeout)
    print(f"kernel: {kernel}\nhard --timeout {args.timeout:g} s per run{per_mode}, "
          f"{args.concurrency} at a time, {total:.0f} s in all")
    print(case_table(outcomes, titles))
    print()
    print(matrix_table(ms, titles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
