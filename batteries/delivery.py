"""Delivery batteries: where a finished run's result goes.

- `StdoutDelivery` prints the output (or the whole result as JSON).
- `DirectoryDelivery` writes `<root>/<run_id>/` with `result.json`, `output.txt`
  and the run's artifacts, atomically (a reader never sees half a run).
- `WebhookDelivery` POSTs the result as JSON, retrying 5xx / 429 / network
  errors with capped exponential backoff and jitter, bounded in attempts and
  total time.
- `FanOutDelivery` delivers to several places at once; one failing or hanging
  does not stop the others.

All are observers: a failure raises `kernel.DeliveryError`, which the kernel
puts on the result and in the audit without changing the run's status.

What is delivered is plain JSON whatever the output holds (non-string keys,
NaN, cycles), written as UTF-8 whatever the locale: a delivery never fails
because of the shape of a result. A webhook URL's credentials (its password,
query, fragment, the path of a Slack or Discord webhook) never appear in an
error, since errors reach stderr and `--json`.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import math
import os
import random
import secrets
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import trio

from kernel import ConfigError, Delivery, DeliveryError, Result
from kernel._renamed import renamed

if TYPE_CHECKING:
    import httpx

#: How deep a result's output is followed before the rest is cut (a marker instead).
MAX_DEPTH = 100
#: A webhook ends this much before the deadline it runs under (the kernel's share of
#: `finalize_timeout`), so its own error, naming it, is what gets reported.
DEADLINE_MARGIN = 0.5


def result_document(result: Result) -> dict[str, Any]:
    """The JSON document every delivery sends: `Result.to_dict()`, as plain JSON.

    Plain so that it always encodes and every reader can parse it: keys are
    strings, NaN and infinities are null, a cycle or a nesting deeper than
    `MAX_DEPTH` is a marker, anything else is its `str()`.
    """
    doc = _plain(result.to_dict(), (), 0)
    assert isinstance(doc, dict)
    return doc


def result_json(result: Result, *, indent: int | None = None) -> str:
    """`result_document(result)` encoded: strict, ASCII-only JSON."""
    return json.dumps(result_document(result), indent=indent, allow_nan=False)


def _plain(value: Any, parents: tuple[int, ...], depth: int) -> Any:
    """`value` as plain JSON data (see `result_document`)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (Mapping, list, tuple, set, frozenset)):
        if id(value) in parents:
            return "<cycle>"
        if depth >= MAX_DEPTH:
            return "<too deep>"
        inner = (*parents, id(value))
        if isinstance(value, Mapping):
            return {k if isinstance(k, str) else _text(k): _plain(v, inner, depth + 1)
                    for k, v in value.items()}
        return [_plain(v, inner, depth + 1) for v in value]
    return _text(value)


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # a host's object whose __str__ breaks
        return f"<{type(value).__name__}: str() failed: {type(exc).__name__}>"


def _output_text(result: Result) -> str | None:
    """What output.txt and stdout show: the output, or its plain JSON."""
    if result.output is None:
        return None
    if isinstance(result.output, str):
        return result.output
    return json.dumps(_plain(result.output, (), 0), allow_nan=False)


def _utf8(text: str) -> bytes:
    """`text` as UTF-8, whatever the locale; lone surrogates back to their bytes or '?'."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


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
                out.write(result_json(result) + "\n")
            else:
                text = _output_text(result)
                if text is not None:
                    out.write(text.rstrip("\n") + "\n")
            out.flush()
        except (OSError, ValueError) as exc:
            raise DeliveryError(f"cannot write the result to stdout: {exc}") from exc


class DirectoryDelivery:
    """Write each run to `<root>/<run_id>/`: result.json, output.txt, artifacts/.

    The run's folder is built under a temporary name in `root` and renamed
    into place, so it appears complete or not at all; its files are private
    (the folder 0700, files 0600: they hold the run's output) and UTF-8.
    Artifact names are confined to the folder: a name that is empty, absolute,
    holds a NUL or climbs out of it (`../x`) is refused, and so is content
    that is not `str` or `bytes`. So is a run id that is not one plain folder
    name (empty, `.`, `..`, with a `/`, a backslash or a control character):
    nothing is written for it. A resumed run delivers again and replaces its
    folder: the old one is moved aside and removed only once the new one is
    in place, so a crash between leaves one of them. Only a folder that
    resolves strictly inside `root` is ever replaced.

    Args:
        root: The folder the runs' folders go in (made if missing).
        limiter: Bounds the worker threads writing at once (None: trio's
            default limiter, shared with every other `trio.to_thread` call). A
            host delivering many runs at once (`kernel batch`) gives its own, so
            its writes never take the threads its journal reads need.
        replace: False: a run whose folder is there already is left as it is
            (a folder is whole or absent, so it was delivered): what `kernel
            batch --resume` delivers again is the result as the journal has it
            (its output as stored, no artifacts), which must never replace the
            run's own.
    """

    def __init__(self, root: str | os.PathLike[str], *,
                 limiter: trio.CapacityLimiter | None = None, replace: bool = True) -> None:
        self.root = Path(root)
        self.limiter = limiter
        self.replace = replace

    async def deliver(self, result: Result) -> None:
        """Write the run's folder in a worker thread.

        Raises:
            DeliveryError: The run id is not one plain folder name, its folder
                cannot be written, or an artifact's name leaves the folder.
        """
        await trio.to_thread.run_sync(self._write, result, limiter=self.limiter)

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
            if (not self.replace and final.is_dir() and not final.is_symlink()
                    and final.resolve().parent == root):
                return  # delivered before, whole (see `replace`)
            tmp = Path(tempfile.mkdtemp(prefix=f".{run_id}.", dir=root))
            try:
                self._fill(tmp, result)
                self._sync_tree(tmp)
                self._put_in_place(tmp, final, root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_dir(root)
        except OSError as exc:
            raise DeliveryError(f"cannot write {self.root}/{result.run_id}: {exc}") from exc

    def _fill(self, tmp: Path, result: Result) -> None:
        """result.json, output.txt and the artifacts, in the fresh folder `tmp`."""
        _write_file(tmp / "result.json", (result_json(result, indent=2) + "\n").encode())
        text = _output_text(result)
        if text is not None:
            _write_file(tmp / "output.txt", _utf8(text))
        for name, content in result.artifacts.items():
            self._artifact(tmp, name, content)

    @staticmethod
    def _sync_tree(tmp: Path) -> None:
        """Every file and folder of `tmp` on disk before it is renamed into place."""
        for path in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)):
            if path.is_dir() and not path.is_symlink():
                _fsync_dir(path)
        _fsync_dir(tmp)

    @staticmethod
    def _put_in_place(tmp: Path, final: Path, root: Path) -> None:
        """Rename `tmp` to `final`; an old `final` is set aside first, removed after."""
        if not (final.exists() or final.is_symlink()):
            os.rename(tmp, final)
            return
        # A resumed run delivers again: replace the old folder, but only a real folder
        # of this root (never a link out of it, never the root or anything above it).
        if final.is_symlink() or not final.is_dir() or final.resolve().parent != root:
            raise DeliveryError(f"{final} is not a folder inside {root}: not replaced")
        aside = root / f".{final.name}.old.{secrets.token_hex(4)}"
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
        shutil.rmtree(aside, ignore_errors=True)

    @staticmethod
    def _artifact(folder: Path, name: object, content: object) -> None:
        if (not isinstance(name, str) or not name or "\0" in name
                or os.path.isabs(name) or name.startswith("\\")):
            raise DeliveryError(f"artifact name {name!r} is not a relative file name")
        base = (folder / "artifacts").resolve()
        target = (base / name).resolve()
        if base not in target.parents:
            raise DeliveryError(f"artifact name {name!r} escapes the run's folder")
        if isinstance(content, str):
            data = _utf8(content)
        elif isinstance(content, (bytes, bytearray, memoryview)):
            data = bytes(content)
        else:
            raise DeliveryError(f"artifact {name!r} is a {type(content).__name__}, "
                                "not str or bytes")
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_file(target, data)


def _write_file(path: Path, data: bytes) -> None:
    """Create `path` (0600, never through an existing name) with `data`, synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shown_url(url: str) -> str:
    """`url` safe to print: scheme, host, port and path; no user info, query or fragment.

    The path of a Slack or Discord webhook (its credential) is redacted too.
    Never raises: a URL too malformed to parse is cut by hand the same way.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        shown = urlunsplit((parts.scheme, host, parts.path, "", ""))
    except ValueError:
        head = url.split("?", 1)[0].split("#", 1)[0]
        scheme, sep, rest = head.partition("://")
        shown = f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else head.rpartition("@")[2]
    from batteries.redact import Redactor

    return Redactor().text(shown)


class WebhookURLError(ConfigError, ValueError):
    """A webhook URL that can never be posted to.

    A `ConfigError`, so `kernel run --webhook URL` (which builds the delivery
    before anything runs) says so in one line and exits 2; a `ValueError`, as
    the constructor has always raised for a bad URL.
    """


def check_webhook_url(url: str) -> None:
    """Raise WebhookURLError (one line, no credentials) unless `url` can be posted to.

    It must be `http(s)://HOST[:PORT][/PATH][?QUERY]` with a host, a port in
    range and no whitespace or control character. Hosts (and `kernel run
    --webhook`) call it before a run, so a typo is not found only after it.
    """
    import httpx

    if not isinstance(url, str):
        raise WebhookURLError(f"webhook URL must be a string, got {type(url).__name__}")
    shown = shown_url(url)
    if not url.isprintable() or any(c.isspace() for c in url):
        raise WebhookURLError(f"webhook URL holds whitespace or a control character: {shown!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port raises for one out of range
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        reason = _scrub(str(exc), url, shown) or type(exc).__name__
        raise WebhookURLError(f"webhook URL is malformed ({reason}): {shown!r}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise WebhookURLError(f"webhook URL must be http(s)://..., got {shown!r}")
    if not parts.hostname:
        raise WebhookURLError(f"webhook URL has no host: {shown!r}")


def check_delivery_options(deliver_dir: str | None, webhooks: Sequence[str] = (),
                           ) -> tuple[str | None, tuple[str, ...]]:
    """The CLI's `--deliver-dir DIR` and `--webhook URL`s, checked before anything runs.

    Returns the directory made absolute (stored so: a run or batch resumed
    from another directory delivers where it was asked) and the URLs.

    Raises:
        ConfigError: One line naming the flag: an empty directory, or a URL
            `check_webhook_url` refuses (without its credentials).
    """
    for url in webhooks:
        try:
            check_webhook_url(url)  # a typo is bad input before anything runs
        except ConfigError as exc:
            raise ConfigError(f"--webhook: {exc}") from None
    if deliver_dir is not None:
        if not deliver_dir.strip():
            raise ConfigError("--deliver-dir expects a directory, got ''")
        deliver_dir = os.path.abspath(os.path.expanduser(deliver_dir))
    return deliver_dir, tuple(webhooks)


def _scrub(text: str, url: str, shown: str) -> str:
    """`text` (an error about `url`) on one line, without the URL's secrets."""
    import httpx

    forms = {url}
    with contextlib.suppress(Exception):  # a URL httpx refuses has no other form
        forms.add(str(httpx.URL(url)))
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, shown)
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        text = text.replace(password, "[redacted]")
    from batteries.redact import Redactor

    return Redactor().text(" ".join(text.split()))


def _retry_after(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds or an HTTP date); None if none."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # ('²'.isdigit() is True, float('²') fails)
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


class WebhookDelivery:
    """POST the result as JSON to `url`, with bounded retries.

    Transport errors, 429 and 5xx are retried with capped exponential backoff
    and jitter, waiting at least what a `Retry-After` asks (one beyond the
    time bound ends the delivery at once); a redirect is not followed and is
    a failure naming where it points; any other 4xx fails at once. Only the
    answer's status and headers are read, never its body. Waits and the total
    bound use `trio.current_time()`, so tests drive the retries under a
    virtual clock; the bound is also kept inside any deadline the delivery
    runs under (the kernel's share of `finalize_timeout`), so a hanging
    endpoint is reported as this webhook's failure.

    Args:
        url: The endpoint (checked by `check_webhook_url`).
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

    Raises:
        WebhookURLError: The URL cannot be posted to (a `ConfigError` and a
            `ValueError`).
        ValueError: `attempts` < 1.
    """

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None,
                 attempts: int = 5, timeout: float = 30.0, wait_initial: float = 0.2,
                 wait_max: float = 5.0, client: httpx.AsyncClient | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        check_webhook_url(url)
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.url = url
        self.shown = shown_url(url)
        self.headers = dict(headers or {})
        self.attempts = attempts
        self.timeout = timeout
        self.wait_initial = wait_initial
        self.wait_max = wait_max
        self.client = client
        self.transport = transport
        self.tries = 0  # across every delivery (a statistic); messages count their own

    async def deliver(self, result: Result) -> None:
        """POST until a 2xx, a non-retryable answer, or the retry budget is spent."""
        import httpx

        body = result_json(result).encode()
        if self.client is not None:
            await self._post_until_done(self.client, body)
            return
        async with httpx.AsyncClient(timeout=self.timeout, transport=self.transport) as client:
            await self._post_until_done(client, body)

    def _error(self, exc: Exception) -> str:
        """`exc` in one line, without the URL's secrets (it reaches stderr and --json)."""
        return _scrub(f"{type(exc).__name__}: {exc}", self.url, self.shown).rstrip(": ")

    async def _post(self, client: httpx.AsyncClient, body: bytes,
                    headers: Mapping[str, str]) -> tuple[int, str | None, str | None]:
        """POST once; the status, Location and Retry-After. The body is never read."""
        request = client.build_request("POST", self.url, content=body, headers=headers)
        response = await client.send(request, stream=True)
        try:
            return (response.status_code, response.headers.get("location"),
                    response.headers.get("retry-after"))
        finally:
            await response.aclose()

    async def _post_until_done(self, client: httpx.AsyncClient, body: bytes) -> None:
        import httpx

        headers = {"content-type": "application/json", **self.headers}
        start = trio.current_time()
        deadline = start + self.timeout
        outer = trio.current_effective_deadline()
        if outer < deadline:
            deadline = max(start, outer - min(DEADLINE_MARGIN, (outer - start) / 10))
        tries = 0
        last = "no attempt made"
        for attempt in range(1, self.attempts + 1):
            tries += 1
            self.tries += 1
            asked: float | None = None
            with trio.move_on_at(deadline):
                try:
                    status, location, retry_after = await self._post(client, body, headers)
                except httpx.TransportError as exc:
                    last = self._error(exc)
                except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
                    raise DeliveryError(f"webhook {self.shown} cannot be posted to: "
                                        f"{self._error(exc)}") from None
                else:
                    if 200 <= status < 300:
                        return
                    if 300 <= status < 400:
                        where = shown_url(location) if location else "nowhere"
                        raise DeliveryError(
                            f"webhook {self.shown} answered HTTP {status}, a redirect to "
                            f"{where} (not followed): the result was not delivered")
                    if status != 429 and status < 500:
                        raise DeliveryError(
                            f"webhook {self.shown} refused the result: HTTP {status}")
                    last = f"HTTP {status}"
                    asked = _retry_after(retry_after)
            if trio.current_time() >= deadline:
                before = f" (before that: {last})" if attempt > 1 else ""
                last = f"no answer within {deadline - start:.3g}s{before}"
                break
            if attempt == self.attempts:
                break
            wait = min(self.wait_max, self.wait_initial * 2 ** (attempt - 1))
            wait += random.uniform(0, self.wait_initial)
            if asked is not None:
                if trio.current_time() + asked >= deadline:
                    last += (f", asked to retry after {asked:g}s, past the delivery's "
                             f"bound of {deadline - start:.3g}s")
                    break
                wait = max(wait, asked)
            if trio.current_time() + wait >= deadline:
                break
            await trio.sleep(wait)
        raise DeliveryError(f"webhook {self.shown} failed after {tries} attempt(s): {last}")


class FanOutDelivery:
    """Deliver to each of `deliveries` at once; report all failures together.

    At once, so that one that hangs (a webhook that never answers) does not
    use up the time the others had: each is bounded by its own limits and by
    the deadline the fan-out runs under.
    """

    def __init__(self, deliveries: Sequence[Delivery]) -> None:
        self.deliveries = list(deliveries)

    async def deliver(self, result: Result) -> None:
        """Try every delivery; raise one DeliveryError naming each that failed, in order."""
        errors: list[str | None] = [None] * len(self.deliveries)

        async def one(i: int, d: Delivery) -> None:
            try:
                await d.deliver(result)
            except Exception as exc:
                errors[i] = f"{type(d).__name__}: {exc}"

        async with trio.open_nursery() as nursery:
            for i, d in enumerate(self.deliveries):
                nursery.start_soon(one, i, d)
        failed = [e for e in errors if e is not None]
        if failed:
            raise DeliveryError("; ".join(failed))


# Names renamed in 0.2 (see README, "Renamed names"): still importable for one
# release, with a DeprecationWarning; type checkers see them as plain aliases.
if TYPE_CHECKING:
    FanOut = FanOutDelivery


__getattr__ = renamed(__name__, {"FanOut": "FanOutDelivery"}, globals())
