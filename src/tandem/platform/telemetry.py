"""Telemetry: Prometheus exposition for /metrics. (OpenTelemetry spans and metrics: next step.)"""

from __future__ import annotations


def prometheus_text() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()
