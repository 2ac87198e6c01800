"""Tools an LLM agent may call: `read_file`, `shell` (opt-in), and host callables.

A `Tool` is a name, a description, a JSON Schema for its arguments (what the
model sees) and an async callable (what the kernel awaits with the model's
arguments as keywords, under `Limits.tool_timeout`). A tool reports failure
by raising; the kernel turns that into an error tool result the model reads.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import stat
import types
import typing
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from .._proc import spawn

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_JSON_TYPES: dict[Any, str] = {
    str: "string", int: "integer", float: "number", bool: "boolean",
    list: "array", tuple: "array", dict: "object",
}


@dataclass(slots=True, frozen=True)
class Tool:
    """One tool: what the model is told about it, and the callable that runs it.

    Attributes:
        name: The tool's name (letters, digits, `_`, `-`; at most 64).
        description: What it does, for the model.
        parameters: A JSON Schema object describing its keyword arguments.
        fn: The async callable the kernel awaits with the arguments as keywords.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Awaitable[Any]]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, _ or -")

    def schema(self) -> dict[str, Any]:
        """The entry for the request's `tools` list."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": dict(self.parameters)}}

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None,
                      description: str | None = None) -> Tool:
        """Describe a host's Python function as a tool, from its signature and docstring.

        Parameters become schema properties typed from their annotations
        (str, int, float, bool, list, dict, and `X | None`); those without a
        default are required. The docstring's first paragraph is the
        description, and a Google-style `Args:` section describes each
        parameter. A plain (non-async) function runs in a worker thread.
        """
        if not callable(fn):
            raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
        tool_name: str = name or str(getattr(fn, "__name__", ""))
        doc = inspect.getdoc(fn) or ""
        summary: str = description or doc.split("\n\n", 1)[0].replace("\n", " ").strip()
        arg_docs = _arg_docs(doc)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:
            hints = {}
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                continue
            prop = _json_type(hints.get(p.name, p.annotation))
            if p.name in arg_docs:
                prop["description"] = arg_docs[p.name]
            props[p.name] = prop
            if p.default is p.empty:
                required.append(p.name)
        params: dict[str, Any] = {"type": "object", "properties": props, "required": required}
        if inspect.iscoroutinefunction(fn):
            call: Callable[..., Awaitable[Any]] = fn
        else:
            call = _in_thread(fn)
        return cls(tool_name, summary or tool_name, params, call)


def as_tool(obj: Tool | Callable[..., Any]) -> Tool:
    """A `Tool` as is, or a plain function described by `Tool.from_function`."""
    return obj if isinstance(obj, Tool) else Tool.from_function(obj)


def _in_thread(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def call(**kwargs: Any) -> Any:
        return await trio.to_thread.run_sync(functools.partial(fn, **kwargs),
                                             abandon_on_cancel=True)
    return call


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(inner[0]) if len(inner) == 1 else {}
    base = origin if origin is not None else annotation
    kind = _JSON_TYPES.get(base)
    return {"type": kind} if kind else {}


def _arg_docs(doc: str) -> dict[str, str]:
    """`{name: description}` from a Google-style `Args:` section."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            break
        m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


# ---------------------------------------------------------------- read_file


def read_file_tool(root: str | os.PathLike[str], *, max_bytes: int = 256 * 1024) -> Tool:
    """The `read_file` tool, confined to `root` (the agent's working directory).

    Paths are resolved relative to `root` with every symlink followed; a path
    that ends up outside `root` (`../x`, an absolute path, a symlink pointing
    out) is refused, and so is anything that is not a regular file. Files
    longer than `max_bytes` are cut, with a note saying so.
    """
    base = Path(os.path.realpath(root))

    async def read_file(path: str) -> str:
        """Read a text file in the working directory.

        Args:
            path: The file's path, relative to the working directory.
        """
        return await trio.to_thread.run_sync(_read_confined, base, path, max_bytes)

    return Tool("read_file", "Read a text file in the working directory.",
                {"type": "object", "required": ["path"], "properties": {"path": {
                    "type": "string",
                    "description": "The file's path, relative to the working directory."}}},
                read_file)


def _read_confined(root: Path, path: Any, max_bytes: int) -> str:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError("path must be a non-empty string")
    real = Path(os.path.realpath(root / path))
    if real != root and not real.is_relative_to(root):
        raise PermissionError(f"{path!r} is outside the working directory; refused")
    try:
        # O_NOFOLLOW: the path was resolved above, so a symlink here means it
        # was swapped in since; O_NONBLOCK keeps a FIFO from hanging the open.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path!r}") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{path!r} is a directory, not a file") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{path!r} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path!r} is not a regular file; refused")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    text = data[:max_bytes].decode("utf-8", errors="replace")
    if len(data) > max_bytes:
        text += f"\n[truncated: {path} is {st.st_size} bytes; showed the first {max_bytes}]"
    return text


# -------------------------------------------------------------------- shell


def shell_tool(root: str | os.PathLike[str], *, hide_env: Iterable[str] = (),
               max_output_bytes: int = 64 * 1024, grace: float = 2.0,
               on_process: Callable[[int, bool], None] | None = None,
               on_group: Callable[[dict[str, Any]], None] | None = None) -> Tool:
    """The `shell` tool: run a command with `/bin/sh -c` in `root`. Opt-in only.

    The command runs in its own process group; when the kernel's tool timeout
    cancels it, or it exits leaving children behind, the group gets SIGTERM,
    then SIGKILL after `grace` seconds. stdout and stderr are merged and only
    the last `max_output_bytes` are kept. Environment variables named in
    `hide_env` (the API key's) are removed from the command's environment.
    `on_process(pid, started)` hears of the command's process starting
    (True) and ending (False): the LLM agent passes it on to the critic,
    which samples the process tree while the call is in flight.
    `on_group(record)` gets what identifies the command's process group
    (`Child.record()`) as it starts: the LLM agent audits it as
    `process_start`, so `kernel recover` can stop a command left running by a
    supervisor that died before resuming the run.
    """
    cwd = os.path.realpath(root)
    hidden = frozenset(hide_env)

    async def shell(command: str) -> str:
        """Run a shell command in the working directory.

        Args:
            command: The command line, run with /bin/sh -c.
        """
        if not isinstance(command, str) or not command.strip():
            raise ValueError("command must be a non-empty string")
        env = {k: v for k, v in os.environ.items() if k not in hidden}
        return await _run_shell(command, cwd, env, max_output_bytes, grace, on_process,
                                on_group)

    return Tool("shell", "Run a shell command in the working directory; returns its exit "
                         "code and output.",
                {"type": "object", "required": ["command"], "properties": {"command": {
                    "type": "string", "description": "The command line, run with /bin/sh -c."}}},
                shell)


async def _run_shell(command: str, cwd: str, env: dict[str, str], limit: int,
                     grace: float, on_process: Callable[[int, bool], None] | None = None,
                     on_group: Callable[[dict[str, Any]], None] | None = None) -> str:
    proc = await spawn(["/bin/sh", "-c", command], cwd=cwd, env=env, merge_stderr=True)
    if on_group is not None:
        on_group(proc.record())
    if on_process is not None:
        on_process(proc.pid, True)
    chunks: deque[bytes] = deque()
    size = 0
    dropped = False
    drained = trio.Event()

    async def pump() -> None:
        nonlocal size, dropped
        assert proc.stdout is not None
        while chunk := await proc.stdout.receive_some(65536):
            chunks.append(bytes(chunk))
            size += len(chunk)
            while size - len(chunks[0]) >= limit:
                size -= len(chunks.popleft())
                dropped = True
        drained.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            await proc.wait()
            # Children may still hold the pipe: give them a moment, then stop reading.
            with trio.move_on_after(0.2):
                await drained.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await proc.stop(grace)
        if on_process is not None:
            on_process(proc.pid, False)
    out = b"".join(chunks)[-limit:].decode("utf-8", errors="replace")
    note = "[earlier output dropped]\n" if dropped else ""
    rc = proc.returncode
    return f"exit code {rc}\n{note}{out}"
