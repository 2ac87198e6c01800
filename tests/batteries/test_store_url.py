"""A store URL libpq would not take is a configuration error when it is chosen: one line
that names the problem and never the password, exit 2 from the CLI, no run started.

Before, such a URL was taken for an unreachable server (several log lines, exit 3, a
run id minted), and a URL that does not parse had its password printed (psycopg's
parse error quotes the whole URI).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from batteries.store import choose, open_store, store_url
from batteries.store._select import check_url
from kernel import ConfigError

pytest.importorskip("psycopg")

SECRET = "Sup3rS3cretXY"

BAD = [
    pytest.param(f"postgresql://u:{SECRET}@[::1/db", "not a valid PostgreSQL URL",
                 id="unclosed-ipv6"),
    pytest.param(f"postgres://x:{SECRET}@[::1", "not a valid PostgreSQL URL", id="postgres-ipv6"),
    pytest.param(f"postgresql://u:{SECRET}@h/db?foo=1", "not a valid PostgreSQL URL",
                 id="unknown-option"),
    pytest.param("postgresql://u:Sup%33rS3cretXY@[::1/db", "not a valid PostgreSQL URL",
                 id="percent-encoded-password"),
    pytest.param(f"postgresql://u@h/db?password={SECRET}&x", "not a valid PostgreSQL URL",
                 id="password-in-query"),
    pytest.param("postgresql://", "names no host and no database", id="empty"),
    pytest.param(f"postgresql://u:{SECRET}@/", "names no host and no database",
                 id="only-a-user"),
    pytest.param(f"postgresql://x:{SECRET}@127.0.0.1:1/db?sslmode=bogus", "sslmode must be",
                 id="sslmode"),
    pytest.param(f"postgresql://x:{SECRET}@h/db?target_session_attrs=any-old",
                 "target_session_attrs must be", id="target-session-attrs"),
    pytest.param(f"postgresql://x:{SECRET}@h:port/db", "port must be a number", id="port"),
    pytest.param(f"postgresql://x:{SECRET}@h:99999/db", "port must be a number",
                 id="port-range"),
    pytest.param(f"postgresql://x:{SECRET}@h/db?connect_timeout=soon",
                 "connect_timeout must be", id="connect-timeout"),
]

GOOD = [
    "postgresql://postgres@127.0.0.1:5432/kernel",
    f"postgresql://u:{SECRET}@db.example:5432/kernel?sslmode=verify-full",
    "postgres://u@[::1]:5432/kernel",
    "postgresql:///kernel?host=/var/run/postgresql",
    "postgresql://h1:5432,h2:5433/kernel?target_session_attrs=read-write",
    "postgresql://u@h/kernel?connect_timeout=5&application_name=x",
]


@pytest.mark.parametrize(("url", "problem"), BAD)
def test_a_bad_url_is_refused_in_one_line_without_its_password(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_url(url)
    message = str(info.value)
    assert problem in message and message.startswith("--store")
    assert "\n" not in message
    assert SECRET not in message and "Sup%33r" not in message


@pytest.mark.parametrize("url", GOOD)
def test_a_good_url_is_taken(url: str) -> None:
    assert check_url(url) == url


@pytest.mark.parametrize(("url", "problem"), BAD[:1] + BAD[5:6] + BAD[7:8])
def test_every_way_of_choosing_a_store_checks_it(url: str, problem: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`--store` (`choose`), `$KERNEL_STORE` (`store_url`), `open_store(url=)` and the
    store itself (`PostgresStore`) all refuse it, before any connection is tried."""
    from batteries.store import PostgresStore

    with pytest.raises(ConfigError, match=problem):
        choose(url)
    with pytest.raises(ConfigError, match=problem):
        open_store(url=url)
    with pytest.raises(ConfigError, match=problem):
        PostgresStore(url)
    monkeypatch.setenv("KERNEL_STORE", url)
    with pytest.raises(ConfigError, match=f"KERNEL_STORE.*{problem}"):
        store_url()


@pytest.mark.parametrize(("url", "problem"), BAD[:1] + BAD[5:6] + BAD[7:8])
@pytest.mark.parametrize("how", ["--store", "KERNEL_STORE"])
def test_the_cli_exits_2_with_one_line(url: str, problem: str, how: str, kernel_exe: str,
                                       cli_env: dict[str, str], tmp_path: Path) -> None:
    """`kernel run --store BAD` (or `$KERNEL_STORE=BAD`): exit 2, one line naming the
    problem, no password, the command not run and no journal made."""
    marker = tmp_path / "ran"
    args = [kernel_exe, "run"]
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "1"}
    if how == "--store":
        args += ["--store", url]
    else:
        env["KERNEL_STORE"] = url
    proc = subprocess.run([*args, "--", "touch", str(marker)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and problem in proc.stderr, proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr and "unreachable" not in proc.stderr
    assert not marker.exists()
    assert not list(tmp_path.glob("*.journal"))
