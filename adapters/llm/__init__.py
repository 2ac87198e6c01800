"""An LLM tool-calling agent over any OpenAI-compatible chat-completions API.

OpenAI, vLLM, llama.cpp's server and Ollama all speak the protocol::

    from adapters.llm import ChatClient, LLMAgent, Price

    agent = LLMAgent("gpt-4o-mini", "Summarise README.md",
                     client=ChatClient("http://127.0.0.1:8000/v1"),
                     prices={"gpt-4o-mini": Price(0.15, 0.60)})
    result = await Kernel(ports).run(agent, RunInfo(name="summary"))

Each model turn is one kernel step; the kernel runs the tools the model asks
for and hands their results to the next turn. httpx is imported only when
the first request is made.
"""

from ._agent import LLMAgent as LLMAgent
from ._agent import Price as Price
from ._client import DEFAULT_BASE_URL as DEFAULT_BASE_URL
from ._client import CallInfo as CallInfo
from ._client import ChatClient as ChatClient
from ._client import Retry as Retry
from ._client import parse_retry_after as parse_retry_after
from ._client import redact_url as redact_url
from ._errors import APIError as APIError
from ._errors import LLMError as LLMError
from ._errors import MalformedResponse as MalformedResponse
from ._judge import llm_judge as llm_judge
from ._judge import parse_answer as parse_answer
from ._protocol import Completion as Completion
from ._protocol import ModelToolCall as ModelToolCall
from ._protocol import parse_completion as parse_completion
from ._tools import Tool as Tool
from ._tools import read_file_tool as read_file_tool
from ._tools import shell_tool as shell_tool

__all__ = [
    "DEFAULT_BASE_URL",
    "APIError",
    "CallInfo",
    "ChatClient",
    "Completion",
    "LLMAgent",
    "LLMError",
    "MalformedResponse",
    "ModelToolCall",
    "Price",
    "Retry",
    "Tool",
    "llm_judge",
    "parse_answer",
    "parse_completion",
    "parse_retry_after",
    "read_file_tool",
    "redact_url",
    "shell_tool",
]
