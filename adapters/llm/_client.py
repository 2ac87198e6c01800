"""HTTP to an OpenAI-compatible chat-completions endpoint: timeouts, retries, backoff.

httpx is imported inside the methods that use it, so importing the adapter
(and `kernel --help`) stays cheap. httpx runs on trio through anyio.

The API key is read once, when the client is built, kept in a private
attribute and sent only as the `Authorization: Bearer` header: it is not in
`repr()`, in error messages, in log lines or in anything handed to the audit.
A server that echoes it back (an "Incorrect API key provided: ..." body) is
answered with an error whose text has it replaced by `[redacted]`, and so
are the base URL's user info and query values (`?sig=...`): every message
the client makes passes through `ChatClient.scrub`.

Timeouts: a request has a connect timeout of its own and, by default, no
read timeout. How long a request in flight may take is the run's business
(the critic's `model_timeout`, `kernel run --model-timeout`, and the run's
deadline), not a number hidden here. A host that sets `read_timeout` gets an
`APIError` when it passes, and the request is *not* sent again: the server
may have started on it (and will bill it), so a silent re-send would pay
twice for one answer and count it once.
"""

from __future__ import annotations

import email.utils
import logging
import math
import os
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, quote_plus, unquote, urljoin, urlsplit, urlunsplit

import trio

from ._errors import APIError, MalformedResponse

if TYPE_CHECKING:
    import httpx

_log = logging.getLogger("kernel.llm")

DEFAULT_BASE_URL = "https://api.openai.com/v1"

#: Statuses worth another try: rate limits, timeouts and server-side failures.
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})

#: What replaces a secret (the API key, a URL credential) in the client's messages.
REDACTED = "[redacted]"
#: Shorter secrets are not replaced as substrings (they would mangle unrelated text):
#: an API key, and a credential or query value of the base URL.
_MIN_KEY = 4
_MIN_URL_SECRET = 6


@dataclass(slots=True, frozen=True)
class CallInfo:
    """How one `ChatClient.complete` call went, for the audit (no secrets in here).

    Attributes:
        status_code: The HTTP status of the answer that was used.
        attempts: Requests made, 1 when the first one succeeded.
        latency_s: Wall time of the whole call, retries and waits included.
        waited_s: Time spent sleeping between attempts.
    """

    status_code: int
    attempts: int
    latency_s: float
    waited_s: float


@dataclass(slots=True, frozen=True)
class Retry:
    """One retry about to happen: handed to `complete`'s `on_retry` before the wait."""

    attempt: int
    reason: str
    wait_s: float
    status_code: int | None


def redact_url(url: str) -> str:
    """`url` without user info, query or fragment: safe to show and to audit.

    Never raises: a URL too malformed to parse (a port out of range, a bad
    IPv6 literal) is cut by hand the same way.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        head = re.split(r"[?#]", url, maxsplit=1)[0]
        return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/]*@", r"\1", head)
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def check_base_url(url: str) -> None:
    """Raise ValueError (one line, no credentials) unless `url` is http(s)://HOST[:PORT][/PATH]."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port raises for one out of range
    except ValueError as exc:
        raise ValueError(f"base URL is malformed ({exc}): {redact_url(url)!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base URL must be http(s)://HOST[/PATH], got {redact_url(url)!r}")


def parse_retry_after(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """Seconds the server asked us to wait, from `retry-after-ms` or `Retry-After`.

    `Retry-After` may be delta-seconds or an HTTP date. Returns None when
    neither header is present or parses.
    """
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class ChatClient:
    """Posts chat-completion requests, retrying what is worth retrying.

    Retried: statuses in `RETRY_STATUSES` and transport failures (refused
    connections, connect timeouts, dropped connections). A read timeout is
    not retried (the server may be working on the request: see the module
    docstring), nor is a redirect (its error names where it points). A `Retry-After`
    (or `retry-after-ms`) header sets the wait, capped at `max_retry_after`;
    otherwise the wait is exponential backoff with jitter. Any other 4xx fails
    at once. A wait that would end past the caller's deadline is not taken:
    the call fails instead, so a rate limit never silently eats a run.

    Use it as an async context manager to keep one connection pool for many
    calls; otherwise each call opens (and closes) its own connection. A host
    that owns a pool (proxies, certificates, limits) passes it as `client`.

    Args:
        base_url: The API root, e.g. "http://127.0.0.1:8000/v1"; requests go to
            `{base_url}/chat/completions`.
        api_key: The key; if None it is read from the environment variable
            `api_key_env`. With no key, no Authorization header is sent (local
            servers such as vLLM, llama.cpp or Ollama need none).
        api_key_env: The environment variable holding the key.
        connect_timeout: Seconds to establish a connection (a failed connect is
            retried: the server never saw the request).
        read_timeout: Seconds to wait for each chunk of the answer. None (the
            default): no bound here; the run's critic (`model_timeout`) and
            deadline bound a request in flight. When it passes, the call fails
            with an `APIError` and is not sent again (see the module docstring).
        max_retries: Retries after the first attempt (0 = no retry).
        backoff: The first backoff wait in seconds; doubles each retry.
        max_backoff: Upper bound of one backoff wait.
        max_retry_after: Upper bound of a server-requested wait.
        headers: Extra request headers (e.g. an organisation id).
        client: An `httpx.AsyncClient` to send every request with; it is never
            closed here. The key, the extra headers and the timeouts above are
            set on each request. If None, the client makes its own.
        transport: The transport of the clients made here (e.g.
            `httpx.MockTransport` in tests); ignored when `client` is given.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        connect_timeout: float = 10.0,
        read_timeout: float | None = None,
        max_retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        max_retry_after: float = 60.0,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        check_base_url(base_url)
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self._api_key = api_key if api_key is not None else os.environ.get(api_key_env) or None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_retry_after = max_retry_after
        self._extra_headers = dict(headers or {})
        self._secrets = _secrets(self._api_key, base_url)
        self._pool: httpx.AsyncClient | None = None
        self._given = client
        self._transport = transport

    def __repr__(self) -> str:
        key = "set" if self._api_key else "unset"
        return f"ChatClient({self.display_url!r}, api_key={key} (${self.api_key_env}))"

    @property
    def url(self) -> str:
        """The endpoint requests are posted to (the base URL's query string is kept)."""
        parts = urlsplit(self.base_url)
        path = parts.path.rstrip("/") + "/chat/completions"
        return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))

    @property
    def display_url(self) -> str:
        """The endpoint without credentials or query: what the audit and errors show."""
        return redact_url(self.url)

    def scrub(self, text: str) -> str:
        """`text` without the API key or the base URL's credentials and query values.

        Applied to every message this client makes (errors, log lines, retry
        reasons), since servers echo what they were sent ("Incorrect API key
        provided: ...", a 404 naming the path and query).
        """
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    @property
    def pooled(self) -> bool:
        """True when calls share one connection pool (entered, or a host's `client`)."""
        return self._pool is not None or self._given is not None

    @property
    def has_key(self) -> bool:
        """True when an API key will be sent."""
        return self._api_key is not None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", **self._extra_headers}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _timeout(self) -> httpx.Timeout:
        import httpx

        return httpx.Timeout(self.read_timeout, connect=self.connect_timeout)

    def _client(self) -> httpx.AsyncClient:
        import httpx

        return httpx.AsyncClient(headers=self._headers(), timeout=self._timeout(),
                                 transport=self._transport)

    async def __aenter__(self) -> ChatClient:
        if self._pool is None and self._given is None:
            self._pool = self._client()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with trio.CancelScope(shield=True):
                await pool.aclose()

    async def _post(self, body: Mapping[str, Any]) -> httpx.Response:
        if self._given is not None:
            return await self._given.post(self.url, json=body, headers=self._headers(),
                                          timeout=self._timeout())
        if self._pool is not None:
            return await self._pool.post(self.url, json=body)
        async with self._client() as client:
            return await client.post(self.url, json=body)

    def _redirect(self, resp: httpx.Response) -> str:
        """For a 3xx: where it points (credentials and query cut), and what that means."""
        if not 300 <= resp.status_code < 400:
            return ""
        location = resp.headers.get("location")
        if not location:
            return " (a redirect with no Location; check the base URL)"
        try:
            target = redact_url(urljoin(self.url, location))
        except ValueError:
            target = redact_url(location)
        return (f" to {target} (redirects are not followed: check the base URL, e.g. "
                "https instead of http, or a missing /v1)")

    async def complete(
        self,
        body: Mapping[str, Any],
        *,
        deadline: float = math.inf,
        on_retry: Callable[[Retry], None] | None = None,
    ) -> tuple[dict[str, Any], CallInfo]:
        """Post `body` and return the decoded JSON answer and how the call went.

        Args:
            body: The chat-completions request (model, messages, tools, ...).
            deadline: Absolute `trio.current_time()` after which no retry wait
                may end (the run's deadline).
            on_retry: Called before each retry wait (to audit it).

        Raises:
            APIError: A non-retryable status, or retries ran out, or the next
                wait would pass `deadline`.
            MalformedResponse: A 2xx answer whose body is not a JSON object.
        """
        import httpx

        t0 = trio.current_time()
        waited = 0.0
        attempt = 0
        while True:
            attempt += 1
            status: int | None = None
            server_wait: float | None = None
            try:
                resp = await self._post(body)
            except httpx.ReadTimeout:
                # The request went out and the server may be working on it (and
                # billing it): sending it again would pay twice for one answer.
                within = ("" if self.read_timeout is None
                          else f" of {self.read_timeout:g}s")
                raise APIError(
                    f"{self.display_url}: no answer within the read timeout{within}; the "
                    "request was not sent again (the server may still be working on it)",
                    attempts=attempt) from None
            except httpx.TransportError as exc:
                reason = self.scrub(f"{type(exc).__name__}: {exc}".rstrip(": "))
            else:
                status = resp.status_code
                if 200 <= status < 300:
                    info = CallInfo(status, attempt, trio.current_time() - t0, waited)
                    try:
                        return _decode(resp, self.display_url), info
                    except MalformedResponse as exc:
                        raise MalformedResponse(self.scrub(str(exc))) from None
                reason = self.scrub(f"HTTP {status} {resp.reason_phrase}".rstrip()
                                    + _error_detail(resp) + self._redirect(resp))
                if status not in RETRY_STATUSES:
                    raise APIError(f"{self.display_url} answered {reason}",
                                   status_code=status, attempts=attempt)
                server_wait = parse_retry_after(resp.headers)
            if attempt > self.max_retries:
                raise APIError(
                    f"{self.display_url} failed after {attempt} attempt"
                    f"{'s' if attempt > 1 else ''}: {reason}",
                    status_code=status, attempts=attempt)
            if server_wait is not None:
                wait = min(server_wait, self.max_retry_after)
            else:
                wait = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
                wait *= random.uniform(0.5, 1.0)
            if trio.current_time() + wait > deadline:
                raise APIError(
                    f"{self.display_url}: {reason}; the retry wait of {wait:.1f}s "
                    "would pass the run's deadline", status_code=status, attempts=attempt)
            _log.warning("model call retrying in %.3fs (attempt %d): %s: %s", wait, attempt,
                         self.display_url, reason)
            if on_retry is not None:
                on_retry(Retry(attempt, reason, wait, status))
            await trio.sleep(wait)
            waited += wait


def _secrets(api_key: str | None, base_url: str) -> tuple[str, ...]:
    """What `ChatClient.scrub` replaces: the key and the base URL's credentials and
    query values, as given and as they would be quoted; longest first."""
    found: set[str] = set()
    raw: list[tuple[str, int]] = [(api_key or "", _MIN_KEY)]
    parts = urlsplit(base_url)
    raw += [(parts.query, _MIN_URL_SECRET), (parts.fragment, _MIN_URL_SECRET)]
    if "@" in parts.netloc:
        raw.append((parts.netloc.rpartition("@")[0], _MIN_URL_SECRET))
    raw += [(parts.username or "", _MIN_URL_SECRET), (parts.password or "", _MIN_URL_SECRET)]
    raw += [(pair.partition("=")[2], _MIN_URL_SECRET) for pair in re.split(r"[&;]", parts.query)]
    for value, least in raw:
        for form in (value, unquote(value), quote(value, safe=""), quote_plus(value)):
            if len(form) >= least:
                found.add(form)
    return tuple(sorted(found, key=len, reverse=True))


def _decode(resp: httpx.Response, url: str) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError as exc:
        snippet = resp.text[:200].replace("\n", " ")
        raise MalformedResponse(
            f"{url} answered HTTP {resp.status_code} with a body that is not JSON "
            f"({exc}): {snippet!r}") from exc
    if not isinstance(data, dict):
        raise MalformedResponse(
            f"{url} answered with JSON {type(data).__name__}, not an object")
    return data


def _error_detail(resp: httpx.Response) -> str:
    """The API's own error message, if the body has one (OpenAI: error.message)."""
    try:
        data = resp.json()
    except ValueError:
        text = resp.text.strip().replace("\n", " ")
        return f": {text[:300]}" if text else ""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return f": {err['message'][:300]}"
        if isinstance(err, str):
            return f": {err[:300]}"
    return ""
