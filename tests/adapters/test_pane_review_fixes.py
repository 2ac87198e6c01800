"""Second review of the pane features: each test reproduces a defect found by attacking
`kernel actions run` and `kernel run --agent pane` with a real tmux server.

- the pane lock followed a symlink planted in a shared lock directory, truncating
  (and overwriting) whatever file it pointed at;
- a target such as `dev` was looked up again for every key typed, so switching
  the session's active pane mid-typing sent the rest of the keys to another pane;
- an attempt cancelled by Ctrl-C left no trace of the keys it had typed;
- any program that echoes its input (`cat`, a Python REPL's syntax error) passed
  the nonce probe as a live agent;
- a pane that vanished after the keys were sent was polled until the timeout;
- `actions run --json` did not say when the attempt could not be recorded.

The tmux tests use a private server (the `tmux` fixture of test_pane_tmux.py) and
the installed `kernel` executable; they wait for conditions, never for fixed times.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_pane_tmux import FAST, Tmux, kernel, tmux  # noqa: F401  (tmux: the fixture)

from adapters.pane import has_nonce_echo

pytestmark = [
    pytest.mark.realtime,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

#: Overall bound on waiting for a condition (generous: CI is a small shared machine).
PATIENCE = 90.0


@pytest.fixture
def env(cli_env: dict[str, str], tmux: Tmux) -> dict[str, str]:  # noqa: F811
    """CLI environment: the test's audit database, our tmux server, fast typing."""
    return {**cli_env, **FAST, "KERNEL_TMUX_SOCKET": tmux.socket}


def wait_for(condition: Callable[[], bool], what: str,
             proc: subprocess.Popen[str] | None = None) -> None:
    """Poll `condition` until it holds (bounded by PATIENCE); fail naming `what`."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the kernel exited before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start(exe: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([exe, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Wait for `proc` (bounded); kill it if it overstays."""
    try:
        out, err = proc.communicate(timeout=PATIENCE)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the kernel did not finish: {err}") from None
    return proc.returncode, out, err


def sql(exe: str, env: dict[str, str], query: str) -> list[dict[str, Any]]:
    proc = kernel(exe, env, "query", query, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def pane_id(tmux: Tmux, target: str) -> str:  # noqa: F811
    return tmux.cmd("display-message", "-p", "-t", target, "#{pane_id}").stdout.strip()


# ------------------------------------------------------------- the lock file


class TestLockFile:
    def test_a_planted_symlink_is_not_followed(self, kernel_exe: str, env: dict[str, str],
                                               tmux: Tmux, tmp_path: Path) -> None:  # noqa: F811
        """Another user can create the shared fallback lock directory (`<tmp>/kernel-panes-
        <uid>`) first and plant the pane's lock file as a symlink: the run must not
        truncate or write the file it points at, and must type nothing."""
        name = tmux.agent("alive")
        victim = tmp_path / "victim.txt"
        victim.write_text("precious data\n")
        shared = tmp_path / "tmp"
        planted = shared / f"kernel-panes-{os.getuid()}"
        planted.mkdir(parents=True)
        planted.chmod(0o777)  # as a stranger's directory would be
        key = "tmux:" + tmux.cmd("display-message", "-p", "-t", f"={name}:",
                                 "#{socket_path}|#{pane_id}").stdout.strip()
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        (planted / f"{digest}.lock").symlink_to(victim)
        before = tmux.capture(name)
        run_env = {k: v for k, v in env.items() if k != "XDG_RUNTIME_DIR"}
        run_env["TMPDIR"] = str(shared)
        proc = kernel(kernel_exe, run_env, "actions", "run", "nonce-probe", name, "--json",
                      "--poll-interval", "0.1")
        assert victim.read_text() == "precious data\n"
        assert proc.returncode == 1, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["outcome"] == "precondition_fail"
        assert "lock" in doc["extras"]["precheck_error"]
        assert "Repeat" not in tmux.capture(name) and tmux.capture(name) == before

    def test_a_symlink_in_a_private_directory_is_refused(self, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
        """Even in our own lock directory, the lock file is never opened through a link."""
        from adapters.pane import PaneError
        from adapters.pane._lock import PaneLock, lock_dir

        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        import tempfile
        monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
        victim = tmp_path / "victim.txt"
        victim.write_text("precious data\n")
        lock = PaneLock("tmux:/sock|%1", "dev")
        assert lock.path.parent == lock_dir()
        lock.path.symlink_to(victim)
        with pytest.raises(PaneError, match="lock"):
            lock.acquire({"run_id": "x"})
        assert victim.read_text() == "precious data\n"


# ------------------------------------------------------- one pane throughout


class TestTargetResolvedOnce:
    def test_switching_the_active_pane_mid_typing(self, kernel_exe: str, env: dict[str, str],
                                                  tmux: Tmux) -> None:  # noqa: F811
        """`dev` names the session's active pane; a person switching panes while the
        kernel types must not get the rest of the keys in the other pane."""
        name = tmux.start("cat", ready="")
        first = pane_id(tmux, f"={name}:")
        tmux.cmd("split-window", "-t", first, "cat")
        second = pane_id(tmux, f"={name}:")  # the new pane is the active one
        assert second != first
        tmux.cmd("select-pane", "-t", first)
        slow = {**env, "KERNEL_PANE_KEY_DELAY": "0.4"}
        proc = start(kernel_exe, slow, "actions", "run", "nonce-probe", name, "--json",
                     "--timeout", "1", "--poll-interval", "0.2")
        try:
            wait_for(lambda: "R" in tmux.capture(first), "the first key", proc)
            tmux.cmd("select-pane", "-t", second)
            _code, out, err = finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        doc = json.loads(out or "{}")
        assert doc, err
        nonce = doc["extras"]["nonce"]
        assert tmux.capture(second).strip() == "", tmux.capture(second)
        assert f"Repeat {nonce}" in tmux.capture(first)

    def test_kernel_run_agent_pane_keeps_its_pane(self, kernel_exe: str, env: dict[str, str],
                                                  tmux: Tmux) -> None:  # noqa: F811
        """The same for `kernel run --agent pane`: the prompt goes whole into one pane."""
        name = tmux.start("cat", ready="")
        first = pane_id(tmux, f"={name}:")
        tmux.cmd("split-window", "-t", first, "cat")
        second = pane_id(tmux, f"={name}:")
        tmux.cmd("select-pane", "-t", first)
        slow = {**env, "KERNEL_PANE_KEY_DELAY": "0.4"}
        proc = start(kernel_exe, slow, "run", "--json", "--agent", "pane", "--target", name,
                     "--prompt", "say kiwi please", "--timeout", "40")
        try:
            wait_for(lambda: "s" in tmux.capture(first), "the first key", proc)
            tmux.cmd("select-pane", "-t", second)
            finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert tmux.capture(second).strip() == "", tmux.capture(second)
        assert "say kiwi please" in tmux.capture(first)


# ------------------------------------------------------------ Ctrl-C mid-way


class TestCancelledAttempt:
    def test_sigint_after_typing_keeps_a_record(self, kernel_exe: str, env: dict[str, str],
                                                tmux: Tmux) -> None:  # noqa: F811
        """Ctrl-C while waiting for the echo: exit 130, the run row closed `cancelled`,
        no outcome in the attempts view, and an `attempt_cancelled` event saying what
        was typed (the nonce) and how far the attempt got."""
        name = tmux.agent("silent")
        proc = start(kernel_exe, env, "actions", "run", "nonce-probe", name, "--json",
                     "--timeout", "60", "--poll-interval", "0.1")
        typed = re.compile(r"Repeat ([a-z0-9]{10})\n")
        try:
            wait_for(lambda: typed.search(tmux.capture(name)) is not None, "the request", proc)
            proc.send_signal(signal.SIGINT)
            code, out, err = finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert code == 130, err
        doc = json.loads(out)
        assert doc["status"] == "cancelled" and doc["outcome"] is None
        match = typed.search(tmux.capture(name))
        assert match is not None
        [run] = sql(kernel_exe, env, f"SELECT status FROM runs WHERE run_id = '{doc['run_id']}'")
        assert run["status"] == "cancelled"
        assert sql(kernel_exe, env, "SELECT * FROM attempts") == []
        events = sql(kernel_exe, env, "SELECT kind, payload FROM events WHERE run_id = "
                                      f"'{doc['run_id']}' AND kind = 'attempt_cancelled'")
        assert len(events) == 1, events
        payload = events[0]["payload"]
        payload = json.loads(payload) if isinstance(payload, str) else payload
        assert payload["stage"] in ("send", "poll")
        assert payload["extras"]["nonce"] == match.group(1)
        assert payload["action"] == "nonce-probe" and payload["agent"] == name
        assert payload["pane_before"]["text"].rstrip().endswith(">")


# ------------------------------------------------------------ what counts


class TestNonceEcho:
    def test_a_program_echoing_its_input_is_not_alive(self, kernel_exe: str,
                                                      env: dict[str, str],
                                                      tmux: Tmux) -> None:  # noqa: F811
        """`cat` prints the request back ("Repeat <nonce>" twice on the screen): that is
        an echo of our typing, not an agent answering."""
        name = tmux.start("cat", ready="")
        proc = kernel(kernel_exe, env, "actions", "run", "nonce-probe", name, "--json",
                      "--timeout", "5", "--poll-interval", "0.2")
        doc = json.loads(proc.stdout)
        assert tmux.capture(name).count(f"Repeat {doc['extras']['nonce']}") == 2
        assert doc["outcome"] == "completion_timeout" and proc.returncode == 1, doc
        assert doc["extras"]["probe"] == "silent"

    @pytest.mark.parametrize(("screen", "echoed"), [
        # Python's REPL quotes the offending source line under a SyntaxError.
        ('>>> Repeat k7q2mzx9ab\n  File "<stdin>", line 1\n    Repeat k7q2mzx9ab\n'
         '           ^^^^^^^^^^\nSyntaxError: invalid syntax\n>>> ', False),
        ("> Repeat k7q2mzx9ab\n● k7q2mzx9ab\n", True),
        ("● k7q2mzx9ab\n> ", True),  # the request has scrolled away; the answer shows
        ("> Repeat k7q2mzx9ab\nrepeat k7q2mzx9ab\n", False),
    ])
    def test_only_text_other_than_the_request_counts(self, screen: str, echoed: bool) -> None:
        """The nonce must show somewhere other than in a copy of the request."""
        assert has_nonce_echo(screen, "k7q2mzx9ab") is echoed


# ------------------------------------------------------------ a vanished pane


class TestVanishedPane:
    def test_a_pane_gone_after_the_send_ends_the_wait(self, kernel_exe: str,
                                                      env: dict[str, str],
                                                      tmux: Tmux) -> None:  # noqa: F811
        """Closing the pane after /compact was typed ends the attempt at the next poll
        (completion_timeout, with `pane_gone` saying why), not at --timeout."""
        name = tmux.agent("silent")
        proc = start(kernel_exe, env, "actions", "run", "compact", name, "--json",
                     "--timeout", "600", "--poll-interval", "0.2")
        try:
            wait_for(lambda: "> /compact\n> " in tmux.capture(name), "/compact taken", proc)
            tmux.cmd("kill-session", "-t", name)
            code, out, err = finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert code == 1, err
        doc = json.loads(out)
        assert doc["outcome"] == "completion_timeout", doc["extras"]
        assert "pane_gone" in doc["extras"], doc["extras"]  # not the 600 s timeout


# ------------------------------------------------------------ the JSON document


class TestJsonDocument:
    def test_an_unrecorded_attempt_says_so(self, kernel_exe: str, env: dict[str, str],
                                           tmux: Tmux) -> None:  # noqa: F811
        """When the audit cannot be written, `--json` carries the port failures, as
        `kernel run --json` does: a script must be able to tell the attempt is not
        in the log."""
        name = tmux.agent("alive")
        proc = kernel(kernel_exe, env, "actions", "run", "nonce-probe", name, "--json",
                      "--poll-interval", "0.1", "--db", "/proc/kernel-no-such.duckdb")
        assert proc.stdout.count("\n") == 1, proc.stdout
        doc = json.loads(proc.stdout)
        assert doc["outcome"] == "success"
        assert doc["port_failures"] and "audit" in doc["port_failures"][0]

    def test_a_recorded_attempt_has_no_port_failures(self, kernel_exe: str,
                                                     env: dict[str, str],
                                                     tmux: Tmux) -> None:  # noqa: F811
        """The key is always there, empty when everything was recorded."""
        name = tmux.agent("alive")
        proc = kernel(kernel_exe, env, "actions", "run", "nonce-probe", name, "--json",
                      "--poll-interval", "0.1")
        assert json.loads(proc.stdout)["port_failures"] == []


# ------------------------------------------------------------ the terminal


class TestTerminalOutput:
    def test_escape_sequences_are_not_sent_raw(self, kernel_exe: str, env: dict[str, str],
                                               tmux: Tmux) -> None:  # noqa: F811
        """A skip reason or pane name holding escape sequences (a window title, a clear
        screen) is shown escaped by `actions run` and `actions query`, never executed
        by the reader's terminal; the record keeps it as it was given."""
        name = tmux.agent("alive")
        hostile = "\x1b]0;pwned\x07\x1b[2Jquiet\u202ehours"
        proc = kernel(kernel_exe, env, "actions", "run", "compact", name, "--skip-reason",
                      hostile, "--pane", "fleet\x1b[31m")
        assert proc.returncode == 0, proc.stderr
        listing = kernel(kernel_exe, env, "actions", "query")
        assert listing.returncode == 0, listing.stderr
        for out in (proc.stdout, listing.stdout):
            assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out, out
            assert "\\x1b]0;pwned\\x07" in out and "quiet\\u202ehours" in out
        assert "fleet\\x1b[31m" in listing.stdout
        rows = kernel(kernel_exe, env, "actions", "query", "--json")
        assert json.loads(rows.stdout)["extras"]["skip_reason"] == hostile


class TestZeroTimeout:
    def test_a_zero_timeout_is_refused_before_anything_is_typed(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`--timeout 0` gave no time for an answer: the request was typed into the pane
        and the attempt failed at once. It is bad input (one line, exit 2), like a
        negative one; no pane is touched (none exists here)."""
        proc = kernel(kernel_exe, cli_env, "actions", "run", "nonce-probe", "nowhere",
                      "--timeout", "0")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "--timeout" in proc.stderr
