"""Adapter metrics on ``/metrics`` (prometheus-client): requests, in-flight, latency, TTFT.

The engine's own metrics (queue, KV usage, tokens) are on Triton's metrics port.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from adapter.guards import INFERENCE_PATHS

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REGISTRY = CollectorRegistry()
REQUESTS = Counter("mindie_adapter_requests", "HTTP requests by route and status",
                   ["route", "status"], registry=REGISTRY)
IN_FLIGHT = Gauge("mindie_adapter_requests_in_flight", "inference requests being served", registry=REGISTRY)
LATENCY = Histogram("mindie_adapter_request_latency_seconds", "request latency to the last byte",
                    ["route"], buckets=BUCKETS, registry=REGISTRY)
TTFT = Histogram("mindie_adapter_time_to_first_token_seconds", "request arrival to the first streamed event",
                 ["route"], buckets=BUCKETS, registry=REGISTRY)

# Leak watch: tasks of the event loop (set at each scrape), and process_open_fds / _resident_memory_bytes.
TASKS = Gauge("mindie_adapter_asyncio_tasks", "asyncio tasks alive in the event loop", registry=REGISTRY)
ProcessCollector(registry=REGISTRY)


class MetricsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in INFERENCE_PATHS:
            return await self.app(scope, receive, send)
        route = scope["path"]
        start = time.monotonic()
        scope.setdefault("state", {})["arrival"] = start  # request.state.arrival: e2eTimeout counts from it
        status = 500
        first_body = True

        async def observe(message):
            nonlocal status, first_body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and first_body and message.get("body"):
                first_body = False
                TTFT.labels(route).observe(time.monotonic() - start)
            await send(message)

        IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, observe)
        finally:
            IN_FLIGHT.dec()
            REQUESTS.labels(route, str(status)).inc()
            LATENCY.labels(route).observe(time.monotonic() - start)
