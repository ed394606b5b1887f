"""OpenTelemetry spans for one process (DESIGN §9): route, admission, promote, prefill,
decode, transfer.

Tracing is off unless a process main turns it on (``setup_process`` with the config's
``otlp_endpoint``) or a test installs a provider (``install``). Off, ``is_enabled()`` is
False and callers skip building spans altogether; ``tracer()`` is OTel's no-op tracer.

A worker's request spans are made once, when the request ends, from timestamps the
engine loop keeps anyway (``GenerationTimes``), with explicit start and end times: the
engine thread never opens a span per step or per token, and a ``BatchSpanProcessor``
exports off-thread, so the engine never waits for an exporter::

    generate ─┬─ admission   submitted → admitted (queued, waiting for pages)
              ├─ promote     admitted → prefill start (DRAM/NVMe pages copied up; only if any)
              ├─ prefill     first forward pass → first token
              └─ decode      first token → finished (one span for the whole phase)
    transfer                 one per transfer job (submitted → done), never per page
    route                    the controller's Router.route (its own process and trace)

Every request span carries the run id (``kvtier.run_id``, the one in logs and in the final
``GenerateEvent``). Attributes are ids, tiers, counts and outcomes — never token ids or text.
A caller's W3C ``traceparent`` (gRPC metadata) becomes the parent of ``generate`` and
``route``, so a frontend that propagates its context sees both in its trace.

OTLP export needs the optional ``opentelemetry-exporter-otlp-proto-grpc`` package
(``pip install 'kvtier[otlp]'``); with an endpoint set and the package missing the process
refuses to start, naming the setting and the extra.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Tracer

from kvtier.domain.errors import ConfigError
from kvtier.runtime.log import get_logger

if TYPE_CHECKING:
    from kvtier.domain.records import RouteDecision, RouteRequest
    from kvtier.tiers.transfer import TransferDone

log = get_logger("kvtier.runtime.tracing")

T = TypeVar("T")

RUN_ID = "kvtier.run_id"
OTLP_SETTING = "otlp_endpoint"
OTLP_EXTRA = "kvtier[otlp]"
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"

# Offsets from the engine's clocks to the epoch, in ns (OTel span times are epoch ns).
_PERF_TO_EPOCH_NS = time.time_ns() - time.perf_counter_ns()
_MONO_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()

_NOOP: Tracer = trace.NoOpTracer()
_tracer: Tracer = _NOOP
_provider: TracerProvider | None = None
_otlp_endpoint: str | None = None


def tracer() -> Tracer:
    return _tracer


def is_enabled() -> bool:
    """Whether spans go anywhere; callers skip building them when not."""
    return _provider is not None


def otlp_endpoint() -> str | None:
    """The OTLP endpoint this process exports to (``setup_process``); metrics use it too."""
    return _otlp_endpoint


def install(provider: TracerProvider | None) -> None:
    """Make ``provider`` this process's span sink (None: tracing off). Tests install an
    in-memory one; a process main calls ``setup_process`` instead."""
    global _tracer, _provider
    _provider = provider
    _tracer = _NOOP if provider is None else provider.get_tracer("kvtier")


def setup_process(service: str, *, otlp_endpoint: str | None) -> TracerProvider | None:
    """Turn on OTLP export of spans (and of ``kvtier.runtime.telemetry`` metrics) for this process.

    Without an endpoint nothing changes (tracing stays off, at no cost). With one, the
    exporter package must be installed; otherwise ``ConfigError`` names the setting and the
    extra, so the process stops at start-up rather than run without the telemetry it was
    configured for.
    """
    global _otlp_endpoint
    if not otlp_endpoint:
        return None
    exporter_cls = otlp_exporters()[0]
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter_cls(endpoint=otlp_endpoint)))
    install(provider)
    _otlp_endpoint = otlp_endpoint
    log.info("tracing to OTLP", extra={"otlp_endpoint": otlp_endpoint, "service": service})
    return provider


def shutdown() -> None:
    """Flush and stop the installed provider (end of process); tracing is off afterwards."""
    global _otlp_endpoint
    provider = _provider
    install(None)
    _otlp_endpoint = None
    if provider is not None:
        provider.shutdown()


def otlp_exporters() -> tuple[Any, Any]:
    """(OTLPSpanExporter, OTLPMetricExporter), or ``ConfigError`` naming the extra to install."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            f"{OTLP_SETTING} is set but {OTLP_PACKAGE} is not installed; install it with "
            f"`pip install '{OTLP_EXTRA}'` or unset {OTLP_SETTING} (KVTIER_OTLP_ENDPOINT)",
            field=OTLP_SETTING,
        ) from None
    return OTLPSpanExporter, OTLPMetricExporter


def perf_ns(t: float) -> int:
    """A ``time.perf_counter()`` reading as epoch nanoseconds."""
    return _PERF_TO_EPOCH_NS + int(t * 1e9)


def monotonic_ns(t: float) -> int:
    """A ``time.monotonic()`` reading as epoch nanoseconds."""
    return _MONO_TO_EPOCH_NS + int(t * 1e9)


def remote_parent(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The caller's trace context from gRPC metadata (W3C ``traceparent``), if it sent one."""
    if metadata is None or not is_enabled():
        return None
    carrier = {key: value for key, value in metadata if isinstance(value, str)}
    return propagate.extract(carrier) if "traceparent" in carrier else None


# ---- worker: one generation ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GenerationTimes:
    """``time.perf_counter()`` readings of one generation; None where it never got there."""

    submitted_at: float
    finished_at: float
    prefill_started_at: float | None = None  # the request's first forward pass began
    first_token_at: float | None = None
    promotion_wait_s: float = 0.0  # inside admission: copying matched pages up into HBM


def record_generation(
    run_id: str,
    times: GenerationTimes,
    attributes: Mapping[str, Any],
    *,
    phase_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    parent: Context | None = None,
) -> None:
    """Emit ``generate`` and its phase spans for a finished (or cancelled) generation.

    ``attributes`` go on ``generate``; ``phase_attributes[name]`` on that phase. Admission
    ends where prefill starts, less the promotion wait (promotion happens while the
    scheduler admits the request, right before its first forward pass).
    """
    tr, ids = _tracer, {RUN_ID: run_id}
    end = times.finished_at
    root = tr.start_span(
        "generate", context=parent, kind=SpanKind.SERVER,
        start_time=perf_ns(times.submitted_at), attributes={**ids, **attributes},
    )
    context = trace.set_span_in_context(root)
    extra = phase_attributes or {}
    prefill = times.prefill_started_at
    admitted = end if prefill is None else max(times.submitted_at, prefill - times.promotion_wait_s)
    phases: list[tuple[str, float, float]] = [("admission", times.submitted_at, admitted)]
    if prefill is not None:
        if prefill > admitted:
            phases.append(("promote", admitted, prefill))
        first = times.first_token_at
        phases.append(("prefill", prefill, end if first is None else first))
        if first is not None:
            phases.append(("decode", first, end))
    for name, start, stop in phases:
        span = tr.start_span(name, context=context, start_time=perf_ns(start), attributes={**ids, **extra.get(name, {})})
        span.end(end_time=perf_ns(stop))
    root.end(end_time=perf_ns(end))


# ---- worker: transfers --------------------------------------------------------------------
def record_transfer(done: TransferDone) -> None:
    """One ``transfer`` span per transfer job (any thread): queue + copy, by tier pair."""
    t = done.transfer
    span = _tracer.start_span(
        "transfer", start_time=monotonic_ns(t.submitted_at),
        attributes={
            "kvtier.transfer_id": int(t.transfer_id),
            "kvtier.src_tier": t.src_tier.label,
            "kvtier.dst_tier": t.dst_tier.label,
            "kvtier.reason": t.reason.value,
            "kvtier.num_pages": t.num_pages,
            "kvtier.num_bytes": done.num_bytes,
            "kvtier.status": done.status.value,
            "kvtier.queued_s": done.queued_s,
        },
    )
    span.end(end_time=monotonic_ns(t.submitted_at + done.latency_s))


# ---- controller: route --------------------------------------------------------------------
async def traced_route(
    decision: Awaitable[RouteDecision], request: RouteRequest, metadata: Iterable[tuple[str, Any]] | None = None
) -> RouteDecision:
    """Await ``decision`` inside a ``route`` span (or just await it when tracing is off)."""
    if not is_enabled():
        return await decision
    attributes: dict[str, Any] = {"kvtier.namespace.model_id": request.namespace.model_id}
    if request.session_id:
        attributes["kvtier.session_id"] = request.session_id
    with _tracer.start_as_current_span(
        "route", context=remote_parent(metadata), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        result = await decision
        span.set_attribute("kvtier.num_workers", len(result.workers))
        span.set_attribute("kvtier.degraded", result.is_degraded)
        best = result.best
        if best is not None:
            span.set_attribute("kvtier.worker_id", best.worker_id)
            span.set_attribute("kvtier.matched_tokens", best.matched_tokens.total_tokens)
        return result

