"""MindIE's error envelope: ``{"error": "<message>", "error_type": "<type>"}`` (spec §1.2).

Statuses: 422 validation, 424 rejected at enqueue, 500 anything else that stops a
generation (timeouts, Triton or the model unreachable, no engine response), 503 while
stopping. One deliberate addition: overload (``maxLinkNum``, the engine's or Triton's
queue full) is load shedding and answers 503 with ``Retry-After``, so that clients and
balancers back off and retry instead of treating it as a failed generation.
"""

from __future__ import annotations

NOT_FOUND = "NotFoundError"
VALIDATION = "Input Validation Error"
GENERATION = "Generation Error"
INCOMPLETE = "Incomplete Generation"
UNAVAILABLE = "Service Unavailable"


class MindIEError(Exception):
    """An error the HTTP layer answers with ``status`` and the MindIE envelope."""

    def __init__(self, status: int, message: str, error_type: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.headers = headers or {}

    def __repr__(self) -> str:
        return f"MindIEError({self.status}, {self.message!r}, {self.error_type!r})"


def not_found_error(msg: str) -> MindIEError:
    """404 with a body: an unknown model or request id, a bad ``/health/timed`` wait (unknown
    paths get an empty 404 instead)."""
    return MindIEError(404, msg, NOT_FOUND)


def validation_error(msg: str) -> MindIEError:
    """422: parse, type, range or combination failure, or tokenizer/media failure."""
    return MindIEError(422, msg, VALIDATION)


def generation_error(msg: str) -> MindIEError:
    """424: the engine rejected the request at enqueue with an argument error."""
    return MindIEError(424, msg, GENERATION)


def incomplete_error(msg: str) -> MindIEError:
    """500: timeouts, other enqueue failures (Triton or the model unreachable), no engine response."""
    return MindIEError(500, msg, INCOMPLETE)


def unavailable_error(msg: str) -> MindIEError:
    """503: the service is stopping."""
    return MindIEError(503, msg, UNAVAILABLE)


def overloaded_error(msg: str, retry_after: int = 1) -> MindIEError:
    """503 + ``Retry-After``: a queue is full (load shedding; the project's addition to §1.2)."""
    return MindIEError(503, msg, UNAVAILABLE, {"Retry-After": str(retry_after)})


def error_body(err: MindIEError) -> dict:
    """The response body, keys in MindIE's order."""
    return {"error": err.message, "error_type": err.error_type}
