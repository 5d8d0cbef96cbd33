"""Server-sent-event framing, byte-exact as MindIE writes it.

Each event is ``data: `` + compact JSON + a blank line; there are no ``event:``
or ``id:`` lines and no heartbeats. ``/v1/completions`` ends with ``data: [DONE]``,
``/infer`` with its last event.
"""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def compact(body) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def event(body) -> bytes:
    return b"data: " + compact(body) + b"\n\n"
