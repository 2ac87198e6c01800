"""Secrets never reach the audit file, the checkpoints or a Parquet export (the real CLI).

A corpus of secrets (every known token shape, secret-named env vars and
context keys, URLs with passwords, user patterns) goes in through every
door: `--context`, `${env.X}` rendered by a loop, `--webhook` / `--base-url`
URLs (a failing webhook is a `port_failure` event), a command's echoed
output and argv, and an LLM agent's tool-call arguments and answer (a local
chat-completions server). Then the raw bytes of the DuckDB file, every
table's decoded text, and a `kernel export` directory (raw and decoded) are
searched for each secret. A resumed run still gets the real value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from http_fakes import send_json, serving

pytestmark = pytest.mark.realtime

_BODY = "0123456789abcdefghijKLMNOP"
#: name -> the secret as it is used. Every one carries a unique body that must not survive.
SHAPED = {
    "openai": f"sk-OpenAi{_BODY}",
    "openai_proj": f"sk-proj-OpenAiProj{_BODY}",
    "anthropic": f"sk-ant-api03-Anthropic{_BODY}",
    **{f"github_{p}": f"{p}_GitHub{p.upper()}{_BODY}"
       for p in ("ghp", "gho", "ghu", "ghs", "ghr")},
    "github_pat": f"github_pat_11FineGrained_{_BODY}{_BODY}",
    "aws_id": "AKIAIOSFODNN7EXAMPLE",
    "aws_sts": "ASIAY34FZKBOKMUTVV7A",
    "aws_secret": "aws_secret_access_key=wJalrXUtnFEMIK7MDENGbPxRfiCYAwsSecret",
    "slack": f"xoxb-123456789012-SlackBody{_BODY}",
    "bearer": f"Authorization: Bearer BearerBody{_BODY}",
    "url": f"https://alice:UrlPasswordBody{_BODY}@example.com/x",
    "pem": f"-----BEGIN RSA PRIVATE KEY-----\nMIIEpPemBody{_BODY}\n-----END RSA PRIVATE KEY-----",
}
#: The part of each secret that must be found nowhere.
BODIES = {
    **{k: v.split(_BODY)[0].split("_")[-1].split("-")[-1] + _BODY for k, v in SHAPED.items()
       if _BODY in v},
    "aws_id": "IOSFODNN7EXAMPLE", "aws_sts": "Y34FZKBOKMUTVV7A",
    "aws_secret": "wJalrXUtnFEMIK7MDENGbPxRfiCYAwsSecret",
}
ENV_SECRET = "EnvPlainSecretValue42"  # no shape: found by its variable's name
CTX_SECRET = "CtxPlainSecretValue77"  # no shape: found by its context key's name
HOOK_PASSWORD = "HookPasswordBody9876"
BASE_PASSWORD = "BasePasswordBody5432"
FAIL_BASE_PASSWORD = "FailBasePasswordBody1"
PATTERN_SECRET = "corp-424242"  # --redact 'corp-[0-9]{6}'
FLEET_SECRET = "fleet-abcxyz"  # KERNEL_REDACT='fleet-[a-z]{6}'
PLAIN = [ENV_SECRET, CTX_SECRET, HOOK_PASSWORD, BASE_PASSWORD, FAIL_BASE_PASSWORD,
         PATTERN_SECRET, FLEET_SECRET]
ALL_BODIES = [*BODIES.values(), *PLAIN]


def _env(cli_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")}
    env.update(GITHUB_TOKEN=SHAPED["github_ghp"], DEPLOY_PASSWORD=ENV_SECRET,
               KERNEL_REDACT="fleet-[a-z]{6}")
    return env


def kernel(exe: str, env: dict[str, str], *args: str, cwd: Path | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL)


class _ToolCaller(BaseHTTPRequestHandler):
    """First turn: a shell tool call whose arguments carry secrets; then an answer with one."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if any(m.get("role") == "tool" for m in body["messages"]):
            message: dict[str, Any] = {"role": "assistant",
                                       "content": f"done {SHAPED['github_ghs']}"}
        else:
            command = f"echo {SHAPED['openai_proj']} {SHAPED['slack']} {PATTERN_SECRET}"
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "shell", "arguments": json.dumps({
                    "command": command, "token": SHAPED["github_gho"]})}}]}
        send_json(self, {"choices": [{"message": message, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def chat_port() -> Iterator[int]:
    """A chat-completions server on 127.0.0.1 that calls the shell tool once."""
    with serving(_ToolCaller) as port:
        yield port


def _leaks(text: str, secrets: list[str]) -> list[str]:
    return [s for s in secrets if s in text]


def _journal_bytes(db: Path) -> bytes:
    """The raw bytes of the journal beside `db` (and its WAL), where every run writes first."""
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + ".*") if p.is_file())


def _db_text(db: Path) -> str:
    """Every table's rows, decoded by DuckDB (the file's compression cannot hide anything)."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        tables = [r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
        ).fetchall()]
        return "\n".join(repr(con.execute(f'SELECT COLUMNS(*)::VARCHAR FROM "{t}"').fetchall())
                         for t in tables)
    finally:
        con.close()


def _export_text(directory: Path) -> tuple[bytes, str]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped, unused-ignore]

    raw = b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())
    decoded = "\n".join(repr(pq.read_table(p).to_pylist())
                        for p in sorted(directory.rglob("*.parquet")))
    return raw, decoded


def _loop_file(tmp_path: Path) -> Path:
    refs = " ".join(f"${{context.{k}}}" for k in SHAPED if k != "pem")
    path = tmp_path / "leak.yaml"
    path.write_text(
        "name: leak\ninitial: one\nmax_iterations: 4\nstates:\n"
        "  one:\n"
        f"    action: 'echo \"{refs} ${{env.GITHUB_TOKEN}} ${{env.DEPLOY_PASSWORD}} "
        f"${{context.db_password}} {PATTERN_SECRET} {FLEET_SECRET}\"'\n"
        "    capture: out\n    next: done\n"
        "  done:\n    terminal: true\n")
    return path


class TestSecretsCorpus:
    def test_no_secret_is_stored_anywhere(self, kernel_exe: str, cli_env: dict[str, str],
                                          tmp_path: Path, chat_port: int) -> None:
        """Every secret, through every door, is absent from the DB file, its tables, an export."""
        env = _env(cli_env)
        db = Path(env["KERNEL_DB"])
        ctx = [a for k, v in SHAPED.items() if k != "pem" for a in ("-c", f"{k}={v}")]
        # 1. A loop: --context values, ${env.X}, a failing --webhook with a password, --redact.
        loop = kernel(kernel_exe, env, "run", str(_loop_file(tmp_path)), *ctx,
                      "-c", f"db_password={CTX_SECRET}", "--redact", "corp-[0-9]{6}",
                      "--webhook", f"http://hook:{HOOK_PASSWORD}@127.0.0.1:9/hook")
        assert loop.returncode == 0, loop.stderr
        assert SHAPED["github_ghp"] in loop.stdout  # the command itself saw the real value
        assert "delivery.deliver" in loop.stderr
        # 2. A command: secrets in its argv, its output and its context.
        echoed = "; ".join(f"printf '%s\\n' '{v}'" for v in SHAPED.values())
        cmd = kernel(kernel_exe, env, "run", "-c", f"password={CTX_SECRET}", "--", "sh", "-c",
                     f"{echoed}; echo $KERNEL_CTX_PASSWORD $DEPLOY_PASSWORD {FLEET_SECRET}")
        assert cmd.returncode == 0, cmd.stderr
        assert CTX_SECRET in cmd.stdout and SHAPED["pem"] in cmd.stdout
        # 3. An LLM agent: a password in --base-url, secrets in tool-call arguments,
        #    the tool's output and the final answer.
        llm = kernel(kernel_exe, env, "run", "--json", "--agent", "llm", "--model", "m",
                     "--allow-shell", "--redact", "corp-[0-9]{6}",
                     "--base-url", f"http://u:{BASE_PASSWORD}@127.0.0.1:{chat_port}/v1",
                     "--prompt", "deploy with ${context.key}", "-c",
                     f"key={SHAPED['anthropic']}", cwd=tmp_path)
        assert llm.returncode == 0, llm.stderr
        assert json.loads(llm.stdout)["output"] == f"done {SHAPED['github_ghs']}"
        # 4. An LLM agent whose --base-url (with a password) fails.
        failed = kernel(kernel_exe, env, "run", "--agent", "llm", "--model", "m",
                        "--timeout", "3", "--prompt", "x", "--base-url",
                        f"http://u:{FAIL_BASE_PASSWORD}@127.0.0.1:9/v1")
        assert failed.returncode != 0

        # Every run wrote the journal (kernel.duckdb.journal and its -wal); the analysts'
        # file is made from it by a sync. Both must be free of secrets.
        journal = b"".join(
            p.read_bytes() for p in db.parent.glob(db.name + ".*") if p.is_file())
        synced = kernel(kernel_exe, env, "sync")
        assert synced.returncode == 0, synced.stderr
        raw = journal + db.read_bytes() + b"".join(
            p.read_bytes() for p in db.parent.glob(db.name + ".*") if p.is_file())
        decoded = _db_text(db)
        assert _leaks(decoded, ALL_BODIES) == []
        assert _leaks(raw.decode("latin-1"), ALL_BODIES) == []
        # ... and the doors were really used: the markers are there instead.
        for kind in ("openai_key", "anthropic_key", "github_token", "aws_access_key_id",
                     "secret", "slack_token", "authorization", "url_credentials",
                     "private_key", "literal", "context", "pattern"):
            assert f"[REDACTED:{kind}]" in decoded, kind
        kinds = {json.loads(line)["kind"] for line in kernel(
            kernel_exe, env, "query", "SELECT DISTINCT kind FROM events", "--format",
            "json").stdout.splitlines()}
        assert {"action_start", "output", "port_failure", "tool_start", "tool_end"} <= kinds

        out = tmp_path / "export"
        exported = kernel(kernel_exe, env, "export", str(out))
        assert exported.returncode == 0, exported.stderr
        raw_export, decoded_export = _export_text(out)
        assert "[REDACTED:github_token]" in decoded_export
        assert _leaks(raw_export.decode("latin-1"), ALL_BODIES) == []
        assert _leaks(decoded_export, ALL_BODIES) == []


class TestBadPatterns:
    @pytest.mark.parametrize("where", ["flag", "env"])
    def test_a_bad_pattern_is_one_line_exit_2(self, kernel_exe: str, cli_env: dict[str, str],
                                              where: str) -> None:
        """A --redact or $KERNEL_REDACT pattern that does not compile: one line, exit 2."""
        env = dict(cli_env)
        args = ["run", "--", "true"]
        if where == "flag":
            args[1:1] = ["--redact", "a("]
        else:
            env["KERNEL_REDACT"] = "ok-[0-9]+\na("
        proc = kernel(kernel_exe, env, *args)
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        assert "redact pattern 'a(' is not a valid regular expression" in line


def _resume_loop(tmp_path: Path) -> Path:
    """A loop that writes its secret to a file before and after a state it is stopped in."""
    path = tmp_path / "resumable.yaml"
    path.write_text(
        "name: resumable\ninitial: first\nmax_iterations: 6\nstates:\n"
        "  first:\n"
        "    action: 'printf %s ${context.api_token} > before.txt; echo ${context.api_token}'\n"
        "    capture: seen\n    next: wait\n"
        "  wait:\n"
        "    action: 'if [ -e ready ]; then exit 0; fi; touch ready; sleep 60'\n"
        "    next: last\n"
        "  last:\n"
        "    action: 'printf %s ${context.api_token} > after.txt'\n"
        "    next: done\n"
        "  done:\n    terminal: true\n")
    return path


class TestResume:
    def test_a_secret_context_value_must_be_given_again(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """Interrupted with a secret --context value: resume refuses without it, works with it."""
        env = _env(cli_env)
        db = Path(env["KERNEL_DB"])
        secret = "ResumeSecretValue314"
        loop = _resume_loop(tmp_path)
        proc = subprocess.Popen(
            [kernel_exe, "run", "--json", "--checkpoint-interval", "0", str(loop),
             "-c", f"api_token={secret}"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists(), "the loop never reached its waiting state"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        run_id = json.loads(out)["run_id"]
        assert (tmp_path / "before.txt").read_text() == secret
        # Interrupted: the spec and the saved state (which captured the secret) hold none of it,
        # in the journal every run writes or in the analysts' file made from it.
        assert secret.encode() not in _journal_bytes(db)
        assert kernel(kernel_exe, env, "sync").returncode == 0
        assert secret not in _db_text(db)
        assert secret.encode() not in db.read_bytes()

        refused = kernel(kernel_exe, env, "resume", run_id[:12])
        assert refused.returncode == 2
        (line,) = refused.stderr.strip().splitlines()
        assert line == (f"kernel: run {run_id[20:28]} cannot resume: its secrets are not stored; "
                        f"give them again: kernel resume {run_id[20:28]} --context api_token=...")
        recovered = kernel(kernel_exe, env, "recover")
        assert recovered.returncode != 0 and "--context api_token=..." in recovered.stderr
        listed = kernel(kernel_exe, env, "recover", "--list", "--json")
        assert run_id in listed.stdout  # refused, but still resumable

        resumed = kernel(kernel_exe, env, "resume", run_id[20:28].upper(), "--json",
                         "-c", f"api_token={secret}")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["status"] == "ok"
        assert (tmp_path / "after.txt").read_text() == secret  # the real value, not a marker
        assert secret.encode() not in _journal_bytes(db)
        assert kernel(kernel_exe, env, "sync").returncode == 0
        assert secret not in _db_text(db)
        assert secret.encode() not in db.read_bytes()

    def test_a_secret_in_the_command_line_cannot_be_resumed(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """A loop path holding a secret shape cannot be given back: refused and marked failed."""
        env = _env(cli_env)
        sub = tmp_path / "ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
        sub.mkdir()
        loop = _resume_loop(sub)
        proc = subprocess.Popen([kernel_exe, "run", "--json", "--checkpoint-interval", "0",
                                 str(loop), "-c", "api_token=x"], cwd=sub, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (sub / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        run_id = json.loads(out)["run_id"]
        refused = kernel(kernel_exe, env, "resume", run_id[:12])
        assert refused.returncode == 6  # lost
        assert "cannot resume: its agent.path held a secret" in refused.stderr
        assert run_id not in kernel(kernel_exe, env, "recover", "--list", "--json").stdout
        assert os.path.isdir(sub)


_KEY_BODY = ["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7KeyLine1",
             "QWERTYLEAKKEYBODYLINETWO0123456789abcdefABCDEF+/KeyLine2==",
             "ZmFrZUtleUJvZHlMaW5lVGhyZWUxMjM0NTY3ODkwYWJjZGVmZ2hpamtsbW5v"]
_KEY = ("-----BEGIN PRIVATE KEY-----\n" + "\n".join(_KEY_BODY)
        + "\n-----END PRIVATE KEY-----\n")


class TestAttackCorpus:
    """The shapes an adversarial review found stored in clear, through the real CLI."""

    def test_cut_prefixed_escaped_and_argument_secrets_are_not_stored(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        env = dict(cli_env, DB_PASS="EnvDbPassValue77", MYSQL_PWD="MysqlPwdValue55")
        db = Path(env["KERNEL_DB"])
        (tmp_path / "key.pem").write_text(_KEY)
        (tmp_path / "sa.json").write_text(json.dumps(
            {"type": "service_account", "private_key": _KEY}, indent=1))
        (tmp_path / "ssh").mkdir()
        (tmp_path / "ssh" / "id_ed25519").write_text(_KEY)
        token_body = "CutTokenBody0123456789abcdefXYZ"
        jwt = ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJKd3RTdWJqZWN0OTkifQ."
               "JwtSignatureBody1234567890abcdef")
        secrets = [token_body[3:], *(line[8:] for line in _KEY_BODY), "FlagTokenValue11",
                   "FlagPasswordValue22", "RedisPasswordValue33", jwt[40:],
                   "EnvDbPassValue77", "MysqlPwdValue55", "CtxDbPassValue88", "horse battery",
                   "NameTokenValue44"]
        runs = [
            # A token cut by the 4 KiB stderr tail: its `ghp_` prefix is cut off.
            ["--", "python3", "-c", f"import sys; sys.stderr.write('ghp_{token_body}\\n' + "
                                    "'x' * 4060 + '\\n')"],
            # A key whose BEGIN line the stderr tail cut off, followed by warnings.
            ["--", "sh", "-c", "cat key.pem >&2; i=0; while [ $i -lt 85 ]; do "
                               "echo \"warning: deprecated option $i in config file\" >&2; "
                               "i=$((i+1)); done"],
            # A key inside a JSON file; a key behind `grep -r` prefixes.
            ["--", "cat", "sa.json"],
            ["--", "grep", "-r", "", "ssh/"],
            # A key's first lines on stderr, then a failure: runs.error holds a body line.
            ["--", "sh", "-c", "head -3 key.pem >&2; exit 1"],
            # Secrets as the argument after a flag, a URL with an empty user, a JWT, a quoted
            # assignment, secret-named env vars and context keys.
            ["--name", "deploy --token NameTokenValue44", "-c", "db_pass=CtxDbPassValue88",
             "--", "sh", "-c", "echo \"$@\" $DB_PASS $MYSQL_PWD $KERNEL_CTX_DB_PASS; "
                               "echo 'DB_PASSWORD=\"correct horse battery staple\"'",
             "x", "--token", "FlagTokenValue11", "--password", "FlagPasswordValue22",
             "redis://:RedisPasswordValue33@h", jwt],
        ]
        for args in runs:
            proc = kernel(kernel_exe, env, "run", *args, cwd=tmp_path)
            assert proc.returncode in (0, 1), proc.stderr
        assert kernel(kernel_exe, env, "sync").returncode == 0
        decoded = _db_text(db)
        raw = (_journal_bytes(db) + db.read_bytes()).decode("latin-1")
        assert _leaks(decoded, secrets) == []
        assert _leaks(raw, secrets) == []
        for kind in ("private_key", "flag", "url_credentials", "jwt", "secret", "literal",
                     "context"):
            assert f"[REDACTED:{kind}]" in decoded, kind

    def test_a_key_header_without_its_end_keeps_the_rest_of_the_run(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A message naming a key's header line blanks no later line, nor the run's status."""
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--", "sh", "-c",
                      "echo 'error: key file must start with -----BEGIN PRIVATE KEY-----'; "
                      "echo building; echo 'tests passed: 42'")
        assert proc.returncode == 0, proc.stderr
        run_id = json.loads(proc.stdout)["run_id"]
        rows = kernel(kernel_exe, cli_env, "query", "--format", "json",
                      f"SELECT kind, payload FROM events WHERE run_id = '{run_id}' "
                      "AND kind IN ('output', 'run_end') ORDER BY seq").stdout.splitlines()
        stored = [(r["kind"], r["payload"]) for r in map(json.loads, rows)]  # JSON, nested
        assert [p.get("line") for k, p in stored if k == "output"] == [
            "error: key file must start with [REDACTED:private_key_start]", "building",
            "tests passed: 42"]
        assert [p["status"] for k, p in stored if k == "run_end"] == ["ok"]
        output = kernel(kernel_exe, cli_env, "query", "--format", "csv",
                        f"SELECT output FROM runs WHERE run_id = '{run_id}'").stdout
        assert "building" in output and "tests passed: 42" in output

    def test_a_multi_line_secret_is_not_stored_line_by_line(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A secret-named variable holding several lines: each output line is recorded
        on its own, where the whole value never appears; every line is replaced."""
        lines = ["firstpartABCDEF123", "secondpartXYZ98765"]
        env = {**cli_env, "MY_SECRET": "\n".join(lines)}
        proc = kernel(kernel_exe, env, "run", "--json", "--", "sh", "-c", 'echo "$MY_SECRET"')
        assert proc.returncode == 0, proc.stderr
        db = Path(cli_env["KERNEL_DB"])
        assert _leaks(_journal_bytes(db).decode("utf-8", "replace"), lines) == []
        assert kernel(kernel_exe, cli_env, "runs").returncode == 0  # feeds the DuckDB file
        assert _leaks(_db_text(db), lines) == []
