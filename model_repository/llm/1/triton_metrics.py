"""Engine metrics exported through Triton's own /metrics (``pb_utils.MetricFamily``).

Triton's request-duration metrics mislead for decoupled models, so the engine
reports LLM-native ones: TTFT, time per output token, queue time, end-to-end latency,
running and waiting sequences, KV-cache usage, tokens in and out, cancellations and
failures. The adapter's ``/metrics`` relays them under MindIE's names.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import triton_python_backend_utils as pb_utils

FLUSH_SECONDS = 0.25
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class EngineMetrics:
    METRICS = ("running", "waiting", "kv_usage", "batch", "steps", "preempt", "requests", "prompt_tokens",
               "gen_tokens", "cancelled", "finished", "failed", "ttft", "tpot", "queue", "e2e")

    def __init__(self, triton_model: str, served_name: str, instance: str = ""):
        labels = {"model": triton_model, "model_name": served_name, "instance": instance}
        self._families: list = []  # a MetricFamily must outlive its metrics: see close()

        def _family(name: str, doc: str, kind):
            family = pb_utils.MetricFamily(name=name, description=doc, kind=kind)
            self._families.append(family)
            return family

        G, C = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        hist = getattr(pb_utils.MetricFamily, "HISTOGRAM", None)
        self.running = _family("llm_num_requests_running", "requests in the running batch", G).Metric(labels)
        self.waiting = _family("llm_num_requests_waiting", "requests waiting for admission", G).Metric(labels)
        self.kv_usage = _family("llm_kv_cache_usage_perc", "share of KV-cache blocks in use", G).Metric(labels)
        self.batch = _family("llm_step_batch_size", "sequences in the last engine step", G).Metric(labels)
        self.steps = _family("llm_engine_steps_total", "engine steps run", C).Metric(labels)
        self.preempt = _family("llm_preemptions_total", "sequences preempted for KV space", C).Metric(labels)
        self.requests = _family("llm_request_received_total", "requests accepted by the engine", C).Metric(labels)
        self.prompt_tokens = _family("llm_prompt_tokens_total", "prompt tokens received", C).Metric(labels)
        self.gen_tokens = _family("llm_generation_tokens_total", "tokens generated", C).Metric(labels)
        self.cancelled = _family("llm_request_cancelled_total", "requests dropped on cancellation",
                                 C).Metric(labels)
        self.finished = _family("llm_request_success_total", "requests finished normally", C).Metric(labels)
        self.failed = _family("llm_request_failed_total", "requests ended with an error", C).Metric(labels)
        if hist is not None:
            def h(name, doc):
                return _family(name, doc, hist).Metric(labels, buckets=LATENCY_BUCKETS)
        else:  # older Triton: export sums as counters instead
            def h(name, doc):
                return _CounterAsHistogram(_family(name + "_sum", doc, C).Metric(labels))
        self.ttft = h("llm_time_to_first_token_seconds", "arrival to first token")
        self.tpot = h("llm_time_per_output_token_seconds", "gap between output tokens")
        self.queue = h("llm_queue_time_seconds", "arrival to first scheduling")
        self.e2e = h("llm_e2e_request_latency_seconds", "arrival to the last response")
        self._seq: dict[tuple[int, int], list] = {}  # (request, index) -> [first, last, tokens]
        self._preemptions = 0
        self._lock = threading.Lock()
        self._pending: Counter = Counter()
        self._received: set[int] = set()  # requests accepted and not yet ended (sender ids)
        self._counters = {"steps": self.steps, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                          "gen_tokens": self.gen_tokens, "cancelled": self.cancelled, "finished": self.finished,
                          "failed": self.failed}
        self._engine = None
        self._flusher: threading.Thread | None = None
        self._stopped = threading.Event()

    # Every Metric call is a round trip to the Triton process, so counts are kept here and
    # pushed by a background thread a few times a second; histograms get one observation
    # per sequence (TTFT, queue time, mean time per output token), not one per token.
    def start(self, engine) -> None:
        self._engine = engine
        self._flusher = threading.Thread(target=self._flush_loop, name="llm-metrics", daemon=True)
        self._flusher.start()

    def stop(self) -> None:
        self._stopped.set()

    def close(self) -> None:
        """Stop the flusher and delete every metric, then every family, from ``finalize()``.

        Their destructors message the Triton process through the stub. Left for the
        interpreter's exit, they ran after the stub was gone and segfaulted it at every
        shutdown (a null pointer in ``MetricFamily::~MetricFamily``)."""
        self.stop()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        self._engine = None
        self._counters = {}
        for name in self.METRICS:
            setattr(self, name, None)
        self._families.clear()

    def _add(self, name: str, value: float) -> None:
        with self._lock:
            self._pending[name] += value

    def on_request(self, prompt_tokens: int, request_key: int) -> None:
        """A request the engine accepted; only such a request can later count as failed."""
        with self._lock:
            self._received.add(request_key)
        self._add("requests", 1)
        self._add("prompt_tokens", prompt_tokens)

    def on_step(self, engine) -> None:
        self._add("steps", 1)

    def on_state(self, engine) -> None:
        """The engine calls this when a step had nothing to run; gauges follow in the next flush."""

    def on_output(self, out, t0: float, request_key: int) -> None:
        """Called by the sender thread for every response."""
        now = time.monotonic()
        key = (request_key, out.index)
        n = len(out.token_ids)
        if n:
            self._add("gen_tokens", n)
            seen = self._seq.get(key)
            if seen is None:
                # the engine's own stamp: a non-stream request's one response comes at its end
                first = min(out.first_token_time or now, now)
                self.ttft.observe(max(0.0, first - t0))
                if out.queue_wait_us:
                    self.queue.observe(out.queue_wait_us[0] / 1e6)
                self._seq[key] = [first, now, n]
            else:
                seen[1] = now
                seen[2] += n
        if out.finish_reason:
            first, last, tokens = self._seq.pop(key, (now, now, 0))
            if tokens > 1:
                self.tpot.observe((last - first) / (tokens - 1))
            if out.finish_reason == "cancelled":
                self._add("cancelled", 1)
            elif out.finish_reason in ("stop", "length"):
                self._add("finished", 1)
        if out.final:
            self.e2e.observe(max(0.0, now - t0))
            with self._lock:
                self._received.discard(request_key)

    def forget(self, request_key: int) -> None:
        """A request ended with an error: count it if the engine had accepted it (a request
        refused before, e.g. a prompt over the limit, was never received), and drop its
        per-sequence state."""
        with self._lock:
            received = request_key in self._received
            self._received.discard(request_key)
        if received:
            self._add("failed", 1)
        for key in [k for k in self._seq if k[0] == request_key]:
            self._seq.pop(key, None)

    def _flush_loop(self) -> None:
        while not self._stopped.wait(FLUSH_SECONDS):
            try:
                self.flush()
            except Exception:  # metrics must never take the model down
                pass

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, Counter()
        for name, value in pending.items():
            if value:
                self._counters[name].increment(value)
        engine = self._engine
        if engine is None:
            return
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(engine.blocks.usage)
        self.batch.set(engine.last_batch_size)
        if sched.num_preemptions != self._preemptions:
            self.preempt.increment(sched.num_preemptions - self._preemptions)
            self._preemptions = sched.num_preemptions


class _CounterAsHistogram:
    def __init__(self, counter):
        self.counter = counter

    def observe(self, value: float) -> None:
        self.counter.increment(value)
