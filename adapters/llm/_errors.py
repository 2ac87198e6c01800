"""The LLM adapter's errors, all `kernel.AgentError`s so a run that hits one ends `error`.

::

    kernel.AgentError
    └── LLMError              base of what the LLM adapter raises on purpose
        ├── APIError          the API refused the call, or retries ran out
        └── MalformedResponse the API answered 200 with something not a chat completion
"""

from __future__ import annotations

from kernel import AgentError


class LLMError(AgentError):
    """Base class of the LLM adapter's errors."""


class APIError(LLMError):
    """The chat-completions API refused a call, or every retry failed.

    Attributes:
        status_code: The last HTTP status, or None when no response arrived.
        attempts: How many requests were made.
    """

    def __init__(self, message: str, *, status_code: int | None = None,
                 attempts: int = 1) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.attempts = attempts


class MalformedResponse(LLMError):
    """The API answered with a body that is not a usable chat completion."""
