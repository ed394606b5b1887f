"""The controller's metrics (DESIGN §9, issue #8), on its Prometheus endpoint.

``ControllerConfig.metrics_port`` turns the endpoint on (0 picks a free port); the
instruments live on a per-instance registry (``kvtier.runtime.telemetry.Telemetry``), so two
controllers in one process never share series. Families (OpenTelemetry names; Prometheus
appends ``_seconds`` / ``_bytes`` for real units and ``_total`` to counters)::

    kvtier.controller.rpc_latency           s          unary RPC (Route, Pause, Admin...) by rpc, code
    kvtier.controller.directory_op_latency  s          one directory round trip, by op (Lua script)
    kvtier.controller.mirror_lookups        {lookup}   Route lookups answered by the leader's mirror (0010)
    kvtier.controller.mirror_entries        {entry}    (page, holder) pairs in that mirror (~150 B each)
    kvtier.controller.workers               {worker}   registered workers by state (live/draining/expired)
    kvtier.controller.sessions              {session}  sessions by state, as this controller last wrote them
    kvtier.controller.prefetches            {session}  closed parked pauses by outcome (on_time, late)
    kvtier.controller.prefetch_bytes        By         their bytes by outcome (on_time, late)
    kvtier.controller.prefetch_wasted       {session}  prefetches not used, by reason (ended, evicted)
    kvtier.controller.prefetch_wasted_bytes By         their bytes, by reason (as the directory shows it at
                                                       the Route: a lower bound; the workers'
                                                       kvtier.session_prefetch_pages count it exactly)
    kvtier.controller.prefetch_lead         s          how long before the return the pages were back
    kvtier.controller.prediction_abs_error  s          |actual − predicted| pause, by prediction source
    kvtier.controller.pages_moved           {page}     pages moved by the controller's commands (acks),
    kvtier.controller.bytes_moved           By           by reason (park/prefetch/returning/end), src, dst

Resume TTFT is not here: the controller is never on the token path, so first-token latency
(``kvtier.ttft``, ``kvtier.resume_ttft``, ``kvtier.eviction_induced_ttft``) is the worker's. Attributes are method
names, states, tiers and outcomes — never session ids, tenants, tool names or token ids.

Gauges and counters read controller state at scrape time. The scrape runs on the HTTP
server's thread while the registry and the orchestrator belong to the event loop, so those
reads are handed to the loop and waited for (``_on_loop``); a scrape that cannot get the
loop within ``SCRAPE_TIMEOUT_S`` reports nothing for them rather than racing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio
from opentelemetry.metrics import CallbackOptions, Observation

from kvtier.controller.prefetch import Outcome, PauseOutcome
from kvtier.runtime.log import get_logger
from kvtier.runtime.telemetry import LATENCY_BUCKETS_S, Telemetry

if TYPE_CHECKING:
    from kvtier.controller.orchestrator import Orchestrator
    from kvtier.controller.registry import Registry
    from kvtier.controller.resync import DirectoryAccess

log = get_logger("kvtier.controller.metrics")

T = TypeVar("T")
SCRAPE_TIMEOUT_S = 2.0
# Pauses last sub-second to minutes: these buckets cover prefetch leads and prediction errors.
PAUSE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ControllerMetrics:
    """Instruments on ``telemetry``; ``bind`` attaches the controller state they read."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registry: Registry | None = None
        self._orchestrator: Orchestrator | None = None
        self._access: DirectoryAccess | None = None
        m = telemetry.meter
        self.rpc_latency = m.create_histogram(
            "kvtier.controller.rpc_latency", unit="s",
            description="server-side latency of one unary controller RPC (Route, Pause, Admin ...), by rpc and code",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.directory_op_latency = m.create_histogram(
            "kvtier.controller.directory_op_latency", unit="s",
            description="one round trip to the directory in Redis, by operation (Lua script)",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.prefetch_lead = m.create_histogram(
            "kvtier.controller.prefetch_lead", unit="s",
            description="how long before a parked session came back its prefetched pages were in HBM",
            explicit_bucket_boundaries_advisory=PAUSE_BUCKETS_S,
        )
        self.prediction_abs_error = m.create_histogram(
            "kvtier.controller.prediction_abs_error", unit="s",
            description="absolute error of the predicted tool-call pause, by prediction source",
            explicit_bucket_boundaries_advisory=PAUSE_BUCKETS_S,
        )
        m.create_observable_counter(
            "kvtier.controller.mirror_lookups", callbacks=[self._mirror_lookups], unit="{lookup}",
            description="Route lookups answered by the leader's in-memory mirror of the directory (no Redis round trip)",
        )
        m.create_observable_gauge(
            "kvtier.controller.mirror_entries", callbacks=[self._mirror_entries], unit="{entry}",
            description="(page, holder) pairs in the leader's in-memory mirror of the directory",
        )
        m.create_observable_gauge(
            "kvtier.controller.workers", callbacks=[self._workers], unit="{worker}",
            description="registered workers by state (live, draining, expired)",
        )
        m.create_observable_gauge(
            "kvtier.controller.sessions", callbacks=[self._sessions], unit="{session}",
            description="sessions by state (active, paused, resuming), as this controller last wrote them",
        )
        m.create_observable_counter(
            "kvtier.controller.prefetches", callbacks=[self._prefetches], unit="{session}",
            description="parked pauses closed, by prefetch outcome (on_time: pages back before the next Route)",
        )
        m.create_observable_counter(
            "kvtier.controller.prefetch_bytes", callbacks=[self._prefetch_bytes], unit="By",
            description="bytes of parked pauses closed, by prefetch outcome",
        )
        m.create_observable_counter(
            "kvtier.controller.prefetch_wasted", callbacks=[self._wasted], unit="{session}",
            description="prefetches not used: the session ended, or its pages left HBM before it came back",
        )
        m.create_observable_counter(
            "kvtier.controller.prefetch_wasted_bytes", callbacks=[self._wasted_bytes], unit="By",
            description="prefetched bytes not used, by reason (ended, evicted), as the directory shows them at the "
            "session's Route (a lower bound: workers' kvtier.session_prefetch_pages counts them exactly)",
        )
        m.create_observable_counter(
            "kvtier.controller.pages_moved", callbacks=[self._pages_moved], unit="{page}",
            description="pages moved by the controller's tier commands (acknowledged), by reason, src and dst",
        )
        m.create_observable_counter(
            "kvtier.controller.bytes_moved", callbacks=[self._bytes_moved], unit="By",
            description="bytes moved by the controller's tier commands (acknowledged), by reason, src and dst",
        )

    @property
    def port(self) -> int | None:
        return self.telemetry.port

    def bind(
        self, registry: Registry, orchestrator: Orchestrator | None, access: DirectoryAccess | None = None
    ) -> None:
        """Read workers from ``registry``, sessions/prefetches from ``orchestrator`` and the
        directory mirror from ``access`` (call on the event loop that owns them)."""
        self._loop = asyncio.get_running_loop()
        self._registry = registry
        self._orchestrator = orchestrator
        self._access = access
        if orchestrator is not None:
            orchestrator.listeners.append(self.pause_closed)

    def close(self) -> None:
        self.telemetry.close()

    # ---- recorded as they happen (event loop) -------------------------------------------
    def directory_op(self, op: str, seconds: float) -> None:
        self.directory_op_latency.record(seconds, {"op": op})

    def pause_closed(self, outcome: PauseOutcome) -> None:
        if outcome.abs_error_ms is not None:
            source = outcome.source.value if outcome.source is not None else "none"
            self.prediction_abs_error.record(outcome.abs_error_ms / 1000.0, {"source": source})
        if outcome.outcome == Outcome.ON_TIME and outcome.lead_ms is not None:
            self.prefetch_lead.record(outcome.lead_ms / 1000.0)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _LatencyInterceptor(self.rpc_latency)

    # ---- observed at scrape (HTTP thread) -----------------------------------------------
    def _on_loop(self, read: Callable[[], T]) -> T | None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return None
        try:
            if asyncio.get_running_loop() is loop:
                return read()  # scraped from the loop itself (Telemetry.scrape in a test)
        except RuntimeError:
            pass  # no loop in this thread: the HTTP server's
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(read())
            except Exception as exc:  # reported to the scrape thread
                result.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
            return result.result(timeout=SCRAPE_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:  # loop stopped or busy
            log.warning("controller state not read for a scrape", extra={"reason": type(exc).__name__})
            return None

    # Two integers of the current Directory: a read from this thread is atomic, no loop hop.
    def _mirror_lookups(self, _: CallbackOptions) -> Iterable[Observation]:
        access = self._access
        return [Observation(access.directory.counters["lookup.local"])] if access is not None else []

    def _mirror_entries(self, _: CallbackOptions) -> Iterable[Observation]:
        access = self._access
        return [Observation(access.directory.mirror.num_entries)] if access is not None else []

    def _workers(self, _: CallbackOptions) -> Iterable[Observation]:
        registry = self._registry
        if registry is None:
            return []
        states = self._on_loop(lambda: [registry.state_of(e).value for e in registry.workers()])
        counts = {state: 0 for state in ("live", "draining", "expired")}
        for state in states or ():
            counts[state] = counts.get(state, 0) + 1
        return [Observation(n, {"state": state}) for state, n in counts.items()] if states is not None else []

    def _sessions(self, _: CallbackOptions) -> Iterable[Observation]:
        orchestrator = self._orchestrator
        if orchestrator is None:
            return []
        counts = self._on_loop(orchestrator.session_counts)
        if counts is None:
            return []
        return [Observation(n, {"state": state.value}) for state, n in counts.items() if state.value != "ended"]

    def _stats(self) -> dict[str, Any] | None:
        orchestrator = self._orchestrator
        if orchestrator is None:
            return None

        def read() -> dict[str, Any]:
            s = orchestrator.stats
            return {
                "count": {Outcome.ON_TIME: s.num_on_time, Outcome.LATE: s.num_late},
                "bytes": {Outcome.ON_TIME: s.on_time_bytes, Outcome.LATE: s.late_bytes},
                "wasted_bytes": dict(s.wasted_by_reason),
                "wasted_count": dict(s.wasted_count_by_reason),
                "moved": {k: tuple(v) for k, v in s.moved.items()},
            }

        return self._on_loop(read)

    def _prefetches(self, _: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        return [Observation(n, {"outcome": o}) for o, n in stats["count"].items()] if stats else []

    def _prefetch_bytes(self, _: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        return [Observation(n, {"outcome": o}) for o, n in stats["bytes"].items()] if stats else []

    def _wasted(self, _: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        if not stats:
            return []
        return [Observation(stats["wasted_count"].get(r, 0), {"reason": r}) for r in ("ended", "evicted")]

    def _wasted_bytes(self, _: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        if not stats:
            return []
        return [Observation(stats["wasted_bytes"].get(r, 0), {"reason": r}) for r in ("ended", "evicted")]

    def _pages_moved(self, _: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        if not stats:
            return []
        return [Observation(pages, {"reason": reason, "src": src, "dst": dst})
                for (reason, src, dst), (pages, _bytes) in stats["moved"].items()]

    def _bytes_moved(self, _: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        if not stats:
            return []
        return [Observation(num_bytes, {"reason": reason, "src": src, "dst": dst})
                for (reason, src, dst), (_pages, num_bytes) in stats["moved"].items()]


class _LatencyInterceptor(grpc.aio.ServerInterceptor):
    """Times every unary-unary RPC (the streams — WorkerLink — are long-lived, not timed)."""

    def __init__(self, histogram: Any) -> None:
        self._histogram = histogram

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary
        rpc = handler_call_details.method.rsplit("/", 1)[-1]
        histogram = self._histogram

        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code = "OK"
            try:
                return await behavior(request, context)
            except BaseException:
                status = context.code()
                code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                histogram.record(time.perf_counter() - start, {"rpc": rpc, "code": code})

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
