"""``GET /metrics``: the adapter's own metrics plus the engine's, under MindIE's names.

MindIE serves ``request_received_total``, ``time_to_first_token_seconds``, … with a
``model_name`` label, and only when ``MIES_SERVICE_MONITOR_MODE=1`` (else a 500). The
engine counts and times requests itself (``llm_*`` on Triton's metrics port, one series per
model instance); at each scrape they are read from there, summed over the instances
(the KV-cache share is averaged) and renamed. If Triton does not answer, the adapter's
own metrics are still served.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from adapter.errors import incomplete_error
from adapter.metrics import REGISTRY, TASKS

log = logging.getLogger(__name__)
router = APIRouter(include_in_schema=False)

MONITOR_ENV = "MIES_SERVICE_MONITOR_MODE"
SCRAPE_TIMEOUT = 2.0

# engine family (as the parser names it: counters without _total) -> MindIE's name, kind
RELAYED = {
    "llm_request_received": ("request_received", "counter"),
    "llm_request_success": ("request_success", "counter"),
    "llm_request_failed": ("request_failed", "counter"),
    "llm_prompt_tokens": ("prompt_tokens", "counter"),
    "llm_generation_tokens": ("generation_tokens", "counter"),
    "llm_num_requests_running": ("num_requests_running", "gauge"),
    "llm_num_requests_waiting": ("num_requests_waiting", "gauge"),
    "llm_kv_cache_usage_perc": ("npu_cache_usage_perc", "mean"),
    "llm_time_to_first_token_seconds": ("time_to_first_token_seconds", "histogram"),
    "llm_time_per_output_token_seconds": ("time_per_output_token_seconds", "histogram"),
    "llm_e2e_request_latency_seconds": ("e2e_request_latency_seconds", "histogram"),
}


def relay(text: str, model_name: str) -> list:
    """The MindIE families from Triton's metrics text, for the served model."""
    out = []
    for family in text_string_to_metric_families(text):
        if family.name not in RELAYED:
            continue
        name, kind = RELAYED[family.name]
        samples = [s for s in family.samples if s.labels.get("model_name", model_name) == model_name]
        if kind == "histogram":
            buckets: dict[str, float] = defaultdict(float)
            total = 0.0
            for s in samples:
                if s.name.endswith("_bucket"):
                    buckets[s.labels["le"]] += s.value
                elif s.name.endswith("_sum"):
                    total += s.value
            if not buckets:
                continue
            hist = HistogramMetricFamily(name, family.documentation, labels=["model_name"])
            ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))
            hist.add_metric([model_name], ordered, sum_value=total)
            out.append(hist)
            continue
        values = [s.value for s in samples if not s.name.endswith("_created")]
        if not values:
            continue
        if kind == "counter":
            metric = CounterMetricFamily(name, family.documentation, labels=["model_name"])
            metric.add_metric([model_name], sum(values))
        else:
            metric = GaugeMetricFamily(name, family.documentation, labels=["model_name"])
            metric.add_metric([model_name], sum(values) / len(values) if kind == "mean" else sum(values))
        out.append(metric)
    return out


class _Families:
    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


def scrape_client() -> httpx.AsyncClient:
    """The client that reads Triton's metrics, one for the adapter's life (``create_app``'s
    lifespan closes it): a new ``httpx.AsyncClient`` per scrape built an SSL context each
    time, 33-57 ms of CPU, for a plain-HTTP URL on loopback."""
    return httpx.AsyncClient(timeout=SCRAPE_TIMEOUT, limits=httpx.Limits(max_connections=2))


async def engine_metrics_text(client: httpx.AsyncClient, url: str, model_name: str) -> bytes:
    """Triton's engine metrics in MindIE's names, or nothing if Triton does not answer."""
    try:
        response = await client.get(url)
        response.raise_for_status()
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        log.warning("engine metrics not relayed: %s at %s", type(exc).__name__, url)
        return b""
    try:
        families = relay(response.text, model_name)
    except ValueError as exc:  # not Prometheus text: the adapter's own metrics still go out
        log.warning("engine metrics not relayed: unreadable metrics text at %s (%s)", url, exc)
        return b""
    registry = CollectorRegistry()
    registry.register(_Families(families))
    return generate_latest(registry)


@router.get("/metrics")
async def metrics(request: Request):
    if os.environ.get(MONITOR_ENV) != "1":
        raise incomplete_error(f"Environment variable {MONITOR_ENV} is not set.")
    settings = request.app.state.settings
    engine = await engine_metrics_text(request.app.state.scrape_client, settings.triton.metrics_url,
                                       settings.model.modelName)
    TASKS.set(len(asyncio.all_tasks()))
    return Response(generate_latest(REGISTRY) + engine, media_type=CONTENT_TYPE_LATEST)
