"""Delivery batteries: where a finished run's result goes.

- `StdoutDelivery` prints the output (or the whole result as JSON).
- `DirectoryDelivery` writes `<root>/<run_id>/` with `result.json`, `output.txt`
  and the run's artifacts, atomically (a reader never sees half a run).
- `WebhookDelivery` POSTs the result as JSON, retrying 5xx / 429 / network
  errors with capped exponential backoff and jitter, bounded in attempts and
  total time.
- `FanOutDelivery` delivers to several places; one failing does not stop the others.

All are observers: a failure raises `kernel.DeliveryError`, which the kernel
puts on the result and in the audit without changing the run's status.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import trio

from kernel import Delivery, DeliveryError, Result
from kernel._renamed import renamed

if TYPE_CHECKING:
    import httpx


def result_document(result: Result) -> dict[str, Any]:
    """The JSON document every delivery sends: `Result.to_dict()`."""
    return result.to_dict()


class StdoutDelivery:
    """Print the run's output (text), or its whole result as one JSON object.

    Args:
        as_json: Print `result_document(result)` as one line of JSON.
        stream: Where to print (default: sys.stdout at delivery time).
    """

    def __init__(self, *, as_json: bool = False, stream: IO[str] | None = None) -> None:
        self.as_json = as_json
        self.stream = stream

    async def deliver(self, result: Result) -> None:
        """Write the output or the JSON result, then flush."""
        out = self.stream or sys.stdout
        try:
            if self.as_json:
                out.write(json.dumps(result_document(result), default=str) + "\n")
            elif result.output is not None:
                text = result.output if isinstance(result.output, str) else json.dumps(
                    result.output, default=str)
                out.write(text.rstrip("\n") + "\n")
            out.flush()
        except (OSError, ValueError) as exc:
            raise DeliveryError(f"cannot write the result to stdout: {exc}") from exc


class DirectoryDelivery:
    """Write each run to `<root>/<run_id>/`: result.json, output.txt, artifacts/.

    The run's folder is built under a temporary name in `root` and renamed
    into place, so it appears complete or not at all. Artifact names are
    confined to the folder: a name that climbs out of it (`../x`) is refused.
    So is a run id that is not one plain folder name (empty, `.`, `..`, with a
    `/`, a backslash or a control character): nothing is written for it. A
    resumed run delivers again and replaces its folder, and only a folder that
    resolves strictly inside `root` is ever removed.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    async def deliver(self, result: Result) -> None:
        """Write the run's folder in a worker thread.

        Raises:
            DeliveryError: The run id is not one plain folder name, its folder
                cannot be written, or an artifact's name leaves the folder.
        """
        await trio.to_thread.run_sync(self._write, result)

    def _write(self, result: Result) -> None:
        run_id = result.run_id
        if (not isinstance(run_id, str) or run_id in ("", ".", "..") or "/" in run_id
                or "\\" in run_id or not run_id.isprintable()):
            raise DeliveryError(f"run id {run_id!r} is not a plain folder name: "
                                f"nothing delivered to {self.root}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            root = self.root.resolve()
            final = root / run_id
            tmp = Path(tempfile.mkdtemp(prefix=f".{run_id}.", dir=root))
            try:
                doc = json.dumps(result_document(result), default=str, indent=2)
                (tmp / "result.json").write_text(doc + "\n")
                if result.output is not None:
                    text = result.output if isinstance(result.output, str) else json.dumps(
                        result.output, default=str)
                    (tmp / "output.txt").write_text(text)
                for name, content in result.artifacts.items():
                    self._artifact(tmp, name, content)
                for f in tmp.rglob("*"):
                    if f.is_file():
                        with open(f, "rb") as fh:
                            os.fsync(fh.fileno())
                if final.exists() or final.is_symlink():
                    # A resumed run delivers again: replace the old folder, but only
                    # a real folder of this root (never a link out of it, never the
                    # root or anything above it).
                    if final.is_symlink() or final.resolve().parent != root:
                        raise DeliveryError(f"{final} is not a folder inside {root}: "
                                            "not replaced")
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            dir_fd = os.open(root, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise DeliveryError(f"cannot write {self.root}/{result.run_id}: {exc}") from exc

    @staticmethod
    def _artifact(folder: Path, name: str, content: str | bytes) -> None:
        target = (folder / "artifacts" / name).resolve()
        base = (folder / "artifacts").resolve()
        if base not in target.parents:
            raise DeliveryError(f"artifact name {name!r} escapes the run's folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)


class WebhookDelivery:
    """POST the result as JSON to `url`, with bounded retries.

    Transport errors, 429 and 5xx are retried with capped exponential backoff
    and jitter; any other 4xx fails at once. Waits and the total bound use
    `trio.current_time()`, so tests drive the retries under a virtual clock.

    Args:
        url: The endpoint.
        headers: Extra headers (e.g. an Authorization header; never logged).
        attempts: Total tries, the first included.
        timeout: Total seconds across all tries; also caps each request.
        wait_initial, wait_max: Backoff bounds between tries (up to
            `wait_initial` of jitter is added).
        client: The `httpx.AsyncClient` to post with (the host's pool, proxies,
            certificates); it is not closed here. If None, a client is made
            for each delivery and closed after it.
        transport: The transport of the client made here (e.g.
            `httpx.MockTransport` in tests); ignored when `client` is given.
    """

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None,
                 attempts: int = 5, timeout: float = 30.0, wait_initial: float = 0.2,
                 wait_max: float = 5.0, client: httpx.AsyncClient | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook URL must be http(s)://..., got {url!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.url = url
        self.headers = dict(headers or {})
        self.attempts = attempts
        self.timeout = timeout
        self.wait_initial = wait_initial
        self.wait_max = wait_max
        self.client = client
        self.transport = transport
        self.tries = 0

    async def deliver(self, result: Result) -> None:
        """POST until a 2xx, a non-retryable status, or the retry budget is spent."""
        import httpx

        body = json.dumps(result_document(result), default=str)
        if self.client is not None:
            await self._post_until_done(self.client, body)
            return
        async with httpx.AsyncClient(timeout=self.timeout, transport=self.transport) as client:
            await self._post_until_done(client, body)

    async def _post_until_done(self, client: httpx.AsyncClient, body: str) -> None:
        import httpx

        headers = {"content-type": "application/json", **self.headers}
        deadline = trio.current_time() + self.timeout
        last = "no attempt made"
        for attempt in range(1, self.attempts + 1):
            self.tries += 1
            with trio.move_on_at(deadline):
                try:
                    resp = await client.post(self.url, content=body, headers=headers)
                except httpx.TransportError as exc:
                    last = f"{type(exc).__name__}: {exc}".rstrip(": ")
                else:
                    if resp.status_code < 400:
                        return
                    if resp.status_code != 429 and resp.status_code < 500:
                        raise DeliveryError(
                            f"webhook {self.url} refused the result: HTTP {resp.status_code}")
                    last = f"HTTP {resp.status_code}"
            if trio.current_time() >= deadline:
                last = f"no answer within {self.timeout:g}s (last: {last})"
                break
            if attempt == self.attempts:
                break
            wait = min(self.wait_max, self.wait_initial * 2 ** (attempt - 1))
            wait += random.uniform(0, self.wait_initial)
            if trio.current_time() + wait >= deadline:
                break
            await trio.sleep(wait)
        raise DeliveryError(f"webhook {self.url} failed after {self.tries} attempt(s): {last}")


class FanOutDelivery:
    """Deliver to each of `deliveries` in turn; report all failures together."""

    def __init__(self, deliveries: Sequence[Delivery]) -> None:
        self.deliveries = list(deliveries)

    async def deliver(self, result: Result) -> None:
        """Try every delivery; raise one DeliveryError naming each that failed."""
        errors = []
        for d in self.deliveries:
            try:
                await d.deliver(result)
            except Exception as exc:
                errors.append(f"{type(d).__name__}: {exc}")
        if errors:
            raise DeliveryError("; ".join(errors))


# Names renamed in 0.2 (see README, "Renamed names"): still importable for one
# release, with a DeprecationWarning; type checkers see them as plain aliases.
if TYPE_CHECKING:
    FanOut = FanOutDelivery


__getattr__ = renamed(__name__, {"FanOut": "FanOutDelivery"}, globals())
