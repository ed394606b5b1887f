"""The worker actor's side of peer fetch: ``export_pages`` and ``rank_pages`` for a peer's ``RayTransport``,
``fetch_from_peer`` and ``peer_stats``.

The holder's page group is this method's return value, so Ray puts it in the holder node's
object store and the receiver pulls it from there by reference (decision 0018). The actor is
named after its worker id (``start_worker_actor(name=worker_id)``), which is how a peer finds
it from a fetch plan.
"""

from __future__ import annotations

from typing import Any

from kvtier.domain.errors import FailedPrecondition
from kvtier.domain.hashing import NamespaceIdentity, PageKey
from kvtier.runtime.config import WorkerConfig
from kvtier.worker.peer_fetch import FetchOutcome, PeerOptions, RayTransport
from kvtier.worker.peer_pages import ExportRequest, PageGroup, RankRequest

EXPORT_TIMEOUT_S = 60.0


class PeerExportMixin:
    """Mixed into ``WorkerActor``, whose ``serve`` phase sets ``_runtime`` and ``_server``."""

    _runtime: Any
    _server: Any

    def export_pages(self, request: ExportRequest) -> PageGroup:
        """The longest cached prefix of ``request.keys`` in ``request.digest``, for a worker
        authenticated by ``request.credential`` (``PeerExporter``)."""
        if self._server is None or self._runtime is None or self._server.exporter is None:
            raise FailedPrecondition("the worker is not serving; it exports no pages")
        group: PageGroup = self._runtime.run(self._server.exporter.export(request), timeout_s=EXPORT_TIMEOUT_S)
        return group

    def rank_pages(self, request: RankRequest) -> list[tuple[PageKey, ...]]:
        """Chains of this worker's most valuable pages of ``request.digest`` (a drain migration)."""
        if self._server is None or self._runtime is None or self._server.exporter is None:
            raise FailedPrecondition("the worker is not serving; it ranks no pages")
        chains: list[tuple[PageKey, ...]] = self._runtime.run(self._server.exporter.rank(request),
                                                              timeout_s=EXPORT_TIMEOUT_S)
        return chains

    def fetch_from_peer(self, namespace: NamespaceIdentity, prompt: list[int], peer: str,
                        timeout_s: float = EXPORT_TIMEOUT_S) -> FetchOutcome:
        """Fetch ``prompt``'s full pages from ``peer`` now, as a Generate with a fetch plan would
        (benchmarks, operators warming a worker)."""
        if self._server is None or self._runtime is None:
            raise FailedPrecondition("the worker is not serving; it fetches no pages")
        fetcher = self._server.servicer.peers
        outcome: FetchOutcome = self._runtime.run(fetcher.fetch(namespace, prompt, peer, timeout_s=timeout_s),
                                                  timeout_s=timeout_s + 5.0)
        return outcome

    def peer_stats(self) -> dict[str, int]:
        """Counters of this worker's peer traffic: pages exported, fetches, bytes fetched."""
        if self._server is None:
            return {"exported_pages": 0, "fetches": 0, "failed_fetches": 0, "fetched_bytes": 0}
        fetcher = self._server.servicer.peers
        exporter = self._server.exporter
        return {"exported_pages": exporter.num_exported_pages if exporter is not None else 0,
                "fetches": fetcher.num_fetches, "failed_fetches": fetcher.num_failed,
                "fetched_bytes": fetcher.num_fetched_bytes}


def peer_options(config: WorkerConfig, token: str | None) -> PeerOptions:
    """Peers are fetched from through Ray when this process is connected to a Ray cluster; each
    fetch carries the worker's own token (``auth_token_file``)."""
    import ray

    return PeerOptions(transport=RayTransport() if ray.is_initialized() else None, credential=token,
                       link_bytes_per_s=config.emulated_peer_link_bytes_per_s)
