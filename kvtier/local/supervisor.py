"""What ``kvtier up`` watches in the stack it started: its workers, its Valkey and Ray.

Ray re-creates a worker actor whose process dies (``max_restarts``), and the re-created actor
runs its phases and registers with the controller by itself (``kvtier.worker.actor``). The
supervisor follows that from outside: every ``interval_s`` it reads each worker actor's state
from Ray's actor table and, for a live one, the address it serves at. It returns what changed
as ``Finding`` values, each once:

- a worker back at a new address (recovered): the stack's record follows it;
- the embedded Valkey exited: started again on its port with its password (recovered), the
  controller rebuilding the directory from the workers as after any Redis restart;
- a worker Ray will not bring back (restarts spent, or its restart failed in a phase), a
  Valkey that does not start again, a Ray instance that is gone: these it cannot recover, and
  says so.

``kvtier up`` prints the findings and keeps ``stack.json`` (``LocalStack.write_record``) current:
the workers' addresses, and under ``problems`` what it could not recover.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.domain.errors import KvtierError
from kvtier.runtime.log import get_logger

if TYPE_CHECKING:
    from kvtier.local.stack import LocalStack, WorkerHandle
    from kvtier.runtime.embedded_redis import EmbeddedRedis

log = get_logger("kvtier.local.supervisor")

ADDRESS_TIMEOUT_S = 10.0
MAX_CAUSE_CHARS = 300


@dataclass(frozen=True, slots=True)
class Finding:
    subject: str  # "worker-0", "valkey", "ray"
    message: str
    is_recovered: bool  # True: back in service; False: needs the operator (`kvtier down`, `kvtier up`)


@dataclass(slots=True)
class StackSupervisor:
    stack: LocalStack
    interval_s: float = 2.0
    _reported: set[str] = field(default_factory=set)  # subjects whose loss was already reported

    async def check_once(self) -> list[Finding]:
        """One look at everything the stack started; the findings not reported before."""
        loop = asyncio.get_running_loop()
        findings: list[Finding] = []
        if not await loop.run_in_executor(None, _ray_is_up):
            return self._once(Finding("ray", "Ray is gone: no worker can be restarted; run `kvtier down`, "
                                      "then `kvtier up`", is_recovered=False))
        for handle in self.stack.workers:
            if (finding := await loop.run_in_executor(None, functools.partial(self._check_worker, handle))):
                findings += self._once(finding) if not finding.is_recovered else [finding]
        embedded = self.stack.controller.embedded_redis
        if embedded is not None and not embedded.is_running and "valkey" not in self._reported:
            finding = self._restart_valkey(embedded)
            findings += self._once(finding) if not finding.is_recovered else [finding]
        return findings

    async def run(self, notify: Callable[[Finding], None]) -> None:
        """Check every ``interval_s`` until cancelled; each finding goes to ``notify`` and the log,
        and the stack's record is rewritten after any (addresses, pids, problems)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                findings = await self.check_once()
            except Exception as exc:  # a failed look is retried at the next interval
                log.warning("stack check failed", extra={"error": f"{type(exc).__name__}: {exc}"})
                continue
            for finding in findings:
                (log.info if finding.is_recovered else log.error)(
                    finding.message, extra={"subject": finding.subject})
                if finding.is_recovered:
                    self.stack.problems.pop(finding.subject, None)
                else:
                    self.stack.problems[finding.subject] = finding.message
                notify(finding)
            if findings:
                self.stack.write_record()

    def _restart_valkey(self, embedded: EmbeddedRedis) -> Finding:
        """Start the exited Valkey again on its port and password; the controller's Redis monitor
        then rebuilds the directory from the workers' inventories. Run on the event loop's thread:
        the server dies with the thread that started it (``EmbeddedRedis``), and the loop's
        lives as long as `kvtier up`; the loop waits for the start (well under a second)."""
        try:
            embedded.restart()
        except KvtierError as exc:
            return Finding("valkey", f"the embedded Valkey exited and did not start again ({exc}); the directory "
                           "is unreachable: run `kvtier down`, then `kvtier up`", is_recovered=False)
        return Finding("valkey", f"the embedded Valkey exited and was started again at {embedded.public_url}; "
                       "the directory is rebuilt from the workers", is_recovered=True)

    def _once(self, finding: Finding) -> list[Finding]:
        if finding.subject in self._reported:
            return []
        self._reported.add(finding.subject)
        return [finding]

    def _check_worker(self, handle: WorkerHandle) -> Finding | None:
        """Blocking (Ray calls): run in an executor."""
        import ray

        info = _actor_info(handle.actor)
        state = info.get("State")
        if state == "DEAD":
            cause = str(info.get("DeathCause") or "no cause recorded").replace("\n", " ")[:MAX_CAUSE_CHARS]
            return Finding(handle.worker_id, (
                f"{handle.worker_id} is gone and Ray will not restart it ({info.get('NumRestarts', 0)} of "
                f"{self.stack.options.max_restarts} restarts used; {cause}); run `kvtier down`, then `kvtier up`"),
                is_recovered=False)
        if state != "ALIVE":
            return None  # restarting: its constructor is running the phases
        try:
            address = ray.get(handle.actor.address.remote(), timeout=ADDRESS_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None  # died or busy since the table was read: the next look decides
        if address == handle.address:
            return None
        handle.address = address
        self._reported.discard(handle.worker_id)
        return Finding(handle.worker_id, f"{handle.worker_id} was restarted by Ray and serves again at {address}",
                       is_recovered=True)


def _ray_is_up() -> bool:
    import ray

    if not ray.is_initialized():
        return False
    try:
        ray.cluster_resources()
    except Exception:  # the GCS is gone
        return False
    return True


def _actor_info(actor: Any) -> dict[str, Any]:
    """The actor's row in Ray's actor table (State, NumRestarts, DeathCause); {} when unknown."""
    from ray._private.state import actors  # the table Ray's own runtime context reads restarts from

    try:
        info = actors(actor_id=actor._actor_id.hex())
    except Exception as exc:
        log.debug("actor table unreadable", extra={"error": type(exc).__name__})
        return {}
    return info if isinstance(info, dict) else {}
