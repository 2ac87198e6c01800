"""The LLM agent's tools: read_file's confinement, the opt-in shell, host functions."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio
from procs import gone

from adapters.llm import Tool, read_file_tool, shell_tool


class TestReadFileTool:
    """read_file reads inside the working directory and nothing outside it."""

    async def test_reads_a_file_relative_to_the_root(self, tmp_path: Path) -> None:
        """A relative path inside the root is read as text."""
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "a.txt").write_text("hello\n")
        tool = read_file_tool(tmp_path)
        assert await tool.fn(path="sub/a.txt") == "hello\n"
        assert await tool.fn(path="./sub/../sub/a.txt") == "hello\n"

    @pytest.mark.parametrize("path", ["../outside.txt", "sub/../../outside.txt"])
    async def test_refuses_parent_escapes(self, tmp_path: Path, path: str) -> None:
        """A path climbing out of the root is refused even though the file exists."""
        root = tmp_path / "root"
        (root / "sub").mkdir(parents=True)
        (tmp_path / "outside.txt").write_text("secret")
        with pytest.raises(PermissionError, match="outside the working directory"):
            await read_file_tool(root).fn(path=path)

    async def test_refuses_absolute_paths_outside(self, tmp_path: Path) -> None:
        """An absolute path outside the root is refused; one inside it is allowed."""
        (tmp_path / "in.txt").write_text("in")
        tool = read_file_tool(tmp_path)
        with pytest.raises(PermissionError):
            await tool.fn(path="/etc/hostname")
        assert await tool.fn(path=str(tmp_path / "in.txt")) == "in"

    async def test_refuses_symlinks_pointing_out(self, tmp_path: Path) -> None:
        """A symlink inside the root that points outside it is refused; one pointing in is read."""
        root = tmp_path / "root"
        root.mkdir()
        (tmp_path / "secret.txt").write_text("secret")
        (root / "real.txt").write_text("real")
        (root / "escape").symlink_to(tmp_path / "secret.txt")
        (root / "dirlink").symlink_to(tmp_path)
        (root / "alias").symlink_to(root / "real.txt")
        tool = read_file_tool(root)
        with pytest.raises(PermissionError):
            await tool.fn(path="escape")
        with pytest.raises(PermissionError):
            await tool.fn(path="dirlink/secret.txt")
        assert await tool.fn(path="alias") == "real"

    async def test_root_given_through_a_symlink(self, tmp_path: Path) -> None:
        """A root that is itself a symlink still allows the files under its target."""
        (tmp_path / "real").mkdir()
        (tmp_path / "real" / "a.txt").write_text("a")
        (tmp_path / "link").symlink_to(tmp_path / "real")
        assert await read_file_tool(tmp_path / "link").fn(path="a.txt") == "a"

    async def test_missing_directories_and_fifos(self, tmp_path: Path) -> None:
        """Missing files, directories and FIFOs give clear errors instead of hanging."""
        (tmp_path / "d").mkdir()
        os.mkfifo(tmp_path / "pipe")
        tool = read_file_tool(tmp_path)
        with pytest.raises(FileNotFoundError, match=r"no such file: 'nope\.txt'"):
            await tool.fn(path="nope.txt")
        with pytest.raises(IsADirectoryError, match="'d' is a directory"):
            await tool.fn(path="d")
        with trio.fail_after(5):
            with pytest.raises(PermissionError, match="not a regular file"):
                await tool.fn(path="pipe")
        with pytest.raises(ValueError, match="non-empty string"):
            await tool.fn(path="")

    async def test_long_files_are_cut_with_a_note(self, tmp_path: Path) -> None:
        """Only max_bytes are returned, and the model is told the file was longer."""
        (tmp_path / "big.txt").write_bytes(b"x" * 100 + b"\xff")
        out = await read_file_tool(tmp_path, max_bytes=10).fn(path="big.txt")
        assert out == "x" * 10 + "\n[truncated: big.txt is 101 bytes; showed the first 10]"
        assert await read_file_tool(tmp_path).fn(path="big.txt") == "x" * 100 + "\ufffd"


@pytest.mark.realtime
class TestShellTool:
    """The opt-in shell tool runs commands in the root and cleans up after itself."""

    async def test_runs_in_the_root_and_reports_exit_code(self, tmp_path: Path) -> None:
        """Output (stdout and stderr) and the exit code come back as text."""
        out = await shell_tool(tmp_path).fn(command="pwd; echo oops >&2; exit 3")
        assert out == f"exit code 3\n{os.path.realpath(tmp_path)}\noops\n"

    async def test_hidden_variables_are_not_inherited(self, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """Variables named in hide_env are removed from the command's environment."""
        monkeypatch.setenv("SOME_KEY", "s3cret")
        monkeypatch.setenv("VISIBLE", "yes")
        out = await shell_tool(tmp_path, hide_env=["SOME_KEY"]).fn(
            command='echo "[$SOME_KEY][$VISIBLE]"')
        assert out == "exit code 0\n[][yes]\n"

    async def test_output_is_bounded(self, tmp_path: Path) -> None:
        """Only the tail of a large output is kept, marked as cut."""
        out = await shell_tool(tmp_path, max_output_bytes=1000).fn(
            command="seq 1 100000")
        assert out.startswith("exit code 0\n[earlier output dropped]\n")
        assert out.endswith("99999\n100000\n") and len(out) < 1100

    async def test_cancel_kills_the_whole_group(self, tmp_path: Path) -> None:
        """A timed-out command and the children it started are all gone afterwards."""
        pidfile = tmp_path / "child.pid"
        tool = shell_tool(tmp_path, grace=0.5)
        with trio.move_on_after(0.5) as cs:
            await tool.fn(command=f"sleep 30 & echo $! > {pidfile}; wait")
        assert cs.cancelled_caught
        assert await gone(int(pidfile.read_text()))

    async def test_leftover_background_children_do_not_block(self, tmp_path: Path) -> None:
        """A command that exits leaving a child holding the pipe returns promptly, child gone."""
        with trio.fail_after(5):
            out = await shell_tool(tmp_path, grace=0.5).fn(
                command="sleep 30 & echo $! > child.pid; echo started")
        assert out == "exit code 0\nstarted\n"
        assert await gone(int((tmp_path / "child.pid").read_text()))


class TestToolFromFunction:
    """Host functions become tools with a schema built from their signature."""

    def test_schema_from_signature_and_docstring(self) -> None:
        """Annotations give types, defaults make parameters optional, Args: describes them."""

        async def search(query: str, limit: int = 10, exact: bool | None = None,
                         tags: list[str] | None = None, *, scale: float = 1.0) -> list[str]:
            """Search the notes.

            More detail that the model does not need.

            Args:
                query: Words to look for.
                limit (int): At most this many hits.
            """
            return []

        tool = Tool.from_function(search)
        assert tool.schema() == {"type": "function", "function": {
            "name": "search", "description": "Search the notes.",
            "parameters": {"type": "object", "required": ["query"], "properties": {
                "query": {"type": "string", "description": "Words to look for."},
                "limit": {"type": "integer", "description": "At most this many hits."},
                "exact": {"type": "boolean"},
                "tags": {"type": "array"},
                "scale": {"type": "number"},
            }}}}

    async def test_plain_functions_run_in_a_worker_thread(self) -> None:
        """A synchronous function is awaited through a worker thread, not on the trio thread."""
        trio_thread = threading.get_ident()

        def where(tag: str) -> tuple[str, bool]:
            return tag, threading.get_ident() != trio_thread

        tool = Tool.from_function(where, name="where_am_i", description="Say where.")
        assert (tool.name, tool.description) == ("where_am_i", "Say where.")
        assert await tool.fn(tag="t") == ("t", True)

    def test_invalid_names_are_refused(self) -> None:
        """Tool names the API would reject fail when the tool is described."""
        with pytest.raises(ValueError, match="must be 1-64 letters"):
            Tool.from_function(lambda: None)
        with pytest.raises(TypeError, match="must be callable"):
            Tool.from_function("not a function")  # type: ignore[arg-type]
