"""Engine errors (torch-free, so ``app`` can catch them without importing the engine).

Source of the split: vLLM's ``vllm/v1/engine/exceptions.py`` (``EngineDeadError``) and its
``ValueError``-based input validation in the input processor.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop stopped; no request can be served (HTTP 503)."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot take (HTTP 400); nothing was queued.

    Subclasses ``ValueError`` (vLLM raises ``ValueError`` for bad input).

    Attributes:
        message: client-safe text (no token ids, no salt).
        param: the OpenAI request field at fault (``"prompt"``, ``"max_tokens"``, ...) or None.
        code: OpenAI error code: ``"invalid_value"`` or ``"context_length_exceeded"``.
    """

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message, param)
        self.message, self.param, self.code = message, param, code

    def __str__(self) -> str:
        return self.message


class RequestFailedError(EngineError):
    """One request failed inside the engine (its sampling, stop checks, detokenisation, block
    allocation, or its step's forward pass); the others go on (HTTP 500).

    Attributes:
        message: client-safe text (no token ids, no prompt).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
