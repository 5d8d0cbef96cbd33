"""ASGI middleware that protects the inference routes before any handler runs.

* Headers: more than 100 headers or 16 KiB of them gets 431.
* Body size: more than ``maxRequestLength`` MiB gets 413, from ``Content-Length``
  at once, and for chunked bodies as soon as the running count passes the limit,
  so a huge body is never buffered.
* API key: when set, every route except liveness needs ``Authorization: Bearer <key>``
  (or ``X-API-Key``); compared in constant time and never logged.
* Admission: at most ``maxLinkNum`` inference requests run at once and ``2 × maxLinkNum``
  wait for a slot (:mod:`adapter.admission`); past that the answer is an immediate 503
  with ``Retry-After``. While stopping, 503 too. A waiting client that hangs up leaves the
  queue at once (:class:`Admission`).
"""

from __future__ import annotations

import asyncio
import hmac
import json

from adapter.admission import AdmissionState

INFERENCE_PATHS = ("/v1/completions", "/infer", "/infer_token")  # /infer_token: the same handler as /infer
OPEN_PATHS = ("/v2/health/live",)


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": payload})


_GONE = object()  # the client hung up while its request waited for a slot


async def _stopped(send) -> None:
    await _send_json(send, 503, {"error": "The service has been stopped", "error_type": "Service Unavailable"},
                     [(b"retry-after", b"5")])


def _replay(body: bytes, receive):
    """``receive`` that gives the body already read once, then the connection's own messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


class HeaderLimit:
    """431 for too many or too large headers (h11 only bounds a head that arrives in pieces)."""

    def __init__(self, app, max_bytes: int = 16 * 1024, max_count: int = 100):
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            size = sum(len(k) + len(v) + 4 for k, v in headers)
            if len(headers) > self.max_count or size > self.max_bytes:
                return await _send_json(send, 431, {"error": "Request header fields too large",
                                                    "error_type": "Input Validation Error"},
                                        [(b"connection", b"close")])
        return await self.app(scope, receive, send)


class BodyLimit:
    def __init__(self, app, max_bytes: int, mib: int):
        self.app = app
        self.max_bytes = max_bytes
        self.message = {"message": f"Request body too large. Maximum allowed size is {mib}MB."}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_json(send, 413, self.message, [(b"connection", b"close")])
        seen = 0
        too_big = False

        async def limited_receive():
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_big = True
                    raise _TooLarge()
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _send_json(send, 413, self.message, [(b"connection", b"close")])


class _TooLarge(Exception):
    pass


class ApiKey:
    def __init__(self, app, key: str | None):
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.key is None or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given, self.key):
            return await _send_json(send, 401, {"error": "Invalid or missing API key",
                                                "error_type": "Unauthorized"},
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class Admission:
    """Queue the inference routes for a slot. A request that must wait has its body read
    first (up to ``WATCHED_BODY_BYTES``) and is then watched for its client hanging up: a
    client gone while queued leaves the queue at once instead of holding its place (up to
    ``e2eTimeout``) and turning live clients away. A larger or chunked body is read after
    admission, as before, so a queued request holds at most that much memory."""

    WATCHED_BODY_BYTES = 64 * 1024

    def __init__(self, app, state: AdmissionState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in INFERENCE_PATHS:
            return await self.app(scope, receive, send)
        if self.state.stopping:
            return await _stopped(send)
        if self.state.would_wait and self.state.waiting < self.state.queue_limit:
            body = await self._small_body(scope, receive)
            if body is not None:
                if body is _GONE:
                    return None
                admitted = await self._acquire_unless_gone(receive)
                if admitted is _GONE:
                    return None
                return await self._serve(admitted, scope, _replay(body, receive), send)
        return await self._serve(await self.state.acquire(), scope, receive, send)

    async def _small_body(self, scope, receive) -> bytes | object | None:
        """The whole body when ``Content-Length`` says it is small (``_GONE`` if the client
        hung up meanwhile); ``None`` to leave the body to the route."""
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if not length.isdigit() or int(length) > self.WATCHED_BODY_BYTES:
            return None
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _GONE
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _acquire_unless_gone(self, receive) -> bool | object:
        """``acquire()``, or ``_GONE`` when the client hangs up first (the body is read, so the
        next message is the disconnect)."""
        waiting = asyncio.ensure_future(self.state.acquire())
        hangup = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((waiting, hangup), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done() or not hangup.done():
                for task in (waiting, hangup):
                    task.cancel()
        if waiting.done() and not waiting.cancelled():
            admitted = waiting.result()
            if hangup.done() and not hangup.cancelled():  # both at once: the client is gone
                if admitted:
                    self.state.release()
                return _GONE
            return admitted
        try:  # it leaves the queue, or passes on a slot it was just handed ...
            admitted = await waiting
        except asyncio.CancelledError:
            admitted = False
        if admitted:  # ... or, handed one as it was cancelled, returns it (wait_for in 3.11)
            self.state.release()
        return _GONE

    async def _serve(self, admitted: bool, scope, receive, send):
        if not admitted:
            return await _send_json(send, 503, {"error": f"Too many requests (maxLinkNum {self.state.limit} "
                                                         f"running, {self.state.waiting} waiting); retry later",
                                                "error_type": "Service Unavailable"},
                                    [(b"retry-after", b"1")])
        try:
            if self.state.stopping:  # it waited while the service began to stop
                return await _stopped(send)
            await self.app(scope, receive, send)
        finally:
            self.state.release()
