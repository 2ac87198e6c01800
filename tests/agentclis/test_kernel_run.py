"""`kernel run --agent claude|codex|gemini --prompt ...`: the installed CLI, a real client,
a fake model server, and nothing else on the command line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from clients import CLIENTS, client_env, require
from fake_models import FakeModelServer, ListDir, Reply, Say

pytestmark = pytest.mark.realtime


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_kernel_run_agent_with_only_a_prompt(client: str, kernel_exe: str,
                                             tmp_path: Path) -> None:
    """The preset finds the client on PATH; the client reads its endpoint and key itself."""
    require(client)
    work = tmp_path / "work"
    work.mkdir()
    replies = [Reply([ListDir(".")]), Reply([Say("All done here.")])]
    with FakeModelServer(CLIENTS[client][2], replies) as srv:
        env = client_env(client, srv.url, tmp_path / "home")
        env["KERNEL_DB"] = str(tmp_path / "kernel.duckdb")
        proc = subprocess.run([kernel_exe, "run", "--agent", client, "--prompt", "Look around"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        assert "All done here." in proc.stdout
        assert "Look around" in json.dumps(srv.model_bodies()[0])
        shown = subprocess.run([kernel_exe, "runs", "--json"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert '"ok"' in shown.stdout
