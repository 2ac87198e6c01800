"""Finding the pinned real agent CLIs, and an offline environment for each.

`.ci/install-agent-clis` installs them into ``$KERNEL_AGENT_CLIS`` (default
``~/.cache/kernel-agent-clis``). A test that needs a client calls `require`: it skips
with the reason when the client is absent, and fails instead under ``CI=true``.

`client_env` builds the environment a client runs in against a `FakeModelServer`:
HOME (and the client's config directory) in a temporary directory, the base URL and a
fake key in the variables the client itself reads, and telemetry, update checks and
auto-updates off, so no test reaches the internet. A dead proxy for everything but
127.0.0.1 catches any stray request that honours the proxy variables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

PREFIX = Path(os.environ.get("KERNEL_AGENT_CLIS")
              or Path.home() / ".cache" / "kernel-agent-clis")
BIN = PREFIX / "node_modules" / ".bin"
PINS = json.loads((Path(__file__).parents[2] / ".ci" / "agent-clis" / "package.json")
                  .read_text())["dependencies"]

#: kernel preset name -> (executable, npm package, protocol of its fake server)
CLIENTS = {
    "claude": ("claude", "@anthropic-ai/claude-code", "anthropic"),
    "codex": ("codex", "@openai/codex", "responses"),
    "gemini": ("gemini", "@google/gemini-cli", "gemini"),
}


def client_path(name: str) -> Path | None:
    """The pinned client's executable, or None when it is not installed."""
    exe = BIN / CLIENTS[name][0]
    return exe if exe.exists() and os.access(exe, os.X_OK) else None


def require(name: str) -> Path:
    """The client's executable; skip (or under CI=true, fail) when it is missing."""
    exe = client_path(name)
    if exe is not None:
        return exe
    package = CLIENTS[name][1]
    why = (f"{package}@{PINS[package]} is not installed in {PREFIX} "
           "(run .ci/install-agent-clis)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI needs the real client: {why}")
    pytest.skip(why)


def client_env(name: str, server_url: str, home: Path) -> dict[str, str]:
    """Environment for running client `name` offline against the fake server at `server_url`.

    Writes the client's config files under `home`. The client's bin directory leads
    PATH, so the kernel's presets find the pinned executable by name.
    """
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "OPENAI_", "GEMINI_", "GOOGLE_", "CODEX_",
                                "CLAUDE_"))}
    env.update({
        "HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "NO_COLOR": "1", "TERM": "dumb", "CI": env.get("CI", ""),
        "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
    })
    if name == "claude":
        env.update({
            "ANTHROPIC_BASE_URL": server_url, "ANTHROPIC_API_KEY": "sk-ant-fake",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_ENABLE_TELEMETRY": "0",
        })
    elif name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(
            'model = "fake-model"\n'
            'model_provider = "fake"\n'
            "check_for_update_on_startup = false\n"
            "[analytics]\nenabled = false\n"
            "[model_providers.fake]\n"
            'name = "fake"\n'
            f'base_url = "{server_url}/v1"\n'
            'env_key = "FAKE_MODEL_API_KEY"\n'
            'wire_api = "responses"\n'
            "request_max_retries = 2\n"
            "stream_max_retries = 2\n"
            "stream_idle_timeout_ms = 300000\n")
        env.update({"CODEX_HOME": str(codex_home), "FAKE_MODEL_API_KEY": "sk-fake"})
    elif name == "gemini":
        gemini_dir = home / ".gemini"
        gemini_dir.mkdir(exist_ok=True)
        (gemini_dir / "settings.json").write_text(json.dumps({
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            # Its own loop detection would end a looping run `ok` before the critic can:
            # the scenarios test the critic's.
            "model": {"name": "gemini-2.5-flash", "disableLoopDetection": True},
        }))
        env.update({"GOOGLE_GEMINI_BASE_URL": server_url, "GEMINI_API_KEY": "fake-key",
                    "GEMINI_CLI_TRUST_WORKSPACE": "true", "GEMINI_TELEMETRY_ENABLED": "false"})
    else:
        raise ValueError(f"unknown client {name!r}")
    return env
