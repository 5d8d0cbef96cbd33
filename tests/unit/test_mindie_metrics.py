"""``/metrics``: MindIE's switch, and the engine's metrics relayed under MindIE's names."""

from __future__ import annotations

from fastapi.testclient import TestClient
from llm_engine.config import Settings
from prometheus_client.parser import text_string_to_metric_families

from adapter.app import create_app
from adapter.mindie_metrics import relay

# what Triton's metrics port shows for two instances of the llm model (trimmed)
TRITON = """# HELP llm_request_received_total requests accepted by the engine
# TYPE llm_request_received_total counter
llm_request_received_total{instance="llm_0",model="llm",model_name="m"} 5
llm_request_received_total{instance="llm_1",model="llm",model_name="m"} 2
# HELP llm_request_failed_total requests ended with an error
# TYPE llm_request_failed_total counter
llm_request_failed_total{instance="llm_0",model="llm",model_name="m"} 1
# HELP llm_num_requests_running requests in the running batch
# TYPE llm_num_requests_running gauge
llm_num_requests_running{instance="llm_0",model="llm",model_name="m"} 3
llm_num_requests_running{instance="llm_1",model="llm",model_name="m"} 1
# HELP llm_kv_cache_usage_perc share of KV-cache blocks in use
# TYPE llm_kv_cache_usage_perc gauge
llm_kv_cache_usage_perc{instance="llm_0",model="llm",model_name="m"} 0.5
llm_kv_cache_usage_perc{instance="llm_1",model="llm",model_name="m"} 0.25
# HELP llm_time_to_first_token_seconds arrival to first token
# TYPE llm_time_to_first_token_seconds histogram
llm_time_to_first_token_seconds_count{instance="llm_0",model="llm",model_name="m"} 2
llm_time_to_first_token_seconds_sum{instance="llm_0",model="llm",model_name="m"} 0.3
llm_time_to_first_token_seconds_bucket{instance="llm_0",model="llm",model_name="m",le="0.1"} 1
llm_time_to_first_token_seconds_bucket{instance="llm_0",model="llm",model_name="m",le="1"} 2
llm_time_to_first_token_seconds_bucket{instance="llm_0",model="llm",model_name="m",le="+Inf"} 2
llm_time_to_first_token_seconds_count{instance="llm_1",model="llm",model_name="m"} 1
llm_time_to_first_token_seconds_sum{instance="llm_1",model="llm",model_name="m"} 2.0
llm_time_to_first_token_seconds_bucket{instance="llm_1",model="llm",model_name="m",le="0.1"} 0
llm_time_to_first_token_seconds_bucket{instance="llm_1",model="llm",model_name="m",le="1"} 0
llm_time_to_first_token_seconds_bucket{instance="llm_1",model="llm",model_name="m",le="+Inf"} 1
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="llm",version="1"} 9
"""


def _samples(families) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    class C:
        def collect(self):
            return iter(families)

    registry = CollectorRegistry()
    registry.register(C())
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_engine_metrics_are_summed_over_instances_and_renamed():
    got = _samples(relay(TRITON, "m"))
    m = (("model_name", "m"),)
    assert got[("request_received_total", m)] == 7
    assert got[("request_failed_total", m)] == 1
    assert got[("num_requests_running", m)] == 4
    assert got[("npu_cache_usage_perc", m)] == 0.375
    assert got[("time_to_first_token_seconds_count", m)] == 3
    assert got[("time_to_first_token_seconds_sum", m)] == 2.3
    assert got[("time_to_first_token_seconds_bucket", (("le", "0.1"), ("model_name", "m")))] == 1
    assert got[("time_to_first_token_seconds_bucket", (("le", "1"), ("model_name", "m")))] == 2
    assert got[("time_to_first_token_seconds_bucket", (("le", "+Inf"), ("model_name", "m")))] == 3
    assert not any(name.startswith(("llm_", "nv_")) for name, _ in got)
    assert relay(TRITON, "another-model") == []


def test_metrics_need_the_monitor_switch(monkeypatch):
    monkeypatch.delenv("MIES_SERVICE_MONITOR_MODE", raising=False)
    with TestClient(create_app(Settings(), tokenizer=object())) as client:  # Triton is not needed
        r = client.get("/metrics")
        assert r.status_code == 500 and r.json() == {
            "error": "Environment variable MIES_SERVICE_MONITOR_MODE is not set.",
            "error_type": "Incomplete Generation"}
        monkeypatch.setenv("MIES_SERVICE_MONITOR_MODE", "1")
        r = client.get("/metrics")  # nothing listens on Triton's metrics port: the adapter's own still come
        assert r.status_code == 200 and "mindie_adapter_requests_in_flight" in r.text


def test_unreadable_engine_metrics_leave_the_adapters_own(monkeypatch, caplog):
    """Whatever Triton's metrics port answers, /metrics still serves the adapter's metrics."""
    import asyncio

    import httpx

    from adapter import mindie_metrics

    def handler(request):
        return httpx.Response(200, text="this is { not prometheus text\n")

    async def scrape():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await mindie_metrics.engine_metrics_text(client, "http://triton/metrics", "m")

    assert asyncio.run(scrape()) == b""
    assert "unreadable metrics text" in caplog.text


def test_the_engine_metrics_are_read_with_one_client_for_the_adapters_life(monkeypatch):
    """A new httpx client per scrape built an SSL context each time (33-57 ms of CPU): the
    lifespan makes one, every scrape uses it, and shutdown closes it."""
    monkeypatch.setenv("MIES_SERVICE_MONITOR_MODE", "1")
    with TestClient(create_app(Settings(), tokenizer=object())) as client:
        scraper = client.app.state.scrape_client
        for _ in range(2):  # nothing listens on Triton's metrics port: the adapter's own still come
            r = client.get("/metrics")
            assert r.status_code == 200 and "mindie_adapter_requests_in_flight" in r.text
        assert client.app.state.scrape_client is scraper and not scraper.is_closed
    assert scraper.is_closed
