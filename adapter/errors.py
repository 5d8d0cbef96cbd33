"""MindIE's error envelope: ``{"error": "<message>", "error_type": "<type>"}`` (spec §1.2)."""

from __future__ import annotations

VALIDATION = "Input Validation Error"
GENERATION = "Generation Error"
INCOMPLETE = "Incomplete Generation"
UNAVAILABLE = "Service Unavailable"


class MindIEError(Exception):
    """An error the HTTP layer answers with ``status`` and the MindIE envelope."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    def __repr__(self) -> str:
        return f"MindIEError({self.status}, {self.message!r}, {self.error_type!r})"


def validation_error(msg: str) -> MindIEError:
    """422: parse, type, range or combination failure, or tokenizer/media failure."""
    return MindIEError(422, msg, VALIDATION)


def generation_error(msg: str) -> MindIEError:
    """424: the engine rejected the request at enqueue with an argument error."""
    return MindIEError(424, msg, GENERATION)


def incomplete_error(msg: str) -> MindIEError:
    """500: timeouts, other enqueue failures, missing engine response."""
    return MindIEError(500, msg, INCOMPLETE)


def unavailable_error(msg: str) -> MindIEError:
    """503: the service is stopping."""
    return MindIEError(503, msg, UNAVAILABLE)


def error_body(err: MindIEError) -> dict:
    """The response body, keys in MindIE's order."""
    return {"error": err.message, "error_type": err.error_type}
