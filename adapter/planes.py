"""MindIE's three planes and the listeners that serve them.

MindIE Server serves inference on ``ipAddress:port`` (business), health and status on
``managementIpAddress:managementPort`` and ``/metrics`` on
``managementIpAddress:metricsPort``; a plane whose port equals another's is served by
that listener. Unset keys mean the business listener here (MindIE's defaults are
127.0.0.2, 1026 and 1027), so a settings file without them serves everything on ``port``.
One uvicorn server listens on every socket, and :class:`PlaneFilter` answers a route
that belongs to another plane with MindIE's empty 404.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from llm_engine.config import ServerSection, url_host

BUSINESS, MANAGEMENT, METRICS = "business", "management", "metrics"
CONTAINER_IP_ENV = "MIES_CONTAINER_IP"  # overrides ipAddress (MindIE)
CONTAINER_MANAGEMENT_IP_ENV = "MIES_CONTAINER_MANAGEMENT_IP"  # overrides managementIpAddress

_MANAGEMENT_PATHS = ("/health", "/v2/health/live", "/v2/health/ready", "/v1/config")
_MANAGEMENT_PATTERNS = (re.compile(r"/health/timed.*"), re.compile(r"/v2/models/[^/]+/ready"))


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    planes: frozenset[str]

    @property
    def url_host(self) -> str:
        return url_host(self.host)


def listeners(srv: ServerSection) -> list[Listener]:
    """The sockets to listen on, business first; planes that share a port share its listener."""
    host = os.environ.get(CONTAINER_IP_ENV) or srv.ipAddress
    management_host = os.environ.get(CONTAINER_MANAGEMENT_IP_ENV) or srv.managementIpAddress or host
    by_port: dict[int, tuple[str, set[str]]] = {srv.port: (host, {BUSINESS})}
    for plane, port in ((MANAGEMENT, srv.managementPort or srv.port), (METRICS, srv.metricsPort or srv.port)):
        if port in by_port:
            by_port[port][1].add(plane)
        else:
            by_port[port] = (management_host, {plane})
    return [Listener(h, port, frozenset(planes)) for port, (h, planes) in by_port.items()]


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4 or IPv6, ``SO_REUSEADDR``); raises ``OSError``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listener_for(srv: ServerSection, plane: str) -> Listener:
    return next(listener for listener in listeners(srv) if plane in listener.planes)


def plane_of(path: str) -> str:
    if path == "/metrics":
        return METRICS
    if path in _MANAGEMENT_PATHS or any(p.fullmatch(path) for p in _MANAGEMENT_PATTERNS):
        return MANAGEMENT
    return BUSINESS


class PlaneFilter:
    """ASGI middleware: a route is served only on the listener of its plane."""

    def __init__(self, app, planes_by_port: dict[int, frozenset[str]]):
        self.app = app
        self.planes_by_port = planes_by_port

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            server = scope.get("server")
            planes = self.planes_by_port.get(server[1]) if server else None
            if planes is not None and plane_of(scope["path"]) not in planes:
                await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)
