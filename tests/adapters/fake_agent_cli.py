"""A stand-in for a CLI coding agent: prints a scripted JSON-lines event stream.

Usage: python fake_agent_cli.py SCENARIO [PIDFILE]

Scenarios imitate Claude Code's `--output-format stream-json --verbose
--include-partial-messages`, Codex's `exec --json`, and the plain dialect,
including their rough edges: unknown event types, deltas before the stream
starts, a tool result before its tool use, non-JSON lines, a crash mid-turn,
a hang, and a process that lingers after its result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

SESSION = "5f1c2a9e-0000-4000-8000-000000000001"


def emit(obj: object) -> None:
    sys.stdout.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    sys.stdout.flush()
    time.sleep(0.01)


def init() -> None:
    emit({"type": "system", "subtype": "init", "cwd": os.getcwd(), "session_id": SESSION,
          "tools": ["Bash", "Read", "Edit"], "mcp_servers": [], "model": "claude-sonnet-4-5",
          "permissionMode": "default", "apiKeySource": "none"})


def assistant(*blocks: dict[str, object]) -> None:
    emit({"type": "assistant", "parent_tool_use_id": None, "session_id": SESSION,
          "message": {"id": "msg_01", "type": "message", "role": "assistant",
                      "model": "claude-sonnet-4-5", "content": list(blocks),
                      "stop_reason": None, "usage": {"input_tokens": 4, "output_tokens": 1}}})


def delta(text: str, index: int = 0) -> None:
    emit({"type": "stream_event", "session_id": SESSION, "event": {
        "type": "content_block_delta", "index": index,
        "delta": {"type": "text_delta", "text": text}}})


def result(text: str, *, subtype: str = "success", is_error: bool = False) -> None:
    emit({"type": "result", "subtype": subtype, "is_error": is_error, "duration_ms": 2345,
          "duration_api_ms": 2001, "num_turns": 2, "result": text, "session_id": SESSION,
          "total_cost_usd": 0.0123,
          "usage": {"input_tokens": 120, "cache_creation_input_tokens": 30,
                    "cache_read_input_tokens": 50, "output_tokens": 40}})


def claude() -> None:
    # A delta before anything else: real streams reorder.
    delta("Two ", index=1)
    init()
    emit({"type": "rate_limit_event", "rate_limit_info": {"status": "allowed"}})
    emit({"type": "stream_event", "event": {"type": "message_start", "message": {}}})
    assistant({"type": "thinking", "thinking": "I should list the files.", "signature": "x"})
    assistant({"type": "tool_use", "id": "toolu_01", "name": "Bash",
               "input": {"command": "ls", "description": "List files"}})
    time.sleep(0.05)
    emit({"type": "user", "session_id": SESSION, "message": {"role": "user", "content": [
        {"tool_use_id": "toolu_01", "type": "tool_result", "content": "a.txt\nb.txt",
         "is_error": False}]}})
    delta("files.", index=1)
    assistant({"type": "text", "text": "Two files."})
    result("There are two files: a.txt and b.txt.")


def codex() -> None:
    emit({"type": "thread.started", "thread_id": "0199a213-81c0-7800-8aa1-bbab2a035a53"})
    emit({"type": "turn.started"})
    emit({"type": "item.completed", "item": {"id": "item_0", "type": "reasoning",
                                             "text": "**Listing files**"}})
    emit({"type": "item.started", "item": {"id": "item_1", "type": "command_execution",
                                           "command": "bash -lc ls", "aggregated_output": "",
                                           "exit_code": None, "status": "in_progress"}})
    emit({"type": "item.completed", "item": {"id": "item_1", "type": "command_execution",
                                             "command": "bash -lc ls",
                                             "aggregated_output": "a.txt\n", "exit_code": 0,
                                             "status": "completed"}})
    emit({"type": "item.completed", "item": {"id": "item_2", "type": "todo_list",
                                             "items": []}})
    emit({"type": "item.completed", "item": {"id": "item_3", "type": "agent_message",
                                             "text": "One file: a.txt."}})
    emit({"type": "turn.completed", "usage": {"input_tokens": 2400, "cached_input_tokens": 0,
                                              "output_tokens": 60}})


def transient_error() -> None:
    emit({"type": "thread.started", "thread_id": "th-2"})
    emit({"type": "error", "message": "Reconnecting... 1/5"})
    time.sleep(0.1)
    emit({"type": "turn.started"})
    time.sleep(0.8)  # working, silent, for longer than the exit grace
    emit({"type": "item.completed", "item": {"id": "i", "type": "agent_message",
                                             "text": "Recovered."}})
    emit({"type": "turn.completed", "usage": {"input_tokens": 5, "output_tokens": 2}})


def reordered() -> None:
    emit({"type": "text_delta", "text": "Hel"})
    emit({"type": "session_start", "session_id": "s-1"})
    emit({"type": "tool_result", "id": "t1", "output": "ok"})
    emit({"type": "tool_use", "tool": "grep", "id": "t1", "input": {"pattern": "x"}})
    emit({"type": "heartbeat", "seq": 7})
    emit("warning: this line is not JSON")
    emit({"type": "text_delta", "text": "lo"})
    emit({"type": "done"})


def crash() -> None:
    init()
    assistant({"type": "thinking", "thinking": "Run the tests.", "signature": "x"})
    assistant({"type": "tool_use", "id": "toolu_02", "name": "Bash",
               "input": {"command": "pytest"}})
    sys.stderr.write("Error: connection to the API was lost\n")
    sys.stderr.flush()
    sys.exit(3)


def message(mid: str) -> None:
    """One model message streamed with its usage (Claude Code's partial messages)."""
    emit({"type": "stream_event", "session_id": SESSION, "event": {
        "type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "content": [],
            "usage": {"input_tokens": 1000, "output_tokens": 1,
                      "cache_read_input_tokens": 200, "cache_creation_input_tokens": 100}}}})
    delta("Looking.")
    emit({"type": "stream_event", "session_id": SESSION, "event": {
        "type": "message_delta", "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 70}}})
    emit({"type": "stream_event", "session_id": SESSION, "event": {"type": "message_stop"}})


def usage_loop() -> None:
    init()
    message("msg_u1")
    message("msg_u2")
    assistant({"type": "tool_use", "id": "toolu_h", "name": "Halt", "input": {}})
    time.sleep(30)


def usage_crash() -> None:
    init()
    message("msg_u1")
    sys.exit(3)


def hang(pidfile: str) -> None:
    init()
    assistant({"type": "thinking", "thinking": "Hmm.", "signature": "x"})
    child = subprocess.Popen(["sleep", "60"])
    with open(pidfile, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)


def error_result() -> None:
    init()
    assistant({"type": "text", "text": "Working on it"})
    result("", subtype="error_max_turns", is_error=True)


def linger() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL will do
    init()
    result("finished early")
    time.sleep(60)


def no_result() -> None:
    emit({"type": "text_delta", "text": "partial "})
    emit({"type": "text_delta", "text": "answer"})


def steer() -> None:
    init()
    line = sys.stdin.readline()
    text = json.loads(line)["message"]["content"][0]["text"]
    assistant({"type": "text", "text": f"heard: {text}"})
    result(f"heard: {text}")


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "hang":
        hang(sys.argv[2])
        return
    {"claude": claude, "codex": codex, "reordered": reordered, "crash": crash,
     "error-result": error_result, "linger": linger, "no-result": no_result,
     "steer": steer, "transient-error": transient_error, "usage_loop": usage_loop,
     "usage_crash": usage_crash}[scenario]()


if __name__ == "__main__":
    main()
