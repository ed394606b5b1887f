"""OpenTelemetry metrics for one process, served on a Prometheus endpoint (DESIGN §9).

Each process builds one ``Telemetry``; instruments carry units and descriptions, and
attributes are ids, tiers and outcomes — never token ids or text (DESIGN §5.11). The
Prometheus registry is per instance (not the global one), so several processes' worth of
telemetry can live in one test process without colliding. OTLP export is added when the
process has an OTLP endpoint (the ``otlp_endpoint`` setting, installed by
``kvtier.runtime.tracing.setup_process``, or ``otlp_endpoint=`` here); it needs the ``kvtier[otlp]``
extra. No collector is required otherwise. Spans: ``kvtier.runtime.tracing``.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from kvtier.runtime import tracing

log = logging.getLogger("kvtier.runtime.telemetry")

# Latency buckets in seconds: sub-millisecond directory ops up to multi-second prefills.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Telemetry:
    def __init__(
        self, service: str, *, port: int | None = None, host: str = "127.0.0.1", otlp_endpoint: str | None = None
    ) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        readers: list[MetricReader] = [PrometheusMetricReader(registry=self.registry)]
        endpoint = otlp_endpoint or tracing.otlp_endpoint()
        if endpoint:
            metric_exporter = tracing.otlp_exporters()[1]  # ConfigError naming the extra when missing
            readers.append(PeriodicExportingMetricReader(metric_exporter(endpoint=endpoint)))
        self.provider = MeterProvider(resource=Resource.create({"service.name": service}), metric_readers=readers)
        self.meter: Meter = self.provider.get_meter("kvtier")
        self._server: WSGIServer | None = None
        self.port: int | None = None
        if port is not None:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
            self.port = self._server.server_port
            log.info("metrics endpoint", extra={"address": f"http://{host}:{self.port}/metrics"})

    def scrape(self) -> str:
        """The Prometheus text exposition, as an HTTP scrape would return it."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.provider.shutdown()

