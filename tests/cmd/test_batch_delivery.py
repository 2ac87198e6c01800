"""`kernel batch --deliver-dir DIR --webhook URL`: every run of a batch delivered as `kernel
run` delivers it, apart from the runs; stored with the batch for `--resume`.

Real parts: the installed `kernel` executable, real commands, the real journal, real
folders and a real HTTP server on 127.0.0.1. Waits are for readiness (journal rows,
folders, requests received), never fixed sleeps.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from journal_texts import stored_texts

from tests.cmd.test_batch_cli import (
    PATIENCE,
    batch,
    journal_count,
    lines,
    only_batch_id,
    wait_for,
    write_tasks,
)

pytestmark = pytest.mark.realtime

PASSWORD = "hunter2pw"


class Hook:
    """A real webhook endpoint: keeps each POSTed result (its path, its Cookie header) and
    answers with a cookie; while `hold` is set, each request waits (unanswered) until
    `release`."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.cookies: list[str | None] = []
        self.answered = 0
        self.hold = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(length))
                with hook.lock:
                    hook.bodies.append(body)
                    hook.paths.append(self.path)
                    hook.cookies.append(self.headers.get("cookie"))
                if hook.hold.is_set():
                    hook.release.wait(PATIENCE)
                self.send_response(204)
                self.send_header("Set-Cookie", "sid=from-the-hook; Path=/")
                self.end_headers()
                with hook.lock:
                    hook.answered += 1

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def url(self, path: str = "/hook", *, password: bool = False) -> str:
        who = f"bot:{PASSWORD}@" if password else ""
        return f"http://{who}127.0.0.1:{self.port}{path}"

    def run_ids(self) -> list[str]:
        with self.lock:
            return [b["run_id"] for b in self.bodies]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    try:
        yield h
    finally:
        h.close()


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (the port was free a moment ago)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://bot:{PASSWORD}@127.0.0.1:{port}/x?token=qsecret"


def docs(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(x) for x in proc.stdout.splitlines()]


def delivered(folder: Path) -> dict[str, dict[str, Any]]:
    """Run id -> its delivered result.json, for each run folder under `folder`."""
    if not folder.exists():
        return {}
    return {p.name: json.loads((p / "result.json").read_text())
            for p in folder.iterdir() if not p.name.startswith(".")}


def batch_rows(env: dict[str, str]) -> int:
    return journal_count(env, "SELECT count(*) FROM batches")


def stored_options(env: dict[str, str]) -> dict[str, Any]:
    journal = Path(env["KERNEL_DB"] + ".journal")
    with closing(sqlite3.connect(journal)) as con:
        [(options,)] = con.execute("SELECT options FROM batches").fetchall()
    return dict(json.loads(options))


def batch_id_of(stderr: str) -> str:
    return stderr.split("kernel: batch ", 1)[1].split()[0]


@pytest.mark.parametrize("workers", ["1", "2"], ids=["in-process", "workers"])
def test_every_run_is_delivered_to_the_dir_and_the_webhook(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook,
        workers: str) -> None:
    """Each run of the batch is written to DIR/RUN_ID/ and POSTed, with its own result
    (the one --json prints); the exit code is the batch's as without delivery. A relative
    --deliver-dir is stored absolute, the webhook's password is stored nowhere, and no
    POST carries a cookie the webhook set."""
    tasks = [{"id": f"t{i}", "command": ["sh", "-c", f"echo out{i}; exit {3 if i == 2 else 0}"]}
             for i in range(5)]
    tasks_file = write_tasks(tmp_path / "t.jsonl", tasks)
    proc = subprocess.run([kernel_exe, "batch", str(tasks_file), "--json", "-j", "3",
                           "--workers", workers, "--deliver-dir", "out",
                           "--webhook", hook.url(password=True)],
                          capture_output=True, text=True, env=cli_env, cwd=tmp_path,
                          timeout=PATIENCE)
    assert proc.returncode == 1, proc.stderr  # t2 exited 3: the batch's code, unchanged
    assert "warning" not in proc.stderr, proc.stderr
    lines_ = docs(proc)
    by_run = {d["run_id"]: d for d in lines_}
    assert len(by_run) == 5 and all(d["port_failures"] == [] for d in lines_)

    folders = delivered(tmp_path / "out")
    assert set(folders) == set(by_run)
    for run_id, result in folders.items():
        assert result["status"] == by_run[run_id]["status"]
        assert result["exit_code"] == by_run[run_id]["exit_code"]
        task = by_run[run_id]["task_id"]
        assert (tmp_path / "out" / run_id / "output.txt").read_text() == f"out{task[1:]}"
    assert sorted(hook.run_ids()) == sorted(by_run)
    assert {b["run_id"]: b["status"] for b in hook.bodies} == {
        r: d["status"] for r, d in by_run.items()}
    # Each POST is sent as `kernel run` sends its one: no cookie an earlier answer set.
    assert hook.cookies == [None] * 5

    options = stored_options(cli_env)
    assert options["deliver_dir"] == str(tmp_path / "out")
    assert options["redacted"] == [["webhooks", 0]]
    texts = stored_texts(cli_env["KERNEL_DB"] + ".journal")
    assert texts and not [t for t in texts if PASSWORD in t]


def test_a_failing_webhook_is_a_warning_and_exit_1(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """A webhook nobody answers: one warning line per run naming its task and the
    delivery (no password, no query), in --json's port_failures too; the other delivery
    (the folder) still happens; every run ended ok, but results were not delivered
    (`--resume` delivers them: tests/cmd/test_batch_delivery_resume.py), so exit 1."""
    out = tmp_path / "out"
    url = dead_url()
    ok = write_tasks(tmp_path / "ok.jsonl", [{"id": "a", "command": ["true"]},
                                             {"id": "b", "command": ["echo", "hi"]}])
    proc = batch(kernel_exe, cli_env, str(ok), "--json", "--deliver-dir", str(out),
                 "--webhook", url)
    assert proc.returncode == 1, proc.stderr
    warned = [x for x in proc.stderr.splitlines() if x.startswith("kernel: warning: task ")]
    assert len(warned) == 2, proc.stderr
    assert {w.split()[3] for w in warned} == {"a", "b"}
    assert all("delivery.deliver: DeliveryError: WebhookDelivery: webhook http://127.0.0.1:"
               in w for w in warned), warned
    assert PASSWORD not in proc.stderr and "qsecret" not in proc.stderr
    assert "2 run(s) not delivered everywhere" in proc.stderr
    for d in docs(proc):
        [failure] = d["port_failures"]
        assert failure.startswith("delivery.deliver: DeliveryError: WebhookDelivery")
        assert PASSWORD not in failure and "qsecret" not in failure
    assert len(delivered(out)) == 2  # the folder delivery is not held back by the webhook

    mixed = write_tasks(tmp_path / "mixed.jsonl", [{"command": ["true"]},
                                                   {"command": ["sh", "-c", "exit 4"]}])
    proc = batch(kernel_exe, cli_env, str(mixed), "--webhook", url)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("delivery.deliver") == 2


@pytest.mark.parametrize("args", [
    ["--webhook", f"http://u:{PASSWORD}@127.0.0.1:99999/x"],
    ["--webhook", "ftp://host/x"],
    ["--webhook", "http:///no-host"],
    ["--webhook", "http://exa mple.com/"],
    ["--webhook", "http://127.0.0.1:1/ok", "--webhook", "nonsense"],
    ["--deliver-dir", ""],
], ids=["port", "scheme", "no-host", "space", "second", "empty-dir"])
def test_a_bad_target_is_refused_before_anything_runs(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, args: list[str]) -> None:
    """Bad input, as `kernel run` says it: one line naming the flag, exit 2, no password;
    nothing ran and no batch was stored (a new batch, and a resume)."""
    ran = tmp_path / "ran"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["touch", str(ran)]}])
    got = batch(kernel_exe, cli_env, str(tasks), *args)
    assert got.returncode == 2, got.stderr
    [line] = got.stderr.splitlines()
    assert line.startswith("kernel batch: error: --") and args[-2] in line, line
    assert PASSWORD not in got.stderr
    assert not ran.exists() and batch_rows(cli_env) == 0

    resumed = batch(kernel_exe, cli_env, "--resume", "last", *args)
    assert resumed.returncode == 2 and resumed.stderr.count("\n") == 1, resumed.stderr
    assert args[-2] in resumed.stderr and PASSWORD not in resumed.stderr


def test_a_slow_webhook_holds_no_run(kernel_exe: str, cli_env: dict[str, str],
                                     tmp_path: Path, hook: Hook) -> None:
    """Runs one at a time (-j 1) and a webhook that answers nothing until released: every
    run still ends (their deliveries wait apart from them), and the batch waits for the
    deliveries before it exits (0: the runs' code)."""
    hook.hold.set()
    n = 6
    tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]}] * n)
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", "1", "--json",
                             "--webhook", hook.url()], env=cli_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for("every run to end", lambda: journal_count(
            cli_env, "SELECT count(*) FROM runs WHERE status = 'ok'") == n)
        wait_for("every result to be posted", lambda: len(hook.run_ids()) == n)
        assert hook.answered == 0  # all n ended while the webhook answered none
        assert proc.poll() is None  # the batch waits for its deliveries
        hook.release.set()
        out, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert sorted(json.loads(x)["run_id"] for x in out.splitlines()) == sorted(hook.run_ids())


def test_resume_delivers_the_remaining_runs_as_stored(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook) -> None:
    """A batch SIGKILLed halfway: --resume delivers the runs it finishes to the stored
    folder (from another directory) and, once the webhook's password is given again (it
    is not stored; without it the resume is refused and runs nothing), to the webhook.
    Each run is delivered once in all."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    n, half = 8, 4
    tasks = []
    for i in range(n):
        wait = (f"echo {i} >> {started}; while [ ! -e {gate} ]; do sleep 0.05; done; "
                if i >= half else "")
        tasks.append({"id": f"t{i}", "command": ["sh", "-c", f"{wait}echo {i} >> {effects}"]})
    tasks_file = write_tasks(tmp_path / "t.jsonl", tasks)
    first = tmp_path / "first"
    first.mkdir()
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks_file), "-j", "2", "--deliver-dir",
                             "out", "--webhook", hook.url(password=True)], env=cli_env,
                            cwd=first, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        # Delivered and marked so in the journal (the mark commits a moment after the
        # webhook's answer: a SIGKILL in between leaves it owed, sent again on resume).
        wait_for("the first half to end and be delivered", lambda: journal_count(
            cli_env, "SELECT count(*) FROM runs WHERE status = 'ok'") == half
            and len(delivered(first / "out")) == half and len(hook.run_ids()) == half
            and journal_count(cli_env, "SELECT count(*) FROM batch_tasks "
                                       "WHERE delivery = 'delivered'") == half)
        wait_for("two runs in flight", lambda: len(lines(started)) == 2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    batch_id = only_batch_id(cli_env)
    runs_before = journal_count(cli_env, "SELECT count(*) FROM runs")

    refused = batch(kernel_exe, cli_env, "--resume", batch_id)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"kernel batch: error: batch {batch_id}: its secrets are not stored; give them "
        f"again: kernel batch --resume {batch_id} --webhook URL")
    assert journal_count(cli_env, "SELECT count(*) FROM runs") == runs_before

    gate.touch()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = subprocess.run([kernel_exe, "batch", "--resume", batch_id, "--json",
                              "--webhook", hook.url("/again", password=True)],
                             capture_output=True, text=True, env=cli_env, cwd=elsewhere,
                             timeout=PATIENCE)
    assert resumed.returncode == 0, resumed.stderr
    ran_here = [d["run_id"] for d in docs(resumed) if not d["skipped"]]
    assert len(ran_here) == n - half
    assert sorted(map(int, lines(effects))) == list(range(n))
    folders = delivered(first / "out")
    assert len(folders) == n and {r["status"] for r in folders.values()} == {"ok"}
    assert not (elsewhere / "out").exists()
    ids = hook.run_ids()
    assert len(ids) == n and len(set(ids)) == n  # each run once
    assert sorted(hook.paths) == sorted(["/hook"] * half + ["/again"] * (n - half))
    assert sorted(i for i, p in zip(ids, hook.paths, strict=True) if p == "/again") \
        == sorted(ran_here)


def test_a_second_signal_stops_the_deliveries(kernel_exe: str, cli_env: dict[str, str],
                                              tmp_path: Path, hook: Hook) -> None:
    """Every run ended, their deliveries hang: SIGTERM gives them at most 30 s more (the
    batch is not interrupted: nothing is left to run; tests/cmd/test_batch_late_signal.py),
    a second signal stops them (exit 130); each run is still reported, once, with its
    delivery failure."""
    hook.hold.set()
    n = 3
    tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]}] * n)
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "--json", "--webhook",
                                 hook.url()], env=cli_env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        wait_for("every result to be posted", lambda: len(hook.run_ids()) == n)
        proc.send_signal(signal.SIGTERM)
        wait_for("the first signal to be taken",
                 lambda: "SIGTERM: every run of batch" in err_file.read_text())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = err_file.read_text()
    assert proc.returncode == 130, said
    got = [json.loads(x) for x in out.splitlines()]
    assert sorted(d["run_id"] for d in got) == sorted(hook.run_ids())
    for d in got:
        [failure] = d["port_failures"]
        # Stopped by the second signal (or, on a machine so loaded that the webhook's own
        # 30 s bound passed first, by that bound): never delivered, never lost silently.
        assert ("not delivered: the batch was stopped" in failure
                or "no answer within" in failure), failure
    assert said.count("kernel: warning: task ") == n


@pytest.mark.timeout(900)
def test_a_ray_batch_is_delivered_by_its_driver(kernel_exe: str, cli_env: dict[str, str],
                                                tmp_path: Path, hook: Hook) -> None:
    """--ray: the runs' results come back to the batch process, which delivers them (the
    folder is on this machine, whichever node ran the run)."""
    pytest.importorskip("ray")
    from ray_cluster import RayCluster, ray_env

    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": f"t{i}", "command": ["echo", str(i)]}
                                               for i in range(3)])
    with RayCluster(tmp_path / "ray", workers=1, cpus=2) as c:
        proc = subprocess.run([kernel_exe, "batch", str(tasks), "--ray", c.address, "--json",
                               "--deliver-dir", str(tmp_path / "out"), "--webhook",
                               hook.url()], capture_output=True, text=True,
                              env={**cli_env, **ray_env()}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    ran = {d["run_id"]: d for d in docs(proc)}
    assert len(ran) == 3 and all(d["port_failures"] == [] for d in ran.values())
    folders = delivered(tmp_path / "out")
    assert set(folders) == set(ran) and sorted(hook.run_ids()) == sorted(ran)
    for run_id, result in folders.items():
        assert result["output"] == ran[run_id]["output"]
