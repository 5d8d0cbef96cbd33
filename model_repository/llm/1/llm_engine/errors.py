"""Engine errors and how they travel through Triton.

A Triton error carries only a message, so the HTTP status travels as a prefix:
``"[424] Failed to enqueue inferRequest. ..."``. :func:`parse_error` reads it back.
"""

from __future__ import annotations

import re


class EngineError(Exception):
    """Base class; ``status`` is the HTTP status a front end should answer with."""

    status = 500

    def wire(self) -> str:
        return f"[{self.status}] {self}"


class InvalidParameter(EngineError):
    """A request parameter is malformed or out of range (names the field)."""

    status = 400


class EnqueueRejected(EngineError):
    """The prompt cannot be enqueued, e.g. it is longer than the model allows."""

    status = 424


class Overloaded(EngineError):
    """The engine's waiting queue is full."""

    status = 503


class RequestTimeout(EngineError):
    """The request's own deadline passed."""

    status = 504


_WIRE = re.compile(r"^\[(\d{3})\] (.*)$", re.S)


def parse_error(message: str) -> tuple[int, str]:
    """Split a wire error into ``(status, message)``; unknown text gives 500."""
    # Triton may wrap the model's text, so look for the prefix anywhere.
    idx = message.find("[")
    while idx != -1:
        m = _WIRE.match(message[idx:])
        if m:
            return int(m.group(1)), m.group(2)
        idx = message.find("[", idx + 1)
    return 500, message
