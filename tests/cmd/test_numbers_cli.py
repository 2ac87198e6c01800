"""Every number and duration the CLI takes is finite and in range, in one grammar (issue 13.11).

The matrix goes through `kernel_cli.app.main`, the console script's entry
point, so the one-line usage error is what a user sees; the issue's two
reproductions also run through the installed executable.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from batteries.critic import CriticPolicy
from kernel import ConfigError, Limits
from kernel_cli import numbers
from kernel_cli.app import main

#: (command words, option) for every numeric option of every command.
OPTIONS = [
    (["run"], "--timeout"), (["run"], "--soft-timeout"), (["run"], "--idle-timeout"),
    (["run"], "--checkpoint-interval"), (["run"], "--max-steps"), (["run"], "--model-timeout"),
    (["run"], "--tool-timeout"), (["run"], "--max-turns"),
    (["runs"], "--since"), (["runs"], "--limit"), (["stats"], "--since"), (["purge"], "--days"),
    (["actions", "run", "compact", "nowhere:0"], "--timeout"),
    (["actions", "run", "compact", "nowhere:0"], "--poll-interval"),
    (["actions", "run", "compact", "nowhere:0"], "--min-drop-pct"),
    (["actions", "query"], "--since"), (["actions", "query"], "--limit"),
    (["actions", "stats"], "--since"),
    (["budget", "set", "who"], "--runs"), (["budget", "set", "who"], "--runtime"),
    (["budget", "set", "who"], "--tokens"), (["budget", "set", "who"], "--cost"),
    (["budget", "set", "who"], "--window"),
]
NON_FINITE = ["inf", "-inf", "nan", "NaN", "Infinity", "1e400", "nanh", "infs", "infd"]
OTHER_BAD = ["-1", "abc", "", "1e3", "9" * 400, "5y", "1,5"]


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), out, err


@pytest.mark.parametrize(("words", "option"), OPTIONS,
                         ids=[" ".join([*w[:2], o]) for w, o in OPTIONS])
def test_non_finite_and_malformed_numbers_are_one_line_and_exit_2(
        words: list[str], option: str, capsys: pytest.CaptureFixture[str],
        _isolated_db: Path) -> None:
    """inf, nan, 1e400, negatives, junk: exit 2 and one stderr line naming the option."""
    tail = ["--", "true"] if words == ["run"] else []
    for bad in NON_FINITE + OTHER_BAD:
        code, out, err = _main([*words, f"{option}={bad}", *tail], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and out == "", (option, bad, code, err)
        assert len(lines) == 1 and lines[0].startswith("kernel"), (option, bad, err)
        assert option in lines[0], lines[0]
    assert not _isolated_db.exists()  # nothing was run, nothing stored


@pytest.mark.parametrize(("words", "option", "value", "fragment"), [
    (["runs"], "--limit", "0", "must be at least 1"),
    (["actions", "query"], "--limit", "0", "must be at least 1"),
    (["budget", "set", "who"], "--window", "0", "must be more than 0"),
    (["actions", "run", "compact", "nowhere:0"], "--poll-interval", "0s",
     "must be more than 0"),
    (["runs"], "--since", "5 fortnights", "expects a duration like 90, 90s, 5m"),
])
def test_values_below_an_options_minimum_are_refused(
        words: list[str], option: str, value: str, fragment: str,
        capsys: pytest.CaptureFixture[str], _isolated_db: Path) -> None:
    """A zero where zero means nothing, or a limit below 1: one line naming why, exit 2."""
    code, out, err = _main([*words, option, value], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and option in err and fragment in err, err


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("5m", 300), ("2h", 7200), ("7d", 604800), ("2w", 1209600),
    ("1.5h", 5400), (" 30m ", 1800), ("0", 0), ("0.25", 0.25), (".5m", 30),
])
def test_one_duration_grammar(text: str, seconds: float) -> None:
    """A bare number is seconds; s, m, h, d, w are units; decimals are fine."""
    assert numbers.parse_duration(text) == seconds


def test_zero_is_refused_where_it_means_nothing() -> None:
    """A rolling window (or a poll interval) of 0 is refused; a timeout of 0 means none."""
    with pytest.raises(ValueError, match="more than 0"):
        numbers.parse_duration("0s", zero=False)
    assert numbers.parse_duration("0s") == 0


def test_limits_to_what_the_store_and_clock_can_hold() -> None:
    """At most 100 years of duration, 36500 days, a 64-bit count."""
    assert numbers.parse_duration("5200w") == 5200 * 7 * 86400
    with pytest.raises(ValueError, match="100 years"):
        numbers.parse_duration("5300w")
    with pytest.raises(ValueError, match="at most"):
        numbers.parse_count(str(2**63))
    with pytest.raises(ValueError, match="36500 days"):
        numbers.parse_days("36501")


def test_the_retention_variable_is_checked_the_same_way(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        _isolated_db: Path) -> None:
    """$KERNEL_RETENTION_DAYS=inf is one line and exit 2, naming the variable."""
    for bad in ("inf", "nan", "-3", "1e400"):
        monkeypatch.setenv("KERNEL_RETENTION_DAYS", bad)
        code, _, err = _main(["purge"], capsys)
        assert code == 2 and err.count("\n") == 1 and "KERNEL_RETENTION_DAYS" in err, err


def test_the_lock_timeout_variable_refuses_non_finite_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """$KERNEL_AUDIT_LOCK_TIMEOUT=inf or nan would wait forever: a ConfigError naming it."""
    from batteries.audit import _store as audit_store
    from batteries.store import _sqlite as journal_store
    from kernel import ConfigError

    for bad in ("inf", "nan", "-1", "soon"):
        monkeypatch.setenv("KERNEL_AUDIT_LOCK_TIMEOUT", bad)
        for parse in (audit_store.lock_timeout_from_env, journal_store.lock_timeout_from_env):
            with pytest.raises(ConfigError, match="KERNEL_AUDIT_LOCK_TIMEOUT"):
                parse()
    monkeypatch.setenv("KERNEL_AUDIT_LOCK_TIMEOUT", "2.5")
    assert journal_store.lock_timeout_from_env() == 2.5


@pytest.mark.parametrize("field", ["timeout", "soft_timeout", "tool_timeout", "max_cost_usd",
                                   "checkpoint_every_seconds", "poll_interval",
                                   "finalize_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_library_limits_refuse_non_finite_values(field: str, value: float) -> None:
    """Limits is a ConfigError for NaN and infinities, whoever builds it."""
    with pytest.raises(ConfigError, match=f"Limits.{field}"):
        Limits(**{field: value})


@pytest.mark.parametrize("field", ["soft_timeout", "extend_by", "idle_timeout", "grace"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_critic_policy_refuses_non_finite_values(field: str, value: float) -> None:
    """CriticPolicy is a ConfigError for NaN and infinities."""
    with pytest.raises(ConfigError, match=f"CriticPolicy.{field}"):
        CriticPolicy(**{field: value})


@pytest.mark.realtime
def test_the_issue_reproductions(kernel_exe: str, cli_env: dict[str, str]) -> None:
    """`--idle-timeout inf` and `--window nanh` are one line, exit 2, nothing stored; the same
    grammar is accepted everywhere."""
    def kernel(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kernel_exe, *args], env=cli_env, capture_output=True,
                              text=True, timeout=120)

    for args in (["run", "--idle-timeout", "inf", "--", "true"],
                 ["budget", "set", "X", "--runs", "5", "--window", "nanh"]):
        proc = kernel(*args)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = kernel("budget", "show", "--json")
    assert proc.returncode == 0 and "NaN" not in proc.stdout and "X" not in proc.stdout

    proc = kernel("budget", "set", "X", "--runs", "5", "--window", "2w", "--runtime", "90m")
    assert proc.returncode == 0, proc.stderr
    shown = [json.loads(line) for line in kernel("budget", "show", "X", "--json"
                                                 ).stdout.splitlines()]
    assert any(r.get("window_seconds") == 1209600 and r.get("max_runtime_seconds") == 5400
               for r in shown), shown
    proc = kernel("run", "--timeout", "2m", "--idle-timeout", "90s", "--soft-timeout", "1h",
                  "--", "true")
    assert proc.returncode == 0, proc.stderr
    assert kernel("runs", "--since", "90").returncode == 0
