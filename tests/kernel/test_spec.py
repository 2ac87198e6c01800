"""RunSpec: the versioned run spec, its JSON round trip and its one-line errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kernel import (
    AgentSpec,
    CommandSpec,
    ConfigError,
    Limits,
    LoopSpec,
    PortSpec,
    RunInfo,
    RunSpec,
)

#: Exactly what `kernel run` on main stored for a loop run before specs had a version
#: (captured from its journal: a secret context value and a webhook with a password).
MAIN_STORED = json.loads("""{"agent": {"kind": "loop", "path": "/tmp/spec_main/loop.yaml",
"context": {"api_token": "[REDACTED:context]", "dir": "src"}, "scenario": null, "model": null,
"base_url": null, "api_key_env": null}, "info": {"run_id": "01a207300dff76ccad581353b10fdf4a",
"name": "tiny", "subject_id": "loop:tiny", "caller_id": "", "channel_id": "",
"parent_run_id": null, "inputs": {"loop": "/tmp/spec_main/loop.yaml", "context":
{"api_token": "[REDACTED:context]", "dir": "src"}}}, "limits": {"max_steps": 5,
"timeout": 60.0, "soft_timeout": null, "tool_timeout": null, "max_tool_calls": null,
"max_input_tokens": null, "max_output_tokens": null, "max_total_tokens": null,
"max_cost_usd": null, "checkpoint_every_steps": 1, "checkpoint_every_seconds": 0.0,
"poll_interval": 0.25, "finalize_timeout": 30.0, "dry_run": false}, "ports": {"db":
"/tmp/spec_main/k.duckdb", "no_audit": false, "no_critic": false, "soft_timeout": null,
"idle_timeout": null, "model_timeout": null, "tool_timeout": null, "deliver_dir": null,
"webhooks": ["http://[REDACTED:url_credentials]@127.0.0.1:9/x"], "otlp": null},
"cwd": "/tmp/spec_main", "redacted": [["agent", "context", "api_token"],
["ports", "webhooks", 0]]}""")

SPECS = [
    RunSpec(CommandSpec(("make", "test"), {"k": "v"}), RunInfo(name="make test"),
            Limits(timeout=60), PortSpec(db="/x/k.duckdb", no_critic=True), cwd="/x"),
    RunSpec(LoopSpec("/x/loop.yaml", {"dir": "src"}, scenario="all-pass", model="m"),
            RunInfo(name="loop", inputs={"loop": "/x/loop.yaml"}),
            Limits(max_steps=7, dry_run=True),
            PortSpec(webhooks=("http://127.0.0.1:9/a", "http://127.0.0.1:9/b"))),
    RunSpec(AgentSpec("llm", model="m", prompt="hi", allow_shell=True, max_turns=None,
                      price=(0.15, 0.6)),
            RunInfo(name="llm m", caller_id="me", parent_run_id="p"),
            ports=PortSpec(idle_timeout=0.0, otlp="http://127.0.0.1:4318")),
    RunSpec(AgentSpec("claude", prompt="fix it", max_turns=3), redacted=(("ports", "otlp"),)),
    RunSpec(CommandSpec(("true",)), batch={"batch_id": "b1", "task_id": "7"}),
]


class TestRoundTrip:
    @pytest.mark.parametrize("spec", SPECS,
                             ids=lambda s: s.agent.kind + ("-batch" if s.batch else ""))
    def test_json_round_trip(self, spec: RunSpec) -> None:
        """to_json then from_json gives an equal spec, for every kind of run."""
        back = RunSpec.from_json(spec.to_json())
        assert back == spec
        assert back.to_dict() == spec.to_dict()
        assert back.to_dict()["version"] == RunSpec.LATEST_VERSION == 2

    def test_frozen(self) -> None:
        """A spec and what it runs cannot be changed in place."""
        spec = SPECS[0]
        with pytest.raises(AttributeError):
            spec.cwd = "/elsewhere"  # type: ignore[misc]
        with pytest.raises(AttributeError):
            spec.agent.argv = ("rm",)  # type: ignore[misc]


class TestOldSpecs:
    def test_spec_stored_by_main_loads(self) -> None:
        """A spec with no version field (stored before versions were written) is version 1,
        read as today's shape (version 2 added `price`, absent before: None)."""
        spec = RunSpec.from_dict(MAIN_STORED)
        assert spec.version == 2
        assert spec.agent == LoopSpec("/tmp/spec_main/loop.yaml",
                                      {"api_token": "[REDACTED:context]", "dir": "src"})
        assert spec.info.run_id == "01a207300dff76ccad581353b10fdf4a"
        assert spec.limits == Limits(max_steps=5, timeout=60.0, tool_timeout=None,
                                     poll_interval=0.25)
        assert spec.ports.webhooks == ("http://[REDACTED:url_credentials]@127.0.0.1:9/x",)
        assert spec.redacted == (("agent", "context", "api_token"), ("ports", "webhooks", 0))
        # Written again, it is main's document in today's shape.
        assert spec.to_dict() == _today(MAIN_STORED)

    def test_batch_task_spec_stored_by_main_loads(self) -> None:
        """`kernel batch` on main stored its task specs with a `batch` object: version 1 too."""
        doc = {**MAIN_STORED, "batch": {"batch_id": "01b2", "task_id": "build"}}
        spec = RunSpec.from_dict(doc)
        assert spec.batch == {"batch_id": "01b2", "task_id": "build"}
        assert spec.to_dict() == _today(doc)
        assert "batch" not in RunSpec.from_dict(MAIN_STORED).to_dict()  # written only if set

    def test_a_newer_version_is_refused_clearly(self) -> None:
        """A spec from a newer kernel is refused with one line, never guessed at."""
        with pytest.raises(ConfigError) as err:
            RunSpec.from_dict({**MAIN_STORED, "version": 3})
        assert str(err.value) == ("run spec: version 3 is newer than this kernel reads (up to 2); "
                                  "upgrade the kernel to use it")

    def test_a_version_1_agent_spec_reads_without_a_price(self) -> None:
        """Version 1 had no `price`: an llm agent stored then resumes unpriced."""
        doc = {"version": 1, "agent": {"kind": "agent", "agent": "llm", "model": "m",
                                       "prompt": "hi"}}
        spec = RunSpec.from_dict(doc)
        assert isinstance(spec.agent, AgentSpec) and spec.agent.price is None
        assert spec.to_dict()["agent"]["price"] is None


def _today(stored: dict[str, Any]) -> dict[str, Any]:
    """A version-1 document as this kernel writes it back: version 2, `price` None."""
    return {**stored, "version": 2, "agent": {**stored["agent"], "price": None}}


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(MAIN_STORED))
    *parents, last = path.split(".")
    where = doc
    for key in parents:
        where = where[key]
    if value is _DROP:
        del where[last]
    else:
        where[last] = value
    return doc


_DROP = object()


class TestErrors:
    @pytest.mark.parametrize(("path", "value", "message"), [
        ("version", "1", "run spec: version must be a whole number >= 1, got '1'"),
        ("version", 0, "run spec: version must be a whole number >= 1, got 0"),
        ("agent", _DROP, "run spec: agent is missing"),
        ("agent.kind", "robot", "run spec: agent.kind must be one of command, loop, agent, "
                                "got 'robot'"),
        ("agent.path", _DROP, "run spec: agent.path is missing"),
        ("agent.path", 3, "run spec: agent.path must be a string, got 3"),
        ("agent.context", ["a"], "run spec: agent.context must be an object, got ['a']"),
        ("agent.context", {"k": 1}, "run spec: agent.context.k must be a string, got 1"),
        ("agent.colour", "red", "run spec: unknown field agent.colour"),
        ("info.run_id", None, "run spec: info.run_id must be a string, got None"),
        ("info.inputs", "x", "run spec: info.inputs must be an object, got 'x'"),
        ("limits.timeout", "soon", "run spec: limits.timeout must be a number or null, "
                                   "got 'soon'"),
        ("limits.timeout", -1, "run spec: limits.timeout must be > 0 or None, got -1.0"),
        ("limits.max_steps", 2.5, "run spec: limits.max_steps must be a whole number or null, "
                                  "got 2.5"),
        ("limits.dry_run", "no", "run spec: limits.dry_run must be true or false, got 'no'"),
        ("ports.webhooks", "http://x", "run spec: ports.webhooks must be a list, got 'http://x'"),
        ("ports.webhooks", [1], "run spec: ports.webhooks[0] must be a string, got 1"),
        ("cwd", 5, "run spec: cwd must be a string or null, got 5"),
        ("redacted", [["agent", None]], "run spec: redacted[0] must be a list of keys and "
                                        "indexes, got ['agent', None]"),
        ("surprise", 1, "run spec: unknown field surprise"),
        ("batch", {"task_id": 3}, "run spec: batch.task_id must be a string, got 3"),
    ])
    def test_one_line_naming_the_field(self, path: str, value: Any, message: str) -> None:
        """Every bad field is a ConfigError of one line that names it."""
        with pytest.raises(ConfigError) as err:
            RunSpec.from_dict(_with(path, value))
        assert str(err.value) == message

    @pytest.mark.parametrize(("agent", "message"), [
        ({"kind": "command", "argv": []}, "run spec: agent.argv must name a command"),
        ({"kind": "agent", "agent": "robot"},
         "run spec: agent.agent must be one of llm, agentcli, pane, claude, codex, gemini, "
         "got 'robot'"),
        ({"kind": "agent", "agent": "llm", "allow_shell": "yes"},
         "run spec: agent.allow_shell must be true or false, got 'yes'"),
    ])
    def test_what_to_run(self, agent: dict[str, Any], message: str) -> None:
        """What to run is checked per kind."""
        with pytest.raises(ConfigError) as err:
            RunSpec.from_dict({"agent": agent})
        assert str(err.value) == message

    @pytest.mark.parametrize(("text", "start"), [
        ("{", "run spec: not valid JSON: "),
        ("[]", "run spec: expected a JSON object, got list"),
    ])
    def test_not_a_spec(self, text: str, start: str) -> None:
        """Text that is not a JSON object is one line too."""
        with pytest.raises(ConfigError) as err:
            RunSpec.from_json(text)
        assert str(err.value).startswith(start) and "\n" not in str(err.value)
