"""Telemetry: OpenTelemetry metrics (exported as Prometheus text on /metrics) and traces.

One `Telemetry` per process (`get_telemetry()`). Request metrics are recorded where the request
ends (the ingress) with `tenant` and `model` labels; engine gauges (KV occupancy, running,
waiting, preemptions) are read from the engine when /metrics is scraped. Each request gets a
span with `queue`, `prefill` and `decode` children built from the engine's phase durations.
Traces go to OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set and the OTLP exporter is installed;
tests may add their own span processor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanProcessor

if TYPE_CHECKING:
    from tandem.platform.usage_records import UsageRecord

logger = logging.getLogger("tandem.telemetry")

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


# The engines' stats read at each scrape: (metric, `LLMEngine.stats()` key, description).
ENGINE_GAUGES = (
    ("tandem_kv_cache_occupancy", "kv_occupancy", "KV blocks used / total"),
    ("tandem_num_requests_running", "num_running", "Requests in the running batch"),
    ("tandem_num_requests_waiting", "num_waiting", "Requests waiting for admission"),
    ("tandem_loras_loaded", "num_loras_loaded", "LoRA adapters held in the engine's memory"),
    (
        "tandem_prefix_cache_hit_rate",
        "prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / looked up",
    ),
    (
        "tandem_moe_expert_imbalance",
        "moe_expert_imbalance",
        "Mixture-of-experts models: the busiest expert's routed tokens over the mean (1 is even)",
    ),
)
ENGINE_COUNTERS = (
    ("tandem_num_preemptions", "num_preemptions", "Requests preempted (recomputed) so far"),
    (
        "tandem_prefix_cache_hit_tokens",
        "prefix_cache_hits",
        "Prompt tokens served from the prefix cache",
    ),
    (
        "tandem_kv_integrity_aborts",
        "num_kv_integrity_aborts",
        "Requests aborted by the KV-page integrity check",
    ),
    (
        "tandem_failed_requests",
        "num_failed_requests",
        "Requests the engine ended alone because they broke their step (their adapter, "
        "parameters or logits); the others in the step went on",
    ),
    ("tandem_engine_steps", "num_steps", "Engine steps that ran the model"),
    (
        "tandem_kv_window_released_blocks",
        "kv_window_released_blocks",
        "KV blocks given back early because they left every layer's sliding window",
    ),
    (
        "tandem_engine_output_tokens_interactive",
        "num_output_tokens_interactive",
        "Tokens the engine generated for real-time requests",
    ),
    (
        "tandem_engine_output_tokens_batch",
        "num_output_tokens_batch",
        "Tokens the engine generated for batch requests (batch progress between shard commits)",
    ),
    ("tandem_spec_draft_tokens", "num_draft_tokens", "Speculative draft tokens verified"),
    ("tandem_spec_accepted_tokens", "num_accepted_draft_tokens", "Draft tokens the model accepted"),
    (
        "tandem_spec_draft_seconds",
        "draft_wall_s",
        "Wall seconds the draft model spent proposing (against tandem_engine_step_wall_seconds: its share)",
    ),
    ("tandem_engine_step_wall_seconds", "step_wall_s", "Wall seconds inside engine steps"),
    (
        "tandem_engine_step_cpu_seconds",
        "step_thread_cpu_s",
        "CPU seconds of the engine thread inside steps (below wall: steps waited for cores)",
    ),
)


def _latency_views() -> list[View]:
    """The latency histograms' buckets."""
    return [
        View(
            instrument_name="tandem_time_to_first_token_seconds",
            aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS_S),
        ),
        View(
            instrument_name="tandem_e2e_request_latency_seconds",
            aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS_S),
        ),
        View(
            instrument_name="tandem_time_per_output_token_seconds",
            aggregation=ExplicitBucketHistogramAggregation(TOKEN_LATENCY_BUCKETS_S),
        ),
    ]


class Telemetry:
    def __init__(self, service_name: str = "tandem") -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        resource = Resource.create({"service.name": service_name})
        self.meter_provider = MeterProvider(
            resource=resource, metric_readers=[PrometheusMetricReader()], views=_latency_views()
        )
        self.tracer_provider = TracerProvider(resource=resource)
        self._num_span_processors = 0  # spans are built only when something receives them
        self._maybe_add_otlp()
        meter = self.meter_provider.get_meter("tandem")
        self.tracer = self.tracer_provider.get_tracer("tandem")
        self.ttft = meter.create_histogram(
            "tandem_time_to_first_token_seconds", unit="s", description="Time to first token"
        )
        self.tpot = meter.create_histogram(
            "tandem_time_per_output_token_seconds",
            unit="s",
            description="Mean time per output token after the first",
        )
        self.e2e = meter.create_histogram(
            "tandem_e2e_request_latency_seconds",
            unit="s",
            description="Request latency from arrival to last token",
        )
        self.prompt_tokens = meter.create_counter(
            "tandem_prompt_tokens", description="Prompt tokens processed"
        )
        self.generation_tokens = meter.create_counter(
            "tandem_generation_tokens", description="Tokens generated"
        )
        self.requests = meter.create_counter(
            "tandem_requests", description="Finished requests by finish reason"
        )
        # Metered usage (each record once, when stored): per tenant, priority and status.
        self.usage_counters = {
            field: meter.create_counter(f"tandem_usage_{name}", description=description)
            for field, name, description in (
                (None, "requests", "Requests metered (usage records stored)"),
                ("input_tokens", "input_tokens", "Metered input tokens, cached ones included"),
                ("cached_tokens", "cached_tokens", "Metered input tokens served from the prefix cache"),
                ("output_tokens", "output_tokens", "Metered output tokens"),
            )
        }  # a record's field (None: count the record) -> its counter
        self._engine_stats: dict[tuple[str, str], dict[str, Any]] = {}  # (model, replica id) ->
        self._lock = threading.Lock()
        for name, key, description in ENGINE_GAUGES:
            meter.create_observable_gauge(name, callbacks=[self._observer(key)], description=description)
        for name, key, description in ENGINE_COUNTERS:
            meter.create_observable_counter(name, callbacks=[self._observer(key)], description=description)

    def _maybe_add_otlp(self) -> None:
        if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            logger.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed"
            )
            return
        self.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))

    def add_span_processor(self, processor: SpanProcessor) -> None:
        self.tracer_provider.add_span_processor(processor)
        self._num_span_processors += 1

    def _observer(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                snapshot = dict(self._engine_stats)
            for (model, replica_id), stats in snapshot.items():
                if key in stats:
                    yield Observation(float(stats[key]), {"model": model, "replica": replica_id})

        return observe

    def set_engine_stats(self, model: str, stats_by_replica: dict[str, dict[str, object]]) -> None:
        """Replace `model`'s engine figures with these replicas' (a replica left out is gone)."""
        with self._lock:
            for key in [k for k in self._engine_stats if k[0] == model]:
                del self._engine_stats[key]
            for replica_id, stats in stats_by_replica.items():
                self._engine_stats[(model, replica_id)] = dict(stats)

    def record_usage(self, records: Iterable[UsageRecord]) -> None:
        """Count stored usage records (the usage log calls this after each flush)."""
        for record in records:
            labels = {"tenant": record.tenant, "priority": record.priority, "status": record.status}
            for field, counter in self.usage_counters.items():
                counter.add(1 if field is None else getattr(record, field), labels)

    def record_request(
        self,
        *,
        tenant: str,
        model: str,
        request_id: str,
        finish_reason: str | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
        phases: dict[str, float],
        started_ns: int,
    ) -> None:
        labels = {"tenant": tenant, "model": model}
        if ttft_s is not None:
            self.ttft.record(ttft_s, labels)
            if num_output_tokens > 1:
                self.tpot.record((e2e_s - ttft_s) / (num_output_tokens - 1), labels)
        self.e2e.record(e2e_s, labels)
        self.prompt_tokens.add(num_prompt_tokens, labels)
        self.generation_tokens.add(num_output_tokens, labels)
        self.requests.add(1, {**labels, "finish_reason": finish_reason or "unknown"})
        self._record_spans(labels, request_id, finish_reason, phases, started_ns)

    def _record_spans(
        self,
        labels: dict[str, str],
        request_id: str,
        finish_reason: str | None,
        phases: dict[str, float],
        started_ns: int,
    ) -> None:
        """Root span over the whole request; phase children laid back-to-back ending at its end.

        Phase durations come from the engine's clock (possibly another process), so only their
        lengths are used, not absolute times. Without a span processor (no OTLP endpoint) nothing
        would receive the spans, so none are built (their cost on the event loop per request is
        in docs/performance.md)."""
        if not self._num_span_processors:
            return
        from opentelemetry import trace

        end_ns = time.time_ns()
        root = self.tracer.start_span(
            "llm.request",
            start_time=started_ns,
            attributes={
                "tandem.tenant": labels["tenant"],
                "tandem.model": labels["model"],
                "tandem.request_id": request_id,
                "tandem.finish_reason": finish_reason or "",
            },
        )
        ctx = trace.set_span_in_context(root)
        cursor = end_ns
        for phase in ("decode", "prefill", "queue"):
            if phase in phases:
                length = int(max(phases[phase], 0.0) * 1e9)
                child = self.tracer.start_span(
                    f"llm.{phase}", context=ctx, start_time=max(started_ns, cursor - length)
                )
                child.end(end_time=cursor)
                cursor = max(started_ns, cursor - length)
        root.end(end_time=end_ns)


_telemetry: Telemetry | None = None
_telemetry_lock = threading.Lock()


def get_telemetry() -> Telemetry:
    global _telemetry
    with _telemetry_lock:
        if _telemetry is None:
            _telemetry = Telemetry()
        return _telemetry


def prometheus_text() -> str:
    from prometheus_client import REGISTRY, generate_latest

    get_telemetry()  # make sure our reader is registered
    return generate_latest(REGISTRY).decode()
