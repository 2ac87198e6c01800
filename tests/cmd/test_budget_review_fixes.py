"""`kernel budget set|show|rm` and `JournalBudget` under a demanding user (review fixes).

Real processes and real journal files, no mocks. The battery's own tests are
here too (not in tests/batteries/ under the same file name: two test modules
of one basename in a rootdir without packages cannot both be collected).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from batteries.budget import JournalBudget
from batteries.store import journal_path


def kernel(exe: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    """Poll until `path` exists (the helper process is ready), for at most 120 s."""
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@contextmanager
def journal_locked(journal: Path, tmp: Path) -> Iterator[None]:
    """Another process holds the journal's write lock (BEGIN IMMEDIATE) inside the block."""
    ready, release = tmp / "locked", tmp / "release"
    script = (
        "import sqlite3, sys, time, pathlib\n"
        "con = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "con.execute('BEGIN IMMEDIATE')\n"
        "pathlib.Path(sys.argv[2]).touch()\n"
        "deadline = time.monotonic() + 300\n"
        "while not pathlib.Path(sys.argv[3]).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "con.execute('ROLLBACK')\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(journal), str(ready),
                               str(release)], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        wait_for(ready, holder)
        yield
    finally:
        release.touch()
        holder.communicate(timeout=120)


@pytest.mark.realtime
class TestALockedJournal:
    def test_set_and_rm_exit_1_not_2(self, kernel_exe: str, cli_env: dict[str, str],
                                     tmp_path: Path) -> None:
        """A journal another process keeps locked past $KERNEL_AUDIT_LOCK_TIMEOUT is not bad
        input: `budget set` and `budget rm` say so in one line and exit 1 (as every other
        command does for a locked store), not 2; nothing is lost, and the budget as it was
        still binds once the lock is gone."""
        env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
        assert kernel(kernel_exe, env, "budget", "set", "ann", "--runs", "1").returncode == 0
        journal = Path(env["KERNEL_DB"] + ".journal")
        assert journal.exists()
        with journal_locked(journal, tmp_path):
            for args in (["budget", "set", "ann", "--runs", "9"], ["budget", "rm", "ann"]):
                proc = kernel(kernel_exe, env, *args)
                assert proc.returncode == 1, (args, proc.returncode, proc.stderr)
                (line,) = proc.stderr.strip().splitlines()
                assert line.startswith(f"kernel budget {args[1]}: error: ") and "locked" in line
            shown = kernel(kernel_exe, env, "budget", "show", "ann", "--json")
            assert shown.returncode == 0, shown.stderr  # a reader never waits for the lock
        [doc] = [json.loads(line) for line in kernel(kernel_exe, env, "budget", "show",
                                                      "--json").stdout.splitlines()]
        assert (doc["caller_id"], doc["max_runs"]) == ("ann", 1)


@pytest.mark.realtime
class TestRmLeavesNoTrace:
    def test_rm_on_a_fresh_path_creates_nothing(self, kernel_exe: str,
                                                cli_env: dict[str, str], tmp_path: Path) -> None:
        """`budget rm` of a caller where no database exists yet (a mistyped --db) says there
        is no such budget (exit 2) without creating the directory or a journal there."""
        where = tmp_path / "typo" / "k.duckdb"
        proc = kernel(kernel_exe, cli_env, "budget", "rm", "nobody", "--db", str(where))
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "no budget for 'nobody'" in line
        assert not (tmp_path / "typo").exists()


@pytest.mark.realtime
class TestTheTable:
    def test_windows_read_as_set_and_columns_line_up(self, kernel_exe: str,
                                                     cli_env: dict[str, str]) -> None:
        """The window column reads as it was given (3s, 90m, 24h, 7d), never `0.000833333h`,
        and a long caller id neither breaks the columns nor pushes them off the screen: it is
        cut (whole in --json)."""
        long_id = "release-bot-" + "x" * 300
        for caller, window in (("short", "3s"), ("ninety", "90m"), ("day", "24h"),
                               ("week", "7d"), (long_id, "2h")):
            proc = kernel(kernel_exe, cli_env, "budget", "set", caller, "--runs", "5",
                          "--window", window)
            assert proc.returncode == 0, proc.stderr
        lines = kernel(kernel_exe, cli_env, "budget", "show").stdout.splitlines()
        header, rows = lines[0].split(), {line.split()[0]: line.split() for line in lines[1:]}
        assert header[:3] == ["caller", "window", "runs"]
        cut = long_id[:31] + "…"
        assert {c: rows[c][1] for c in ("short", "ninety", "day", "week", cut)} == {
            "short": "3s", "ninety": "90m", "day": "24h", "week": "7d", cut: "2h"}
        starts = {line.index(" 0/5") for line in lines[1:]}
        assert len(starts) == 1, lines  # the runs column is one column
        assert max(map(len, lines)) < 100, lines
        shown = [json.loads(line) for line in kernel(kernel_exe, cli_env, "budget", "show",
                                                     "--json").stdout.splitlines()]
        assert long_id in {d["caller_id"] for d in shown}

    def test_a_control_character_in_a_stored_id_is_shown_escaped(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A budget row whose caller id holds an escape sequence (written by another tool or
        an older version into the journal) is shown as `\\x1b...`, never sent to the
        terminal raw."""
        assert kernel(kernel_exe, cli_env, "budget", "set", "evil", "--runs", "1"
                      ).returncode == 0
        with closing(sqlite3.connect(cli_env["KERNEL_DB"] + ".journal")) as con, con:
            con.execute("UPDATE budgets SET caller_id = ? WHERE caller_id = 'evil'",
                        ("\x1b]0;pwned\x07evil",))
        proc = kernel(kernel_exe, cli_env, "budget", "show")
        assert proc.returncode == 0, proc.stderr
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout
        assert "\\x1b]0;pwned\\x07evil" in proc.stdout


class TestBatteryCallerIds:
    @pytest.mark.parametrize("caller", ["", "   ", "a\nb", "ci\x1b[2Jbot", "x\x00"])
    def test_set_refuses_an_id_no_run_can_have(self, tmp_path: Path, caller: str) -> None:
        """`set` refuses an empty id or one holding a control character, as `kernel budget
        set` and `kernel run --caller` do: such a row could never bind a run started from
        the command line, and would be printed raw to whoever lists the budgets."""
        budget = JournalBudget(tmp_path / "k.duckdb")
        with pytest.raises(ValueError, match="caller id"):
            budget.set(caller, max_runs=1)
        assert budget.all() == []

    def test_set_takes_odd_but_printable_ids(self, tmp_path: Path) -> None:
        """Spaces, unicode and long ids are ids like any other."""
        budget = JournalBudget(tmp_path / "k.duckdb")
        for caller in ("a b", "ünï🙂", "*", "x" * 5000):
            budget.set(caller, max_runs=1)
        assert sorted(b.caller_id for b in budget.all()) == sorted(["a b", "ünï🙂", "*",
                                                                   "x" * 5000])


class TestBatteryRemove:
    def test_remove_where_there_is_no_journal_creates_none(self, tmp_path: Path) -> None:
        """Removing a budget from a journal that does not exist finds none (False) and
        leaves no journal (nor its directory) behind: nothing was there to remove."""
        db = tmp_path / "missing" / "k.duckdb"
        budget = JournalBudget(db)
        assert budget.remove("nobody") is False
        assert not journal_path(db).exists()
        assert not db.parent.exists()


class TestRefusalWindow:
    def test_a_refusal_names_the_window_as_it_was_set(self, kernel_exe: str,
                                                      cli_env: dict[str, str]) -> None:
        """A refused run says "in the last 90m" for `--window 90m` (it said "5400s"), as
        `budget show` prints it."""
        assert kernel(kernel_exe, cli_env, "budget", "set", "w", "--runs", "1",
                      "--window", "90m").returncode == 0
        assert kernel(kernel_exe, cli_env, "run", "--caller", "w", "--", "true").returncode == 0
        got = kernel(kernel_exe, cli_env, "run", "--caller", "w", "--", "true")
        assert got.returncode == 3, got.stderr
        assert "used 1 of 1 runs in the last 90m" in got.stderr, got.stderr
