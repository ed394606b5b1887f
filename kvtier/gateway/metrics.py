"""The gateway's Prometheus metrics (``GET /metrics``). Labels carry no text or token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(slots=True)
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    requests: Counter = field(init=False)
    unparsed_tool_calls: Counter = field(init=False)
    ttft_s: Histogram = field(init=False)
    session_hints_failed: Counter = field(init=False)
    streams_in_flight: Gauge = field(init=False)
    streams_abandoned: Counter = field(init=False)

    def __post_init__(self) -> None:
        self.requests = Counter("kvtier_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.unparsed_tool_calls = Counter(
            "kvtier_gateway_unparsed_tool_calls", "tool calls the model opened but that did not parse "
            "(returned as text)", registry=self.registry)
        self.ttft_s = Histogram("kvtier_gateway_ttft_seconds", "request received to first token sent",
                                registry=self.registry)
        self.session_hints_failed = Counter(
            "kvtier_gateway_session_hints_failed", "Pause/Returning hints the controller refused",
            registry=self.registry)
        self.streams_in_flight = Gauge(
            "kvtier_gateway_streams_in_flight", "SSE streams open: from their first chunk until they close",
            registry=self.registry)
        self.streams_abandoned = Counter(
            "kvtier_gateway_streams_abandoned", "chat streams that ended before their generation did (the client "
            "left, or the stack failed mid-stream): generation cancelled, session ended", registry=self.registry)
