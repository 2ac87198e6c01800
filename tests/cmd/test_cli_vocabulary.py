"""One vocabulary across commands (issue 17): the same option says the same thing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batteries.audit import resolve_db_path
from kernel_cli import dbopt

ROOT = Path(__file__).resolve().parent.parent.parent
DB_COMMANDS = [["run"], ["runs"], ["show"], ["stats"], ["query"], ["purge"], ["export"],
               ["sync"], ["recover"], ["resume"], ["actions", "run"], ["actions", "query"],
               ["actions", "stats"], ["budget", "set"], ["budget", "show"], ["budget", "rm"]]


def help_of(args: list[str], env: dict[str, str]) -> str:
    code = f"from kernel_cli.app import main; main({[*args, '--help']!r})"
    proc = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=False,
                          stdin=subprocess.DEVNULL)
    return proc.stdout


class TestDbOption:
    def test_the_default_path_is_the_one_the_store_uses(self, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """dbopt.default_path() agrees with batteries.audit.resolve_db_path, env set or not."""
        monkeypatch.delenv("KERNEL_DB", raising=False)
        assert dbopt.default_path() == str(resolve_db_path(None))
        monkeypatch.setenv("KERNEL_DB", str(tmp_path / "x.duckdb"))
        assert dbopt.default_path() == str(resolve_db_path(None)) == str(tmp_path / "x.duckdb")

    def test_every_db_option_has_one_wording_with_the_path_in_effect(
            self, tmp_path: Path) -> None:
        """Each command's --db help is the same text, naming the file it would use now."""
        env = {**os.environ, "KERNEL_DB": str(tmp_path / "here.duckdb"), "COLUMNS": "400"}
        seen = set()
        for args in DB_COMMANDS:
            text = help_of(args, env)
            assert "--db PATH" in text, (args, text)
            block = text.split("--db PATH", 1)[1]
            block = re.split(r"\n\s*-", block, maxsplit=1)[0]  # up to the next option
            seen.add(re.sub(r"\s+", "", block))  # wrapping differs with the column width
        assert len(seen) == 1, seen
        want = f"[default: {tmp_path / 'here.duckdb'}, from $KERNEL_DB]"
        assert re.sub(r"\s+", "", want) in seen.pop()


class TestTimeZone:
    def test_time_columns_are_utc_whatever_tz_says(self, kernel_exe: str,
                                                   cli_env: dict[str, str]) -> None:
        """`kernel runs` labels STARTED (UTC) and prints UTC under TZ=Asia/Tokyo too."""
        import json
        from datetime import UTC, datetime

        run = subprocess.run([kernel_exe, "run", "--json", "--", "true"], env=cli_env,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL,
                             timeout=60)
        short = json.loads(run.stdout)["short_id"]
        tokyo = {**cli_env, "TZ": "Asia/Tokyo"}
        table = subprocess.run([kernel_exe, "runs"], env=tokyo, capture_output=True,
                               text=True, stdin=subprocess.DEVNULL, timeout=60).stdout
        header, *rows = table.splitlines()
        assert header.split()[:3] == ["RUN", "STARTED", "(UTC)"]
        row = next(r for r in rows if r.startswith(short))
        shown = datetime.strptime(" ".join(row.split()[1:3]), "%Y-%m-%d %H:%M:%S")
        assert abs((datetime.now(UTC).replace(tzinfo=None) - shown).total_seconds()) < 3600


class TestErrorFormat:
    @pytest.mark.parametrize(("args", "prefix"), [
        (["run", "--context", "novalue", "--", "true"], "kernel run: error: "),
        (["run", "--timeout", "soon", "--", "true"], "kernel run: error: "),
        (["show", "zz-not-hex"], "kernel show: error: "),
        (["runs", "--status", "great"], "kernel runs: error: "),
        (["query", "DELETE FROM runs"], "kernel query: error: "),
        (["resume", "ffff"], "kernel resume: error: "),
        (["budget", "set", "ci", "--runs", "-1"], "kernel budget set: error: "),
        (["actions", "query", "--outcome", "meh"], "kernel actions query: error: "),
        (["purge", "--days", "x"], "kernel purge: error: "),
    ])
    def test_every_command_says_kernel_cmd_error(self, kernel_exe: str,
                                                 cli_env: dict[str, str], args: list[str],
                                                 prefix: str) -> None:
        """Bad input to any command is one line `kernel <cmd>: error: ...` and exit 2."""
        proc = subprocess.run([kernel_exe, *args], env=cli_env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr


def _leaf_commands() -> dict[str, object]:
    """Every command a person can run, by its path ("run", "actions query", ...)."""
    import typer

    from kernel_cli.app import app

    found: dict[str, object] = {}

    def walk(cmd: object, path: str) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, f"{path} {name}".strip())
        else:
            found[path] = cmd

    walk(typer.main.get_command(app), "")
    return found


def _options(cmd: object) -> dict[str, object]:
    return {opt: p for p in getattr(cmd, "params", ()) for opt in getattr(p, "opts", ())}


#: Commands that print a table, so take --format table|json|csv too.
TABLE_COMMANDS = {"runs", "stats", "query", "actions query", "actions stats", "budget show",
                  "batch"}


class TestMachineOutputVocabulary:
    def test_every_command_takes_json(self) -> None:
        """`--json` everywhere: every command, the new ones too, has the flag."""
        leaves = _leaf_commands()
        assert {"run", "runs", "show", "budget show", "actions run"} <= set(leaves)
        missing = [path for path, cmd in leaves.items() if "--json" not in _options(cmd)]
        assert missing == []

    def test_every_table_takes_format(self) -> None:
        """`--format table|json|csv` on each command that prints a table, with one help text."""
        from kernel_cli import output

        leaves = _leaf_commands()
        for path in TABLE_COMMANDS:
            opt = _options(leaves[path]).get("--format")
            assert opt is not None, path
            assert getattr(opt, "metavar", None) == output.FORMAT_METAVAR, path
            assert output.FORMAT_HELP in getattr(opt, "help", ""), path


def _help(path: str) -> str:
    """`kernel PATH --help` as printed at 100 columns, rendered in-process."""
    import typer

    from kernel_cli.app import app

    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("kernel", [], resilient_parsing=True, max_content_width=100,
                           terminal_width=100)
    for name in path.split():
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
        ctx = cmd.make_context(name, [], parent=ctx, resilient_parsing=True)
    return str(cmd.get_help(ctx))


#: Metavars click/typer invent from a parameter's type, which say nothing to a reader
#: (PATH is one too, but --db PATH says what it means).
TYPE_NAMES = {"TEXT", "INTEGER", "FLOAT", "BOOLEAN", "FILENAME", "DIRECTORY", "UUID",
              "DATETIME", "CHOICE"}


class TestHelp:
    def test_run_groups_its_options_in_panels(self) -> None:
        """`kernel run --help`: every option sits under a panel title (--help alone is not)."""
        leaves = _leaf_commands()
        ungrouped = [p.opts for p in leaves["run"].params  # type: ignore[attr-defined]
                     if p.param_type_name == "option" and not p.rich_help_panel]
        assert ungrouped == []
        text = _help("run")
        titles = ["Limits:", "Critic (supervision):", "Context and input:", "Audit and storage:",
                  "Output and delivery:", "Dry run:", "Agents (--agent):", "Options:"]
        where = [text.index("\n" + t + "\n") for t in titles]
        assert where == sorted(where), text
        limits = text.split("\nLimits:\n", 1)[1].split("\n\n", 1)[0]
        assert "--timeout DURATION" in limits and "--max-steps N" in limits
        options = text.split("\nOptions:\n", 1)[1]
        assert options.split() == ["-h,", "--help", "Show", "this", "message", "and", "exit."]

    def test_every_value_has_a_real_metavar(self) -> None:
        """Each argument and valued option names what it wants: never a Python or click type."""
        bad = []
        for path, cmd in _leaf_commands().items():
            for p in cmd.params:  # type: ignore[attr-defined]
                if p.param_type_name == "option" and p.is_flag:
                    continue
                if not p.metavar or p.metavar.upper() in TYPE_NAMES:
                    bad.append((path, p.name, p.metavar))
        assert bad == []

    def test_no_typer_internals_in_any_help(self) -> None:
        """No `<str>`, `<int range>`, `<list[str]>`, `{RUN_ID}`, lowercase run_id in any help."""
        for path in ["", *_leaf_commands()]:
            text = _help(path) if path else _help("")
            for leak in ("<str>", "<int", "<float", "<list", "<path>", "{RUN_ID}", "{run_id}",
                         "[run_id]", "RUN_ID <", " TEXT", " INTEGER", " FLOAT"):
                assert leak not in text, (path, leak)
            usage = text.splitlines()[0]
            assert "{" not in usage and "<" not in usage, (path, usage)
        for path in ("show", "resume", "export"):
            assert "RUN_ID" in _help(path), path
