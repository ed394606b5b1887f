"""The generations in flight on a worker, from admission to their last event.

A run enters through ``admit``: it waits outside the engine (``worker.admission``) when its
pages or its room are not ready, or while a peer's pages of its prompt arrive (``fetched``
ends that wait), else it is added to the engine at once. ``dispatch`` turns
each step's outputs into events for the run's consumer; ``abort`` ends a run its consumer
left, releasing its pages exactly once; ``fail_all`` ends every run when the engine stops.
Everything here runs on the engine thread (``worker.engine_loop``); events reach the asyncio
side with ``loop.call_soon_threadsafe``.

The request was validated at the worker's edge (``EngineLoop.submit``: the wire fields when
it was decoded, the prompt against the model before it was posted), so the engine takes it
as it is (``Engine.enqueue``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from opentelemetry.context import Context

from kvtier.domain.errors import IntegrityError, KvtierError
from kvtier.domain.hashing import NamespaceDigest, short
from kvtier.domain.records import GenerateEvent, GenerateFinal, GenerateRequest, RunId, TokenChunk
from kvtier.engine.engine import Engine, GenerationResult, StepOutput
from kvtier.runtime import tracing
from kvtier.runtime.log import get_logger, redact_tokens
from kvtier.worker.admission import Admission, Admitted
from kvtier.worker.commands import Commands
from kvtier.worker.costs import CostMeter
from kvtier.worker.holds import Holds
from kvtier.worker.page_events import PageEvents
from kvtier.worker.usage import WorkerRecorder, add_promotions, finish, record_spans

log = get_logger("kvtier.worker.engine")


def new_run_id() -> RunId:
    return RunId(uuid.uuid4().hex[:16])


@dataclass(slots=True, eq=False)
class Run:
    """One generation. Fields below the line are touched by the engine thread only."""

    run_id: RunId
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateEvent | BaseException]
    submitted_at: float
    trace_parent: Context | None = None  # the caller's trace context (kvtier.runtime.tracing), if any
    is_done: bool = False  # asyncio side: the final event (or an error) was received
    # ---- engine thread
    first_token_at: float | None = None
    num_emitted: int = 0
    digest: NamespaceDigest | None = None  # of its namespace, from admission on
    waited: Admitted[Run] | None = None  # its wait outside the engine, if it waited
    added_at: float = 0.0  # handed to the engine, after any wait outside it (time.perf_counter)
    num_queued_ahead: int = 0  # requests in the engine when it was added: queued or running


class Runs:
    """Runs in the engine, by run id, and their counters; hands each run's events to its
    consumer. ``metrics`` is set when the process exports metrics (``kvtier.worker.metrics``);
    ``span_attributes`` are the attributes of every ``generate`` span (e.g. the worker id)."""

    def __init__(self, engine: Engine, holds: Holds, admission: Admission[Run], page_events: PageEvents,
                 commands: Commands, costs: CostMeter) -> None:
        self._engine = engine
        self._holds = holds
        self._admission = admission
        self._page_events = page_events
        self._commands = commands
        self._costs = costs  # measured rates for Route's cost model
        self._in_engine: dict[str, Run] = {}
        self.metrics: WorkerRecorder | None = None
        self.span_attributes: dict[str, str] = {}
        self.num_finished = 0
        self.num_cancelled = 0

    def ids(self) -> set[str]:
        """Run ids in the engine (``CheckIntegrity`` compares them with the engine's requests)."""
        return set(self._in_engine)

    def admit(self, run: Run, *, fetching: bool = False) -> None:
        """Add ``run`` to the engine, or let it wait outside for its pages or room; ``fetching``:
        it waits until ``fetched``, its prompt's pages on their way from a peer."""
        request = run.request
        digest = run.digest = self._engine.digest_for(request.namespace)
        if request.session_id is not None:
            self._holds.arrived(digest, request.session_id)
        if fetching:
            self._admission.wait_for_fetch(run.run_id, run, request, digest)
            return
        tiers = self._engine.tiers
        if tiers is not None and not tiers.config.simulate:
            if self._admission.offer(run.run_id, run, request, digest):
                self.admit_ready()
                return
        self._add(run, digest)

    def fetched(self, run: Run) -> None:
        """The run's peer fetch ended: it is admitted once its room and pages are ready."""
        self._admission.fetched(run.run_id)
        self.admit_ready()

    def admit_ready(self) -> None:
        """Add the waiting runs whose room and pages are ready, one by one (``Admission.ready``)."""
        for admitted in self._admission.ready():
            run = admitted.run
            run.waited = admitted
            try:
                assert run.digest is not None
                self._add(run, run.digest)
            except KvtierError as exc:
                self._admission.release(run.run_id)
                self.emit(run, exc)
        if self.metrics is not None:
            for waited, outcome in self._admission.take_deferrals():
                self.metrics.record_hold_deferral(waited, outcome)

    def _add(self, run: Run, digest: NamespaceDigest) -> None:
        request = run.request
        run.added_at = time.perf_counter()
        run.num_queued_ahead = self._engine.num_queued + self._engine.num_running
        self._engine.enqueue(list(request.prompt_token_ids), request.sampling, request_id=run.run_id,
                             priority=request.priority, namespace=request.namespace)
        self._page_events.admitted(digest, request.namespace or self._engine.namespace)
        self._in_engine[run.run_id] = run
        log.info("generation admitted", extra={
            "run_id": run.run_id, "request_id": request.request_id, "prompt": redact_tokens(request.prompt_token_ids),
            "max_tokens": request.sampling.max_tokens, "namespace": short(digest)})

    def abort(self, run: Run) -> None:
        """End a run its consumer left (or that cannot be delivered); its pages are released once."""
        if self._admission.cancel(run.run_id):  # never reached the engine
            self.num_cancelled += 1
            log.info("generation cancelled before admission", extra={"run_id": run.run_id})
            return
        if self._in_engine.pop(run.run_id, None) is None:
            return
        self._admission.release(run.run_id)
        self._engine.abort(run.run_id)
        result = self._engine.pop_result(run.run_id)
        self.num_cancelled += 1
        self._commands.run_ended(run.digest)
        if tracing.is_enabled():
            record_spans(run.run_id, run.request, result, _times(run, result), self.span_attributes,
                         run.trace_parent)
        log.info("generation cancelled", extra={"run_id": run.run_id, "generated_tokens": len(result.token_ids)})

    def dispatch(self, outputs: list[StepOutput]) -> None:
        """Hand one step's new tokens, and the final event of each finished run, to their consumers."""
        now = time.perf_counter()
        for out in outputs:
            run = self._in_engine.get(out.request_id)
            if run is None:
                raise IntegrityError(f"the engine stepped request {out.request_id} that no run owns")
            self._admission.release(run.run_id)  # stepped: its sequence holds its pages now
            if out.new_token_ids:
                if run.first_token_at is None:
                    run.first_token_at = now
                self.emit(run, TokenChunk(token_ids=tuple(out.new_token_ids), index=run.num_emitted))
                run.num_emitted += len(out.new_token_ids)
            if out.finished:
                del self._in_engine[run.run_id]
                self.num_finished += 1
                self._commands.run_ended(run.digest)
                self.emit(run, self._final(run))

    def fail_all(self, error: KvtierError) -> None:
        """End every run, in the engine or waiting outside it, with ``error``."""
        for run in [*self._in_engine.values(), *self._admission.runs()]:
            try:
                self.abort(run)
            except Exception:  # the engine may be broken; consumers must still hear
                log.exception("could not abort a run while stopping", extra={"run_id": run.run_id})
            self.emit(run, error)

    def emit(self, run: Run, item: GenerateEvent | BaseException) -> None:
        try:
            run.loop.call_soon_threadsafe(run.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read or abort
            self.abort(run)

    def _final(self, run: Run) -> GenerateFinal:
        result = self._engine.pop_result(run.run_id)
        self._costs.finished(submitted_at=run.added_at, prefill_started_at=result.prefill_started_at,
                             first_token_at=run.first_token_at, num_queued_ahead=run.num_queued_ahead,
                             num_computed_tokens=len(result.prompt_token_ids) - result.num_cached_tokens)
        waited = run.waited
        if waited is not None:
            add_promotions(result, waited.promoted_tokens_by_tier, waited.promotion_wait_s)
        session = run.request.session_id
        # A session's next turn here: its last turn's pages are the history this one resumes.
        resumed = session is not None and run.digest is not None and self._holds.has_session(session, run.digest)
        if session is not None:
            assert run.digest is not None
            self._holds.remember(session, run.digest, result.prompt_token_ids, result.token_ids)
        return finish(run.run_id, run.request, result, _times(run, result), recorder=self.metrics,
                      span_attributes=self.span_attributes, parent=run.trace_parent, resumed=resumed,
                      admission_wait_s=waited.admission_wait_s if waited else 0.0,
                      hold_wait_s=waited.hold_wait_s if waited else 0.0)


def _times(run: Run, result: GenerationResult) -> tracing.GenerationTimes:
    return tracing.GenerationTimes(submitted_at=run.submitted_at, finished_at=time.perf_counter(),
                                   prefill_started_at=result.prefill_started_at,
                                   first_token_at=run.first_token_at, promotion_wait_s=result.promotion_wait_s)
