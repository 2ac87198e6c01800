"""Presets: the non-interactive command line and stream format of each known client.

`preset("claude" | "codex" | "gemini", prompt, ...)` returns a `SessionCLIAgent`
set up the way that client runs unattended::

    claude  claude -p --output-format stream-json --verbose --include-partial-messages
            --input-format stream-json [--model M] [--max-turns N]
            (the task and nudges as stdin messages; deltas stream as they come, so a
            slow model is not mistaken for a silent one)
            resume: ... --resume SESSION_ID
    codex   codex exec --json --skip-git-repo-check [--model M] -- TASK
            resume: codex exec resume --json --skip-git-repo-check [--model M] -- THREAD_ID PROMPT
    gemini  gemini --output-format stream-json [--model M] --prompt=TASK
            resume: ... --resume SESSION_ID --prompt=PROMPT

A task is never read as an option, whatever it starts with: `--` ends
Codex's options, and Gemini's takes its value in the same argument.

Each client reads its model endpoint and key itself (ANTHROPIC_BASE_URL /
ANTHROPIC_API_KEY; Codex's config.toml and its provider's key variable;
GOOGLE_GEMINI_BASE_URL / GEMINI_API_KEY), so the presets pass none. Only
Claude Code takes input mid-run (stream-json on stdin): nudges reach it;
for the others they are audited as undeliverable. Only Claude Code has a
turn limit flag; asking another client for one is a `ValueError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ._agent import SessionCLIAgent

#: The clients with a preset, and their npm packages.
CLIENTS: Mapping[str, str] = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "gemini": "@google/gemini-cli",
}


def preset(client: str, prompt: str, *, model: str | None = None,
           max_turns: int | None = None, cwd: str | None = None,
           env: Mapping[str, str] | None = None, executable: str | None = None,
           permission_prompt: bool = False, **options: object) -> SessionCLIAgent:
    """A `SessionCLIAgent` running `client` non-interactively on `prompt`.

    Args:
        client: "claude", "codex" or "gemini".
        prompt: The task.
        model: Passed as the client's model flag.
        max_turns: Claude Code's `--max-turns` (the others have no such flag).
        cwd: The working directory the client runs (and edits) in.
        env: Extra environment variables for the client.
        executable: The client's executable (default: its name, found on PATH).
        permission_prompt: Claude Code only: ask for tool approvals on the
            stream (`--permission-prompt-tool stdio`), so a tool needing one
            puts the run in `waiting_for_approval` (bounded by `approval_ttl`)
            instead of Claude Code denying it by itself.
        **options: Further `CLIAgent` fields (idle_ttl, approval_ttl, on_event, ...).

    Raises:
        ValueError: An unknown client, or an option the client does not support.
    """
    if client not in CLIENTS:
        raise ValueError(f"no preset for {client!r} (known: {', '.join(CLIENTS)})")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"--max-turns must be at least 1, got {max_turns}")
    if max_turns is not None and client != "claude":
        raise ValueError(f"--max-turns: {client} has no turn limit option "
                         "(only claude does)")
    if permission_prompt and client != "claude":
        raise ValueError(f"{client} cannot ask for approvals on its stream (only claude can)")
    exe = executable or client
    model_args = ["--model", model] if model else []
    argv: list[str]
    resume: Callable[[str], Sequence[str]]
    stdin = False
    if client == "claude":
        base = [exe, "-p", "--output-format", "stream-json", "--verbose",
                "--include-partial-messages", "--input-format", "stream-json", *model_args]
        if max_turns is not None:
            base += ["--max-turns", str(max_turns)]
        if permission_prompt:
            base += ["--permission-prompt-tool", "stdio"]
        argv = base
        stdin = True

        def resume(sid: str) -> list[str]:
            return [*base, "--resume", sid]
    elif client == "codex":
        flags = ["--json", "--skip-git-repo-check", *model_args]
        # After `--`, a prompt starting with "-" is the prompt, not an option.
        argv = [exe, "exec", *flags, "--", prompt]
        resume_prompt = str(options.get("resume_prompt") or _RESUME)

        def resume(sid: str) -> list[str]:
            return [exe, "exec", "resume", *flags, "--", sid, resume_prompt]
    else:
        base = [exe, "--output-format", "stream-json", *model_args]
        # `--prompt=TASK`: a task starting with "-" is the option's value, not an option.
        argv = [*base, f"--prompt={prompt}"]
        resume_prompt = str(options.get("resume_prompt") or _RESUME)

        def resume(sid: str) -> list[str]:
            return [*base, "--resume", sid, f"--prompt={resume_prompt}"]
    return SessionCLIAgent(argv, cwd=cwd, env=env, client=client, resume_argv=resume,
                           stdin_prompt=prompt if stdin else None, stdin_steer=stdin,
                           **options)  # type: ignore[arg-type]


_RESUME = ("Continue the task. You were interrupted; check what is already done before "
           "redoing it.")
