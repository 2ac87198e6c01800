"""`kernel actions` bad input and empty logs, on the real app in-process (no tmux needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from kernel_cli.app import app, main


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def one_line_error(res: Result, needle: str) -> None:
    """Exit 2, nothing on stdout, and a single stderr line containing `needle`."""
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    assert res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr


def usage_error(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the console script's entry point: exit 2, a single stderr line with `needle`."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err
    assert out == ""
    assert err.count("\n") == 1 and needle in err, err


class TestRunInput:
    @pytest.mark.parametrize(("args", "needle"), [
        (["reboot", "dev"], "unknown action 'reboot' (choose from: compact, nonce-probe)"),
        (["nonce-probe", "dev", "--min-drop-pct", "30"], "--min-drop-pct applies to the "
                                                         "compact action only"),
        (["compact", "dev", "--min-drop-pct", "0"], "--min-drop-pct must be in (0, 100]"),
        (["nonce-probe", " "], "TARGET must not be empty"),
    ])
    def test_bad_options(self, args: list[str], needle: str) -> None:
        """Each malformed `actions run` is one line naming the problem, exit 2."""
        one_line_error(cli("actions", "run", *args), needle)

    @pytest.mark.parametrize(("args", "needle"), [
        (["compact", "dev", "--min-drop-pct", "150"], "'--min-drop-pct': must be at most 100"),
        (["nonce-probe", "dev", "--timeout", "-1"], "'--timeout': expects a duration"),
        (["nonce-probe", "dev", "--poll-interval", "0"], "'--poll-interval': must be more than"),
    ])
    def test_bad_numbers(self, args: list[str], needle: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
        """A malformed number is typer's usage error: one line from `kernel`, exit 2."""
        usage_error(["actions", "run", *args], needle, capsys)

    def test_bad_timing_variable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A malformed KERNEL_PANE_KEY_DELAY is named in a one-line error, exit 2."""
        monkeypatch.setenv("KERNEL_PANE_KEY_DELAY", "fast")
        one_line_error(cli("actions", "run", "nonce-probe", "dev"), "KERNEL_PANE_KEY_DELAY")

    def test_missing_tmux(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """Without tmux on PATH, `actions run` says so in one line, exit 2."""
        monkeypatch.setenv("PATH", str(tmp_path))
        one_line_error(cli("actions", "run", "nonce-probe", "dev"), "tmux is not installed")

    def test_help_lists_the_actions(self) -> None:
        """`kernel actions run --help` names both actions and the exit codes."""
        res = cli("actions", "run", "--help")
        assert res.exit_code == 0
        assert "nonce-probe" in res.stdout and "compact" in res.stdout
        assert "KERNEL_PANE_KEY_DELAY" in res.stdout and "2 bad input" in res.stdout


class TestQueryInput:
    @pytest.mark.parametrize(("args", "needle"), [
        (["query", "--outcome", "failed"], "--outcome must be one of success,"),
    ])
    def test_bad_filters(self, args: list[str], needle: str) -> None:
        """A malformed filter is one line naming it, exit 2."""
        one_line_error(cli("actions", *args), needle)

    @pytest.mark.parametrize(("args", "needle"), [
        (["query", "--since", "yesterday"], "'--since': expects a duration"),
        (["query", "--limit", "0"], "'--limit': must be at least 1"),
        (["stats", "--since", "3 fortnights"], "'--since': expects a duration"),
    ])
    def test_bad_numbers(self, args: list[str], needle: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
        """A malformed number is typer's usage error: one line from `kernel`, exit 2."""
        usage_error(["actions", *args], needle, capsys)

    @pytest.mark.parametrize("command", ["query", "stats"])
    def test_the_pane_name_option_is_pane(self, _isolated_db: Path, command: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
        """`--pane NAME` filters by the pane's agent; `--agent` is `kernel run`'s alone."""
        assert cli("actions", command, "--pane", "dev", "--json").exit_code == 0
        usage_error(["actions", command, "--agent", "dev"], "No such option: --agent", capsys)

    def test_no_database_yet(self, _isolated_db: Path) -> None:
        """Before anything was recorded, query and stats show nothing and succeed."""
        assert not _isolated_db.exists()
        for command in ("query", "stats"):
            res = cli("actions", command, "--json")
            assert res.exit_code == 0 and res.stdout == ""
            assert "no audit database" in res.stderr
        assert not _isolated_db.exists()
